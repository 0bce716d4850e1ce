"""`Linear` (every projection outside the routed experts) against a float64 reference on fresh random data: each
weight format, decode-sized and prefill-sized batches (both sides of the float weights' torch crossovers: same
dtype as the activations, and bf16/f16 weights under float32 ones), with and without a bias, on every ISA this
machine runs; projections of one input in one call (LinearGroup) give what each gives alone."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.checkpoint.fp8 import dequantize_fp8, quantize_fp8
from hybridmoe.kernels import isa
from hybridmoe.kernels.formats import dequantize_int, quantize_int4, quantize_int8
from hybridmoe.layers.linear import (CONVERT_ROWS, CONVERTED_KERNEL_MAX_TOKENS, FLOAT_KERNEL_MAX_TOKENS, Linear,
                                    LinearGroup, SharedInput)

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


def _member(fmt: str, rows: int, gen: torch.Generator, group: int = 32) -> Linear:
    w = torch.randn(rows, COLS, generator=gen) * 0.05
    if fmt in ("f32", "bf16"):
        return Linear.dense(w.to(torch.float32 if fmt == "f32" else torch.bfloat16))
    if fmt == "fp8":
        return Linear("fp8", *quantize_fp8(w), cols=COLS)
    return Linear(fmt, *(quantize_int4 if fmt == "int4" else quantize_int8)(w, group=group), cols=COLS)


@pytest.mark.parametrize("fmts", [("int4", "int4", "int4"), ("f32", "f32", "f32"), ("bf16", "bf16", "bf16"),
                                  ("fp8", "fp8", "fp8"), ("int8", "int4", "int8"), ("fp8", "bf16", "f32")])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, FLOAT_KERNEL_MAX_TOKENS, CONVERTED_KERNEL_MAX_TOKENS])
def test_a_group_gives_each_members_own_output(each_isa, fmts, x_dtype, tokens):
    gen = torch.Generator().manual_seed(len(fmts) * tokens)
    members = [_member(fmt, rows, gen) for fmt, rows in zip(fmts, (200, 48, 72))]  # q / k / v-like widths
    group = LinearGroup.of(*members)
    assert group is not None
    x = torch.randn(tokens, COLS, generator=gen).to(x_dtype)
    got = group(x)
    for out, member in zip(got, members):
        assert out.dtype == x_dtype and torch.equal(out, member(x))  # the same rows of the same kernels


def test_projections_that_cannot_share_a_call_are_no_group():
    gen = torch.Generator().manual_seed(2)
    q = _member("int4", 64, gen)
    assert LinearGroup.of(q, _member("int4", 64, gen, group=128)) is None  # other int8 groups of the input
    assert LinearGroup.of(q, _member("f32", 64, gen)) is None  # int8 against float activations
    wider = Linear.dense(torch.randn(8, COLS + 32, generator=gen))
    assert LinearGroup.of(Linear.dense(torch.randn(8, COLS, generator=gen)), wider) is None
    biased = _member("f32", 8, gen)
    biased.bias = torch.zeros(8)
    assert LinearGroup.of(_member("f32", 8, gen), biased) is None
    assert LinearGroup.of(q, object()) is None


def test_shared_input_remakes_its_group_when_the_projections_change():
    gen = torch.Generator().manual_seed(3)
    a, b, c = (_member("int8", 40, gen) for _ in range(3))
    shared = SharedInput()
    x = torch.randn(1, COLS, generator=gen)
    assert [torch.equal(o, m(x)) for o, m in zip(shared((a, b), x), (a, b))] == [True, True]
    assert [torch.equal(o, m(x)) for o, m in zip(shared((a, c), x), (a, c))] == [True, True]

    class Swapped:  # a projection of another kind (a device layer): separate calls
        def __call__(self, x):
            return x[:, :5] * 2

    outs = shared((a, Swapped()), x)
    assert torch.equal(outs[0], a(x)) and torch.equal(outs[1], x[:, :5] * 2)
