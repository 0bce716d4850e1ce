"""Rotary position embeddings: default, linear and YaRN frequency schedules; half-split or interleaved pairs.

Legend: T tokens, N heads, R rotary dims.
"""

from __future__ import annotations

import math

import torch

from hybridmoe.config import RopeConfig
from hybridmoe.kernels import rope as kernel
from hybridmoe.layers.norm import rms_norm


def inverse_frequencies(rope: RopeConfig) -> torch.Tensor:
    """[R/2] float32 angular frequencies after the configured context-extension schedule."""
    dim, base = rope.rotary_dim, rope.theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if rope.scaling_type == "linear":
        return 1.0 / (pos_freqs * rope.factor)
    if rope.scaling_type != "yarn":
        return 1.0 / pos_freqs
    # YaRN: interpolate low frequencies, keep high ones, ramp linearly between the correction dims.
    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


class RotaryEmbedding:
    def __init__(self, rope: RopeConfig):
        self.config = rope
        self.inv_freq = inverse_frequencies(rope)
        # (positions, dtype, cos, sin) of the last call: every layer of a forward asks for the same positions tensor
        self._last: tuple | None = None

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, R/2] (times the YaRN attention factor); computed once per positions tensor
        (its identity: the forward's, never written after it is made) and dtype."""
        last = self._last
        if last is not None and last[0] is positions and last[1] == dtype:
            return last[2], last[3]
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        scale = self.config.attention_factor
        cos, sin = (freqs.cos() * scale).to(dtype), (freqs.sin() * scale).to(dtype)
        self._last = (positions, dtype, cos, sin)
        return cos, sin

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm: torch.Tensor | None = None,
              eps: float = 1e-6) -> torch.Tensor:
        """x [T, N, R] -> rotated [T, N, R]; with norm [R], rms_norm(x, norm, eps) rotated (Qwen3's q / k norms).

        Interleaved (DeepSeek): pairs (x0, x1), (x2, x3), .. rotate together and the result comes out in half-split
        layout (evens then odds); applied alike to q and k, so dot products are those of the interleaved rotation.
        On the C++ kernels where they apply (CPU, float32 or bfloat16: the norm and the rotation in one call), else
        through torch.
        """
        if kernel.applies(x, cos, norm):
            return kernel.rope(x, cos, sin, self.config.interleaved, norm, eps)
        if norm is not None:
            x = rms_norm(x, norm, eps)
        c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, R/2]
        if self.config.interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
