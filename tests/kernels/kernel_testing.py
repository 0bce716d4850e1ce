"""Random weight builders shared by the kernel tests (imported by name: pytest puts this folder on sys.path)."""

from __future__ import annotations

import torch

from hybridmoe.kernels import formats


def random_fp8(rows: int, cols: int, block: tuple[int, int], gen: torch.Generator,
               subnormal_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Random e4m3fn codes (no NaN codes) [rows, cols] and float32 block scales of varied magnitude."""
    codes = torch.randint(0, 256, (rows, cols), generator=gen, dtype=torch.int64)
    if subnormal_only:
        codes = codes & 0x87  # exponent bits 0: zero or subnormal
    codes = torch.where((codes & 0x7F) == 0x7F, codes ^ 0x01, codes)  # 0x7F/0xFF -> 0x7E/0xFE
    nr, nc = -(-rows // block[0]), -(-cols // block[1])
    scales = torch.pow(2.0, torch.empty(nr, nc).uniform_(-12, 3, generator=gen)).float()
    return codes.to(torch.uint8).view(torch.float8_e4m3fn), scales


def random_int(fmt: str, rows: int, cols: int, group: int, scale_dtype: torch.dtype, gen: torch.Generator):
    """A random matrix quantised to int4/int8 -> (data, scales)."""
    w = torch.randn(rows, cols, generator=gen) * torch.empty(rows, 1).uniform_(0.1, 3, generator=gen)
    quantize = formats.quantize_int4 if fmt == "int4" else formats.quantize_int8
    return quantize(w, group, scale_dtype)
