"""The hardware profile of this machine (`hybridmoe profile`): what the planner's cost model reads.

Measures, each with a short timed loop (best of a few repeats, working sets larger than the last-level cache):
CPU memory read bandwidth; the CPU expert kernels (the C++ kernels when importable, else torch matmul, and the
profile says which) per weight format and tokens per expert T, cold and in cache; the CPU slowdown while
host<->device copies run; attention cost against context length; accelerator matmul throughput per format and
T; pinned host->device and device->host bandwidth. Without a GPU the accelerator entries describe the CPU
standing in for it (torch on the CPU, host memory copies for the link) and are marked stand_in. Given a model,
it also measures this engine's op tables for that model's shapes (profiling/op_tables.py).

Legend: T tokens per expert, H hidden, I expert intermediate, E experts.
"""

from __future__ import annotations

import os
import platform
import threading
import time

from hybridmoe.profiling.timing import best_time, last_level_cache_bytes, release_freed_memory

EXPERT_SHAPE = (2048, 768)  # (H, I): Qwen3-30B-A3B's routed experts
TOKENS = (1, 4, 16, 64)
CACHE_MULTIPLE = 4  # working sets are at least this many times the last-level cache


def matmul_shapes(quick: bool, accelerator: bool) -> tuple[int, tuple[int, ...]]:
    """(n, token counts) of the matmul table: T x n activations times n x n weights. The planner holds a table's
    last rate beyond its largest T, and an accelerator's rate still climbs past 512 tokens (a lent H200's quick
    table, 2048^2 weights up to 512 tokens, topped out at 146 bf16 TFLOP/s, a fifth of its rate on large products),
    so an accelerator also measures prefill-sized products on larger weights; a CPU keeps to what it times in
    seconds."""
    if accelerator:
        return (4096 if quick else 8192), (1, 16, 128, 512, 2048, 8192)
    return (2048 if quick else 4096), (1, 16, 128, 512)


def measured(value: float, what: str) -> dict:
    return {"value": float(value), "source": f"measured: {what}"}


class Measurer:
    def __init__(self, quick: bool):
        import torch

        self.torch = torch
        self.quick = quick
        self.repeats = 3 if quick else 7
        self.read_bytes = max((256 if quick else 1024) * 2**20, CACHE_MULTIPLE * last_level_cache_bytes())
        self.cuda = torch.cuda.is_available()
        self.device = torch.device("cuda" if self.cuda else "cpu")

    # ---- host memory ---------------------------------------------------------------------------------
    def read_gbs(self) -> float:
        torch = self.torch
        n = self.read_bytes // 4
        buffers = [torch.rand(n // 2) for _ in range(2)]  # rotate: never served from cache
        return n * 4 / best_time(lambda: [b.sum() for b in buffers], self.repeats) / 1e9

    def host_copy(self) -> tuple[float, float]:
        """(GB/s, small-copy latency in us) of the link: pinned H2D/D2H on a GPU, host memcpy stand-in."""
        torch = self.torch
        n = (64 if self.quick else 256) * 2**20
        if self.cuda:
            host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
            dev = torch.empty(n, dtype=torch.uint8, device="cuda")
            h2d = n / best_time(lambda: (dev.copy_(host, non_blocking=True), torch.cuda.synchronize()), self.repeats)
            d2h = n / best_time(lambda: (host.copy_(dev, non_blocking=True), torch.cuda.synchronize()), self.repeats)
            small_h, small_d = host[:16384], dev[:16384]
            lat = best_time(lambda: (small_d.copy_(small_h, non_blocking=True), torch.cuda.synchronize()), 20)
            return min(h2d, d2h) / 1e9, lat * 1e6
        src, dst = torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
        gbs = n / best_time(lambda: dst.copy_(src), self.repeats) / 1e9
        lat = best_time(lambda: dst[:16384].copy_(src[:16384]), 20)
        return gbs, lat * 1e6

    # ---- expert kernels ------------------------------------------------------------------------------
    def expert_backend(self, fmt: str, num_experts: int, hidden: int, inter: int):
        """(call(hidden, ids, weights), bytes per expert, name of what measured)."""
        torch = self.torch
        g = torch.Generator().manual_seed(0)
        # float32 matrices one expert at a time, each converted before the next is drawn: thousands of these
        # medium-sized temporaries alive at once stay in glibc's heap after they are freed (GBs of RSS kept)
        mats = ([torch.randn(*shape, generator=g) * 0.05 for shape in ((inter, hidden), (inter, hidden),
                                                                      (hidden, inter))] for _ in range(num_experts))
        try:
            from hybridmoe.kernels import isa
            from hybridmoe.layers.moe.backend import ExpertWeights
            from hybridmoe.layers.moe.cpu_backend import CpuExpertBackend

            weights = _expert_weights(fmt, mats, ExpertWeights)
            backend = CpuExpertBackend(weights)
            return (lambda x, ids, w: backend.wait(backend.submit(x, ids, w)), weights.nbytes() / num_experts,
                    f"C++ expert kernels ({isa.active_isa()}, {isa.num_threads()} threads, idle spin "
                    f"{isa.idle_spin_us()} us, short rows prefetched to {isa.short_row_prefetch().upper()})")
        except ImportError as e:
            if fmt != "bf16":
                raise RuntimeError(f"no C++ expert kernels ({e}); torch fallback measures bf16 only") from None
            stacked = [[m.to(torch.bfloat16) for m in e] for e in mats]

            def call(x, ids, w):
                out = torch.zeros_like(x)
                for e in ids.unique().tolist():
                    rows = (ids[:, 0] == e).nonzero()[:, 0]
                    gate, up, down = stacked[e]
                    h = torch.nn.functional.silu(x[rows] @ gate.T) * (x[rows] @ up.T)
                    out[rows] = h @ down.T
                return out

            return call, 3 * hidden * inter * 2, "torch matmul fallback (bf16; no C++ kernels)"

    def experts(self, fmt: str) -> dict:
        torch = self.torch
        hidden, inter = EXPERT_SHAPE
        probe_call, per_expert, what = self.expert_backend(fmt, 1, hidden, inter)
        cold_n = max(2, int(CACHE_MULTIPLE * last_level_cache_bytes() // per_expert) // (2 if self.quick else 1))
        call, per_expert, what = self.expert_backend(fmt, cold_n, hidden, inter)
        table = []
        for t in TOKENS:
            x = torch.randn(cold_n * t, hidden, dtype=torch.bfloat16)
            ids = torch.arange(cold_n).repeat_interleave(t)[:, None]  # every expert gets t tokens
            w = torch.ones(cold_n * t, 1)
            seconds = best_time(lambda: call(x, ids, w), self.repeats)
            table.append([t, cold_n * per_expert / seconds / 1e9])
        x1 = torch.randn(1, hidden, dtype=torch.bfloat16)
        one = torch.zeros(1, 1, dtype=torch.int64)
        hot = best_time(lambda: probe_call(x1, one, torch.ones(1, 1)), self.repeats * 3)
        tiny_call, _, _ = self.expert_backend(fmt, 1, 64, 64)
        xs = torch.randn(1, 64, dtype=torch.bfloat16)
        dispatch = best_time(lambda: tiny_call(xs, one, torch.ones(1, 1)), 20)
        return {"table": table, "decode_gweights_s": 3 * hidden * inter / hot / 1e9, "dispatch_us": dispatch * 1e6,
                "what": what, "call": call, "n": cold_n, "bytes": per_expert}

    def copy_slowdown(self, probe: dict) -> float:
        """Expert-kernel time alone / while a thread streams copies (to the GPU, or host memcpy stand-in)."""
        torch = self.torch
        hidden = EXPERT_SHAPE[0]
        n = probe["n"]
        x = torch.randn(n, hidden, dtype=torch.bfloat16)
        ids, w = torch.arange(n)[:, None], torch.ones(n, 1)
        alone = best_time(lambda: probe["call"](x, ids, w), self.repeats)
        stop = threading.Event()
        size = 64 * 2**20
        src = torch.empty(size, dtype=torch.uint8, pin_memory=self.cuda)
        dst = torch.empty(size, dtype=torch.uint8, device=self.device)

        def stream():
            while not stop.is_set():
                dst.copy_(src, non_blocking=self.cuda)
                if self.cuda:
                    torch.cuda.synchronize()

        thread = threading.Thread(target=stream, daemon=True)
        thread.start()
        try:
            during = best_time(lambda: probe["call"](x, ids, w), self.repeats)
        finally:
            stop.set()
            thread.join()
        return min(1.0, alone / during)

    # ---- matmul and attention ------------------------------------------------------------------------
    def matmul_table(self, dtype_name: str, device) -> list[list[float]]:
        """(T, achieved TFLOP/s) of T x n activations times n x n weights (matmul_shapes)."""
        torch = self.torch
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
        n, tokens = matmul_shapes(self.quick, device.type != "cpu")
        w = torch.randn(n, n, dtype=dtype, device=device)
        rows = []
        for t in tokens:
            x = torch.randn(t, n, dtype=dtype, device=device)
            sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
            seconds = best_time(lambda: (x @ w.T, sync()), self.repeats)
            rows.append([t, 2 * t * n * n / seconds / 1e12])
        return rows

    def attention_table(self, device) -> list[list[float]]:
        """Achieved TFLOP/s of causal-free attention of 256 queries (16 heads x 128) against C keys (bf16)."""
        torch = self.torch
        dtype = torch.bfloat16
        heads, dim, queries = 16, 128, 256
        rows = []
        for context in ((512, 2048) if self.quick else (512, 2048, 8192)):
            q = torch.randn(1, heads, queries, dim, dtype=dtype, device=device)
            k = torch.randn(1, heads, context, dim, dtype=dtype, device=device)
            v = torch.randn_like(k)
            sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
            seconds = best_time(lambda: (torch.nn.functional.scaled_dot_product_attention(q, k, v), sync()),
                                self.repeats)
            rows.append([context, 4 * heads * dim * queries * context / seconds / 1e12])
        return rows


def _expert_weights(fmt: str, mats, ExpertWeights):
    """Synthetic expert weights in a kernel format (bf16 / fp8 block / int4 group 32) from `mats`, an iterable of
    each expert's float [gate, up, down]."""
    import torch

    if fmt == "bf16":
        parts = [[m.to(torch.bfloat16) for m in e] for e in mats]  # [E][3]
        return ExpertWeights("dense", *[list(x) for x in zip(*parts)])
    if fmt == "fp8":
        from hybridmoe.checkpoint.fp8 import quantize_fp8 as quantize
    elif fmt == "int4":
        from hybridmoe.kernels.formats import quantize_int4

        quantize = lambda m: quantize_int4(m, group=32)
    else:
        raise ValueError(f"cannot profile expert format {fmt!r} (bf16, fp8, int4)")
    packed = [[quantize(m) for m in e] for e in mats]  # [E][3] of (data, scales)
    data = [list(x) for x in zip(*[[p[0] for p in e] for e in packed])]
    scales = [list(x) for x in zip(*[[p[1] for p in e] for e in packed])]
    return ExpertWeights(fmt, *data, *scales)


def build_profile(quick: bool, formats: tuple[str, ...], log=print, model_dir=None) -> dict:
    """Measure everything and return the profile dictionary (see module docstring); with `model_dir`, the
    engine's op tables for that model too. The GBs of synthetic weights measured are given back to the system
    afterwards, not kept in this process's heap."""
    try:
        return _measure_profile(quick, formats, log, model_dir)
    finally:
        release_freed_memory()


def _measure_profile(quick: bool, formats: tuple[str, ...], log, model_dir) -> dict:
    import torch

    import hybridmoe
    from hybridmoe.placement.hardware import SCHEMA, VERSION

    m = Measurer(quick)
    threads = torch.get_num_threads()
    log(f"memory read bandwidth ({threads} threads) ...")
    read = m.read_gbs()
    experts, kernel_what = {}, set()
    for fmt in formats:
        log(f"expert kernel {fmt} ...")
        try:
            experts[fmt] = m.experts(fmt)
            kernel_what.add(experts[fmt]["what"])
        except (RuntimeError, ValueError) as e:
            log(f"  skipped: {e}")
    if not experts:
        raise RuntimeError("no expert format could be measured")
    probe = next(iter(experts.values()))
    log("CPU slowdown while copies run ...")
    slowdown = m.copy_slowdown(probe)
    log("CPU matmul and attention ...")
    cpu = torch.device("cpu")
    cpu_matmul = {k: m.matmul_table(k, cpu) for k in ("fp32", "bf16")}
    cpu_attention = m.attention_table(cpu)
    log("host<->device link ...")
    link_gbs, latency_us = m.host_copy()
    gemv = max(row[1] for row in cpu_matmul["fp32"] if row[0] == 1) * 1e12 * 4 / 2  # bytes/s of fp32 W @ x
    peak = max(max(r[1] for r in rows) for rows in cpu_matmul.values())
    stand_in = not m.cuda
    where = "the CPU standing in for an accelerator (no GPU here)" if stand_in else torch.cuda.get_device_name(0)
    cpu_section = {
        "cores": measured(len(os.sched_getaffinity(0)), "CPUs this process may use"),
        "memory_gb": measured(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, "physical memory"),
        "memory_read_gbs": measured(read, f"torch sum over {m.read_bytes >> 20} MiB, {threads} threads"),
        "stream_efficiency": measured(min(1.0, gemv / 1e9 / read), "torch fp32 GEMV bandwidth / read bandwidth"),
        "peak_tflops": measured(peak, "best torch GEMM (fp32/bf16), taken as the peak"),
        "matmul_efficiency": measured(1.0, "the peak above is itself achieved"),
        "decode_gweights_s": {f: measured(e["decode_gweights_s"], f"{e['what']}, one expert in cache, T=1")
                              for f, e in experts.items()},
        "dispatch_us": measured(probe["dispatch_us"], f"{probe['what']}, one 64x64 expert, T=1"),
        "copy_slowdown": measured(slowdown, "expert kernel alone / during " +
                                  ("pinned host->device copies" if m.cuda else "a host-memory copy thread (stand-in)")),
        "expert_table": {f: e["table"] for f, e in experts.items()},
        "expert_table_source": f"measured: {', '.join(sorted(kernel_what))}; (T, weight GB/s), {EXPERT_SHAPE} experts",
        "attention_table": cpu_attention,
    }
    if model_dir is not None:
        from hybridmoe.profiling.op_tables import measure_op_tables

        log(f"this engine's op tables for {model_dir} ...")
        cpu_section["op_tables"] = measure_op_tables(model_dir).to_json()
    device = m.device
    matmul_n = matmul_shapes(quick, not stand_in)[0]
    if stand_in:
        gpu_matmul, gpu_attention, mem_gbs = cpu_matmul, cpu_attention, read
        memory_gb = cpu_section["memory_gb"]["value"]
    else:
        log("accelerator matmul and attention ...")
        gpu_matmul = {k: m.matmul_table(k, device) for k in ("fp32", "bf16")}
        gpu_attention = m.attention_table(device)
        memory_gb = torch.cuda.get_device_properties(0).total_memory / 1e9
        n = 256 * 2**20
        a, b = torch.empty(n, dtype=torch.uint8, device=device), torch.empty(n, dtype=torch.uint8, device=device)
        mem_gbs = 2 * n / best_time(lambda: (b.copy_(a), torch.cuda.synchronize()), m.repeats) / 1e9
    gpu_section = {
        "stand_in": stand_in,
        "memory_gb": measured(memory_gb, "total memory of " + where),
        "reserved_gb": measured(0.1 if stand_in else 1.0, "runtime reserve (stand-in: small)" if stand_in else
                                "runtime reserve (CUDA context, allocator)"),
        "memory_gbs": measured(mem_gbs, "device copy bandwidth" if not stand_in else "host read bandwidth (stand-in)"),
        "memory_efficiency": measured(1.0, "the bandwidth above is itself achieved"),
        "peak_tflops": {k: measured(max(r[1] for r in rows), f"best torch {k} GEMM on {where}")
                        for k, rows in gpu_matmul.items()},
        "matmul_efficiency": measured(1.0, "the peaks above are themselves achieved"),
        "h2d_gbs": measured(link_gbs, "pinned host->device copy" if m.cuda else "host memory copy (stand-in)"),
        "d2h_gbs": measured(link_gbs, "pinned device->host copy" if m.cuda else "host memory copy (stand-in)"),
        "link_latency_us": measured(max(latency_us, 0.1), "16 KiB copy"),
        "matmul_table": gpu_matmul,
        "matmul_table_source": f"measured: torch on {where}; (T, TFLOP/s), {matmul_n}^2 weights",
        "attention_table": gpu_attention,
        "attention_table_source": f"measured: torch SDPA on {where}; (context, TFLOP/s)",
    }
    return {"schema": SCHEMA, "version": VERSION, "name": platform.node() or "this-machine", "kind": "machine",
            "description": f"measured by hybridmoe {hybridmoe.__version__} on {platform.machine()} "
                           f"({platform.processor() or 'cpu'}); accelerator: {where}",
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "expert_kernels": sorted(kernel_what),
            "references": {}, "cpu": cpu_section, "gpu": gpu_section}


def engine_cpu(op_tables, log=print):
    """This machine's CPU part for the cost model, measured quickly (read bandwidth, the best torch fp32 GEMM)
    and carrying the engine's op tables: where they cover a model every CPU piece comes from them, and the
    roofline numbers only stand for what they do not cover."""
    import torch

    from hybridmoe.placement.hardware import CpuSpec

    m = Measurer(quick=True)
    log("memory read bandwidth and fp32 GEMM rate (quick) ...")
    read = m.read_gbs()
    peak = max(rate for _, rate in m.matmul_table("fp32", torch.device("cpu")))
    return CpuSpec(name=platform.node() or "this-machine", description="measured quickly, with this engine's op tables",
                   cores=len(os.sched_getaffinity(0)),
                   memory_gb=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, memory_read_gbs=read,
                   stream_efficiency=1.0, peak_tflops=peak, matmul_efficiency=1.0, decode_gweights_s={},
                   op_tables=op_tables)
