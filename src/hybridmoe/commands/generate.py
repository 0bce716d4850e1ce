"""`hybridmoe generate [--model DIR] --prompt TEXT`: stream a completion and report its speed (default model: the
embedded demo model)."""

from __future__ import annotations

import sys

from hybridmoe.commands._generation import (add_model_arguments, add_sampling_arguments, build_engine,
                                            sampling_params, stream)


def register(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="generate text from a prompt (streams tokens)")
    add_model_arguments(parser)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_sampling_arguments(parser)
    parser.set_defaults(func=run)


def run(args) -> int:
    params = sampling_params(args)
    engine = build_engine(args)
    prompt = args.prompt
    if args.chat:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    try:
        _, stats = stream(engine, prompt, params)
    finally:
        engine.close()
    print()
    print(stats.summary(), file=sys.stderr)
    if args.verbose and engine.placement is not None:
        print(engine.run_stats.summary(), file=sys.stderr)
    return 0
