"""`Linear`: y = x W^T (+ b) for every projection outside the routed experts, on the C++ kernels.

The weight keeps its stored format: float (f32/bf16/f16, in the model's compute dtype), DeepSeek's FP8 with
128x128 block scales, or int4/int8 per group (written by `hybridmoe quantize`), zero-copy where the checkpoint
holds it so. The kernels' GEMV reads a decode step's weights near the memory bandwidth (torch's bf16 matmul at
one token reads at a fraction of it); from FLOAT_KERNEL_MAX_TOKENS tokens on, float weights go to torch's matmul
(oneDNN, AMX where present), which beat the kernels' GEMM there on the machines measured (docs/kernels.md,
"Linear layers"). FP8 and int weights run on the kernels at every size: torch has no matmul for them.

Legend: T tokens, K input features, N output features.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridmoe.kernels.moe import matmul
from hybridmoe.kernels.weights import contiguous_rows, dense_format, kernel_matrix

FLOAT_KERNEL_MAX_TOKENS = 8  # float weights: the kernels below this many tokens, torch's matmul from it on


class Linear:
    """A weight matrix [N, K] in its stored format, with an optional float bias [N]."""

    def __init__(self, fmt: str, data: torch.Tensor, scales: torch.Tensor | None = None, *, cols: int,
                 bias: torch.Tensor | None = None, block: tuple[int, int] = (128, 128), name: str = "weight"):
        self.fmt, self.rows, self.cols, self.bias, self.block = fmt, data.shape[0], cols, bias, block
        self.data, self.scales = data, scales  # the matrix reads this memory: keep it alive
        self.matrix = kernel_matrix(fmt, data, scales, cols=cols, block=block, name=name)

    @classmethod
    def dense(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, name: str = "weight") -> "Linear":
        """A float weight [N, K] (rows made contiguous if they are not: a one-time copy)."""
        weight, _ = contiguous_rows(weight)
        return cls(dense_format(weight.dtype), weight, cols=weight.shape[1], bias=bias, name=name)

    @property
    def weight(self) -> torch.Tensor | None:
        """The float weight [N, K] (None for FP8 and int formats)."""
        return self.data if self.fmt in ("f32", "bf16", "f16") else None

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (self.scales.nbytes if self.scales is not None else 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype."""
        if x.dim() != 2:
            return self(x.reshape(-1, self.cols)).view(*x.shape[:-1], self.rows)
        weight = self.weight
        if weight is not None and x.shape[0] >= FLOAT_KERNEL_MAX_TOKENS:
            return F.linear(x, weight if weight.dtype == x.dtype else weight.to(x.dtype), self.bias)
        if self.bias is None and (x.dtype == torch.bfloat16 or x.dtype == torch.float32):
            return matmul(self.matrix, x, out_dtype=x.dtype)  # [T, N]; bf16 in and out without torch conversions
        y = matmul(self.matrix, x)  # [T, N] float32; a decode step runs this for every projection: lean
        if self.bias is not None:
            y += self.bias
        return y if x.dtype == torch.float32 else y.to(x.dtype)
