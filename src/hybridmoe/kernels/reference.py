"""Float64 references of the kernels: dequantised matmul per format and the routed-expert MoE.

Legend: T tokens, H hidden, K top-k, I intermediate, N output rows, Kw input columns, M tokens.
"""

from __future__ import annotations

import torch

from hybridmoe.kernels import formats


def dequantize(fmt: str, data: torch.Tensor, scales: torch.Tensor | None = None, *, cols: int | None = None,
               block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """Any kernel weight format -> float64 [N, Kw]."""
    if fmt in ("f32", "bf16", "f16", "dense"):
        return data.double()
    if fmt == "fp8":
        return formats.dequantize_fp8(data, scales, block)
    if fmt in formats.INT_FORMATS:
        if cols is None:
            raise ValueError("int formats need the logical column count `cols`")
        return formats.dequantize_int(fmt, data, scales, cols)
    raise ValueError(f"unknown weight format {fmt!r}")


def int_matmul_reference(fmt: str, data: torch.Tensor, scales: torch.Tensor, cols: int,
                         x: torch.Tensor) -> torch.Tensor:
    """What the int kernels compute, in float64: x [M, Kw] quantised per group as the kernels do, exact
    integer group sums, scaled by weight and activation scales -> [M, N]."""
    codes = formats.int_codes(fmt, data).long()  # [N, Kp]
    rows, kp = codes.shape
    group = kp // scales.shape[1]
    xq, xs = formats.quantize_activations(x, kp, group)  # [M, Kp], [M, G]
    sums = torch.einsum("ngk,mgk->mng", codes.view(rows, -1, group), xq.long().view(x.shape[0], -1, group))
    return (sums.double() * scales.double()[None] * xs.double()[:, None, :]).sum(-1)  # [M, N]


def bf16_dot_matmul(x: torch.Tensor, fmt: str, data: torch.Tensor, scales: torch.Tensor | None = None,
                    block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """What the bf16 dot-product kernels (ISAs avx512bf16, avx2bf16; GEMV path) compute, in float64, with the
    size of its terms: (x @ W^T, |x| @ |W|^T) [M, N] where for bf16 weights x is rounded to bf16, and for fp8
    the codes' values multiply x * (the block's scale) rounded to bf16 per (row block, column block), the
    product taken in float32 as the kernels do."""
    if fmt == "bf16":
        xe, w = x.float().bfloat16().double(), data.double()  # [M, K], [N, K]
        return xe @ w.T, xe.abs() @ w.abs().T
    if fmt != "fp8":
        raise ValueError(f"the bf16 dot-product kernels take bf16 and fp8 weights, not {fmt!r}")
    values = formats.fp8_values(data)  # [N, K]
    rows, cols = values.shape
    column_scales = scales.float().repeat_interleave(block[1], 1)[:, :cols]  # [N / b0, K]
    out = torch.empty(x.shape[0], rows, dtype=torch.float64)
    size = torch.empty_like(out)
    for rb in range(scales.shape[0]):
        r = slice(rb * block[0], min(rows, (rb + 1) * block[0]))
        xe = (x.float() * column_scales[rb]).bfloat16().double()  # [M, K]
        out[:, r], size[:, r] = xe @ values[r].T, xe.abs() @ values[r].abs().T
    return out, size


def matmul_heads(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """moe.matmul_heads in float64, with the size of its terms: x [T, N, K], per-head weights w [N, M, K] ->
    (x[t, n] @ W_n^T, |x[t, n]| @ |W_n|^T) [T, N, M]."""
    x, w = x.double(), w.double()
    return torch.einsum("tnk,nmk->tnm", x, w), torch.einsum("tnk,nmk->tnm", x.abs(), w.abs())


def silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1 + torch.exp(-x))


def moe_reference(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  experts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """float64 [T, H]: sum_k w[t, k] * down_e(silu(gate_e x_t) * up_e x_t), grouped by expert.

    experts: per expert (gate [I, H], up [I, H], down [H, I]) as float64 (see `dequantize`)."""
    x = hidden.double()  # [T, H]
    out = torch.zeros_like(x)
    for e in topk_ids.unique().tolist():
        token, slot = (topk_ids == e).nonzero(as_tuple=True)  # the (t, k) pairs routed to e
        gate, up, down = experts[e]
        h = silu(x[token] @ gate.T) * (x[token] @ up.T)  # [n, I]
        out.index_add_(0, token, (h @ down.T) * topk_weights[token, slot].double()[:, None])
    return out


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens, scale: float, window: int | None = None) -> torch.Tensor:
    """Float64 reference of kernels.attention.decode_attention: q [S, N, D], caches [NB, BS, Nk, D / Dv] -> [S, N, Dv].
    Gathers each sequence's context and repeats its KV heads, the plain way."""
    num_seqs, num_heads, _ = q.shape
    block_size, num_kv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(num_seqs, num_heads, v_cache.shape[-1], dtype=torch.float64)
    for s in range(num_seqs):
        ctx = int(seq_lens[s])
        blocks = block_tables[s, : -(-ctx // block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:ctx].double()  # [C, Nk, D]
        v = v_cache[blocks].flatten(0, 1)[:ctx].double()  # [C, Nk, Dv]
        if window:
            k, v = k[-window:], v[-window:]
        k = k.repeat_interleave(num_heads // num_kv, dim=1)  # [C, N, D]
        v = v.repeat_interleave(num_heads // num_kv, dim=1)
        scores = torch.einsum("nd,cnd->nc", q[s].double(), k) * scale
        out[s] = torch.einsum("nc,cnv->nv", torch.softmax(scores, dim=-1), v)
    return out
