"""`hybridmoe demo`: the main job on the embedded default model, with no arguments needed."""

from __future__ import annotations

import sys

from hybridmoe.checkpoint.default_model import default_model_dir
from hybridmoe.commands._generation import build_engine, stream
from hybridmoe.runtime.sampling_params import SamplingParams

DEMO_PROMPTS = ["A man was reading", "The meaning of life is"]  # prompts in the style of its text (MODEL_CARD.md)


def register(subparsers) -> None:
    parser = subparsers.add_parser("demo", help="generate with the embedded default model and report speed")
    parser.add_argument("--model", default=None, help="model directory (default: the embedded demo model)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"])
    parser.add_argument("--kv-cache-gb", type=float, default=0.25)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--expert-backend", default="cpu", choices=["cpu", "torch"])
    parser.set_defaults(func=run)


def run(args) -> int:
    model_dir = args.model or default_model_dir()
    print(f"model: {model_dir}", file=sys.stderr)
    engine = build_engine(model_dir, args)
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
