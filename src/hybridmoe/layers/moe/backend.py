"""The routed-expert interface: `ExpertBackend` and the weights it computes with.

The MoE block computes router -> top-k and hands the routed part to a backend through two calls,
`submit(hidden, topk_ids, topk_weights) -> handle` and `wait(handle) -> output`, so that a backend that runs
on other cores (the C++ CPU kernels) overlaps accelerator work between the two calls. One backend instance
serves one layer's experts.

Legend: T tokens, H hidden, E experts, K top-k, I expert intermediate size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from hybridmoe.accel.accelerator import Accelerator


@dataclass
class ExpertWeights:
    """One MoE layer's routed experts, as loaded (zero-copy views of the checkpoint where possible).

    fmt "dense": gate/up [I, H] and down [H, I] per expert in a float dtype (bf16/fp16/fp32).
    fmt "fp8":   the same shapes in float8_e4m3fn with float32 `*_scale` per block (DeepSeek-V3's
                 `weight_scale_inv`): gate/up scales [ceil(I/b0), ceil(H/b1)], down [ceil(H/b0), ceil(I/b1)].
    fmt "int4" / "int8": symmetric per-group codes over the input columns padded to whole groups of g
                 (hybridmoe.kernels.formats): int4 uint8 [rows, Kp/2] (two codes a byte), int8 int8 [rows, Kp];
                 `*_scale` bf16/fp16 [rows, Kp/g]. Rows are I for gate/up and H for down.
    """

    fmt: str  # "dense" | "fp8" | "int4" | "int8"
    gate: list[torch.Tensor]  # E x [I, H]
    up: list[torch.Tensor]  # E x [I, H]
    down: list[torch.Tensor]  # E x [H, I]
    gate_scale: list[torch.Tensor] | None = None
    up_scale: list[torch.Tensor] | None = None
    down_scale: list[torch.Tensor] | None = None
    block_size: tuple[int, int] = (128, 128)
    # Where a backend that copies the experts per NUMA node puts each node's copies: (node, bytes) -> (uint8 buffer
    # of those bytes, already filled by another process). None: memory of the backend's own.
    shard_storage: Callable[[int, int], tuple[torch.Tensor, bool]] | None = None

    @property
    def num_experts(self) -> int:
        return len(self.gate)

    @property
    def hidden_size(self) -> int:
        return self.down[0].shape[0]

    @property
    def intermediate_size(self) -> int:
        return self.gate[0].shape[0]

    def nbytes(self) -> int:
        return sum(self.expert_bytes(e) for e in range(self.num_experts))

    def expert_bytes(self, e: int) -> int:
        """Bytes of expert e as stored (its three matrices and their scales)."""
        return sum(t.nbytes for t in self.expert_tensors(e))

    def expert_tensors(self, e: int) -> list[torch.Tensor]:
        """Expert e's tensors: gate, up, down, then their scales when the format has them."""
        tensors = [self.gate[e], self.up[e], self.down[e]]
        if self.gate_scale is not None:
            tensors += [self.gate_scale[e], self.up_scale[e], self.down_scale[e]]
        return tensors

    def subset(self, experts: list[int]) -> "ExpertWeights":
        """The listed experts (in that order) as their own ExpertWeights, sharing the tensors."""
        pick = lambda ts: [ts[e] for e in experts] if ts is not None else None  # noqa: E731
        return ExpertWeights(self.fmt, pick(self.gate), pick(self.up), pick(self.down), pick(self.gate_scale),
                             pick(self.up_scale), pick(self.down_scale), self.block_size)

    def to_device(self, accel: "Accelerator", name: str) -> "ExpertWeights":
        """A copy of these experts on the accelerator, counted in its ledger under `name`."""
        move = lambda ts: [accel.to_device(t, name) for t in ts] if ts is not None else None  # noqa: E731
        return ExpertWeights(self.fmt, move(self.gate), move(self.up), move(self.down), move(self.gate_scale),
                             move(self.up_scale), move(self.down_scale), self.block_size)


class ExpertBackend(Protocol):
    """Computes sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden[t]) for one layer."""

    def submit(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> Any:
        """hidden [T, H], topk_ids [T, K] int, topk_weights [T, K] float32 -> an opaque handle."""
        ...

    def wait(self, handle: Any) -> torch.Tensor:
        """Block until the submitted work is done; returns [T, H] in hidden's dtype."""
        ...

# A backend may also have run(hidden, topk_ids, topk_weights) -> [T, H]: submit and wait in one blocking call, on
# the calling thread; MoEBlock takes it when it has nothing to run meanwhile (no shared experts).
