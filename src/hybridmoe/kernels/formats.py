"""The expert weight formats the kernels read, their quantisers, and exact float64 dequantisers.

- "bf16" / "f16" / "f32": plain [N, K] matrices.
- "fp8": float8_e4m3fn [N, K] with a float32 scale per (b0 x b1) block, [ceil(N/b0), ceil(K/b1)]
  (DeepSeek-V3's `weight_scale_inv`, used as loaded; last blocks may be partial).
- "int4": symmetric, per group of `group` (32 or 128) along K. Rows are zero-padded to Kp = ceil(K/g)*g.
  Codes q in [-8, 7] are stored as q + 8, two per byte: in each run of 32 columns c..c+31, byte j (0..15) holds
  column c+j in its low nibble and column c+16+j in its high nibble. data uint8 [N, Kp/2], scales
  bfloat16/float16 [N, Kp/g]; W[n, k] = q[n, k] * scale[n, k // g].
- "int8": symmetric per group, int8 codes in [-127, 127], data int8 [N, Kp], scales as for int4.

The int kernels quantise their activations per group too (`quantize_activations` is the exact reference of the
C++ quantiser): x ~ rint(x * 127 / amax) * amax / 127.

Legend: N output rows, K input columns, Kp padded K, G = Kp / g groups per row, M tokens.
"""

from __future__ import annotations

import torch

FLOAT_FORMATS = ("f32", "bf16", "f16", "fp8")
INT_FORMATS = ("int4", "int8")
INT_GROUPS = (32, 128)
INT_SCALE_DTYPES = (torch.bfloat16, torch.float16)
INT4_MAX, INT8_MAX = 7, 127


def padded_cols(cols: int, group: int) -> int:
    """K rounded up to whole groups."""
    return -(-cols // group) * group


def _check_group(group: int) -> None:
    if group not in INT_GROUPS:
        raise ValueError(f"int group size must be one of {INT_GROUPS}, got {group}")


def _group_scales(weight: torch.Tensor, group: int, qmax: int, scale_dtype: torch.dtype):
    """weight [N, K] -> (zero-padded groups [N, G, g] float32, stored scales [N, G], their float32 values)."""
    _check_group(group)
    if scale_dtype not in INT_SCALE_DTYPES:
        raise ValueError(f"int scales must be bfloat16 or float16, got {scale_dtype}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {list(weight.shape)}")
    rows, cols = weight.shape
    kp = padded_cols(cols, group)
    padded = torch.zeros(rows, kp, dtype=torch.float32)
    padded[:, :cols] = weight.float()
    if not torch.isfinite(padded).all():
        raise ValueError("weight holds NaN or Inf; int formats cannot represent them")
    groups = padded.view(rows, kp // group, group)  # [N, G, g]
    scale = (groups.abs().amax(-1) / qmax).to(scale_dtype)  # [N, G]
    if not torch.isfinite(scale).all():
        raise ValueError(f"a group scale overflows {scale_dtype}; use bfloat16 scales")
    return groups, scale, scale.float()


def _codes(groups: torch.Tensor, scale_f32: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    safe = torch.where(scale_f32 > 0, scale_f32, torch.ones_like(scale_f32))
    q = torch.round(groups / safe[..., None])  # half to even
    q = torch.where(scale_f32[..., None] > 0, q, torch.zeros_like(q))
    return q.clamp(qmin, qmax).to(torch.int8)  # [N, G, g]


def quantize_int4(weight: torch.Tensor, group: int = 128,
                  scale_dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (packed uint8 [N, Kp/2], scales [N, Kp/g]); scale = absmax / 7 per group."""
    groups, scale, scale_f32 = _group_scales(weight, group, INT4_MAX, scale_dtype)
    q = _codes(groups, scale_f32, -8, INT4_MAX).view(weight.shape[0], -1)  # [N, Kp]
    return pack_int4(q), scale


def quantize_int8(weight: torch.Tensor, group: int = 128,
                  scale_dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (int8 [N, Kp], scales [N, Kp/g]); scale = absmax / 127 per group."""
    groups, scale, scale_f32 = _group_scales(weight, group, INT8_MAX, scale_dtype)
    return _codes(groups, scale_f32, -INT8_MAX, INT8_MAX).view(weight.shape[0], -1).contiguous(), scale


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """codes int8 [N, Kp] in [-8, 7] (Kp a multiple of 32) -> uint8 [N, Kp/2] in the kernel layout."""
    rows, kp = q.shape
    if kp % 32:
        raise ValueError(f"int4 rows must be padded to a multiple of 32 columns, got {kp}")
    u = (q.to(torch.int16) + 8).to(torch.uint8).view(rows, kp // 32, 32)  # [N, Kp/32, 32]
    return (u[..., :16] | (u[..., 16:] << 4)).reshape(rows, kp // 2).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, Kp/2] -> codes int8 [N, Kp] in [-8, 7]."""
    rows, half = packed.shape
    b = packed.view(rows, half // 16, 16)  # [N, Kp/32, 16]
    u = torch.cat([b & 0xF, b >> 4], dim=-1)  # [N, Kp/32, 32]
    return (u.to(torch.int16) - 8).to(torch.int8).reshape(rows, half * 2)


def int_codes(fmt: str, data: torch.Tensor) -> torch.Tensor:
    """The integer codes [N, Kp] of an int4/int8 matrix."""
    if fmt == "int4":
        return unpack_int4(data)
    if fmt == "int8":
        return data
    raise ValueError(f"not an int format: {fmt!r}")


def dequantize_int(fmt: str, data: torch.Tensor, scales: torch.Tensor, cols: int) -> torch.Tensor:
    """int4/int8 matrix -> float64 [N, K] (exact: code times the stored scale)."""
    q = int_codes(fmt, data).double()  # [N, Kp]
    group = q.shape[1] // scales.shape[1]
    return (q.view(q.shape[0], -1, group) * scales.double()[..., None]).view(q.shape[0], -1)[:, :cols]


def fp8_e4m3_values() -> torch.Tensor:
    """float64 [256]: the exact value of every float8_e4m3fn code (NaN for 0x7F and 0xFF), from the bits."""
    codes = torch.arange(256, dtype=torch.int64)
    exponent, mantissa = (codes >> 3) & 0xF, (codes & 0x7).double()
    normal = (1 + mantissa / 8) * torch.pow(2.0, (exponent - 7).double())
    subnormal = mantissa / 8 * 2.0 ** -6
    value = torch.where(exponent == 0, subnormal, normal)
    value = torch.where((codes & 0x7F) == 0x7F, torch.full_like(value, float("nan")), value)
    return torch.where(codes >= 128, -value, value)


def dequantize_fp8(data: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp8 codes [N, K] (float8_e4m3fn or uint8) + float32 block scales -> float64 [N, K] (exact)."""
    rows, cols = data.shape
    full = scales.double().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return fp8_values(data) * full


def fp8_values(data: torch.Tensor) -> torch.Tensor:
    """The values of fp8 e4m3fn codes (float8_e4m3fn or uint8) as float64, no scales."""
    return fp8_e4m3_values()[data.view(torch.uint8).long()]


def quantize_activations(x: torch.Tensor, padded: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x float32 [M, K] -> (codes int32 [M, Kp], scales float32 [M, Kp/g]), exactly as the int kernels do it:
    scale = amax / 127, q = rint(x * (127 / amax)) in float32 arithmetic; a group with NaN/Inf gets q = 0 and
    scale NaN."""
    rows, cols = x.shape
    xp = torch.zeros(rows, padded, dtype=torch.float32)
    xp[:, :cols] = x.float()
    groups = xp.view(rows, padded // group, group)  # [M, G, g]
    finite = torch.isfinite(groups).all(-1)  # [M, G]
    amax = torch.where(finite, groups.abs().amax(-1), torch.zeros_like(finite, dtype=torch.float32))
    inv = torch.where(amax > 0, torch.tensor(127.0, dtype=torch.float32) / amax, torch.zeros_like(amax))
    q = torch.round(torch.where(finite[..., None], groups, torch.zeros_like(groups)) * inv[..., None])
    scale = torch.where(finite, amax / torch.tensor(127.0, dtype=torch.float32), torch.full_like(amax, float("nan")))
    return q.clamp(-127, 127).to(torch.int32).view(rows, padded), scale
