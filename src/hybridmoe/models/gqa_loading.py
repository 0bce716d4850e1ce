"""Loading grouped-query attention weights (Qwen3-MoE, Mixtral) from Hugging Face checkpoint names."""

from __future__ import annotations

from hybridmoe.config import ModelConfig
from hybridmoe.layers.attention_gqa import GQAttention, GQAWeights
from hybridmoe.layers.rope import RotaryEmbedding
from hybridmoe.models.weight_loader import WeightLoader


def build_gqa(loader: WeightLoader, prefix: str, config: ModelConfig, rope: RotaryEmbedding) -> GQAttention:
    att, hidden = config.attention, config.hidden_size
    q_dim, kv_dim = att.num_heads * att.head_dim, att.num_kv_heads * att.head_dim
    weights = GQAWeights(
        q_proj=loader.dense(prefix + "q_proj.weight", (q_dim, hidden)),
        k_proj=loader.dense(prefix + "k_proj.weight", (kv_dim, hidden)),
        v_proj=loader.dense(prefix + "v_proj.weight", (kv_dim, hidden)),
        o_proj=loader.dense(prefix + "o_proj.weight", (hidden, q_dim)),
    )
    if att.bias:
        weights.q_bias = loader.dense(prefix + "q_proj.bias", (q_dim,))
        weights.k_bias = loader.dense(prefix + "k_proj.bias", (kv_dim,))
        weights.v_bias = loader.dense(prefix + "v_proj.bias", (kv_dim,))
    if att.qk_norm:
        weights.q_norm = loader.dense(prefix + "q_norm.weight", (att.head_dim,))
        weights.k_norm = loader.dense(prefix + "k_norm.weight", (att.head_dim,))
    return GQAttention(config, weights, rope)
