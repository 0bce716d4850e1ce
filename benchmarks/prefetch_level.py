"""Where short rows' far prefetch should go on this CPU: the fused MoE with it into L1 and into L2
(isa.set_short_row_prefetch), alternating in one process on the same experts, so that the host's drifting
bandwidth meets both alike. The experts are `hybridmoe bench kernels`' own (a pool much larger than the caches,
on huge pages, a new routing each call) and so is the bandwidth probe.

    python benchmarks/prefetch_level.py [--shapes qwen3-30b-a3b,deepseek-v3] [--formats fp8,int4,int8,bf16]
                                        [--tokens 1,4] [--rounds 8] [--seconds 0.25] [--pool-mib MIB]
                                        (HYBRIDMOE_NUM_THREADS=N for another thread count)

    python benchmarks/prefetch_level.py --model DIR[,DIR...] [--rounds 4] [--prompt-tokens 512] [--decode-tokens 64]

--model times a whole engine's decode instead: one engine per checkpoint decodes --decode-tokens greedy tokens
after the same prompt (random ids, its KV cache float16), the two levels alternating over the rounds; prints the
median tok/s of each, their ratio per round, and whether both levels gave the same tokens.

A shape is a name from the bench (qwen3-30b-a3b, deepseek-v3) or HIDDENxINTERxEXPERTSxTOPK (e.g. 256x96x16x4).
Each round times each level for about --seconds (which goes first alternates), then reads the bandwidth probe
once. --pool-mib sets the pool of a shape and format; by default it is the full bench's (1 GiB, or 4x the
last-level cache where that is larger: a lent Xeon's L3 holds 300 MB). Prints per case the median ms and GB/s of
weights of each level, the median and range over the rounds of the L2 level's speed against L1's, and the probe's
range; the level in use before the run is restored after it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from hybridmoe.bench import kernels as bench
from hybridmoe.kernels import _native, isa

LEVELS = ("l1", "l2")


def _shape(spec: str) -> tuple[int, int, int, int]:
    if spec in bench.SHAPES:
        return bench.SHAPES[spec]
    parts = spec.split("x")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise SystemExit(f"shape {spec!r}: a name ({', '.join(bench.SHAPES)}) or HIDDENxINTERxEXPERTSxTOPK")
    hidden, inter, experts, top_k = map(int, parts)
    if top_k > experts:
        raise SystemExit(f"shape {spec!r}: top-k {top_k} is more than its {experts} experts")
    return hidden, inter, experts, top_k


def _case(pool: bench.ExpertPool, tokens: int, top_k: int, rounds: int, seconds: float,
          probe: np.ndarray) -> dict:
    routings = bench._routings(tokens, pool.num_experts, top_k, 64)  # [T, K] ids and weights each
    hidden = torch.randn(tokens, pool.hidden).bfloat16()  # [T, H]

    def calls(n: int) -> float:
        start = time.perf_counter()
        for i in range(n):
            pool.moe(i, hidden, *routings[i % len(routings)])
        return (time.perf_counter() - start) / n

    once = calls(8)  # warm
    n = max(4, int(seconds / once))
    times = {level: [] for level in LEVELS}
    ratios, probes = [], []
    for r in range(rounds):
        for level in (LEVELS if r % 2 == 0 else LEVELS[::-1]):
            isa.set_short_row_prefetch(level)
            calls(2)
            times[level].append(calls(n))
        ratios.append(times["l1"][-1] / times["l2"][-1])
        probes.append(_native.measure_read_bandwidth(probe, 1) / 1e9)
    active = statistics.mean(ids.unique().numel() for ids, _ in routings)
    medians = {level: statistics.median(times[level]) for level in LEVELS}
    return {"ms": {level: medians[level] * 1e3 for level in LEVELS},
            "gbs": {level: active * pool.expert_bytes / medians[level] / 1e9 for level in LEVELS},
            "ratio": statistics.median(ratios), "ratio_range": (min(ratios), max(ratios)),
            "probe_range": (min(probes), max(probes))}


def _engine_case(model: str, rounds: int, prompt_tokens: int, decode_tokens: int) -> dict:
    from hybridmoe.bench._greedy_decode import timed_greedy_decode
    from hybridmoe.runtime.engine import EngineConfig, LLMEngine

    engine = LLMEngine(model, EngineConfig(kv_cache_dtype="float16", enable_prefix_caching=False),
                       show_progress=False)
    prompt = torch.randint(0, engine.model_config.vocab_size, (prompt_tokens,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    timed_greedy_decode(engine, prompt, 4)  # warm
    speeds = {level: [] for level in LEVELS}
    tokens = {}
    for r in range(rounds):
        for level in (LEVELS if r % 2 == 0 else LEVELS[::-1]):
            isa.set_short_row_prefetch(level)
            speed, tokens[level] = timed_greedy_decode(engine, prompt, decode_tokens)
            speeds[level].append(speed)
    ratios = [b / a for a, b in zip(speeds["l1"], speeds["l2"])]
    return {"tok_s": {level: statistics.median(v) for level, v in speeds.items()}, "ratios": ratios,
            "same_tokens": tokens["l1"] == tokens["l2"]}


def _engine_main(args) -> int:
    before = isa.short_row_prefetch()
    print(f"ISA {isa.active_isa()}, {isa.num_threads()} threads, CPU family {isa.cpu_family():#x}; whole-engine decode "
          f"of {args.decode_tokens} tokens after {args.prompt_tokens}, medians of {args.rounds} alternating rounds "
          f"(this CPU's default: {isa.default_short_row_prefetch()})")
    try:
        for model in args.model.split(","):
            c = _engine_case(model, args.rounds, args.prompt_tokens, args.decode_tokens)
            print(f"{model}: L1 {c['tok_s']['l1']:.2f} tok/s, L2 {c['tok_s']['l2']:.2f}, L2/L1 by round "
                  f"{' '.join(f'{r:.2f}' for r in c['ratios'])}; same tokens: {c['same_tokens']}", flush=True)
    finally:
        isa.set_short_row_prefetch(before)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="qwen3-30b-a3b,deepseek-v3")
    parser.add_argument("--formats", default="fp8,int4,int8,bf16")
    parser.add_argument("--tokens", default="1,4")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=0.25)
    parser.add_argument("--pool-mib", type=int)
    parser.add_argument("--model", help="checkpoint directories (comma-separated): time whole-engine decode instead")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=64)
    args = parser.parse_args()
    if args.model:
        for name in ("rounds", "prompt_tokens", "decode_tokens"):
            if getattr(args, name) < 1:
                raise SystemExit(f"--{name.replace('_', '-')} must be positive")
        return _engine_main(args)
    shapes = {name: _shape(name) for name in args.shapes.split(",")}
    formats = args.formats.split(",")
    unknown = [f for f in formats if f not in bench.FORMATS]
    if unknown:
        raise SystemExit(f"unknown format(s) {unknown}; choose from {list(bench.FORMATS)}")
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.rounds < 1 or args.seconds <= 0 or (args.pool_mib is not None and args.pool_mib < 1) or min(tokens) < 1:
        raise SystemExit("--rounds, --seconds, --pool-mib and --tokens must be positive")
    before = isa.short_row_prefetch()
    probe = bench.MachineProbe().buffer
    pool_bytes = args.pool_mib << 20 if args.pool_mib else bench.pool_bytes(quick=False)
    print(f"ISA {isa.active_isa()}, {isa.num_threads()} threads, CPU family {isa.cpu_family():#x}; short rows "
          f"prefetched to {before} in this process (this CPU's default: {isa.default_short_row_prefetch()})")
    print(f"{'shape':14s} {'format':6s} {'T':>4s} {'L1 ms':>8s} {'L1 GB/s':>8s} {'L2 ms':>8s} {'L2 GB/s':>8s} "
          f"{'L2/L1':>6s} {'range':>11s} {'probe GB/s':>11s}")
    source = bench._Bytes()
    try:
        for name, (hidden, inter, experts, top_k) in shapes.items():
            for fmt in formats:
                pool = bench.ExpertPool(fmt, hidden, inter, experts, pool_bytes, source)
                for t in tokens:
                    c = _case(pool, t, top_k, args.rounds, args.seconds, probe)
                    print(f"{name:14s} {fmt:6s} {t:4d} {c['ms']['l1']:8.3f} {c['gbs']['l1']:8.1f} "
                          f"{c['ms']['l2']:8.3f} {c['gbs']['l2']:8.1f} {c['ratio']:5.2f}x "
                          f"{c['ratio_range'][0]:5.2f}-{c['ratio_range'][1]:.2f} "
                          f"{c['probe_range'][0]:5.1f}-{c['probe_range'][1]:.1f}", flush=True)
                del pool
    finally:
        isa.set_short_row_prefetch(before)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
