"""The `hybridmoe` command line: each subcommand lives in its own module under hybridmoe.commands.

A command module defines `register(subparsers)`, which adds its parser and sets `func` (called with the
parsed args; returns an exit code). Modules are discovered (names starting with "_" are helpers), so adding a command touches no other file.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys

from hybridmoe import __version__, commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridmoe", description="CPU-GPU hybrid MoE inference engine")
    parser.add_argument("--version", action="version", version=f"hybridmoe {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):  # shared helpers, not commands
            continue
        importlib.import_module(f"{commands.__name__}.{info.name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (`hybridmoe info | head`): stop quietly, as SIGPIPE would
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when stdout is flushed
        return 141
    except (ValueError, FileNotFoundError) as error:  # bad input: ConfigError, CheckpointError, bad flags
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
