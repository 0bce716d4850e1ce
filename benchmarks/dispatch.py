"""The fixed cost of a fused-MoE call by pool size: one tiny layer (8 experts of 64 x 64, bf16, one token routed
to 8 of them), called directly (blocking: on the calling thread as the pool's thread 0) and through
submit + wait (the executor thread runs it), back to back and after the CPUs idled for a pause, as a decode
step's attention on the accelerator leaves them.

    python benchmarks/dispatch.py [--threads 1,2,4] [--calls 2000] [--rounds 5] [--pauses-us 0,1000]
                                  [--spins-us 100,10000]

(--threads: default 1, 2, 4, ... up to the pool's size, and the pool's size; --spins-us: the pool workers' idle
spins to set, isa.set_idle_spin_us, default the current one.) Prints the median and the range of the rounds'
microseconds per call, for each thread count, idle spin, pause and way of calling, and how many times a worker
went to sleep per call: a pause longer than the spin sends the workers to sleep, so its calls pay their wake-up.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hybridmoe.kernels import isa
from hybridmoe.kernels.moe import FusedMoE

E, H, I, K = 8, 64, 64, 8


def _layer() -> FusedMoE:
    gen = torch.Generator().manual_seed(0)

    def weights(rows: int, cols: int) -> list[torch.Tensor]:
        return [torch.randn(rows, cols, generator=gen).bfloat16() for _ in range(E)]

    return FusedMoE("bf16", weights(I, H), weights(I, H), weights(H, I), hidden_size=H, intermediate_size=I)


def _us_per_call(moe: FusedMoE, way: str, calls: int, pause_s: float) -> float:
    x = torch.randn(1, H)
    ids = torch.arange(K).view(1, K)  # [1, K]
    w = torch.full((1, K), 1.0 / K)
    total = 0.0
    for _ in range(calls):
        if pause_s:
            time.sleep(pause_s)
        start = time.perf_counter()
        if way == "direct":
            moe(x, ids, w)
        else:
            moe.wait(moe.submit(x, ids, w))
        total += time.perf_counter() - start
    return total / calls * 1e6


def _thread_counts(all_threads: int) -> list[int]:
    counts, n = [], 1
    while n < all_threads:
        counts.append(n)
        n *= 2
    return counts + [all_threads]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", help="pool sizes, comma-separated (default: 1, 2, 4, ... and all)")
    p.add_argument("--calls", type=int, default=2000, help="calls a round, back to back (a tenth after a pause)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--pauses-us", default="0,1000", help="idle microseconds before each call")
    p.add_argument("--spins-us", help="idle spins of the pool's workers to set, microseconds (default: as set)")
    args = p.parse_args()
    all_threads, spin_before = isa.num_threads(), isa.idle_spin_us()
    counts = [int(t) for t in args.threads.split(",")] if args.threads else _thread_counts(all_threads)
    pauses = [float(us) for us in args.pauses_us.split(",")]
    spins = [int(us) for us in args.spins_us.split(",")] if args.spins_us else [spin_before]
    moe = _layer()
    print(f"ISA {isa.active_isa()}; one layer of {E} experts of {I} x {H} (bf16), 1 token, top-{K}; us per call, "
          f"median (range) of {args.rounds} rounds")
    print(f"{'threads':>7s} {'spin us':>8s} {'pause us':>8s} {'direct':>20s} {'submit + wait':>20s} "
          f"{'sleeps/call':>11s}")
    try:
        for threads in counts:
            isa.configure_threads(threads)
            for spin_us in spins:
                isa.set_idle_spin_us(spin_us)
                for pause_us in pauses:
                    calls = args.calls if not pause_us else max(1, args.calls // 10)
                    rounds: dict[str, list[float]] = {"direct": [], "submit": []}
                    _us_per_call(moe, "direct", calls, pause_us / 1e6)  # warm-up
                    sleeps = isa.pool_sleeps()
                    for _ in range(args.rounds):
                        for way, times in rounds.items():
                            times.append(_us_per_call(moe, way, calls, pause_us / 1e6))
                    per_call = (isa.pool_sleeps() - sleeps) / (2 * args.rounds * calls)
                    cells = [f"{statistics.median(t):8.1f} ({min(t):.1f}-{max(t):.1f})" for t in rounds.values()]
                    print(f"{threads:7d} {spin_us:8d} {pause_us:8.0f} {cells[0]:>20s} {cells[1]:>20s} "
                          f"{per_call:11.2f}", flush=True)
    finally:
        isa.set_idle_spin_us(spin_before)
        isa.configure_threads(all_threads)


if __name__ == "__main__":
    main()
