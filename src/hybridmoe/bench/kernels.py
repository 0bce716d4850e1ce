"""`hybridmoe bench kernels [--quick] [--json PATH]`: the C++ fused MoE against this machine's limits and torch.

In one run: the machine's read bandwidth (STREAM-style multi-threaded read of 1 GiB, or 4x the last-level
cache where that is larger) and FMA peak (register-only FMA chains, active ISA), then the fused MoE at
DeepSeek-V3 expert shapes (H 7168, I 2048, top-8 of 256) and Qwen3-30B-A3B shapes (H 2048, I 768, top-8 of 128)
for T tokens, in each format (fp8, int4, int8, bf16). The experts come from a pool of distinct weights much
larger than the caches (1 GiB, 256 MiB with --quick, or 4x the last-level cache where that is larger): as many
layers of E experts as the pool fills, called in turn as a model's layers are (the Qwen3 shapes' 128 experts
hold 300-600 MB, which a server's last-level cache can nearly hold), and each repeat draws a new routing, so
weights stream from memory as in decode. Side by side, on the same layers and routing: torch bf16 matmul on
pre-converted weights (timed right after the kernels, _case_times), and torch dequantise-then-matmul of the
format's weights.

The bandwidth probe's buffer comes from numpy, which asks for transparent huge pages, and so do the experts: a
pool's tensors lie in one numpy-allocated block (_HugePageArena), read in place by the kernels and by torch's
baselines alike, unless HYBRIDMOE_COPY_EXPERTS=1 has the kernels copy them at load into memory of their own, also
on huge pages (expert_memory in the JSON). Torch's own allocations sit on 4 KB pages where THP is "madvise" (as
on most distributions), from which the kernels would read the experts up to a tenth slower than the probe's
buffer.

The pool's idle spin (isa.idle_spin_us, HYBRIDMOE_SPIN_US; idle_spin_us in the JSON) is left as set: workers
spinning on past a kernel call hold their CPUs during the torch baseline that follows it, so a spin longer than
the default slows the baseline and flatters the speedups. So is where short rows' far prefetch goes
(isa.short_row_prefetch, HYBRIDMOE_SHORT_ROW_PREFETCH; short_row_prefetch in the JSON).

Reported per (shape, format, T): weight_gbs (bytes of the experts the tokens visit / time), its fraction of the
measured bandwidth, the fraction of the FMA peak (2*3*H*I*T*K flops / time), and the two speedups. The host's
bandwidth and FMA rate drift (on a shared VM by up to 2x within minutes), so each case is measured side by side
with its own probes, right before and right after its timed calls, and its fractions are of the better of those
two (probe_gbs, probe_gflops); the run's memory_bandwidth_gbs and peak_fma_gflops are the best of all probes,
and bandwidth_fraction_of_best / flops_fraction_of_best give the fractions of those. Where the dequantise
baseline would take too long (many active experts), it is timed on the first experts and scaled to all of them
(dequant_torch_estimated: true).

Legend: T tokens, H hidden, I expert intermediate, E experts, K top-k, D distinct expert weights in the pool,
L layers (D / E rounded up).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from hybridmoe.kernels import _native, formats, isa, numa
from hybridmoe.kernels.moe import FusedMoE
from hybridmoe.profiling.timing import last_level_cache_bytes

SHAPES = {"deepseek-v3": (7168, 2048, 256, 8), "qwen3-30b-a3b": (2048, 768, 128, 8)}  # H, I, E, K
TOKENS = (1, 4, 32, 256)
QUICK_TOKENS = {"deepseek-v3": (1, 4), "qwen3-30b-a3b": (1, 4, 32, 256)}
FORMATS = ("fp8", "int4", "int8", "bf16")
INT_GROUP = 32
BANDWIDTH_BYTES = 1 << 30
POOL_BYTES = {False: 1 << 30, True: 256 << 20}  # by quick: the least expert pool
CACHE_MULTIPLE = 4  # the probe's buffer and the pools are at least this many times the last-level cache
# where the kernels read the experts (numa.topology()["copy_shards"]; HYBRIDMOE_COPY_EXPERTS=1 copies them)
EXPERT_MEMORY = {False: "read in place (huge pages)", True: "copied at load (huge pages)"}
# Short calls after the CPUs idled run slower for tens of ms on a VM (one warm-up call is not enough), so each case
# first calls for this long.
WARMUP_SECONDS = 0.2
SETTLE_SECONDS = 0.02  # untimed calls before each timed one (_block_times)
QUIET_STEP_SECONDS = 0.01  # _wait_until_quiet's sleeps, until this process used under 0.1 CPU in one
QUIET_MAX_SECONDS = 1.0
DEQUANT_MAX_EXPERTS = {False: 8, True: 2}  # by quick: experts the dequantise baseline times per call, then scales


def register(subparsers) -> None:
    p = subparsers.add_parser("kernels", help="fused MoE kernels vs memory bandwidth, FMA peak and torch")
    p.add_argument("--quick", action="store_true", help="smaller pools, fewer repeats, DeepSeek at T=1,4 only")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--formats", default=",".join(FORMATS), help=f"formats to run (default {','.join(FORMATS)})")
    p.set_defaults(func=run)


# ---- weights ---------------------------------------------------------------------------------------------

class _Bytes:
    """Pseudo-random bytes made fast: one random 16 MiB block, repeated (the values matter for speed only
    through fp8 subnormal codes, see _realistic_fp8)."""

    def __init__(self, seed: int = 0):
        self.block = torch.from_numpy(np.random.default_rng(seed).integers(0, 256, 16 << 20, dtype=np.uint8))
        self.fixed: dict = {}

    def take(self, n: int, fix=None) -> torch.Tensor:
        """n bytes in memory of their own (a slice of a larger tensor would keep all of it alive)."""
        if fix is not None and fix not in self.fixed:
            self.fixed[fix] = fix(self.block.clone())
        block = self.fixed[fix] if fix is not None else self.block
        whole, rest = divmod(n, block.numel())
        return torch.cat([block] * whole + [block[:rest]])


def _realistic_fp8(b: torch.Tensor) -> torch.Tensor:
    """e4m3 codes of normally distributed weights quantised with absmax at 448, as FP8 checkpoints hold them
    (subnormal codes about 1 in 5000, no NaN), rather than uniform random bytes (1 in 16 subnormal)."""
    gen = torch.Generator().manual_seed(int(b[:8].sum()))
    return (torch.randn(b.numel(), generator=gen) * 90).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)


def _no_128(b: torch.Tensor) -> torch.Tensor:
    return torch.where(b == 0x80, torch.tensor(0x81, dtype=torch.uint8), b)  # int8 -128 -> -127


def _normal_bf16(b: torch.Tensor) -> torch.Tensor:
    bits = b.view(torch.int16)
    return ((bits & 0x3FFF) | 0x3C00).view(torch.uint8)  # normal values of magnitude in [2^-7, 2)


def _matrix(fmt: str, rows: int, cols: int, source: _Bytes, gen: torch.Generator):
    """A random [rows, cols] matrix in fmt -> (data, scales or None)."""
    if fmt == "fp8":
        data = source.take(rows * cols, _realistic_fp8).view(rows, cols).view(torch.float8_e4m3fn)
        return data, torch.rand(-(-rows // 128), -(-cols // 128), generator=gen) * 1e-3
    if fmt == "bf16":
        return source.take(2 * rows * cols, _normal_bf16).view(torch.bfloat16).view(rows, cols), None
    kp = formats.padded_cols(cols, INT_GROUP)
    scales = (torch.rand(rows, kp // INT_GROUP, generator=gen) * 1e-2).bfloat16()
    if fmt == "int4":
        return source.take(rows * kp // 2).view(rows, kp // 2), scales
    return source.take(rows * kp, _no_128).view(torch.int8).view(rows, kp), scales


def pool_bytes(quick: bool) -> int:
    """The expert pool of a shape and format: POOL_BYTES, or CACHE_MULTIPLE x the last-level cache if larger."""
    return max(POOL_BYTES[quick], CACHE_MULTIPLE * last_level_cache_bytes())


class _HugePageArena:
    """One block of memory for a pool's tensors, handed out in 64-byte-aligned pieces. numpy advises transparent
    huge pages for large arrays before their first touch, as for the bandwidth probe's buffer, so that the
    experts and the probe are read through the same page size."""

    ALIGN = 64

    def __init__(self, nbytes: int):
        self.buffer = torch.from_numpy(np.empty(nbytes, dtype=np.uint8))
        self.used = 0

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of t in the arena."""
        n = t.numel() * t.element_size()
        start = self.used + (-(self.buffer.data_ptr() + self.used)) % self.ALIGN
        if start + n > self.buffer.numel():
            raise ValueError(f"arena of {self.buffer.numel()} bytes is full ({start} used, {n} more asked for)")
        out = self.buffer[start:start + n].view(t.dtype).view(t.shape)
        out.copy_(t)
        self.used = start + n
        return out


class ExpertPool:
    """D distinct experts in one format, as L = ceil(D / E) layers of E experts (layer l's expert e is
    pool[(l * E + e) % D]); `moe(layer, ...)` calls layer `layer % L`. The experts' tensors lie in one
    _HugePageArena."""

    def __init__(self, fmt: str, hidden: int, inter: int, num_experts: int, pool_bytes: int, source: _Bytes):
        gen = torch.Generator().manual_seed(1)
        self.fmt, self.hidden, self.inter, self.num_experts = fmt, hidden, inter, num_experts
        shapes = ((inter, hidden), (inter, hidden), (hidden, inter))  # gate, up, down
        first = [_matrix(fmt, r, c, source, gen) for r, c in shapes]
        tensors = [t for m in first for t in m if t is not None]
        self.expert_bytes = sum(t.numel() * t.element_size() for t in tensors)
        self.distinct = max(1, math.ceil(pool_bytes / self.expert_bytes))
        self.arena = _HugePageArena(self.distinct * (self.expert_bytes + len(tensors) * _HugePageArena.ALIGN))
        self.experts = [self._placed(first)] + [self._placed([_matrix(fmt, r, c, source, gen) for r, c in shapes])
                                                for _ in range(self.distinct - 1)]
        self.num_layers = math.ceil(self.distinct / num_experts)
        self.layers = [self._layer(layer) for layer in range(self.num_layers)]

    def _placed(self, expert: list) -> list:
        """The expert's (data, scales) matrices copied into the arena."""
        return [tuple(None if t is None else self.arena.place(t) for t in m) for m in expert]

    def _layer(self, layer: int) -> FusedMoE:
        pick = [self.expert(layer, e) for e in range(self.num_experts)]
        scales = {}
        if pick[0][0][1] is not None:
            scales = dict(gate_scale=[p[0][1] for p in pick], up_scale=[p[1][1] for p in pick],
                          down_scale=[p[2][1] for p in pick])
        return FusedMoE(self.fmt, [p[0][0] for p in pick], [p[1][0] for p in pick], [p[2][0] for p in pick],
                        **scales, hidden_size=self.hidden, intermediate_size=self.inter)

    def expert(self, layer: int, e: int):
        return self.experts[((layer % self.num_layers) * self.num_experts + e) % self.distinct]

    def moe(self, layer: int, hidden, ids, weights) -> torch.Tensor:
        return self.layers[layer % self.num_layers](hidden, ids, weights)

    def dequantized(self, layer: int, e: int) -> list[torch.Tensor]:
        """The expert's (gate, up, down) dequantised to bf16 with torch, as a dequantise-then-matmul path does."""
        out = []
        for (data, scales), cols in zip(self.expert(layer, e), (self.hidden, self.hidden, self.inter)):
            if self.fmt == "bf16":
                out.append(data)
            elif self.fmt == "fp8":
                full = scales.repeat_interleave(128, 0)[:data.shape[0]].repeat_interleave(128, 1)[:, :cols]
                out.append((data.float() * full).bfloat16())
            else:
                codes = formats.int_codes(self.fmt, data)[:, :cols].float()
                out.append((codes * scales.float().repeat_interleave(INT_GROUP, 1)[:, :cols]).bfloat16())
        return out


# ---- timing ----------------------------------------------------------------------------------------------

def _routings(tokens: int, num_experts: int, top_k: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(tokens)
    out = []
    for _ in range(count):
        ids = torch.rand(tokens, num_experts, generator=gen).argsort(dim=1)[:, :top_k]  # [T, K] distinct experts
        weights = torch.rand(tokens, top_k, generator=gen)
        out.append((ids, weights / weights.sum(1, keepdim=True)))
    return out


def _warm_up(call, routing, hidden, seconds: float) -> None:
    """call(0, hidden, *routing) once, then again until `seconds` have passed since the first call began."""
    start = time.perf_counter()
    call(0, hidden, *routing)
    while time.perf_counter() - start < seconds:
        call(0, hidden, *routing)


def _block_times(call, routings, hidden) -> list[float]:
    """call(layer, hidden, ids, weights)'s seconds on each routing i >= 1 (on layer i), each timed call right after
    untimed calls on layer 0 with the first routing for SETTLE_SECONDS (at least one), all after a warm-up of
    WARMUP_SECONDS: the threads are awake and the timed layer's weights are not in the caches."""
    _warm_up(call, routings[0], hidden, WARMUP_SECONDS)
    times = []
    for layer, (ids, weights) in enumerate(routings[1:], 1):
        _warm_up(call, routings[0], hidden, SETTLE_SECONDS)
        start = time.perf_counter()
        call(layer, hidden, ids, weights)
        times.append(time.perf_counter() - start)
    return times


def _wait_until_quiet() -> None:
    """Sleep QUIET_STEP_SECONDS at a time until this process's threads used under a tenth of a CPU in one (torch's
    OpenMP workers spin on after its calls: about 10 ms here, on 2 vCPUs), for at most QUIET_MAX_SECONDS."""
    deadline = time.perf_counter() + QUIET_MAX_SECONDS
    while time.perf_counter() < deadline:
        cpu = time.process_time()
        time.sleep(QUIET_STEP_SECONDS)
        if time.process_time() - cpu < 0.1 * QUIET_STEP_SECONDS:
            return


def _case_times(kernel, baseline, routings, hidden) -> tuple[float, float]:
    """The kernels' and a torch baseline's median seconds (each call(layer, hidden, ids, weights)) on the same
    routings: once the CPUs are quiet (_wait_until_quiet), all of the kernels' calls, then all of torch's
    (_block_times). Torch's OpenMP threads spin on after its calls and compete with the kernels' threads for the
    CPUs: on a lent 16-CPU Xeon, the kernels' calls each timed 20 ms after a torch call (the pairs this bench once
    timed) took up to 2x as long (Qwen3 fp8 T = 1 0.69 ms against 0.34 ms after no torch call, or with
    OMP_WAIT_POLICY=PASSIVE). A case takes about a second, well within the minutes over which the host's bandwidth
    drifts."""
    _wait_until_quiet()
    kernel_times = _block_times(kernel, routings, hidden)
    baseline_times = _block_times(baseline, routings, hidden)
    return float(np.median(kernel_times)), float(np.median(baseline_times))


def _torch_moe(expert_weights, hidden, ids, weights, limit: int | None = None) -> int:
    """Grouped-by-expert torch MoE in bf16; expert_weights(e) -> (gate, up, down). Returns experts computed."""
    x = hidden.bfloat16()
    out = torch.zeros_like(x)
    active = ids.unique().tolist()[:limit]
    for e in active:
        token, slot = (ids == e).nonzero(as_tuple=True)
        gate, up, down = expert_weights(e)
        h = F.silu(x[token] @ gate.T) * (x[token] @ up.T)
        out.index_add_(0, token, (h @ down.T) * weights[token, slot, None].bfloat16())
    return len(active)


# ---- the run ---------------------------------------------------------------------------------------------

class MachineProbe:
    """This machine's read bandwidth (GB/s over 1 GiB or 4x the last-level cache, the kernels' threads, the best of
    a few passes of a plain read and of reads that prefetch ahead: `_native.measure_read_bandwidth`) and FMA peak
    (GFLOP/s of register-only FMA chains, active ISA); every measurement is kept, so that the run can report the
    best of them."""

    def __init__(self):
        self.buffer = np.ones(max(BANDWIDTH_BYTES, CACHE_MULTIPLE * last_level_cache_bytes()) // 8, dtype=np.uint64)
        self.bandwidths: list[float] = []
        self.peaks: list[float] = []

    def measure(self, passes: int, fma_seconds: float) -> tuple[float, float]:
        self.bandwidths.append(_native.measure_read_bandwidth(self.buffer, passes) / 1e9)
        self.peaks.append(_native.measure_fma_peak(fma_seconds) / 1e9)
        return self.bandwidths[-1], self.peaks[-1]

    def full(self, quick: bool) -> tuple[float, float]:
        """The thorough probe that opens and closes a run."""
        return self.measure(3 if quick else 6, 0.2 if quick else 0.5)

    def beside(self) -> tuple[float, float]:
        """The short probe taken right before and right after each case (about 0.25 s: three reads)."""
        return self.measure(1, 0.05)


def bench_shape(name: str, fmts: list[str], quick: bool, probe: MachineProbe, log=print) -> list[dict]:
    hidden, inter, num_experts, top_k = SHAPES[name]
    tokens_list = QUICK_TOKENS[name] if quick else TOKENS
    repeats = 4 if quick else 8
    source = _Bytes()
    flops_per_pair = 2 * 3 * hidden * inter
    bf16_pool = ExpertPool("bf16", hidden, inter, num_experts, pool_bytes(quick), source)
    # fewer timed calls at T = 256 (DeepSeek-V3's take about 1.5 s with torch's), an odd count so that the median
    # is a call's own
    routing = {t: _routings(t, num_experts, top_k, 1 + (repeats if t < 256 else repeats // 2 + 1))
               for t in tokens_list}
    hid = {t: torch.randn(t, hidden).bfloat16() for t in tokens_list}

    def torch_bf16(layer, h, ids, weights):
        return _torch_moe(lambda e: [m[0] for m in bf16_pool.expert(layer, e)], h, ids, weights)

    results = []
    for fmt in fmts:
        pool = bf16_pool if fmt == "bf16" else ExpertPool(fmt, hidden, inter, num_experts, pool_bytes(quick), source)
        # each case between two probes (one case's probe after is the next one's before)
        kernel_seconds, torch_seconds, probes, before = {}, {}, {}, probe.beside()
        for t in tokens_list:
            kernel_seconds[t], torch_seconds[t] = _case_times(pool.moe, torch_bf16, routing[t], hid[t])
            after = probe.beside()
            probes[t] = (max(before[0], after[0]), max(before[1], after[1]))
            before = after
        for t in tokens_list:
            seconds = kernel_seconds[t]
            speedup = torch_seconds[t] / seconds
            active = float(np.mean([ids.unique().numel() for ids, _ in routing[t][1:]]))
            if fmt == "bf16":  # bf16 weights need no dequantisation: the same baseline
                vs_dequant, estimated = speedup, False
            else:
                dequant, estimated = _dequant_time(pool, routing[t], hid[t], DEQUANT_MAX_EXPERTS[quick],
                                                   1 if quick else 2)
                vs_dequant = dequant / seconds
            gbs = active * pool.expert_bytes / seconds / 1e9
            row = {"shape": name, "format": fmt, "tokens": t, "ms": seconds * 1e3, "weight_gbs": gbs,
                   "gflops": flops_per_pair * t * top_k / seconds / 1e9, "torch_bf16_ms": torch_seconds[t] * 1e3,
                   "speedup_vs_bf16_torch": speedup, "speedup_vs_dequant_torch": vs_dequant,
                   "dequant_torch_estimated": estimated, "distinct_experts": pool.distinct,
                   "layers": pool.num_layers,
                   "probe_gbs": probes[t][0], "probe_gflops": probes[t][1]}
            row["bandwidth_fraction"] = gbs / probes[t][0]
            row["flops_fraction"] = row["gflops"] / probes[t][1]
            results.append(row)
            log(f"  {name} {fmt} T={t}: {row['ms']:.2f} ms, {gbs:.1f} GB/s of weights ({row['bandwidth_fraction']:.2f} "
                f"of {probes[t][0]:.1f}), {row['gflops']:.1f} GFLOP/s ({row['flops_fraction']:.2f} of {probes[t][1]:.0f})")
        if pool is not bf16_pool:
            del pool
    return results


def _dequant_time(pool: ExpertPool, routings, hidden, max_experts: int, runs: int) -> tuple[float, bool]:
    """Torch dequantise-then-matmul on the same routing."""
    times, estimated = [], False
    for layer, (ids, weights) in enumerate(routings[1:1 + runs], 1):
        active = ids.unique().numel()
        start = time.perf_counter()
        done = _torch_moe(lambda e: pool.dequantized(layer, e), hidden, ids, weights, limit=max_experts)
        times.append((time.perf_counter() - start) * active / done)
        estimated |= done < active
    return float(np.median(times)), estimated


HEADER = (f"{'shape':14s} {'format':6s} {'T':>4s} {'ms':>9s} {'weights GB/s':>12s} {'probe GB/s':>10s} {'of bw':>6s} "
          f"{'probe GFLOP/s':>13s} {'of FMA peak':>11s} {'vs torch bf16':>13s} {'vs dequant':>10s}")


def _format_row(r: dict) -> str:
    est = "~" if r["dequant_torch_estimated"] else " "
    return (f"{r['shape']:14s} {r['format']:6s} {r['tokens']:4d} {r['ms']:9.2f} {r['weight_gbs']:12.1f} "
            f"{r['probe_gbs']:10.1f} {r['bandwidth_fraction']:6.2f} {r['probe_gflops']:13.0f} "
            f"{r['flops_fraction']:11.2f} {r['speedup_vs_bf16_torch']:12.2f}x "
            f"{est}{r['speedup_vs_dequant_torch']:8.1f}x")


def _progress_line(stream=None):
    """Each case's result as it is measured, on one terminal line rewritten in place (the table follows the run);
    nothing when the stream is not a terminal. -> (show(message), done())."""
    stream = stream or sys.stderr
    if not stream.isatty():
        return (lambda message: None), (lambda: None)

    def show(message: str) -> None:
        stream.write("\r\x1b[K" + message.strip())
        stream.flush()

    return show, lambda: show("")


def run(args) -> int:
    fmts = [f for f in args.formats.split(",") if f]
    unknown = [f for f in fmts if f not in FORMATS]
    if unknown:
        raise SystemExit(f"unknown format(s) {unknown}; choose from {list(FORMATS)}")
    threads = isa.num_threads()
    torch.set_num_threads(threads)
    started = time.perf_counter()
    probe = MachineProbe()
    opening = probe.full(args.quick)
    copied = numa.topology()["copy_shards"]
    print(f"ISA {isa.active_isa()}, {threads} threads (idle spin {isa.idle_spin_us()} us; short rows prefetched "
          f"to {isa.short_row_prefetch().upper()}); "
          f"read bandwidth {opening[0]:.1f} GB/s "
          f"({probe.buffer.nbytes / 2**30:.2f} GiB, all threads; last-level cache {last_level_cache_bytes() >> 20} "
          f"MiB); "
          f"FMA peak {opening[1]:.1f} GFLOP/s; experts {EXPERT_MEMORY[copied]}; the fused MoE, case by case:")
    results = []
    show, done = _progress_line()
    for name in SHAPES:
        results += bench_shape(name, fmts, args.quick, probe, log=show)
    done()
    closing = probe.full(args.quick)
    bandwidth, peak = max(probe.bandwidths), max(probe.peaks)
    for row in results:
        row["bandwidth_fraction_of_best"] = row["weight_gbs"] / bandwidth
        row["flops_fraction_of_best"] = row["gflops"] / peak
    print(f"measured again after the run: {closing[0]:.1f} GB/s, FMA {closing[1]:.1f} GFLOP/s; over the run's "
          f"{len(probe.bandwidths)} probes {min(probe.bandwidths):.1f}-{bandwidth:.1f} GB/s and "
          f"{min(probe.peaks):.0f}-{peak:.0f} GFLOP/s. Fractions are of each case's own probes (probe columns), "
          f"measured right before and after it")
    print(HEADER)
    for row in results:
        print(_format_row(row))
    print(f"(~: dequantise baseline timed on the first {DEQUANT_MAX_EXPERTS[args.quick]} experts and scaled; "
          f"{time.perf_counter() - started:.0f} s)")
    if args.json:
        report = {"memory_bandwidth_gbs": bandwidth, "peak_fma_gflops": peak, "isa": isa.active_isa(),
                  "memory_bandwidth_gbs_probes": probe.bandwidths, "peak_fma_gflops_probes": probe.peaks,
                  "threads": threads, "idle_spin_us": isa.idle_spin_us(),
                  "short_row_prefetch": isa.short_row_prefetch(), "long_row_prefetch": isa.long_row_prefetch(),
                  "cpus": os.cpu_count(),
                  "quick": bool(args.quick),
                  "expert_memory": EXPERT_MEMORY[copied], "last_level_cache_bytes": last_level_cache_bytes(),
                  "bandwidth_probe_bytes": probe.buffer.nbytes, "pool_bytes": pool_bytes(args.quick),
                  "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "results": results}
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
