"""Grouped-query attention (Qwen3-MoE with q/k RMSNorm, Mixtral with an optional sliding window) over a
paged KV cache of shape [2, num_blocks, block_size, num_kv_heads, head_dim] per layer.

Legend: T new tokens, H hidden, N query heads, Nk kv heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridmoe.config import ModelConfig
from hybridmoe.layers.linear import Linear, SharedInput
from hybridmoe.layers.paged_attention import (AttentionMetadata, attend, decode_kernel_seqs, gather_context,
                                              paged_decode, paged_prefill, prefill_kernel_applies, write_to_cache)
from hybridmoe.layers.rope import RotaryEmbedding


@dataclass
class GQAWeights:
    q_proj: Linear  # [N*D, H]
    k_proj: Linear  # [Nk*D, H]
    v_proj: Linear  # [Nk*D, H]
    o_proj: Linear  # [H, N*D]
    q_norm: torch.Tensor | None = None  # [D]
    k_norm: torch.Tensor | None = None  # [D]


class GQAttention:
    def __init__(self, config: ModelConfig, weights: GQAWeights, rope: RotaryEmbedding):
        self.cfg, self.w, self.rope = config.attention, weights, rope
        self.eps = config.rms_norm_eps
        # observe(seq, q [Q, N, D], k [C, Nk, D], scale) per sequence of every forward, q and k post-rope, q the
        # sequence's new tokens (the last Q of its C context positions); hybridmoe.kv scores prompt tokens by it
        self.observers: list = []
        self._qkv = SharedInput()  # q / k / v in one kernel call

    @staticmethod
    def cache_shape(config: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
        att = config.attention
        return (2, num_blocks, block_size, att.num_kv_heads, att.head_dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                cache: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]; writes this step's K/V into cache."""
        cfg, w = self.cfg, self.w
        num_tokens = x.shape[0]
        q, k, v = self._qkv((w.q_proj, w.k_proj, w.v_proj), x)
        q = q.view(num_tokens, cfg.num_heads, cfg.head_dim)
        k = k.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        # Qwen3's per-head q / k RMSNorms (where the model has them) go with the rotation: one kernel call each
        q, k = self.rope.apply(q, cos, sin, w.q_norm, self.eps), self.rope.apply(k, cos, sin, w.k_norm, self.eps)
        write_to_cache(cache[0], meta, k)
        write_to_cache(cache[1], meta, v)
        out = x.new_empty((num_tokens, cfg.num_heads, cfg.head_dim))
        decoded = decode_kernel_seqs(meta, cache, self.observers)  # leading one-token sequences: rows [0, decoded)
        if decoded:
            paged_decode(q[:decoded], cache[0], cache[1], meta, cfg.softmax_scale, cfg.sliding_window, out[:decoded])
            if decoded == num_tokens:
                return w.o_proj(out.view(num_tokens, -1))
        for s, rows in enumerate(meta.query_slices()):
            if s < decoded:
                continue
            if prefill_kernel_applies(meta, s, cache, self.observers):
                paged_prefill(q[rows], cache[0], cache[1], meta, s, cfg.softmax_scale, cfg.sliding_window, out[rows])
                continue
            k_ctx = gather_context(cache[0], meta.block_tables[s], meta.seq_lens[s])  # [C, Nk, D]
            v_ctx = gather_context(cache[1], meta.block_tables[s], meta.seq_lens[s])
            for observe in self.observers:
                observe(s, q[rows], k_ctx, cfg.softmax_scale)
            out[rows] = attend(q[rows], k_ctx, v_ctx, cfg.softmax_scale, cfg.sliding_window, meta.dropped_keys(s))
        return w.o_proj(out.view(num_tokens, -1))
