"""Stored weight formats -> a float matrix, with torch ops on whatever device the codes live on.

The accelerator computes with float weights: FP8 (block scales), int4/int8 (group scales) are expanded per call,
per matrix, where they are used (a tile of the layer, not the whole model at once). Float32 arithmetic is exact
here: an e4m3 value or an int code (|q| <= 127) times a float32/bf16/fp16 scale needs at most 8 + 11 bits of
mantissa. Formats: kernels.formats.
"""

from __future__ import annotations

import torch

from hybridmoe.checkpoint.fp8 import expand_block_scales
from hybridmoe.kernels.formats import int_codes


def dequantize(fmt: str, data: torch.Tensor, scales: torch.Tensor | None, cols: int, dtype: torch.dtype,
               block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """fmt "dense"/"f32"/"bf16"/"f16" (data is the matrix), "fp8" (float8_e4m3fn [N, K] + float32 block scales) or
    "int4"/"int8" (codes [N, Kp/2 or Kp] + scales [N, Kp/g]) -> [N, K] in `dtype`, on data's device."""
    if fmt in ("dense", "f32", "bf16", "f16"):
        return data if data.dtype == dtype else data.to(dtype)
    if fmt == "fp8":
        return (data.float() * expand_block_scales(scales.float(), tuple(data.shape), block)).to(dtype)
    if fmt in ("int4", "int8"):
        q = int_codes(fmt, data).float()  # [N, Kp]
        group = q.shape[1] // scales.shape[1]
        full = (q.view(q.shape[0], -1, group) * scales.float()[..., None]).view(q.shape[0], -1)
        return full[:, :cols].to(dtype)
    raise ValueError(f"cannot dequantise weight format {fmt!r} (dense, f32, bf16, f16, fp8, int4, int8)")
