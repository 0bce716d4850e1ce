"""Int weights' prefill through torch's bf16 matmul: `_native.dequantize_bf16` bit for bit against the float64
dequantisation rounded to bf16, and `Linear` taking that path only where it should (bf16 activations, an AMX ISA,
INT_DEQUANT_MIN_TOKENS tokens and more), closer to the float64 product than the int kernels there."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.kernels import _native, isa
from hybridmoe.kernels.formats import dequantize_int, quantize_int4, quantize_int8
from hybridmoe.kernels.moe import matmul
from hybridmoe.kernels.weights import kernel_matrix
from hybridmoe.layers.linear import DEQUANT_BLOCK_BYTES, INT_DEQUANT_MIN_TOKENS, Linear, LinearGroup, kernel_tokens

needs_amx = pytest.mark.skipif("amx" not in isa.available_isas(), reason="no AMX tiles on this CPU")


def quantized(fmt: str, rows: int, cols: int, group: int, scale_dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen) * 0.05
    return (quantize_int4 if fmt == "int4" else quantize_int8)(w, group=group, scale_dtype=scale_dtype)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("cols,group", [(320, 32), (1000, 32), (512, 128)])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16])
def test_dequantized_rows_are_the_float64_values_rounded_to_bf16(fmt, cols, group, scale_dtype):
    data, scales = quantized(fmt, 77, cols, group, scale_dtype, seed=cols + group)
    matrix = kernel_matrix(fmt, data, scales, cols=cols)
    expected = dequantize_int(fmt, data, scales, cols).to(torch.bfloat16)
    whole = torch.empty(77, cols, dtype=torch.bfloat16)
    _native.dequantize_bf16(matrix, 0, 77, whole)
    assert torch.equal(whole, expected)
    # a range of rows into a strided view
    wide = torch.zeros(20, cols + 8, dtype=torch.bfloat16)
    _native.dequantize_bf16(matrix, 40, 60, wide[:, :cols])
    assert torch.equal(wide[:, :cols], expected[40:60]) and not wide[:, cols:].any()


def test_dequantize_says_what_is_wrong():
    data, scales = quantized("int4", 8, 64, 32, torch.bfloat16, seed=0)
    matrix = kernel_matrix("int4", data, scales, cols=64)
    with pytest.raises(ValueError, match="rows"):
        _native.dequantize_bf16(matrix, 4, 9, torch.empty(5, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out"):
        _native.dequantize_bf16(matrix, 0, 8, torch.empty(8, 64, dtype=torch.float32))
    with pytest.raises(ValueError, match="out"):
        _native.dequantize_bf16(matrix, 0, 8, torch.empty(8, 63, dtype=torch.bfloat16))
    dense = kernel_matrix("bf16", torch.zeros(8, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="int4 or int8"):
        _native.dequantize_bf16(dense, 0, 8, torch.empty(8, 64, dtype=torch.bfloat16))


def linear_and_reference(fmt: str, rows: int, cols: int, seed: int) -> tuple[Linear, torch.Tensor]:
    data, scales = quantized(fmt, rows, cols, 32, torch.bfloat16, seed)
    return Linear(fmt, data, scales, cols=cols), dequantize_int(fmt, data, scales, cols)


@needs_amx
@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_prompt_of_bf16_tokens_goes_through_dequantized_blocks(fmt, with_bias):
    # more rows than one dequantised block, and a partial last block
    cols = 512
    rows = 2 * (DEQUANT_BLOCK_BYTES // (2 * cols)) + 40
    linear, w64 = linear_and_reference(fmt, rows, cols, seed=3)
    gen = torch.Generator().manual_seed(4)
    linear.bias = torch.randn(rows, generator=gen) if with_bias else None
    x = torch.randn(INT_DEQUANT_MIN_TOKENS + 3, cols, generator=gen).to(torch.bfloat16)
    expected = x.double() @ w64.T + (linear.bias.double() if with_bias else 0)
    with isa.use_isa("amx"):
        got = linear(x)
        direct = x @ dequantize_int(fmt, linear.data, linear.scales, cols).to(torch.bfloat16).T
    assert got.dtype == torch.bfloat16 and got.shape == (x.shape[0], rows)
    scale = expected.abs().max()
    err = (got.double() - expected).abs().max() / scale
    assert err < 1e-2, f"relative error {err:.2e}"
    if not with_bias:  # torch's own product of the same bf16 weights, up to the blocks' order of summation
        assert ((got.double() - direct.double()).abs().max() / scale) < 1e-2
    with isa.use_isa("avx512"):  # the int kernels: activations quantised to int8 per group
        kernels = linear(x)
    # bf16 activations and weights are closer to the float64 product than int8 activations
    assert err <= (kernels.double() - expected).abs().max() / scale


@needs_amx
def test_the_kernels_keep_what_the_dequantized_path_does_not_take():
    linear, w64 = linear_and_reference("int4", 64, 256, seed=5)
    x = torch.randn(INT_DEQUANT_MIN_TOKENS, 256).to(torch.bfloat16)
    with isa.use_isa("amx"):
        assert linear.dequantizes(torch.bfloat16) and not linear.dequantizes(torch.float32)
        assert kernel_tokens(linear, torch.bfloat16) == INT_DEQUANT_MIN_TOKENS
        prompt = linear(x)
        short = linear(x[: INT_DEQUANT_MIN_TOKENS - 1])
        assert torch.equal(short, matmul(linear.matrix, x[: INT_DEQUANT_MIN_TOKENS - 1], out_dtype=torch.bfloat16))
        floats = linear(x.float())
    with isa.use_isa("avx512"):
        assert not linear.dequantizes(torch.bfloat16)
        assert kernel_tokens(linear, torch.bfloat16) == float("inf")
        kernels = linear(x)
        assert torch.equal(kernels, matmul(linear.matrix, x, out_dtype=torch.bfloat16))
    assert not torch.equal(prompt, kernels)  # two paths, two roundings
    assert torch.allclose(floats.to(torch.bfloat16).float(), prompt.float(), rtol=5e-2, atol=5e-2)


@needs_amx
def test_a_group_of_int_projections_splits_for_a_prompt():
    members = [linear_and_reference("int4", rows, 256, seed=rows)[0] for rows in (64, 16, 16)]
    group = LinearGroup.of(*members)
    x = torch.randn(INT_DEQUANT_MIN_TOKENS + 1, 256).to(torch.bfloat16)
    with isa.use_isa("amx"):
        together = group(x)
        alone = [m(x) for m in members]
    for a, b in zip(together, alone):
        assert torch.equal(a, b)
