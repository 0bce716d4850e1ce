"""Random weight builders shared by the kernel tests (imported by name: pytest puts this folder on sys.path)."""

from __future__ import annotations

import zlib

import torch

from hybridmoe.kernels import formats


def random_fp8(rows: int, cols: int, block: tuple[int, int], gen: torch.Generator,
               subnormal_only: bool = False, normal_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Random e4m3fn codes (no NaN codes) [rows, cols] and float32 block scales of varied magnitude."""
    codes = torch.randint(0, 256, (rows, cols), generator=gen, dtype=torch.int64)
    if subnormal_only:
        codes = codes & 0x87  # exponent bits 0: zero or subnormal
    if normal_only:
        codes = torch.where((codes & 0x78) == 0, codes | 0x08, codes)  # exponent >= 1
    codes = torch.where((codes & 0x7F) == 0x7F, codes ^ 0x01, codes)  # 0x7F/0xFF -> 0x7E/0xFE
    nr, nc = -(-rows // block[0]), -(-cols // block[1])
    scales = torch.pow(2.0, torch.empty(nr, nc).uniform_(-12, 3, generator=gen)).float()
    return codes.to(torch.uint8).view(torch.float8_e4m3fn), scales


def random_int(fmt: str, rows: int, cols: int, group: int, scale_dtype: torch.dtype, gen: torch.Generator):
    """A random matrix quantised to int4/int8 -> (data, scales)."""
    w = torch.randn(rows, cols, generator=gen) * torch.empty(rows, 1).uniform_(0.1, 3, generator=gen)
    quantize = formats.quantize_int4 if fmt == "int4" else formats.quantize_int8
    return quantize(w, group, scale_dtype)


def amx_int_reference(fmt: str, data: torch.Tensor, scales: torch.Tensor, cols: int, x: torch.Tensor) -> torch.Tensor:
    """What the AMX tiles compute for int weights, in float64: activations and code x scale rounded to bf16."""
    w = formats.dequantize_int(fmt, data, scales, cols).to(torch.bfloat16).double()
    return x.to(torch.bfloat16).double() @ w.T


def random_experts(fmt: str, num_experts: int, hidden: int, inter: int, gen: torch.Generator,
                   group: int = 32, scale_dtype: torch.dtype = torch.bfloat16, block=(128, 128)):
    """Random routed experts in `fmt` -> (FusedMoE keyword arguments, float64 (gate, up, down) per expert)."""
    from hybridmoe.kernels import reference

    tensors = {"gate": [], "up": [], "down": []}
    scales = {"gate": [], "up": [], "down": []}
    exact = []
    for _ in range(num_experts):
        expert = []
        for name, (rows, cols) in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
            w = torch.randn(rows, cols, generator=gen) * cols ** -0.5
            if fmt in ("f32", "bf16", "f16"):
                data, scale = w.to({"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[fmt]), None
            elif fmt == "fp8":
                data, scale = random_fp8(rows, cols, block, gen)
                scale = scale * cols ** -0.5 / 50
            else:
                data, scale = random_int(fmt, rows, cols, group, scale_dtype, gen)
            tensors[name].append(data)
            scales[name].append(scale)
            expert.append(reference.dequantize(fmt, data, scale, cols=cols, block=block))
        exact.append(tuple(expert))
    kwargs = dict(fmt=fmt, gate=tensors["gate"], up=tensors["up"], down=tensors["down"],
                  hidden_size=hidden, intermediate_size=inter, block=block)
    if scales["gate"][0] is not None:
        kwargs.update(gate_scale=scales["gate"], up_scale=scales["up"], down_scale=scales["down"])
    return kwargs, exact


def random_routing(tokens: int, top_k: int, num_experts: int, gen: torch.Generator):
    """topk_ids [T, K] (distinct experts per token) and positive float32 weights [T, K]."""
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen) + 0.1
    return ids, weights / weights.sum(-1, keepdim=True)


def bf16_activation_tolerance(fmt: str, path: str = "auto") -> float:
    """Extra error allowed, relative to the largest output, where the active ISA rounds the activations of bf16
    and fp8 weights to bf16 on `path` (bf16 dot products on the GEMV path: avx512bf16, avx2bf16; AMX tiles: amx),
    as for bf16 hidden states: measured up to 0.003 at test_moe's shapes; the kernels themselves are checked
    exactly in test_matmul_float."""
    from hybridmoe.kernels import isa

    rounds = isa.amx() or (isa.bf16_dot() and path != "gemm")
    return 1e-2 if rounds and fmt in ("bf16", "fp8") else 0.0


def seed(*parts) -> int:
    """A generator seed from a test's parameters, the same in every process (hash() of str is not)."""
    return zlib.crc32(repr(parts).encode())
