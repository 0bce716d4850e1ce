"""RMSNorm on the C++ kernels: a row's norm in one call, and the decoder's residual add fused into it.

`rms_norm(x, weight, eps)` -> weight * x / sqrt(mean(x^2) + eps) over the last dim, computed in float32 (bf16
rounded as torch's reference rounds it). `add_rms_norm_(residual, x, weight, eps)` adds x into residual in place and
returns the norm of the sum. x, weight and residual are float32 or bfloat16 alike, on the CPU, last dim contiguous.
A decode step runs four norms a layer; through torch each costs five ops' dispatch, more than the arithmetic.

Legend: R rows (every leading dim flattened), D the normalised dim.
"""

from __future__ import annotations

import torch
from torch.utils.dlpack import to_dlpack

from hybridmoe.kernels import _native


DTYPES = (torch.float32, torch.bfloat16)


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel computes this norm (else torch does: other dtypes or devices). Four calls a layer of each
    decode step: the cheapest checks first (is_cpu and is_contiguous cost 0.2-0.3 us, .device.type and stride 1 us)."""
    return (x.is_cpu and weight.is_cpu and x.dtype == weight.dtype and x.dtype in DTYPES
            and (x.is_contiguous() or x.stride(-1) == 1))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] -> [..., D] (a new tensor, x's dtype)."""
    rows = x.reshape(-1, x.shape[-1])  # [R, D], a view where x's leading dims allow
    out = rows.new_empty(rows.shape)  # contiguous, x's dtype (cheaper than torch.empty with a dtype)
    _native.rms_norm(to_dlpack(rows), to_dlpack(weight), to_dlpack(out), eps, None)
    return out.view(x.shape)


def add_rms_norm_(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual [R, D] += x [R, D] (in place), -> rms_norm(residual) [R, D]."""
    out = residual.new_empty(residual.shape)
    _native.rms_norm(to_dlpack(x), to_dlpack(weight), to_dlpack(out), eps, to_dlpack(residual))
    return out
