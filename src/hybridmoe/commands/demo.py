"""`hybridmoe demo`: the main job on the embedded default model, with no arguments needed."""

from __future__ import annotations

import sys

from hybridmoe.checkpoint.default_model import resolve_model_dir
from hybridmoe.commands._generation import add_model_arguments, build_engine, stream
from hybridmoe.runtime.sampling_params import SamplingParams

DEMO_PROMPTS = ["A man was reading", "The meaning of life is"]  # prompts in the style of its text (MODEL_CARD.md)


def register(subparsers) -> None:
    parser = subparsers.add_parser("demo", help="generate with the embedded default model and report speed")
    add_model_arguments(parser, kv_cache_gb=0.25)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.set_defaults(func=run)


def run(args) -> int:
    args.model = resolve_model_dir(args.model)
    print(f"model: {args.model}", file=sys.stderr)
    engine = build_engine(args)
    cfg = engine.model_config
    print(f"architecture: {cfg.architecture}, {cfg.num_layers} layers, {cfg.moe.num_experts} experts "
          f"(top-{cfg.moe.num_experts_per_tok}), compute dtype {str(engine.model.dtype).removeprefix('torch.')}",
          file=sys.stderr)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, repetition_penalty=1.1)
    for prompt in DEMO_PROMPTS:
        print(f"\n>>> {prompt}", end="")
        _, stats = stream(engine, prompt, params)
        print()
        print(stats.summary(), file=sys.stderr)
    return 0
