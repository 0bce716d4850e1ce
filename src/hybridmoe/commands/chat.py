"""`hybridmoe chat [--model DIR]`: an interactive conversation using the model's chat template (default model: the
embedded demo model)."""

from __future__ import annotations

import sys

from hybridmoe.commands._generation import (add_model_arguments, add_sampling_arguments, build_engine,
                                            sampling_params, stream)


def register(subparsers) -> None:
    parser = subparsers.add_parser("chat", help="interactive chat (type /exit or Ctrl-D to leave)")
    add_model_arguments(parser)
    parser.add_argument("--system", default=None, help="system message")
    add_sampling_arguments(parser, max_tokens=256)
    parser.set_defaults(func=run)


def run(args) -> int:
    params = sampling_params(args)
    engine = build_engine(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("you> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() in ("/exit", "/quit"):
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        print("assistant> ", end="", flush=True)
        try:
            reply, stats = stream(engine, prompt, params)
        except ValueError as e:  # e.g. the conversation outgrew the context: say so and keep chatting
            print(f"\nerror: {e}", file=sys.stderr)
            messages.pop()
            continue
        print()
        print(f"[{stats.summary()}]", file=sys.stderr)
        messages.append({"role": "assistant", "content": reply})
