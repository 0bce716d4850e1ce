"""RMSNorm, computed in float32 and cast back (as the reference implementations do): on the C++ kernels where they
apply (CPU, float32 or bfloat16), else through torch.

Legend: T rows, D the normalised dim.
"""

from __future__ import annotations

import torch

from hybridmoe.kernels import norm as kernel


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] -> [..., D] in x's dtype."""
    if kernel.applies(x, weight):
        return kernel.rms_norm(x, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The decoder's residual stream: residual [T, D] += x [T, D] in place, -> rms_norm(residual, weight) [T, D]."""
    if (kernel.applies(residual, weight) and x.dtype == residual.dtype and x.shape == residual.shape
            and residual.is_contiguous() and x.stride(-1) == 1):
        return kernel.add_rms_norm_(residual, x, weight, eps)
    residual += x
    return rms_norm(residual, weight, eps)
