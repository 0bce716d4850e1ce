"""Gated MLP (SwiGLU): dense layers and shared experts.

Legend: T tokens, H hidden, I intermediate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class GatedMLP:
    gate_proj: torch.Tensor  # [I, H]
    up_proj: torch.Tensor  # [I, H]
    down_proj: torch.Tensor  # [H, I]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        return F.linear(F.silu(F.linear(x, self.gate_proj)) * F.linear(x, self.up_proj), self.down_proj)
