"""The CPU ExpertBackend: a layer's routed experts on the C++ kernels (hybridmoe.kernels), asynchronously.

`submit` queues the fused MoE (fp8 / int4 / int8 / bf16 / f16 / f32 weights, used in place) on the kernels'
executor and returns at once; `wait` blocks with the GIL released, so the caller runs accelerator work (shared
experts, the other micro-batch's attention) in between. The kernels accumulate in float32 and return the hidden
states' dtype.

Weights stay where the loader put them (zero-copy views of the memory-mapped checkpoint where it has them).
The only repack is for dense weights whose rows are not contiguous (a transposed view): those are copied
once, here, and counted in `repacked_bytes`. On several NUMA nodes (or with HYBRIDMOE_COPY_EXPERTS=1) the kernels
copy each node's shard of the experts into its memory, on huge pages, at load (`numa_copied_bytes`; see
hybridmoe.kernels.numa).

Legend: T tokens, H hidden, K top-k.
"""

from __future__ import annotations

import torch

from hybridmoe.kernels.moe import FusedMoE, MoEHandle
from hybridmoe.kernels.weights import contiguous_rows, dense_format
from hybridmoe.layers.moe.backend import ExpertWeights


def kernel_format(weights: ExpertWeights) -> str:
    """The kernels' format name for an ExpertWeights ("dense" resolves by dtype)."""
    if weights.fmt == "dense":
        return dense_format(weights.gate[0].dtype)
    if weights.fmt in ("fp8", "int4", "int8"):
        return weights.fmt
    raise ValueError(f"CpuExpertBackend: unsupported expert weight format {weights.fmt!r} "
                     "(dense, fp8, int4, int8)")


class CpuExpertBackend:
    """ExpertBackend running one layer's routed experts on the C++ kernels."""

    def __init__(self, weights: ExpertWeights):
        fmt = kernel_format(weights)
        self.weights = weights  # as loaded (what stream-loading prefill copies to the accelerator)
        self.repacked_bytes = 0
        tensors = {name: [self._rows(t) for t in getattr(weights, name)] for name in ("gate", "up", "down")}
        scales = {name: (list(getattr(weights, name + "_scale")) if weights.gate_scale else None)
                  for name in ("gate", "up", "down")}
        self.moe = FusedMoE(fmt, tensors["gate"], tensors["up"], tensors["down"], scales["gate"], scales["up"],
                            scales["down"], hidden_size=weights.down[0].shape[0],
                            intermediate_size=weights.gate[0].shape[0], block=tuple(weights.block_size),
                            shard_storage=weights.shard_storage)

    @property
    def numa_copied_bytes(self) -> int:
        """Bytes copied at load into NUMA nodes' memory (their shards of the experts; 0 when read in place)."""
        return sum(shard[2] for shard in self.moe.numa_shards)

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        if t.dtype.is_floating_point and t.dtype != torch.float8_e4m3fn:
            t, copied = contiguous_rows(t)
            self.repacked_bytes += copied
        return t

    def submit(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> MoEHandle:
        """hidden [T, H], topk_ids [T, K], topk_weights [T, K] -> handle, at once."""
        return self.moe.submit(hidden, topk_ids, topk_weights)

    def wait(self, handle: MoEHandle) -> torch.Tensor:
        """[T, H] in hidden's dtype."""
        return self.moe.wait(handle)

    def run(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """submit + wait on the calling thread, without the hand-off to the kernels' executor thread and back
        (a Qwen3-30B-A3B-shaped bf16 decode 1.07-1.08x on 2 Zen 3 vCPUs) -> [T, H] in hidden's dtype."""
        return self.moe(hidden, topk_ids, topk_weights)
