"""`DeviceLinear`: a projection resident on the accelerator, run with torch's matmul there.

The weight keeps its stored bytes on the device (what the plan budgets for: FP8 with block scales, int4/int8 with
group scales, float as loaded) and is expanded to the compute dtype per call (accel.dequant), one matrix at a time.
On the CPU stand-in this is the accelerator's code path on host tensors: the same calls, separate copies.

Legend: T tokens, K input features, N output features.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridmoe.accel.accelerator import Accelerator
from hybridmoe.accel.dequant import dequantize
from hybridmoe.layers.linear import Linear


class DeviceLinear:
    def __init__(self, linear: Linear, accel: Accelerator, name: str):
        self.fmt, self.rows, self.cols, self.block = linear.fmt, linear.rows, linear.cols, linear.block
        self.device = accel.device
        self.data = accel.to_device(linear.data, name)
        self.scales = accel.to_device(linear.scales, name) if linear.scales is not None else None
        self.bias = accel.to_device(linear.bias, name) if linear.bias is not None else None
        self.nbytes = linear.nbytes + (linear.bias.nbytes if linear.bias is not None else 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] (any device) -> [..., N] on the accelerator, in x's dtype."""
        x = x.to(self.device, non_blocking=True)
        weight = dequantize(self.fmt, self.data, self.scales, self.cols, x.dtype, self.block)  # [N, K]
        bias = self.bias if self.bias is None or self.bias.dtype == x.dtype else self.bias.to(x.dtype)
        return F.linear(x, weight, bias)
