"""The C++ RMSNorm (kernels/norm.py) against float64 and against torch's reference, with and without the fused
residual add, on fresh random rows: one row (a decode step), many (a prefill, split over the pool), strided rows."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.kernels import norm as kernel
from hybridmoe.layers.norm import add_rms_norm_, rms_norm


def _reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """float64 RMSNorm, rounded to x's dtype as the reference implementations round (normalised row, then weight)."""
    xd = x.double()
    normed = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight.double() * normed.double()).to(x.dtype)


def _torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,dim", [(1, 2048), (3, 128), (300, 512), (1, 7)])
def test_against_float64(dtype, rows, dim):
    gen = torch.Generator().manual_seed(rows * 1000 + dim)
    x = (3 * torch.randn(rows, dim, generator=gen)).to(dtype)
    weight = (1 + 0.1 * torch.randn(dim, generator=gen)).to(dtype)
    out = kernel.rms_norm(x, weight, 1e-6)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), _reference(x, weight, 1e-6).double(), rtol=2e-6, atol=1e-6)
    else:  # one bf16 rounding apart at most (of the normalised value, then of the product)
        torch.testing.assert_close(out.float(), _torch(x, weight, 1e-6).float(), rtol=1.6e-2, atol=1e-2)
        assert (out == _torch(x, weight, 1e-6)).float().mean() > 0.98


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_residual_add_is_fused_and_in_place(dtype):
    gen = torch.Generator().manual_seed(7)
    residual = torch.randn(5, 256, generator=gen).to(dtype)
    x = torch.randn(5, 256, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(256, generator=gen)).to(dtype)
    expected_sum = residual + x  # torch's add, rounded to dtype
    before = residual.data_ptr()
    out = add_rms_norm_(residual, x, weight, 1e-5)
    assert residual.data_ptr() == before and torch.equal(residual, expected_sum)
    rtol, atol = (2e-6, 1e-6) if dtype == torch.float32 else (1.6e-2, 1e-2)
    torch.testing.assert_close(out.float(), _torch(expected_sum, weight, 1e-5).float(), rtol=rtol, atol=atol)


def test_rows_of_a_strided_view_and_leading_dims():
    x = torch.randn(4, 3, 64)  # [T, N, D]: per-head norms (Qwen3's q_norm / k_norm)
    weight = torch.randn(64)
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), _torch(x, weight, 1e-6), rtol=2e-6, atol=1e-6)
    wide = torch.randn(6, 200)
    view = wide[:, 40:104]  # rows 200 apart, each contiguous
    torch.testing.assert_close(kernel.rms_norm(view, weight, 1e-6), _torch(view, weight, 1e-6), rtol=2e-6, atol=1e-6)


def test_other_dtypes_and_mixed_ones_go_through_torch():
    x16, w16 = torch.randn(2, 32).half(), torch.randn(32).half()
    assert not kernel.applies(x16, w16)
    torch.testing.assert_close(rms_norm(x16, w16, 1e-6), _torch(x16, w16, 1e-6))
    x, w = torch.randn(2, 32), torch.randn(32).bfloat16()
    assert not kernel.applies(x, w)
    residual, delta = torch.randn(2, 32), torch.randn(2, 32).bfloat16()
    expected = residual + delta
    ones = torch.ones(32)
    torch.testing.assert_close(add_rms_norm_(residual, delta, ones, 1e-6), _torch(expected, ones, 1e-6))


def test_bad_shapes_are_clear_errors():
    from torch.utils.dlpack import to_dlpack

    from hybridmoe.kernels import _native

    x, out = torch.randn(2, 32), torch.empty(2, 32)
    with pytest.raises(ValueError, match="weight: shape \\[16\\] does not match x \\[2, 32\\]"):
        _native.rms_norm(to_dlpack(x), to_dlpack(torch.ones(16)), to_dlpack(out), 1e-6, None)
    with pytest.raises(ValueError, match="residual: shape"):
        _native.rms_norm(to_dlpack(x), to_dlpack(torch.ones(32)), to_dlpack(out), 1e-6, to_dlpack(torch.zeros(3, 32)))
    with pytest.raises(ValueError, match="must be x's float32"):
        _native.rms_norm(to_dlpack(x), to_dlpack(torch.ones(32).bfloat16()), to_dlpack(out), 1e-6, None)
