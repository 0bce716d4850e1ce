"""`Linear` (every projection outside the routed experts) against a float64 reference on fresh random data: each
weight format, decode-sized and prefill-sized batches (both sides of the float weights' torch crossovers: same
dtype as the activations, and bf16/f16 weights under float32 ones), with and without a bias, on every ISA this
machine runs."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.checkpoint.fp8 import dequantize_fp8, quantize_fp8
from hybridmoe.kernels import isa
from hybridmoe.kernels.formats import dequantize_int, quantize_int4, quantize_int8
from hybridmoe.layers.linear import CONVERT_ROWS, CONVERTED_KERNEL_MAX_TOKENS, FLOAT_KERNEL_MAX_TOKENS, Linear

ROWS, COLS = 200, 320  # not multiples of 128: partial FP8 blocks and int groups at the edges


def make(fmt: str, gen: torch.Generator) -> tuple[Linear, torch.Tensor]:
    """A Linear in `fmt` and the float64 weight it stands for (what its stored values decode to)."""
    w = torch.randn(ROWS, COLS, generator=gen) * 0.05
    if fmt in ("f32", "bf16", "f16"):
        dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[fmt]
        stored = w.to(dtype)
        return Linear.dense(stored), stored.double()
    if fmt == "fp8":
        data, scales = quantize_fp8(w)
        return Linear("fp8", data, scales, cols=COLS), dequantize_fp8(data, scales, (128, 128), torch.float64)
    data, scales = (quantize_int4 if fmt == "int4" else quantize_int8)(w, group=32)
    return Linear(fmt, data, scales, cols=COLS), dequantize_int(fmt, data, scales, COLS).double()


@pytest.mark.parametrize("fmt", ["f32", "bf16", "f16", "fp8", "int4", "int8"])
@pytest.mark.parametrize("tokens", [1, 3, FLOAT_KERNEL_MAX_TOKENS, 40, CONVERTED_KERNEL_MAX_TOKENS])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_float64_reference(each_isa, fmt, tokens, with_bias):
    gen = torch.Generator().manual_seed(hash((fmt, tokens, with_bias, each_isa)) % 2**31)
    linear, w64 = make(fmt, gen)
    bias = torch.randn(ROWS, generator=gen) if with_bias else None
    linear.bias = bias
    x = torch.randn(tokens, COLS, generator=gen)
    expected = x.double() @ w64.T + (bias.double() if bias is not None else 0)
    got = linear(x)
    assert got.dtype == torch.float32 and got.shape == (tokens, ROWS)
    # int formats quantise the activations to int8 per group; bf16 dot products and AMX round them to bf16
    rounds = fmt in ("int4", "int8") or (fmt in ("bf16", "fp8") and (isa.bf16_dot() or isa.amx()))
    torch_path = ((fmt == "f32" and tokens >= FLOAT_KERNEL_MAX_TOKENS) or
                  (fmt in ("bf16", "f16") and tokens >= CONVERTED_KERNEL_MAX_TOKENS))
    tolerance = 2e-2 if rounds and not torch_path else 1e-5
    err = (got.double() - expected).abs().max() / expected.abs().max()
    assert err < tolerance, f"{fmt} T={tokens}: relative error {err:.2e}"


@pytest.mark.parametrize("fmt", [torch.bfloat16, torch.float16])
def test_stored_half_weights_under_float32_convert_in_row_blocks(fmt):
    # more rows than one conversion block, and a partial last block
    gen = torch.Generator().manual_seed(7)
    rows = 2 * CONVERT_ROWS + 88
    stored = (torch.randn(rows, COLS, generator=gen) * 0.05).to(fmt)
    linear = Linear.dense(stored)
    linear.bias = torch.randn(rows, generator=gen)
    x = torch.randn(CONVERTED_KERNEL_MAX_TOKENS + 5, COLS, generator=gen)
    expected = x.double() @ stored.double().T + linear.bias.double()
    got = linear(x)
    assert got.dtype == torch.float32 and got.shape == (x.shape[0], rows)
    assert ((got.double() - expected).abs().max() / expected.abs().max()) < 1e-5
    assert linear.data.dtype == fmt  # still as stored


def test_linear_keeps_the_input_dtype_and_leading_dims():
    gen = torch.Generator().manual_seed(1)
    linear, w64 = make("bf16", gen)
    x = torch.randn(2, 3, COLS, generator=gen).to(torch.bfloat16)
    got = linear(x)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 3, ROWS)
    expected = x.double().reshape(6, COLS) @ w64.T
    assert torch.allclose(got.reshape(6, ROWS).double(), expected, rtol=2e-2, atol=2e-2)
    assert linear(torch.empty(0, COLS)).shape == (0, ROWS)
