"""FP8 block format: our dequantiser against a float64 reference, quantiser round trip, partial blocks."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.checkpoint.fp8 import FP8_MAX, dequantize_fp8, quantize_fp8


def _reference_dequant(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(q.shape[0]):
        for j in range(0, q.shape[1]):
            out[i, j] = float(q[i, j].float()) * float(scale[i // block[0], j // block[1]])
    return out


@pytest.mark.parametrize("shape,block", [((256, 128), (128, 128)), ((200, 70), (128, 128)), ((9, 13), (4, 8))])
def test_dequantize_matches_float64_reference(shape, block):
    gen = torch.Generator().manual_seed(sum(shape))
    q = (torch.randn(shape, generator=gen) * 100).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    scale = torch.rand((-(-shape[0] // block[0]), -(-shape[1] // block[1])), generator=gen) + 0.01
    if shape[0] <= 16:
        ref = _reference_dequant(q, scale, block)
    else:  # vectorised float64 reference for larger shapes
        full = scale.double().repeat_interleave(block[0], 0)[: shape[0]].repeat_interleave(block[1], 1)[:, : shape[1]]
        ref = q.double() * full
    ours = dequantize_fp8(q, scale, block, torch.float64)
    assert torch.equal(ours, ref.to(torch.float32).double())  # exact: one float32 product per element


@pytest.mark.parametrize("shape", [(256, 384), (576, 200), (33, 130)])
def test_quantize_round_trip_error_is_fp8_sized(shape):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(7)) * 0.05
    q, scale = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    back = dequantize_fp8(q, scale)
    rel = (back - w).abs() / w.abs().clamp_min(1e-3)
    assert rel.median() < 0.04  # e4m3 has 3 mantissa bits: ~3% worst-case relative rounding
    assert (back - w).abs().max() <= scale.max() * 16  # never beyond half an e4m3 step at the top binade


def test_scale_shape_mismatch_is_an_error():
    q = torch.zeros(130, 128, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="does not fit"):
        dequantize_fp8(q, torch.ones(1, 1))
