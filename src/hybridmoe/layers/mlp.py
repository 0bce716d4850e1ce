"""Gated MLP (SwiGLU): dense layers and shared experts, on the kernels' linear layers.

Where gate and up take the kernels (CPU, float32 or bf16 activations, fewer tokens than their kernel threshold: a
decode step), they come out in float32 and silu(g) * u is the kernels' own (`kernels.moe.silu_mul`, as the routed
experts compute it), rounded once to the activations' dtype before down; the decode stack (models/decode_stack.py)
computes the same. Otherwise torch's silu over gate's and up's outputs in the activations' dtype.

Legend: T tokens, H hidden, I intermediate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from hybridmoe.kernels.moe import silu_mul
from hybridmoe.layers.linear import Linear, SharedInput, kernel_tokens


@dataclass
class GatedMLP:
    gate_proj: Linear  # [I, H]
    up_proj: Linear  # [I, H]
    down_proj: Linear  # [H, I]
    # gate and up in one kernel call where they can share it
    _gate_up: SharedInput = field(default_factory=SharedInput, init=False, repr=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        projections = (self.gate_proj, self.up_proj, self.down_proj)
        if (x.is_cpu and x.dtype in (torch.float32, torch.bfloat16) and x.is_contiguous()
                and all(type(p) is Linear and p.bias is None for p in projections)
                and x.shape[0] < min(kernel_tokens(p, x.dtype) for p in projections[:2])):
            gate, up = self._gate_up(projections[:2], x, torch.float32)
            h = silu_mul(gate, up)  # [T, I] float32
            return self.down_proj(h if x.dtype == torch.float32 else h.to(x.dtype))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
