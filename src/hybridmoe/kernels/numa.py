"""NUMA nodes of the kernels' thread pool: which CPUs each node's threads run on, and where its weight shards live.

With N nodes every MoE layer built afterwards splits each expert's intermediate dimension I into N ranges (on
whole fp8 scale blocks / int groups / 32 dense columns): node n's threads compute gate/up rows and the down
columns of its range only, and the N partial [T, H] outputs are summed. No weight is duplicated: on a machine
with several real nodes each shard is copied once at load into memory bound to its node, and the layer lets go
of the original tensors (FusedMoE.owns_weights); with one node, or emulated nodes, shards are views of the weights.
The copies are 2 MB-aligned and advised for transparent huge pages (one TLB entry per 2 MB of streamed weights;
docs/kernels.md, "Weight formats"). HYBRIDMOE_COPY_EXPERTS=1 asks for them on
one node too (the experts whole: zero-copy from the checkpoint traded for memory of the kernels' own, where
the checkpoint's mapping does not get huge pages by itself; see hybridmoe.checkpoint.safetensors_reader), =0
turns them off.
Each node's work buffers (intermediate activations, partial outputs) are bound to its memory too.

The topology is detected from /sys/devices/system/node; HYBRIDMOE_NUMA_NODES="0-3;4-7" (one cpulist per node)
or `configure_numa` overrides it (tests emulate several nodes on one this way). Both environment variables are
read once, when the pool is first made.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from hybridmoe.kernels import _native


def topology() -> dict[str, Any]:
    """The topology the pool uses: nodes (CPU lists), memory_nodes (-1 = unbound), emulated, copy_shards,
    description."""
    return dict(_native.numa_topology())


def detected_topology() -> dict[str, Any]:
    """The machine's own NUMA nodes (as /sys lists them), whatever override is in force."""
    return dict(_native.detect_numa_topology())


def thread_nodes() -> list[int]:
    """The node of each pool thread (thread 0 is the one that submits work)."""
    return list(_native.thread_nodes())


def configure_numa(nodes: list[list[int]] | None = None, *, memory_nodes: list[int] | None = None,
                   copy_shards: bool = False, num_threads: int = 0) -> None:
    """Replace the topology and the thread pool (after in-flight work finishes).

    nodes: per node the CPUs its threads are pinned to (None: detect). memory_nodes: per node the OS node its
    shard copies are bound to (default: none). copy_shards: copy each node's shards at load (what several real
    nodes do; with nodes None it asks for copies on a detected single node too). num_threads: 0 = one per
    listed CPU, split over the nodes in proportion to their CPUs.
    Layers built before keep the split they were built with (a layer split for another node count fails).
    """
    if nodes is not None and not nodes:
        raise ValueError("nodes: give at least one node, or None to detect")
    _native.configure_numa([list(map(int, n)) for n in (nodes or [])], list(memory_nodes or []),
                           bool(copy_shards), int(num_threads))


@contextmanager
def use_numa(nodes: list[list[int]] | None, **kwargs: Any) -> Iterator[None]:
    """Run the block with `configure_numa(nodes, **kwargs)`, then go back to the detected topology
    (HYBRIDMOE_NUMA_NODES is read once, at first use)."""
    configure_numa(nodes, **kwargs)
    try:
        yield
    finally:
        configure_numa(None)


def split_range(n: int, granularity: int, parts: int) -> list[tuple[int, int]]:
    """[0, n) in `parts` ranges of whole `granularity` units, as the layers cut I over the nodes."""
    return [tuple(r) for r in _native.split_range(n, granularity, parts)]
