"""`attach_expert_parallel(model, model_dir, num_gpus, ...)`: run a loaded model's prefill chunks as distributed
stream-loading prefill with small expert parallelism over `num_gpus` ranks (the engine process and num_gpus - 1
workers it spawns).

Every MoE block gets an `ExpertParallelBackend` as its `prefill_experts` (chunks of at least `min_tokens` tokens
use it; smaller steps, decode among them, keep the block's own backend). Each rank streams its share of every
layer's experts into its own accelerator: rank 0 through a `ShareStreamer` on `accel` (the engine's accelerator,
its two slots counted in its ledger), the workers likewise on theirs. Attention, dense layers, routers and shared
experts run on rank 0 only (docs/hybrid.md, "Several GPUs").
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from hybridmoe.accel.accelerator import Accelerator
from hybridmoe.layers.moe.backend import ExpertWeights
from hybridmoe.layers.moe.block import MoEBlock
from hybridmoe.layers.moe.staging import DEFAULT_STAGING_BYTES
from hybridmoe.layers.moe.stream_prefill import COPY_MODES, StreamStats
from hybridmoe.parallel.backend import ExchangeStats, ExpertParallelBackend, PassState
from hybridmoe.parallel.group import RankGroup
from hybridmoe.parallel.ownership import owned_experts
from hybridmoe.parallel.share import ShareStreamer

DEFAULT_TIMEOUT_S = 300.0  # the longest rank 0 waits for a worker's answer to one layer
CopyChoice = str | Callable[[int], str]  # "all" | "activated", or chunk tokens -> one of them


class ExpertParallel:
    """Expert parallelism attached to a model; `close()` (idempotent) restores the blocks and stops the workers."""

    def __init__(self, model, model_dir: str | Path, num_gpus: int, accel: Accelerator | None = None,
                 min_tokens: int = 1, copy: CopyChoice = "all", timeout_s: float = DEFAULT_TIMEOUT_S,
                 threads: int | None = None, budget_bytes: int | None = None,
                 staging_bytes: int = DEFAULT_STAGING_BYTES, overlap: bool | None = None):
        from hybridmoe.accel.accelerator import select_accelerator

        if min_tokens < 1:
            raise ValueError(f"min_tokens must be >= 1, got {min_tokens}")
        if not callable(copy) and copy not in COPY_MODES:
            raise ValueError(f"copy must be one of {', '.join(COPY_MODES)} or a callable, got {copy!r}")
        self.accel = accel or select_accelerator("cpu")
        moe = model.config.moe
        self.blocks = {i: layer.mlp for i, layer in enumerate(model.layers) if isinstance(layer.mlp, MoEBlock)}
        if not self.blocks:
            raise ValueError("the model has no MoE layer: nothing to split over ranks")
        mine = list(owned_experts(moe.num_experts, num_gpus, 0))  # E >= N, else a clear error before any spawn
        self.stats = ExchangeStats()
        self.local: ShareStreamer | None = None
        self.group = RankGroup(model_dir, num_gpus, model.dtype, self.accel.kind, timeout_s, threads, budget_bytes,
                               staging_bytes, overlap)
        try:
            self.local = ShareStreamer({l: _weights_of(b).subset(mine) for l, b in self.blocks.items()}, self.accel,
                                       staging_bytes, "ep0", overlap)
        except BaseException:
            self.group.close()
            raise
        state = PassState(copy if callable(copy) else lambda _tokens: copy, min(self.blocks))
        self.backends = {layer: ExpertParallelBackend(self.group, layer, moe.num_experts, self.local,
                                                      self.accel.device, state, self.stats)
                         for layer in self.blocks}
        for layer, block in self.blocks.items():
            block.prefill_experts, block.prefill_min_tokens = self.backends[layer], min_tokens

    @property
    def world_size(self) -> int:
        return self.group.world_size

    def stream_stats(self) -> list[StreamStats]:
        """Per rank (0 first), what its streamer moved: passes, bytes copied, copy seconds, the last pass's bytes
        (the workers' figures asked for over the group; their staging and slot fields are left at defaults)."""
        out = [self.local.stats()]
        for rank in range(1, self.world_size):
            passes, nbytes, copy_s, last = self.group.worker_stream_stats(rank)
            out.append(StreamStats(passes=passes, bytes=nbytes, copy_s=copy_s, last_pass_bytes=last))
        return out

    def close(self) -> None:
        for block in self.blocks.values():
            if isinstance(block.prefill_experts, ExpertParallelBackend):
                block.prefill_experts = None
        if self.local is not None:
            self.local.close()
            self.local = None
        self.group.close()


def attach_expert_parallel(model, model_dir: str | Path, num_gpus: int, accel: Accelerator | None = None,
                           min_tokens: int = 1, copy: CopyChoice = "all", timeout_s: float = DEFAULT_TIMEOUT_S,
                           threads: int | None = None, budget_bytes: int | None = None,
                           staging_bytes: int = DEFAULT_STAGING_BYTES, overlap: bool | None = None) -> ExpertParallel:
    """Spawn num_gpus - 1 worker ranks for `model` (loaded from `model_dir`) and route its prefill chunks of at
    least `min_tokens` tokens through them. copy: each chunk's copy mode, "all" (whole layers prefetched),
    "activated", or a callable of the chunk's tokens (stream_prefill.planned_copy: the planner's choice); rank 0
    chooses per chunk and every rank follows. timeout_s bounds each wait for a worker's answer; threads: torch
    threads of each worker; budget_bytes: each worker's accelerator budget; staging_bytes: each rank's pinned
    staging buffer; overlap: copies beside compute (default: on CUDA; True on the stand-in runs them on each
    rank's copy thread, as bench costmodel measures). Returns the handle to close (the engine closes it; a
    finaliser does at exit otherwise)."""
    return ExpertParallel(model, model_dir, num_gpus, accel, min_tokens, copy, timeout_s, threads, budget_bytes,
                          staging_bytes, overlap)


def _weights_of(block: MoEBlock) -> ExpertWeights:
    """The ExpertWeights a block's routed-expert backend was built from (.weights of the CPU and hybrid backends,
    .w of the torch backend)."""
    for attribute in ("weights", "w"):
        weights = getattr(block.experts, attribute, None)
        if isinstance(weights, ExpertWeights):
            return weights
    raise TypeError(f"cannot find the expert weights of {type(block.experts).__name__} (it keeps no ExpertWeights "
                    "as .weights or .w)")
