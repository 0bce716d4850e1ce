"""Each attention kind loaded from Hugging Face checkpoint names: `attention_kind(config)` gives the builder of
one layer's attention and the shape of its KV cache. MLA (DeepSeek-V3's latent attention) and GQA
(grouped-query: Qwen3-MoE, Mixtral) are built here; a family whose config says one of these kinds
(`config.attention.kind`) gets its attention for free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from hybridmoe.config import AttentionConfig, ModelConfig
from hybridmoe.layers.attention_gqa import GQAttention, GQAWeights
from hybridmoe.layers.attention_mla import (MLAttention, MLAWeights, absorbed_layout, split_absorbed, uk_transposed,
                                            uv_heads)
from hybridmoe.layers.paged_attention import AttentionMetadata
from hybridmoe.layers.rope import RotaryEmbedding
from hybridmoe.models.transformed_weights import PrivateWeights
from hybridmoe.models.weight_loader import WeightLoader


class Attention(Protocol):
    observers: list  # observe(seq, q, k, scale) per sequence of every forward (MoEDecoderModel.add_attention_observer)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                cache: torch.Tensor) -> torch.Tensor: ...


def _absorbed_kv_b(loader: WeightLoader, name: str, att: AttentionConfig) -> dict[str, torch.Tensor]:
    """kv_b_proj [N*(P+V), L] as MLAWeights' w_uk_t [N, L, P] and w_uv [N, V, L] (attention_mla.Absorption), made at
    load through `loader.derived` (once for serve --pd's workers), holding no more than kv_b_proj did. Converted or
    dequantised into this process's own memory: both halves into one tensor its size and the converted kv_b_proj
    dropped. A view of the mapped checkpoint (or kept in the workers' shared segment anyway): W_uv stays a view of
    it and W_uk^T is the one copy (the checkpoint's W_uk half is no longer read after load)."""
    N, P, V, L = att.num_heads, att.qk_nope_head_dim, att.v_head_dim, att.kv_lora_rank
    kv_b, dtype = loader.dense(name, (N * (P + V), L)), loader.dtype
    suffix = str(dtype).removeprefix("torch.")
    if loader.reader.entry(name).dtype != dtype and isinstance(loader.transformed, PrivateWeights):
        both = loader.derived(f"{name}:absorbed:{suffix}", (N, L * (P + V)), dtype,
                              lambda out: absorbed_layout(kv_b, att, out))
        w_uk_t, w_uv = split_absorbed(both, att)
    else:
        w_uk_t = loader.derived(f"{name}:uk_t:{suffix}", (N, L, P), dtype, lambda out: uk_transposed(kv_b, att, out))
        w_uv = uv_heads(kv_b, att)
    return {"w_uk_t": w_uk_t, "w_uv": w_uv}


def build_mla(loader: WeightLoader, prefix: str, config: ModelConfig, rope: RotaryEmbedding) -> MLAttention:
    att, hidden = config.attention, config.hidden_size
    heads, qk_dim = att.num_heads, att.qk_nope_head_dim + att.qk_rope_head_dim
    lora, rope_dim = att.kv_lora_rank, att.qk_rope_head_dim
    bias = (lambda name: prefix + name) if att.bias else (lambda name: None)
    weights = MLAWeights(
        kv_a_proj=loader.linear(prefix + "kv_a_proj_with_mqa.weight", (lora + rope_dim, hidden),
                                bias("kv_a_proj_with_mqa.bias")),
        kv_a_norm=loader.dense(prefix + "kv_a_layernorm.weight", (lora,)),
        **_absorbed_kv_b(loader, prefix + "kv_b_proj.weight", att),
        o_proj=loader.linear(prefix + "o_proj.weight", (hidden, heads * att.v_head_dim), bias("o_proj.bias")),
    )
    if att.q_lora_rank is None:
        weights.q_proj = loader.linear(prefix + "q_proj.weight", (heads * qk_dim, hidden))
    else:
        q_lora = att.q_lora_rank
        weights.q_a_proj = loader.linear(prefix + "q_a_proj.weight", (q_lora, hidden), bias("q_a_proj.bias"))
        weights.q_a_norm = loader.dense(prefix + "q_a_layernorm.weight", (q_lora,))
        weights.q_b_proj = loader.linear(prefix + "q_b_proj.weight", (heads * qk_dim, q_lora))
    return MLAttention(config, weights, rope)


def build_gqa(loader: WeightLoader, prefix: str, config: ModelConfig, rope: RotaryEmbedding) -> GQAttention:
    att, hidden = config.attention, config.hidden_size
    q_dim, kv_dim = att.num_heads * att.head_dim, att.num_kv_heads * att.head_dim
    bias = (lambda name: prefix + name) if att.bias else (lambda name: None)
    weights = GQAWeights(
        q_proj=loader.linear(prefix + "q_proj.weight", (q_dim, hidden), bias("q_proj.bias")),
        k_proj=loader.linear(prefix + "k_proj.weight", (kv_dim, hidden), bias("k_proj.bias")),
        v_proj=loader.linear(prefix + "v_proj.weight", (kv_dim, hidden), bias("v_proj.bias")),
        o_proj=loader.linear(prefix + "o_proj.weight", (hidden, q_dim)),
    )
    if att.qk_norm:
        weights.q_norm = loader.dense(prefix + "q_norm.weight", (att.head_dim,))
        weights.k_norm = loader.dense(prefix + "k_norm.weight", (att.head_dim,))
    return GQAttention(config, weights, rope)


@dataclass(frozen=True)
class AttentionKind:
    """How the decoder builds one attention kind and sizes its cache."""

    build: Callable[[WeightLoader, str, ModelConfig, RotaryEmbedding], Attention]  # (loader, prefix, config, rope)
    cache_shape: Callable[[ModelConfig, int, int], tuple[int, ...]]  # (config, num_blocks, block_size)


ATTENTION_KINDS: dict[str, AttentionKind] = {
    "mla": AttentionKind(build_mla, MLAttention.cache_shape),
    "gqa": AttentionKind(build_gqa, GQAttention.cache_shape),
}


def attention_kind(config: ModelConfig) -> AttentionKind:
    kind = config.attention.kind
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"{config.source or config.architecture}: attention kind {kind!r} is not built here; "
                         f"built: {', '.join(ATTENTION_KINDS)}")
    return ATTENTION_KINDS[kind]
