"""Device-side dequantisation and DeviceLinear against float64 references, on fresh random data."""

import pytest
import torch

from hybridmoe.accel.accelerator import Accelerator
from hybridmoe.accel.dequant import dequantize
from hybridmoe.checkpoint.fp8 import quantize_fp8
from hybridmoe.kernels.formats import dequantize_fp8, dequantize_int, quantize_int4, quantize_int8
from hybridmoe.layers.device_linear import DeviceLinear
from hybridmoe.layers.linear import Linear


def _matrix(fmt, rows, cols, gen):
    w = torch.randn(rows, cols, generator=gen)
    if fmt == "fp8":
        q, s = quantize_fp8(w, (128, 128))
        return Linear("fp8", q, s, cols=cols), dequantize_fp8(q, s, (128, 128))
    if fmt in ("int4", "int8"):
        q, s = (quantize_int4 if fmt == "int4" else quantize_int8)(w, 32)
        return Linear(fmt, q, s, cols=cols), dequantize_int(fmt, q, s, cols)
    return Linear.dense(w), w.double()


@pytest.mark.parametrize("fmt", ["f32", "fp8", "int4", "int8"])
def test_dequantize_is_exact(fmt):
    gen = torch.Generator().manual_seed(1)
    linear, reference = _matrix(fmt, 130, 200, gen)
    got = dequantize(linear.fmt, linear.data, linear.scales, linear.cols, torch.float32, linear.block)
    assert got.shape == (130, 200)
    assert torch.equal(got.double(), reference.float().double())


@pytest.mark.parametrize("fmt", ["f32", "fp8", "int4", "int8"])
def test_device_linear_matches_float64(fmt):
    gen = torch.Generator().manual_seed(2)
    linear, reference = _matrix(fmt, 96, 160, gen)
    accel = Accelerator("cpu")
    dev = DeviceLinear(linear, accel, "proj")
    assert accel.held_bytes == linear.nbytes
    x = torch.randn(5, 160, generator=gen)
    expected = x.double() @ reference.T
    torch.testing.assert_close(dev(x).double(), expected, rtol=1e-5, atol=1e-4)
