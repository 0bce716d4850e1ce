"""Measuring this machine and this engine: the hardware profile (`hybridmoe profile`), the engine's op tables
that the cost model reads (placement/op_tables.py), routing statistics, and the timing helpers the benchmarks
share. Above runtime/ (it runs the engine), below bench/ and commands/."""
