"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) over a paged cache of compressed latents.

Only the normalised latent c (kv_lora_rank L) and the rotated shared key k_pe (R dims) are cached:
[num_blocks, block_size, L + R] per layer, 576 values per token for DeepSeek-V3 instead of 2 x 128 heads x 192.
Attention runs in the latent space ("weight absorption"): the no-rope query is projected through the key
half of kv_b_proj (q_lat = W_uk^T q_nope), scores are q_lat . c + q_pe . k_pe, and the attention-weighted
latent is expanded through the value half afterwards, so the context is never decompressed.

The two absorbed products (`Absorption`) multiply each head by its own slice of kv_b_proj: W_uk^T [L, P] (transposed
once at load) and W_uv [V, L]. At decode they run on the CPU kernels (kernels.moe.matmul_heads: all heads in one
pool dispatch, near the memory bandwidth), from ABSORB_KERNEL_MAX_TOKENS tokens on and on the accelerator as one
torch bmm over the heads (`per_head`).

Legend: T new tokens, H hidden, N heads, P qk_nope dims, R rope dims, V v dims, L kv_lora_rank, C context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridmoe.config import AttentionConfig, ModelConfig
from hybridmoe.kernels.moe import MatrixHeads, matmul_heads
from hybridmoe.layers.linear import Linear, SharedInput
from hybridmoe.layers.norm import rms_norm
from hybridmoe.layers.paged_attention import (AttentionMetadata, attend, decode_kernel_seqs, gather_context,
                                              paged_decode, paged_prefill, prefill_kernel_applies, write_to_cache)
from hybridmoe.layers.rope import RotaryEmbedding


# The absorbed products on the CPU kernels below this many tokens, torch's bmm from it on: at DeepSeek-V3's shape (bf16,
# 2 threads) the kernels measured 4-8x faster than bmm at 1-4 tokens, 1.2-1.8x at 24-48, level at 56 and slower from
# 64 (docs/benchmarks.md, "MLA's absorbed products")
ABSORB_KERNEL_MAX_TOKENS = 48
KERNEL_ACTIVATIONS = (torch.float32, torch.bfloat16)


def per_head(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, N, K] times each head's own matrix w [N, K, M] -> [T, N, M] (MLA's weight absorption): one bmm over
    the heads, half the call cost of the equivalent einsum at decode's T = 1."""
    return torch.bmm(x.transpose(0, 1), w).transpose(0, 1)


def uk_transposed(kv_b: torch.Tensor, att: AttentionConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    """kv_b_proj [N*(P+V), L] -> W_uk^T [N, L, P], a copy (into `out` if given; the kernels read W's rows, and
    W_uk[n] is [P, L])."""
    N, P, V, L = att.num_heads, att.qk_nope_head_dim, att.v_head_dim, att.kv_lora_rank
    w_uk = kv_b.view(N, P + V, L)[:, :P]
    return w_uk.transpose(1, 2).contiguous() if out is None else out.copy_(w_uk.transpose(1, 2))


def uv_heads(kv_b: torch.Tensor, att: AttentionConfig) -> torch.Tensor:
    """kv_b_proj [N*(P+V), L] -> W_uv [N, V, L], a view (each head's rows contiguous already)."""
    N, P, V, L = att.num_heads, att.qk_nope_head_dim, att.v_head_dim, att.kv_lora_rank
    return kv_b.view(N, P + V, L)[:, P:]


def absorbed_layout(kv_b: torch.Tensor, att: AttentionConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    """kv_b_proj [N*(P+V), L] -> both per-head matrices in one tensor [N, L*(P+V)] (new, or `out`): W_uk^T [L, P] then
    W_uv [V, L] per head (`split_absorbed` views them), the size of kv_b_proj, which need not be kept."""
    N, P, V, L = att.num_heads, att.qk_nope_head_dim, att.v_head_dim, att.kv_lora_rank
    both = torch.empty(N, L * (P + V), dtype=kv_b.dtype) if out is None else out
    w_uk_t, w_uv = split_absorbed(both, att)
    uk_transposed(kv_b, att, w_uk_t)
    w_uv.copy_(uv_heads(kv_b, att))
    return both


def split_absorbed(both: torch.Tensor, att: AttentionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """absorbed_layout's [N, L*(P+V)] -> (W_uk^T [N, L, P], W_uv [N, V, L]), views."""
    N, P, V, L = att.num_heads, att.qk_nope_head_dim, att.v_head_dim, att.kv_lora_rank
    return both[:, : L * P].view(N, L, P), both[:, L * P:].view(N, V, L)


class Absorption:
    """MLA's two products with kv_b_proj, per head: `query` q_nope [T, N, P] -> q_lat [T, N, L] through W_uk, and
    `values` out_lat [T, N, L] -> [T, N, V] through W_uv. Below ABSORB_KERNEL_MAX_TOKENS tokens with float32 or bf16
    activations on the CPU kernels (matmul_heads: every head in one pool dispatch); from there on, for other dtypes,
    and with kernels=False (weights on the accelerator) torch's bmm over the heads (`per_head`)."""

    def __init__(self, w_uk_t: torch.Tensor, w_uv: torch.Tensor, kernels: bool = True):
        self.w_uk_t, self.w_uv = w_uk_t, w_uv  # [N, L, P], [N, V, L]
        self.w_uk, self.w_uv_t = w_uk_t.transpose(1, 2), w_uv.transpose(1, 2)  # bmm's [N, P, L], [N, L, V] (views)
        self.uk = self.uv = None
        if kernels and w_uk_t.device.type == "cpu":  # the kernel matrices are views of the same tensors
            self.uk, self.uv = MatrixHeads.dense(w_uk_t, "W_uk^T"), MatrixHeads.dense(w_uv, "W_uv")

    @staticmethod
    def _product(x: torch.Tensor, heads: MatrixHeads | None, w: torch.Tensor,
                 out: torch.Tensor | None) -> torch.Tensor:
        if heads is not None and x.shape[0] < ABSORB_KERNEL_MAX_TOKENS and x.dtype in KERNEL_ACTIVATIONS:
            return matmul_heads(heads, x, out, out_dtype=x.dtype)
        y = per_head(x, w)
        return y if out is None else out.copy_(y)

    def query(self, q_nope: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """q_nope [T, N, P] (a view of q, any strides) -> q_lat [T, N, L], into `out` (a view of [T, N, L+R]) if
        given."""
        return self._product(q_nope, self.uk, self.w_uk, out)

    def values(self, out_lat: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """out_lat [T, N, L] -> [T, N, V]."""
        return self._product(out_lat, self.uv, self.w_uv_t, out)


@dataclass
class MLAWeights:
    kv_a_proj: Linear  # [L+R, H]
    kv_a_norm: torch.Tensor  # [L]
    w_uk_t: torch.Tensor  # [N, L, P]: kv_b_proj's key half per head, transposed (Absorption)
    w_uv: torch.Tensor  # [N, V, L]: kv_b_proj's value half per head
    o_proj: Linear  # [H, N*V]
    q_proj: Linear | None = None  # [N*(P+R), H] when q_lora_rank is null
    q_a_proj: Linear | None = None  # [Lq, H]
    q_a_norm: torch.Tensor | None = None  # [Lq]
    q_b_proj: Linear | None = None  # [N*(P+R), Lq]


class MLAttention:
    def __init__(self, config: ModelConfig, weights: MLAWeights, rope: RotaryEmbedding):
        self.cfg, self.w, self.rope = config.attention, weights, rope
        self.eps = config.rms_norm_eps
        self.absorption = Absorption(weights.w_uk_t, weights.w_uv)  # models/placement replaces it when placed
        # observe(seq, q [Q, N, L+R], k [C, 1, L+R], scale) per sequence of every forward: the absorbed queries and
        # the cached latents, whose products are the attention logits; hybridmoe.kv scores prompt tokens by it
        self.observers: list = []
        self._from_x = SharedInput()  # the query's first projection and kv_a in one kernel call

    @staticmethod
    def cache_shape(config: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
        att = config.attention
        return (num_blocks, block_size, att.kv_lora_rank + att.qk_rope_head_dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                cache: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]; writes this step's latents into cache."""
        cfg, w = self.cfg, self.w
        num_tokens, lora = x.shape[0], cfg.kv_lora_rank
        q, kv = self._from_x((w.q_proj if w.q_proj is not None else w.q_a_proj, w.kv_a_proj), x)  # kv [T, L+R]
        if w.q_proj is None:
            q = w.q_b_proj(rms_norm(q, w.q_a_norm, self.eps))
        q = q.view(num_tokens, cfg.num_heads, cfg.head_dim)
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)  # [T, N, P], [T, N, R]
        latent = rms_norm(kv[:, :lora], w.kv_a_norm, self.eps)  # [T, L]
        k_pe = kv[:, None, lora:]  # [T, 1, R]
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        q_pe, k_pe = self.rope.apply(q_pe, cos, sin), self.rope.apply(k_pe, cos, sin)
        write_to_cache(cache, meta, torch.cat((latent, k_pe[:, 0]), dim=-1))

        q_full = torch.empty(num_tokens, cfg.num_heads, lora + cfg.qk_rope_head_dim, dtype=x.dtype, device=x.device)
        self.absorption.query(q_nope, out=q_full[..., :lora])  # q_lat [T, N, L]
        q_full[..., lora:] = q_pe  # [T, N, L+R]
        out_lat = torch.empty(num_tokens, cfg.num_heads, lora, dtype=x.dtype, device=x.device)
        decoded = decode_kernel_seqs(meta, cache, self.observers)  # leading one-token sequences: rows [0, decoded)
        # one shared KV head: the latent + rope key as K, its first L columns as V (views, no copy)
        latents = cache[:, :, None, :]  # [NB, BS, 1, L+R]
        if decoded:
            paged_decode(q_full[:decoded], latents, latents[..., :lora], meta, cfg.softmax_scale, None,
                         out_lat[:decoded])
        for s, rows in enumerate(meta.query_slices()):
            if s < decoded:
                continue
            if prefill_kernel_applies(meta, s, cache, self.observers):
                paged_prefill(q_full[rows], latents, latents[..., :lora], meta, s, cfg.softmax_scale, None,
                              out_lat[rows])
                continue
            ctx = gather_context(cache, meta.block_tables[s], meta.seq_lens[s])[:, None, :]  # [C, 1, L+R]
            for observe in self.observers:
                observe(s, q_full[rows], ctx, cfg.softmax_scale)
            out_lat[rows] = attend(q_full[rows], ctx, ctx[..., :lora], cfg.softmax_scale, None, meta.dropped_keys(s))
        out = self.absorption.values(out_lat)  # [T, N, V]
        return w.o_proj(out.reshape(num_tokens, -1))
