"""The pieces of `hybridmoe bench serve`, kept apart from its command line so that other benchmarks (the
planned `--compare`) run the same workload and report: `workload` (what is sent), `loadgen` (sending it to a
server's URL and timing the streams: `run_workload`), `report` (summary, table, JSON, plot), `server` (the
loopback guard and a server started as a subprocess).

Benchmark discovery (commands/bench.py) skips names starting with "_", so this package is not a benchmark.
"""
