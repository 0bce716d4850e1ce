"""Gated MLP (SwiGLU): dense layers and shared experts, on the kernels' linear layers.

Legend: T tokens, H hidden, I intermediate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridmoe.layers.linear import Linear


@dataclass
class GatedMLP:
    gate_proj: Linear  # [I, H]
    up_proj: Linear  # [I, H]
    down_proj: Linear  # [H, I]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
