"""`hybridmoe bench NAME`: runs one of the benchmarks in hybridmoe.bench."""

from __future__ import annotations

import importlib
import pkgutil

from hybridmoe import bench


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="run a benchmark (ratios measured side by side)")
    benchmarks = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK")
    for info in sorted(pkgutil.iter_modules(bench.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):  # helpers of the benchmarks, as in cli.py
            continue
        importlib.import_module(f"{bench.__name__}.{info.name}").register(benchmarks)
    parser.set_defaults(func=lambda args: parser.print_help() or 2)
