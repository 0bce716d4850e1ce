"""`hybridmoe info`: which kernel ISA runs (and why the others do not), CPU features, the kernels' threads and
pinning, the NUMA layout the kernels use (nodes, their CPUs and threads, where weight shards live), versions."""

from __future__ import annotations

import os
import platform


def register(subparsers) -> None:
    p = subparsers.add_parser("info", help="show which kernel ISA runs, CPU features and threads")
    p.set_defaults(func=run)


def _numa_lines() -> list[str]:
    from hybridmoe.kernels import numa

    used = numa.topology()
    per_node = [numa.thread_nodes().count(n) for n in range(len(used["nodes"]))]
    lines = [f"NUMA layout: {used['description']}",
             "  threads per node: " + ", ".join(f"node {n}: {c}" for n, c in enumerate(per_node))]
    if len(used["nodes"]) > 1:
        lines.append("  each node computes its shard of every expert's intermediate dimension; partial outputs summed")
    detected = numa.detected_topology()
    if used["emulated"]:
        lines.append(f"  (emulated by HYBRIDMOE_NUMA_NODES/configure_numa; machine: {detected['description']})")
    return lines


def run(args) -> int:
    import torch

    print(f"python {platform.python_version()}, torch {torch.__version__}, machine {platform.machine()}")
    try:
        from hybridmoe.kernels import isa
    except ImportError as error:
        print(f"expert kernels: NOT AVAILABLE ({error})")
        return 1
    try:
        active = isa.active_isa()
    except ValueError as error:
        print(f"expert kernels: ISA selection failed: {error}")
        active = None
    forced = os.environ.get("HYBRIDMOE_ISA")
    if active:
        print(f"kernel ISA: {active}" + (f" (forced by HYBRIDMOE_ISA={forced})" if forced else " (best available)"))
    for name in isa.all_isas():
        reason = isa.unavailable_reason(name)
        notes = []
        if not reason and isa.bf16_dot(name):
            min_tokens, long_rows = isa.bf16_dot_min_tokens(), isa.bf16_dot_long_row_bytes()
            notes.append(f"bf16 dot products for bf16/fp8 weights from {min_tokens['bf16']}/{min_tokens['fp8']} "
                         f"tokens per expert (bf16 rows of {long_rows} bytes and more: from 1), activations "
                         "rounded to bf16")
        if not reason and isa.amx(name):
            notes.append(f"AMX tiles for bf16/fp8 weights from {isa.amx_min_tokens()} tokens per expert and int4/int8 "
                         f"from {isa.amx_int_min_tokens()}, activations rounded to bf16")
        if name == "avx2bf16" and not reason:
            notes.append("emulated, for tests")
        if not reason and not isa.auto_selected(name):
            notes.append("only when forced")
        status = "available" + (f" ({'; '.join(notes)})" if notes else "") if not reason else "unavailable: " + reason
        print(f"  {name:10s} {status}")
    features = isa.cpu_features()
    print("CPU features: " + " ".join(f"{k}{'+' if v else '-'}" for k, v in features.items())
          + f"; family {isa.cpu_family():#x}")
    print(f"short rows' far prefetch (one token) into {isa.short_row_prefetch().upper()} (this CPU's default "
          f"{isa.default_short_row_prefetch().upper()}; HYBRIDMOE_SHORT_ROW_PREFETCH="
          f"{os.environ.get('HYBRIDMOE_SHORT_ROW_PREFETCH', 'unset')})")
    print(f"long rows' next-row prefetch (one token) {isa.long_row_prefetch()} (this CPU's default "
          f"{isa.default_long_row_prefetch()}; HYBRIDMOE_LONG_ROW_PREFETCH="
          f"{os.environ.get('HYBRIDMOE_LONG_ROW_PREFETCH', 'unset')})")
    cpus = isa.thread_cpus()
    print(f"threads: {isa.num_threads()} (HYBRIDMOE_NUM_THREADS={os.environ.get('HYBRIDMOE_NUM_THREADS', 'unset')}; "
          f"{os.cpu_count()} CPUs), pinned: {cpus if cpus else 'no'}; idle workers spin {isa.idle_spin_us()} us "
          f"(HYBRIDMOE_SPIN_US={os.environ.get('HYBRIDMOE_SPIN_US', 'unset')})")
    for line in _numa_lines():
        print(line)
    return 0
