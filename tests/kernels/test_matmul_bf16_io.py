"""kernels.moe.matmul with bfloat16 activations in and a bfloat16 output: bit for bit the float32 path followed by
torch's rounding (`Linear` takes it for every bf16 projection without a bias)."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.kernels import formats
from hybridmoe.kernels.moe import matmul
from hybridmoe.kernels.weights import kernel_matrix
from hybridmoe.layers.linear import Linear


def test_bf16_output_rounds_as_torch_does(each_isa):
    """A diagonal weight times ones passes float32 values through: ties, infinities, NaN, subnormals, overflow."""
    values = torch.tensor([1.0, 1.00390625, 1.01171875, 3.0000002, -2.5, float("inf"), -float("inf"), float("nan"),
                           1e-40, -1e-39, 0.0, 3.4e38, -3.39e38, 65504.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8])
    n = values.numel()
    diagonal = kernel_matrix("f32", torch.diag(values), None, cols=n)
    got = matmul(diagonal, torch.ones(1, n), out_dtype=torch.bfloat16)
    want = values[None].to(torch.bfloat16)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


@pytest.mark.parametrize("fmt", ["bf16", "int4", "int8", "fp8"])
@pytest.mark.parametrize("tokens", [1, 5])
def test_bf16_in_and_out_match_the_float32_path(fmt, tokens):
    gen = torch.Generator().manual_seed(tokens)
    w = torch.randn(200, 320, generator=gen) * 0.05
    if fmt == "bf16":
        lin = Linear.dense(w.bfloat16())
    elif fmt == "fp8":
        scales = torch.rand(2, 3, generator=gen) * 0.01 + 0.001
        lin = Linear("fp8", (w / 0.01).clamp(-400, 400).to(torch.float8_e4m3fn), scales, cols=320)
    else:
        quantize = formats.quantize_int4 if fmt == "int4" else formats.quantize_int8
        data, scales = quantize(w, 32, torch.bfloat16)
        lin = Linear(fmt, data, scales, cols=320)
    x = torch.randn(tokens, 320, generator=gen).bfloat16()
    want = matmul(lin.matrix, x.float()).to(torch.bfloat16)
    got = lin(x)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
