"""`Linear`: y = x W^T (+ b) for every projection outside the routed experts, on the C++ kernels.

The weight keeps its stored format: float (f32/bf16/f16, in the model's compute dtype), DeepSeek's FP8 with
128x128 block scales, or int4/int8 per group (written by `hybridmoe quantize`), zero-copy where the checkpoint
holds it so. The kernels' GEMV reads a decode step's weights near the memory bandwidth (torch's bf16 matmul at
one token reads at a fraction of it); from FLOAT_KERNEL_MAX_TOKENS tokens on, float weights go to torch's matmul
(oneDNN, AMX where present), which beat the kernels' GEMM there on the machines measured (docs/kernels.md,
"Linear layers"). A bf16/f16 weight under a float32 compute dtype (a CPU without bf16 units) stays as stored, half
the bytes a decode step reads: the kernels up to CONVERTED_KERNEL_MAX_TOKENS tokens, then torch's matmul over
blocks of CONVERT_ROWS rows converted into a small buffer. FP8 weights run on the kernels at every size: torch
has no matmul for them. Int weights too, except under bf16 activations on a CPU with AMX tiles: from
INT_DEQUANT_MIN_TOKENS tokens their rows are dequantised to bf16 a block at a time (bit for bit code x scale) for
torch's matmul, which multiplies a prompt several times faster than the int kernels there. `LinearGroup` computes
projections of one input (GQA's q / k / v) in one kernel call.

Legend: T tokens, K input features, N output features.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.dlpack import to_dlpack

from hybridmoe.kernels import _native, isa
from hybridmoe.kernels.formats import INT_FORMATS
from hybridmoe.kernels.moe import matmul
from hybridmoe.kernels.weights import contiguous_rows, dense_format, kernel_matrix

FLOAT_KERNEL_MAX_TOKENS = 8  # float weights: the kernels below this many tokens, torch's matmul from it on
# Weights in another float dtype than the activations: the kernels read them as stored and beat converting until
# about 64 tokens (AVX2 Zen 3, 2 threads: 2.9 against 6.9 ms at 16 tokens of 4096 x 2048 bf16; 0.5x at 512).
CONVERTED_KERNEL_MAX_TOKENS = 64
CONVERT_ROWS = 256  # rows converted at a time above that: 2 MB of float32 at 2048 columns, warm in cache for the mm
# Int weights under bf16 activations on an AMX CPU: torch's matmul over dequantised rows from this many tokens, the
# kernels (their AMX tiles from 16 tokens) below. An AMX Xeon, 2 threads, int4 g32, Qwen3-30B-A3B's q / o and k
# projections, against the kernels: 0.5-0.7x at 64, 0.7-1.4x at 128, 0.9-1.3x at 192, 1.3-1.8x at 256, 1.5-2.6x
# at 512 (dequantising 8.4 M weights takes about 2.5 ms).
INT_DEQUANT_MIN_TOKENS = 192
DEQUANT_BLOCK_BYTES = 4 << 20  # bf16 rows dequantised at a time: 1024 rows at 2048 columns, in L2 and L3 for the mm


def keeps_stored(stored: torch.dtype, compute: torch.dtype) -> bool:
    """Whether a float projection stored in `stored` stays so under the compute dtype (bf16/f16 under float32)."""
    return compute == torch.float32 and stored in (torch.bfloat16, torch.float16)


class Linear:
    """A weight matrix [N, K] in its stored format, with an optional float bias [N]."""

    def __init__(self, fmt: str, data: torch.Tensor, scales: torch.Tensor | None = None, *, cols: int,
                 bias: torch.Tensor | None = None, block: tuple[int, int] = (128, 128), name: str = "weight"):
        self.fmt, self.rows, self.cols, self.bias, self.block = fmt, data.shape[0], cols, bias, block
        self.data, self.scales = data, scales  # the matrix reads this memory: keep it alive
        self._float_weight = data if fmt in ("f32", "bf16", "f16") else None  # read by every call: no property
        self.matrix = kernel_matrix(fmt, data, scales, cols=cols, block=block, name=name)

    @classmethod
    def dense(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, name: str = "weight") -> "Linear":
        """A float weight [N, K] (rows made contiguous if they are not: a one-time copy)."""
        weight, _ = contiguous_rows(weight)
        return cls(dense_format(weight.dtype), weight, cols=weight.shape[1], bias=bias, name=name)

    @property
    def weight(self) -> torch.Tensor | None:
        """The float weight [N, K] (None for FP8 and int formats)."""
        return self._float_weight

    def dequantizes(self, x_dtype: torch.dtype) -> bool:
        """Whether int weights go to torch's matmul over dequantised rows from INT_DEQUANT_MIN_TOKENS tokens of
        x_dtype (bf16 on a CPU with AMX tiles, which torch's bf16 matmul uses too)."""
        return self.fmt in INT_FORMATS and x_dtype == torch.bfloat16 and isa.amx()

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (self.scales.nbytes if self.scales is not None else 0)

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [..., K] -> [..., N] in out_dtype (default x's dtype; float32 from the kernels is their own result)."""
        if x.dim() != 2:
            return self(x.reshape(-1, self.cols), out_dtype).view(*x.shape[:-1], self.rows)
        weight = self._float_weight
        if x.shape[0] >= INT_DEQUANT_MIN_TOKENS and self.dequantizes(x.dtype):
            return _as(_linear_dequantizing(x, self), out_dtype)
        if weight is not None and x.shape[0] >= FLOAT_KERNEL_MAX_TOKENS:
            if weight.dtype == x.dtype:
                return _as(F.linear(x, weight, self.bias), out_dtype)
            if x.shape[0] >= CONVERTED_KERNEL_MAX_TOKENS:
                return _as(_linear_converting(x, weight, self.bias), out_dtype)
        if self.bias is None and (x.dtype == torch.bfloat16 or x.dtype == torch.float32):
            # [T, N]; bf16 in and out without torch conversions
            return matmul(self.matrix, x, out_dtype=out_dtype or x.dtype)
        y = matmul(self.matrix, x)  # [T, N] float32; a decode step runs this for every projection: lean
        if self.bias is not None:
            y += self.bias
        return y.to(out_dtype or x.dtype)


class LinearGroup:
    """Projections of one input (GQA's q / k / v) computed together where all of them take the kernels: one call,
    the input's activations prepared once, one dispatch to the thread pool for every matrix's rows. At a decode
    step each call's fixed cost (tens of microseconds) is a sizeable part of reading a small matrix (k / v)."""

    def __init__(self, members: list[Linear]):
        self.members = members
        self._matrices = [m.matrix for m in members]
        # tokens below which every member takes the kernels, per input dtype (see Linear.__call__)
        self._kernel_tokens = {dtype: min(kernel_tokens(m, dtype) for m in members)
                               for dtype in (torch.float32, torch.bfloat16)}

    @classmethod
    def of(cls, *members) -> "LinearGroup | None":
        """The group of these projections, or None where they cannot share a call (another kind of layer, a bias, a
        different input width or activation form)."""
        if not all(type(m) is Linear and m.bias is None for m in members):
            return None
        if _native.matmul_group_mismatch([m.matrix for m in members]) is not None:
            return None
        return cls(list(members))

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """x [T, K] -> one [T, N_i] a member, in out_dtype (default x's dtype)."""
        if x.shape[0] >= self._kernel_tokens.get(x.dtype, 0) or not x.is_contiguous():
            return [m(x, out_dtype) for m in self.members]
        if out_dtype is None or out_dtype == x.dtype:
            outs = [x.new_empty((x.shape[0], m.rows)) for m in self.members]
        else:
            outs = [torch.empty((x.shape[0], m.rows), dtype=out_dtype) for m in self.members]
        if x.shape[0]:
            _native.matmul_group(self._matrices, to_dlpack(x), [to_dlpack(o) for o in outs])
        return outs


class SharedInput:
    """A layer's projections of one input through their LinearGroup, remade when the projections change (placement
    swaps a layer's projections for device ones after it is built); separate calls where they cannot share one."""

    def __init__(self):
        self._of: tuple = ()
        self._group: LinearGroup | None = None

    def __call__(self, members: tuple, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """members: the projections (Linear or not), x [T, K] -> one [T, N_i] a member, in out_dtype (default x's)."""
        made_of = self._of
        if len(made_of) != len(members) or any(a is not b for a, b in zip(made_of, members)):
            self._of, self._group = members, LinearGroup.of(*members)
        if self._group is not None:
            return self._group(x, out_dtype)
        return [m(x) if out_dtype is None else m(x, out_dtype) for m in members]


def kernel_tokens(linear: Linear, x_dtype: torch.dtype) -> int | float:
    """Up to how many tokens (exclusive) `linear` computes x of x_dtype on the kernels."""
    weight = linear.weight
    if weight is None:
        return INT_DEQUANT_MIN_TOKENS if linear.dequantizes(x_dtype) else math.inf
    return FLOAT_KERNEL_MAX_TOKENS if weight.dtype == x_dtype else CONVERTED_KERNEL_MAX_TOKENS


def _as(y: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return y if dtype is None else y.to(dtype)


def _linear_dequantizing(x: torch.Tensor, linear: Linear) -> torch.Tensor:
    """x [T, K] bf16 @ W^T (+ bias) -> [T, N] bf16 for an int4 / int8 W: its rows dequantised to bf16 a block at a
    time (DEQUANT_BLOCK_BYTES), each block multiplied by torch's matmul."""
    step = max(16, DEQUANT_BLOCK_BYTES // (2 * linear.cols))
    return _linear_in_blocks(x, linear.rows, linear.cols, step, linear.bias,
                             lambda block, r0: _native.dequantize_bf16(linear.matrix, r0, r0 + block.shape[0], block))


def _linear_converting(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, K] @ weight^T (+ bias) -> [T, N] in x's dtype, weight [N, K] in another float dtype: converted
    CONVERT_ROWS rows at a time (a whole converted copy would be new memory each call)."""
    return _linear_in_blocks(x, weight.shape[0], weight.shape[1], CONVERT_ROWS, bias,
                             lambda block, r0: block.copy_(weight[r0:r0 + block.shape[0]]))


def _linear_in_blocks(x: torch.Tensor, rows: int, cols: int, step: int, bias: torch.Tensor | None,
                      fill) -> torch.Tensor:
    """x [T, K] @ W^T (+ bias) -> [T, N] in x's dtype, W's rows `step` at a time written by fill(block, r0) into
    one reused buffer in x's dtype, each block multiplied by torch's matmul."""
    out = torch.empty((x.shape[0], rows), dtype=x.dtype)
    buffer = torch.empty((min(step, rows), cols), dtype=x.dtype)
    for r0 in range(0, rows, step):
        block = buffer[: min(step, rows - r0)]
        fill(block, r0)
        out[:, r0:r0 + block.shape[0]] = x @ block.t()
    if bias is not None:
        out += bias.to(x.dtype)
    return out
