"""Rotary position embedding on the C++ kernels: a query or key tensor rotated in one call.

`rope(x, cos, sin, interleaved)` -> x [T, N, R] rotated by cos / sin [T, R/2] (x's dtype, float32 or bfloat16, on
the CPU), in half-split layout either way, as layers/rope.py's torch version; in bfloat16 each product and sum is
rounded as torch's ops round them. x may be a strided view (MLA's rope half of the query). With `norm_weight` [R]
each row is RMS-normalised first, to the values kernels.norm.rms_norm gives (Qwen3's q / k norms: one call, not
two).

Legend: T tokens, N heads, R rotary dims.
"""

from __future__ import annotations

import torch
from torch.utils.dlpack import to_dlpack

from hybridmoe.kernels import _native
from hybridmoe.kernels.norm import DTYPES


def applies(x: torch.Tensor, cos: torch.Tensor, norm_weight: torch.Tensor | None = None) -> bool:
    """Whether the kernel rotates x (else torch does: other dtypes or devices)."""
    return (x.is_cpu and x.dim() == 3 and x.dtype in DTYPES and cos.dtype == x.dtype
            and (x.is_contiguous() or x.stride(-1) == 1) and cos.is_contiguous() and x.shape[-1] == 2 * cos.shape[-1]
            and (norm_weight is None or (norm_weight.dtype == x.dtype and norm_weight.is_cpu)))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
         norm_weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """x [T, N, R], cos and sin [T, R/2] (norm_weight [R]) -> rotated [T, N, R] (a new tensor)."""
    out = x.new_empty(x.shape)  # contiguous, x's dtype (cheaper than torch.empty with a dtype)
    norm = to_dlpack(norm_weight) if norm_weight is not None else None
    _native.rope(to_dlpack(x), to_dlpack(cos), to_dlpack(sin), to_dlpack(out), interleaved, norm, eps)
    return out
