"""Symmetric absmax quantisation of KV rows per (token, group): a group is one kv head's K or V (GQA) or the
latent / the rope key (MLA), so per (layer, kv head, token) over head_dim.

scale = max|x| / qmax (qmax 127 for INT8, 7 for INT4), stored as float16 and rounded up where float16 rounded
it down, so that every code fits and the round-trip error of each value is at most scale / 2. INT8 codes are
int8; INT4 codes are stored as code + 8 in one nibble, two per byte (value 2i in the low nibble, 2i+1 in the
high one). A scale beyond float16's range (max|x| > 65504 * qmax) saturates and clips its group.

Legend: n tokens, W row width, G groups per row.
"""

from __future__ import annotations

import torch

QMAX = {8: 127, 4: 7}
FP16_MAX = 65504.0


def _group_absmax(rows: torch.Tensor, widths: tuple[int, ...]) -> torch.Tensor:
    """rows [n, W] -> max |x| per group [n, G] float32."""
    x = rows.float().abs()
    if len(set(widths)) == 1:
        return x.view(x.shape[0], len(widths), widths[0]).amax(-1)
    return torch.stack([g.amax(-1) for g in x.split(list(widths), dim=-1)], dim=-1)


def _expand(scales: torch.Tensor, widths: tuple[int, ...]) -> torch.Tensor:
    """scales [n, G] -> [n, W] float32, each group's scale repeated over its values."""
    if len(set(widths)) == 1:
        return scales.float().repeat_interleave(widths[0], dim=-1)
    return scales.float().repeat_interleave(torch.tensor(widths), dim=-1)


def scales_for(rows: torch.Tensor, widths: tuple[int, ...], bits: int) -> torch.Tensor:
    """rows [n, W] -> float16 scales [n, G], each >= max|x| / qmax once in float16 (below its range limit)."""
    qmax = QMAX[bits]
    amax = _group_absmax(rows, widths)
    scales = (amax / qmax).clamp(max=FP16_MAX).to(torch.float16)
    low = scales.float() * qmax < amax
    if low.any():
        bumped = torch.nextafter(scales.float(), torch.tensor(float("inf"))).to(torch.float16)
        # nextafter in float32 may round back: step the float16 bits instead
        bumped = torch.where(bumped.float() * qmax < amax,
                             (scales.view(torch.int16) + 1).view(torch.float16), bumped)
        scales = torch.where(low & (scales.float() < FP16_MAX), bumped, scales)
    return scales


def quantize(rows: torch.Tensor, widths: tuple[int, ...], bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [n, W] -> (codes, scales float16 [n, G]); codes int8 [n, W] (INT8) or uint8 [n, W/2] (INT4)."""
    scales = scales_for(rows, widths, bits)
    qmax = QMAX[bits]
    s = _expand(scales, widths)
    x = rows.float()
    codes = torch.where(s > 0, x / torch.where(s > 0, s, 1.0), 0.0).round_().clamp_(-qmax, qmax)
    if bits == 8:
        return codes.to(torch.int8), scales
    if rows.shape[-1] % 2:
        raise ValueError(f"INT4 packs two values per byte: the row width {rows.shape[-1]} must be even")
    nib = (codes + 8).to(torch.uint8)
    return nib[:, 0::2] | (nib[:, 1::2] << 4), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, widths: tuple[int, ...], bits: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(codes, scales) of quantize -> rows [n, W] in dtype."""
    if bits == 4:
        unpacked = torch.empty(codes.shape[0], codes.shape[1] * 2, dtype=torch.int16)
        unpacked[:, 0::2] = (codes & 0x0F).to(torch.int16)
        unpacked[:, 1::2] = (codes >> 4).to(torch.int16)
        values = (unpacked - 8).float()
    else:
        values = codes.float()
    return (values * _expand(scales, widths)).to(dtype)
