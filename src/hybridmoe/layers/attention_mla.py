"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) over a paged cache of compressed latents.

Only the normalised latent c (kv_lora_rank L) and the rotated shared key k_pe (R dims) are cached:
[num_blocks, block_size, L + R] per layer, 576 values per token for DeepSeek-V3 instead of 2 x 128 heads x 192.
Attention runs in the latent space ("weight absorption"): the no-rope query is projected through the key
half of kv_b_proj (q_lat = W_uk^T q_nope), scores are q_lat . c + q_pe . k_pe, and the attention-weighted
latent is expanded through the value half afterwards, so the context is never decompressed.

Legend: T new tokens, H hidden, N heads, P qk_nope dims, R rope dims, V v dims, L kv_lora_rank, C context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridmoe.config import ModelConfig
from hybridmoe.layers.linear import Linear
from hybridmoe.layers.norm import rms_norm
from hybridmoe.layers.paged_attention import (AttentionMetadata, attend, decode_kernel_seqs, gather_context,
                                              paged_decode, write_to_cache)
from hybridmoe.layers.rope import RotaryEmbedding


def per_head(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, N, K] times each head's own matrix w [N, K, M] -> [T, N, M] (MLA's weight absorption): one bmm over
    the heads, half the call cost of the equivalent einsum at decode's T = 1."""
    return torch.bmm(x.transpose(0, 1), w).transpose(0, 1)


@dataclass
class MLAWeights:
    kv_a_proj: Linear  # [L+R, H]
    kv_a_norm: torch.Tensor  # [L]
    kv_b_proj: torch.Tensor  # [N*(P+V), L]: absorbed per head into the query and the output (per_head)
    o_proj: Linear  # [H, N*V]
    q_proj: Linear | None = None  # [N*(P+R), H] when q_lora_rank is null
    q_a_proj: Linear | None = None  # [Lq, H]
    q_a_norm: torch.Tensor | None = None  # [Lq]
    q_b_proj: Linear | None = None  # [N*(P+R), Lq]


class MLAttention:
    def __init__(self, config: ModelConfig, weights: MLAWeights, rope: RotaryEmbedding):
        self.cfg, self.w, self.rope = config.attention, weights, rope
        self.eps = config.rms_norm_eps
        cfg = self.cfg
        kv_b = weights.kv_b_proj.view(cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        self.w_uk = kv_b[:, : cfg.qk_nope_head_dim]  # [N, P, L]
        self.w_uv = kv_b[:, cfg.qk_nope_head_dim:]  # [N, V, L]
        # observe(seq, q [Q, N, L+R], k [C, 1, L+R], scale) per sequence of every forward: the absorbed queries and
        # the cached latents, whose products are the attention logits; hybridmoe.kv scores prompt tokens by it
        self.observers: list = []

    @staticmethod
    def cache_shape(config: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
        att = config.attention
        return (num_blocks, block_size, att.kv_lora_rank + att.qk_rope_head_dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                cache: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]; writes this step's latents into cache."""
        cfg, w = self.cfg, self.w
        num_tokens, lora = x.shape[0], cfg.kv_lora_rank
        if w.q_proj is not None:
            q = w.q_proj(x)
        else:
            q = w.q_b_proj(rms_norm(w.q_a_proj(x), w.q_a_norm, self.eps))
        q = q.view(num_tokens, cfg.num_heads, cfg.head_dim)
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)  # [T, N, P], [T, N, R]
        kv = w.kv_a_proj(x)  # [T, L+R]
        latent = rms_norm(kv[:, :lora], w.kv_a_norm, self.eps)  # [T, L]
        k_pe = kv[:, None, lora:]  # [T, 1, R]
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        q_pe, k_pe = self.rope.apply(q_pe, cos, sin), self.rope.apply(k_pe, cos, sin)
        write_to_cache(cache, meta.slot_mapping, torch.cat((latent, k_pe[:, 0]), dim=-1))

        q_lat = per_head(q_nope, self.w_uk)  # [T, N, L]
        q_full = torch.cat((q_lat, q_pe), dim=-1)  # [T, N, L+R]
        out_lat = torch.empty(num_tokens, cfg.num_heads, lora, dtype=x.dtype, device=x.device)
        decoded = decode_kernel_seqs(meta, cache, self.observers)  # leading one-token sequences: rows [0, decoded)
        if decoded:  # one shared KV head: the latent + rope key as K, its first L columns as V (views, no copy)
            latents = cache[:, :, None, :]  # [NB, BS, 1, L+R]
            paged_decode(q_full[:decoded], latents, latents[..., :lora], meta, cfg.softmax_scale, None,
                         out_lat[:decoded])
        for s, rows in enumerate(meta.query_slices()):
            if s < decoded:
                continue
            ctx = gather_context(cache, meta.block_tables[s], meta.seq_lens[s])[:, None, :]  # [C, 1, L+R]
            for observe in self.observers:
                observe(s, q_full[rows], ctx, cfg.softmax_scale)
            out_lat[rows] = attend(q_full[rows], ctx, ctx[..., :lora], cfg.softmax_scale, None, meta.dropped_keys(s))
        out = per_head(out_lat, self.w_uv.transpose(1, 2))  # [T, N, V]
        return w.o_proj(out.reshape(num_tokens, -1))
