"""`attach_expert_parallel(model, model_dir, num_gpus, ...)`: run a loaded model's prefill chunks with small expert
parallelism over `num_gpus` ranks (the engine process and num_gpus - 1 workers it spawns).

Every MoE block gets an `ExpertParallelBackend` as its `prefill_experts` (chunks of at least `min_tokens` tokens
use it; smaller steps, decode among them, keep the block's own backend). Rank 0's share of each layer is placed on
`accel` (the engine's accelerator, counted in its ledger); the workers load theirs from the checkpoint. Attention,
dense layers, routers and shared experts run on rank 0 only (docs/hybrid.md, "Several GPUs").
"""

from __future__ import annotations

from pathlib import Path

from hybridmoe.accel.accelerator import Accelerator
from hybridmoe.layers.moe.backend import ExpertWeights
from hybridmoe.layers.moe.block import MoEBlock
from hybridmoe.layers.moe.torch_backend import TorchExpertBackend
from hybridmoe.parallel.backend import ExchangeStats, ExpertParallelBackend
from hybridmoe.parallel.group import RankGroup
from hybridmoe.parallel.ownership import owned_experts

DEFAULT_TIMEOUT_S = 300.0  # the longest rank 0 waits for a worker's answer to one layer


class ExpertParallel:
    """Expert parallelism attached to a model; `close()` (idempotent) restores the blocks and stops the workers."""

    def __init__(self, model, model_dir: str | Path, num_gpus: int, accel: Accelerator | None = None,
                 min_tokens: int = 1, timeout_s: float = DEFAULT_TIMEOUT_S, threads: int | None = None,
                 budget_bytes: int | None = None):
        from hybridmoe.accel.accelerator import select_accelerator

        if min_tokens < 1:
            raise ValueError(f"min_tokens must be >= 1, got {min_tokens}")
        self.accel = accel or select_accelerator("cpu")
        moe = model.config.moe
        self.blocks = {i: layer.mlp for i, layer in enumerate(model.layers) if isinstance(layer.mlp, MoEBlock)}
        if not self.blocks:
            raise ValueError("the model has no MoE layer: nothing to split over ranks")
        owned_experts(moe.num_experts, num_gpus, 0)  # E >= N, else a clear error before anything starts
        self.stats = ExchangeStats()
        self.group = RankGroup(model_dir, num_gpus, model.dtype, self.accel.kind, timeout_s, threads, budget_bytes)
        self._names: list[str] = []
        try:
            self.backends = {}
            for layer, block in self.blocks.items():
                name = f"ep.experts.{layer}"
                mine = _weights_of(block).subset(list(owned_experts(moe.num_experts, num_gpus, 0)))
                local = TorchExpertBackend(mine.to_device(self.accel, name))
                self._names.append(name)
                self.backends[layer] = ExpertParallelBackend(self.group, layer, moe.num_experts, local,
                                                             self.accel.device, self.stats)
        except BaseException:
            self.close()
            raise
        for layer, block in self.blocks.items():
            block.prefill_experts, block.prefill_min_tokens = self.backends[layer], min_tokens

    @property
    def world_size(self) -> int:
        return self.group.world_size

    def close(self) -> None:
        for block in self.blocks.values():
            if isinstance(block.prefill_experts, ExpertParallelBackend):
                block.prefill_experts = None
        for name in self._names:
            self.accel.release(name)
        self._names = []
        self.group.close()


def attach_expert_parallel(model, model_dir: str | Path, num_gpus: int, accel: Accelerator | None = None,
                           min_tokens: int = 1, timeout_s: float = DEFAULT_TIMEOUT_S, threads: int | None = None,
                           budget_bytes: int | None = None) -> ExpertParallel:
    """Spawn num_gpus - 1 worker ranks for `model` (loaded from `model_dir`) and route its prefill chunks of at
    least `min_tokens` tokens through them; `threads`: torch threads of each worker; `budget_bytes`: each worker's
    accelerator budget. Returns the handle to close (the engine closes it at exit; a finaliser does otherwise)."""
    return ExpertParallel(model, model_dir, num_gpus, accel, min_tokens, timeout_s, threads, budget_bytes)


def _weights_of(block: MoEBlock) -> ExpertWeights:
    """The ExpertWeights a block's routed-expert backend was built from (CpuExpertBackend.weights,
    TorchExpertBackend.w)."""
    for attribute in ("weights", "w"):
        weights = getattr(block.experts, attribute, None)
        if isinstance(weights, ExpertWeights):
            return weights
    raise TypeError(f"cannot find the expert weights of {type(block.experts).__name__} (it keeps no ExpertWeights "
                    "as .weights or .w)")
