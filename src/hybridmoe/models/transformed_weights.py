"""Where the loader puts the weights it makes at load rather than viewing in the mapped checkpoint.

`WeightLoader` hands out zero-copy views of the checkpoint where the stored dtype is the one computed in; what it
has to make instead goes through a `TransformedWeights`: a non-expert float weight converted to the compute
dtype (a bf16 checkpoint computed in float32), an FP8 one dequantised, a router's weight or bias in float32.
`get(key, shape, dtype, fill)` returns the tensor for `key`, which `fill(out)` writes into an empty one: by
default in this process's memory; `disagg.shared_weights` fills a view of a shared-memory segment instead, once for
several processes (written in place: a temporary copy freed after load would stay in the allocator's heap).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch


class TransformedWeights(Protocol):
    def get(self, key: str, shape: tuple[int, ...], dtype: torch.dtype,
            fill: Callable[[torch.Tensor], object]) -> torch.Tensor:
        """The weight `key`, [shape] of dtype, as `fill(out)` computes it into out; read-only for the caller."""
        ...


class PrivateWeights:
    """Every transformed weight in this process's own memory (what a single engine does)."""

    def get(self, key: str, shape: tuple[int, ...], dtype: torch.dtype,
            fill: Callable[[torch.Tensor], object]) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype)
        fill(out)
        return out
