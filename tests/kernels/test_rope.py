"""The C++ rotary embedding (kernels/rope.py) against a float64 rotation and against torch's version in
layers/rope.py, half-split and interleaved, float32 and bfloat16, on fresh random rows; strided views (MLA's rope
half of the query); clear errors for bad shapes."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.config import RopeConfig
from hybridmoe.kernels import rope as kernel
from hybridmoe.layers import rope as layer


def _torch_rope(x, cos, sin, interleaved):
    """layers/rope.py's torch path (the kernel not asked)."""
    c, s = cos[:, None, :], sin[:, None, :]
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :x.shape[-1] // 2], x[..., x.shape[-1] // 2:])
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def _float64(x, cos, sin, interleaved):
    return _torch_rope(x.double(), cos.double(), sin.double(), interleaved)


def _cos_sin(tokens, half, dtype, seed):
    angles = torch.rand(tokens, half, generator=torch.Generator().manual_seed(seed)) * 6.3
    return angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,heads,dim", [(1, 32, 128), (5, 4, 64), (700, 8, 32)])
def test_against_float64_and_torch(interleaved, dtype, tokens, heads, dim):
    x = torch.randn(tokens, heads, dim, generator=torch.Generator().manual_seed(dim)).to(dtype)
    cos, sin = _cos_sin(tokens, dim // 2, dtype, tokens)
    out = kernel.rope(x, cos, sin, interleaved)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), _float64(x, cos, sin, interleaved), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out, _torch_rope(x, cos, sin, interleaved), rtol=1e-6, atol=1e-6)
    else:  # each product and sum rounded as torch's ops round them: the same bits
        assert torch.equal(out, _torch_rope(x, cos, sin, interleaved))


def test_a_strided_view_and_the_layer_takes_the_kernel():
    q = torch.randn(3, 4, 48 + 16)  # [T, N, P + R]: MLA's query, its rope half a strided view
    q_pe = q[..., 48:]
    cos, sin = _cos_sin(3, 8, torch.float32, 1)
    assert kernel.applies(q_pe, cos)
    rotary = layer.RotaryEmbedding(RopeConfig(theta=10000.0, rotary_dim=16, interleaved=True))
    torch.testing.assert_close(rotary.apply(q_pe, cos, sin), _torch_rope(q_pe, cos, sin, True), rtol=1e-6, atol=1e-6)
    half = q_pe.half()
    assert not kernel.applies(half, cos.half())  # float16: torch's path
    cos16, sin16 = cos.half(), sin.half()
    torch.testing.assert_close(rotary.apply(half, cos16, sin16), _torch_rope(half, cos16, sin16, True))


def test_cos_and_sin_are_computed_once_per_positions_tensor():
    rotary = layer.RotaryEmbedding(RopeConfig(theta=10000.0, rotary_dim=8))
    positions = torch.arange(4)
    first = rotary.cos_sin(positions, torch.float32)
    assert rotary.cos_sin(positions, torch.float32)[0] is first[0]  # the next layer of the same forward
    other = rotary.cos_sin(torch.arange(4), torch.float32)  # the next forward: a new positions tensor
    assert other[0] is not first[0] and torch.equal(other[0], first[0])
    assert rotary.cos_sin(positions, torch.bfloat16)[0].dtype == torch.bfloat16


def test_bad_shapes_are_clear_errors():
    from torch.utils.dlpack import to_dlpack

    from hybridmoe.kernels import _native

    x, out = torch.randn(2, 3, 8), torch.empty(2, 3, 8)
    cos, sin = torch.ones(2, 4), torch.zeros(2, 4)
    with pytest.raises(ValueError, match="cos: must be contiguous \\[2, 4\\], got \\[2, 3\\]"):
        _native.rope(to_dlpack(x), to_dlpack(torch.ones(2, 3)), to_dlpack(sin), to_dlpack(out), False)
    with pytest.raises(ValueError, match="rotary dim must be even"):
        _native.rope(to_dlpack(torch.randn(2, 3, 7)), to_dlpack(cos), to_dlpack(sin), to_dlpack(torch.empty(2, 3, 7)),
                     False)
    with pytest.raises(ValueError, match="sin: dtype bfloat16 != x's float32"):
        _native.rope(to_dlpack(x), to_dlpack(cos), to_dlpack(sin.bfloat16()), to_dlpack(out), False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_norm_before_the_rotation_is_rms_norms(dtype):
    """Qwen3's q / k norm fused into the rotation gives the bits of the norm kernel, then the rotation."""
    from hybridmoe.kernels import norm as norm_kernel

    gen = torch.Generator().manual_seed(3)
    x = (2 * torch.randn(3, 4, 64, generator=gen)).to(dtype)
    weight = (1 + 0.1 * torch.randn(64, generator=gen)).to(dtype)
    cos, sin = _cos_sin(3, 32, dtype, 5)
    fused = kernel.rope(x, cos, sin, False, weight, 1e-6)
    assert torch.equal(fused, kernel.rope(norm_kernel.rms_norm(x, weight, 1e-6), cos, sin, False))
    rotary = layer.RotaryEmbedding(RopeConfig(theta=10000.0, rotary_dim=64))
    assert torch.equal(rotary.apply(x, cos, sin, weight, 1e-6), fused)
    half = x.half()  # torch's path: the same norm, then the rotation
    expected = _torch_rope(norm_kernel.rms_norm(x.float(), weight.float(), 1e-6).half(), cos.half(), sin.half(), False)
    torch.testing.assert_close(rotary.apply(half, cos.half(), sin.half(), weight.half(), 1e-6), expected,
                               rtol=1e-2, atol=1e-2)
