"""Where bf16 dot products (or AMX tiles) pay: one matrix's matmul on ISA A against ISA B, e.g. float32 activations
against bf16 dot products, alternating in one process, on 1 thread and on all threads, with the rows in cache and
streamed from memory.

    python benchmarks/bf16_dot.py [--isas A,B] [--paths PA,PB] [--formats fp8,bf16] [--tokens 1,6,8,24]

(--isas: default avx512,avx512bf16 where the CPU has AVX512-BF16, else avx2,avx2bf16, the emulation. --paths: the
matmul path of each, default gemv,gemv; `--isas avx512,amx --paths auto,gemm` sets AMX tiles at every token count
against what the avx512 table runs by itself, which is where amx_min_tokens() should lie.)

Prints GFLOP/s per (format, tokens, threads, residency) for each ISA and B's speedup over A (median of the
alternating rounds). Shapes: DeepSeek-V3's expert gate (2048 x 7168). "cache": 256 rows (1.8 MB of fp8) called
again and again; "memory": a pool of 1 GiB or 4x the last-level cache, the rows of each call new.

Legend: M tokens, N rows, K columns.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hybridmoe.profiling.timing import last_level_cache_bytes
from hybridmoe.bench.kernels import _Bytes, _matrix
from hybridmoe.kernels import isa
from hybridmoe.kernels.moe import matmul
from hybridmoe.kernels.weights import kernel_matrix

N, K = 2048, 7168


def _matrices(fmt: str, rows: int, count: int) -> list:
    source, gen = _Bytes(), torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        data, scales = _matrix(fmt, rows, K, source, gen)
        out.append(kernel_matrix(fmt, data, scales) if scales is not None else kernel_matrix(fmt, data))
    return out


def _gflops(mats: list, x: torch.Tensor, path: str, seconds: float = 0.2) -> float:
    rows = mats[0].rows
    calls, start, i = 0, time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        matmul(mats[i % len(mats)], x, path)
        calls, i = calls + 1, i + 1
    return 2.0 * rows * K * x.shape[0] * calls / (time.perf_counter() - start) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    native = "avx512bf16" in isa.available_isas()
    p.add_argument("--isas", default="avx512,avx512bf16" if native else "avx2,avx2bf16")
    p.add_argument("--paths", default="gemv,gemv", help="the matmul path (auto, gemv or gemm) of A and of B")
    p.add_argument("--formats", default="fp8,bf16")
    p.add_argument("--tokens", default="1,6,8,24")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pool-mib", type=int, help="the memory pool (default: 1 GiB or 4x the last-level cache)")
    p.add_argument("--seconds", type=float, default=0.2, help="timed seconds per measurement")
    args = p.parse_args()
    sides = list(zip(args.isas.split(","), args.paths.split(",")))  # [(ISA, path) of A, of B]
    if len(sides) != 2:
        raise SystemExit("--isas and --paths each take two names, A,B")
    all_threads = isa.num_threads()
    pool_bytes = args.pool_mib << 20 if args.pool_mib else max(1 << 30, 4 * last_level_cache_bytes())
    columns = "".join(f"{f'{name} {path} GFLOP/s':>24s}" for name, path in sides)
    print(f"{'format':6s} {'M':>3s} {'threads':>7s} {'rows in':>7s}{columns} {'speedup':>7s}")
    for fmt in args.formats.split(","):
        bytes_per_row = K * (1 if fmt == "fp8" else 2)
        residency = {"cache": _matrices(fmt, 256, 1),
                     "memory": _matrices(fmt, N, max(1, pool_bytes // (N * bytes_per_row)))}
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(tokens, K)
            for threads in (1, all_threads):
                isa.configure_threads(threads)
                for where, mats in residency.items():
                    rates = ([], [])
                    for _ in range(args.rounds):
                        for (name, path), side in zip(sides, rates):
                            with isa.use_isa(name):
                                side.append(_gflops(mats, x, path, args.seconds))
                    ra, rb = (statistics.median(r) for r in rates)
                    print(f"{fmt:6s} {tokens:3d} {threads:7d} {where:>7s} {ra:24.1f} {rb:24.1f} {rb / ra:6.2f}x",
                          flush=True)
    isa.configure_threads(all_threads)


if __name__ == "__main__":
    main()
