"""Benchmarks run by `hybridmoe bench NAME`: one module each, defining `register(subparsers)`.

Benchmarks report ratios measured side by side in one run, print a table and optionally write JSON.
"""
