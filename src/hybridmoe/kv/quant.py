"""Symmetric absmax quantisation of KV rows per (token, group): a group is one kv head's K or V (GQA) or the
latent / the rope key (MLA), so per (layer, kv head, token) over head_dim.

scale = max|x| / qmax (qmax 127 for INT8, 7 for INT4), stored as float16 and rounded up where float16 rounded
it down, so that every code fits and the round-trip error of each value is at most scale / 2. INT8 codes are
int8; INT4 codes are stored as code + 8 in one nibble, two per byte (value 2i in the low nibble, 2i+1 in the
high one). A scale beyond float16's range (max|x| > 65504 * qmax) saturates and clips its group.

Legend: n tokens, W row width, G groups per row.
"""

from __future__ import annotations

import math
import threading

import torch

QMAX = {8: 127, 4: 7}
FP16_MAX = 65504.0


def _runs(widths: tuple[int, ...]) -> list[tuple[int, int, int, int]]:
    """Consecutive groups of one width: (first column, first group, groups, width) each. GQA is one run of
    2 Nk heads, MLA two runs (the latent, the rope key)."""
    runs, col, group = [], 0, 0
    for w in widths:
        if runs and runs[-1][3] == w:
            c, g, k, _ = runs[-1]
            runs[-1] = (c, g, k + 1, w)
        else:
            runs.append((col, group, 1, w))
        col, group = col + w, group + 1
    return runs


def _scales(amax: torch.Tensor, qmax: int) -> torch.Tensor:
    """max |x| [..] float32 -> float16 scales, each >= amax / qmax once in float16 (below its range limit)."""
    scales = (amax / qmax).clamp_(max=FP16_MAX).to(torch.float16)
    low = scales.float() * qmax < amax
    if low.any():  # float16 rounded down: one step up
        bumped = (scales.view(torch.int16) + 1).view(torch.float16)
        scales = torch.where(low & (scales.float() < FP16_MAX), bumped, scales)
    return scales


def scales_for(rows: torch.Tensor, widths: tuple[int, ...], bits: int) -> torch.Tensor:
    """rows [n, W] -> float16 scales [n, G]."""
    return quantize(rows, widths, bits)[1]


_local = threading.local()


def scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A per-thread reusable buffer: fresh large tensors cost page faults on every call (most of a pass here).
    One per inference mode: a buffer made inside torch.inference_mode (the PD prefill worker packs a layer from
    within the forward) cannot be written outside it."""
    numel = math.prod(shape)
    buffers = _local.__dict__.setdefault("buffers", {})
    key = (name, dtype, torch.is_inference_mode_enabled())
    buf = buffers.get(key)
    if buf is None or buf.numel() < numel:
        buf = buffers[key] = torch.empty(max(numel, 1), dtype=dtype)
    return buf[:numel].view(shape)


def quantize(rows: torch.Tensor, widths: tuple[int, ...], bits: int, codes_out: torch.Tensor | None = None,
             scales_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [n, W] -> (codes, scales float16 [n, G]); codes int8 [n, W] (INT8) or uint8 [n, W/2] (INT4).
    codes_out / scales_out: where to write them (e.g. views into a payload), else new tensors."""
    qmax = QMAX[bits]
    n, width = rows.shape
    if bits == 4 and width % 2:
        raise ValueError(f"INT4 packs two values per byte: the row width {width} must be even")
    x = rows if rows.dtype == torch.float32 else rows.float()
    scaled = scratch("scaled", (n, width), torch.float32)
    scales = scales_out if scales_out is not None else torch.empty(n, len(widths), dtype=torch.float16)
    saturated = False
    for col, group, count, w in _runs(widths):
        xs = x[:, col: col + count * w].unflatten(1, (count, w))  # [n, g, w]
        amax = torch.maximum(xs.amax(-1), xs.amin(-1).neg_())  # [n, g]: max |x|
        s = _scales(amax, qmax)
        scales[:, group: group + count] = s
        sf = s.float()
        saturated |= bool((sf >= FP16_MAX).any())
        torch.mul(xs, torch.where(sf > 0, 1.0 / sf, 0.0)[..., None],
                  out=scaled[:, col: col + count * w].unflatten(1, (count, w)))
    scaled.round_()  # within +-qmax unless a scale saturated
    if saturated:
        scaled.clamp_(-qmax, qmax)
    if bits == 8:
        codes = codes_out if codes_out is not None else torch.empty(n, width, dtype=torch.int8)
        codes.copy_(scaled)
        return codes, scales
    scaled.add_(8)
    nib = scratch("nibbles", (n, width), torch.uint8)
    nib.copy_(scaled)
    packed = codes_out if codes_out is not None else torch.empty(n, width // 2, dtype=torch.uint8)
    torch.bitwise_left_shift(nib[:, 1::2], 4, out=packed)
    packed.bitwise_or_(nib[:, 0::2])
    return packed, scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, widths: tuple[int, ...], bits: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(codes, scales) of quantize -> rows [n, W] in dtype."""
    if bits == 4:
        values = torch.empty(codes.shape[0], codes.shape[1] * 2, dtype=torch.float32)
        values[:, 0::2] = codes & 0x0F
        values[:, 1::2] = codes >> 4
        values -= 8
    else:
        values = codes.float()
    for col, group, count, w in _runs(widths):
        values[:, col: col + count * w].unflatten(1, (count, w)).mul_(scales[:, group: group + count, None].float())
    return values.to(dtype)


def expand_scales(scales: torch.Tensor, widths: tuple[int, ...]) -> torch.Tensor:
    """scales [n, G] -> [n, W] float32, each group's scale repeated over its values."""
    return scales.float().repeat_interleave(torch.tensor(widths), dim=-1)
