"""Wrapping tensors as kernel weight matrices, without copies.

`kernel_matrix` checks that a tensor (and its scales) is in one of the formats of hybridmoe.kernels.formats,
on the CPU, with contiguous rows, and hands the memory to the C++ kernels by DLPack (no copy). A tensor that
is not in such a layout is an error here, never a silent copy: callers that accept a one-time repack at load
(see `contiguous_rows`) do it explicitly and count its bytes.
"""

from __future__ import annotations

import torch

from hybridmoe.kernels import _native, formats

_DENSE_FORMATS = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


def dense_format(dtype: torch.dtype) -> str:
    """The kernel format name of a plain float weight dtype."""
    if dtype not in _DENSE_FORMATS:
        raise ValueError(f"dense expert weights must be float32, bfloat16 or float16, got {dtype}")
    return _DENSE_FORMATS[dtype]


def contiguous_rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """`t` itself when its rows are contiguous, else a contiguous copy; with the bytes copied (0 or t's size)."""
    if t.dim() == 2 and (t.shape[1] <= 1 or t.stride(1) == 1) and (t.shape[0] <= 1 or t.stride(0) >= t.shape[1]):
        return t, 0
    c = t.contiguous()
    return c, c.numel() * c.element_size()


def kernel_matrix(fmt: str, data: torch.Tensor, scales: torch.Tensor | None = None, *, cols: int | None = None,
                  block: tuple[int, int] = (128, 128), name: str = "weight") -> _native.Matrix:
    """A kernel matrix over `data` (no copy).

    fmt: "f32"/"bf16"/"f16" ([N, K] of that dtype), "fp8" (float8_e4m3fn [N, K] + float32 block scales),
    "int4"/"int8" (see formats; `cols` = the logical K, the group size follows from the scales' shape).
    """
    if data.device.type != "cpu":
        raise ValueError(f"{name}: must be on the CPU, got {data.device}")
    rows = data.shape[0]
    if fmt in ("f32", "bf16", "f16"):
        return _native.make_matrix(fmt, data, None, rows, data.shape[1], name=name)
    if fmt == "fp8":
        if data.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{name}: fp8 weights must be float8_e4m3fn, got {data.dtype}")
        if scales is None or scales.dtype != torch.float32:
            raise ValueError(f"{name}: fp8 weights need float32 block scales")
        return _native.make_matrix("fp8", data.view(torch.uint8), scales, rows, data.shape[1],
                                   block_rows=block[0], block_cols=block[1], name=name)
    if fmt in formats.INT_FORMATS:
        if cols is None or scales is None:
            raise ValueError(f"{name}: {fmt} weights need their scales and logical column count `cols`")
        expected = torch.uint8 if fmt == "int4" else torch.int8
        if data.dtype != expected:
            raise ValueError(f"{name}: {fmt} data dtype must be {expected}, got {data.dtype}")
        if scales.dim() != 2 or scales.shape[1] == 0:
            raise ValueError(f"{name}: {fmt} scales must be [N, groups], got {list(scales.shape)}")
        stored_cols = data.shape[1] * (2 if fmt == "int4" else 1)
        group = stored_cols // scales.shape[1]
        return _native.make_matrix(fmt, data, scales, rows, cols, group=group, name=name)
    raise ValueError(f"{name}: unknown weight format {fmt!r} (f32, bf16, f16, fp8, int4, int8)")
