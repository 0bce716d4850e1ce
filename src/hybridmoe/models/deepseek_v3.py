"""DeepSeek-V3 / R1 / Kimi-K2: MLA attention, sigmoid group-limited router with correction bias, shared
experts, dense first layers. Checkpoint names as in the official and Hugging Face checkpoints; the
multi-token-prediction layers (model.layers.{num_hidden_layers + k}) are not used for inference and are
left unread.
"""

from __future__ import annotations

from hybridmoe.config import ModelConfig
from hybridmoe.layers.attention_mla import MLAttention, MLAWeights
from hybridmoe.layers.rope import RotaryEmbedding
from hybridmoe.models.decoder import ArchSpec
from hybridmoe.models.weight_loader import WeightLoader


def build_mla(loader: WeightLoader, prefix: str, config: ModelConfig, rope: RotaryEmbedding) -> MLAttention:
    att, hidden = config.attention, config.hidden_size
    heads, qk_dim = att.num_heads, att.qk_nope_head_dim + att.qk_rope_head_dim
    lora, rope_dim = att.kv_lora_rank, att.qk_rope_head_dim
    bias = loader.dense if att.bias else (lambda name, shape: None)
    weights = MLAWeights(
        kv_a_proj=loader.dense(prefix + "kv_a_proj_with_mqa.weight", (lora + rope_dim, hidden)),
        kv_a_bias=bias(prefix + "kv_a_proj_with_mqa.bias", (lora + rope_dim,)),
        kv_a_norm=loader.dense(prefix + "kv_a_layernorm.weight", (lora,)),
        kv_b_proj=loader.dense(prefix + "kv_b_proj.weight", (heads * (att.qk_nope_head_dim + att.v_head_dim), lora)),
        o_proj=loader.dense(prefix + "o_proj.weight", (hidden, heads * att.v_head_dim)),
        o_bias=bias(prefix + "o_proj.bias", (hidden,)),
    )
    if att.q_lora_rank is None:
        weights.q_proj = loader.dense(prefix + "q_proj.weight", (heads * qk_dim, hidden))
    else:
        q_lora = att.q_lora_rank
        weights.q_a_proj = loader.dense(prefix + "q_a_proj.weight", (q_lora, hidden))
        weights.q_a_bias = bias(prefix + "q_a_proj.bias", (q_lora,))
        weights.q_a_norm = loader.dense(prefix + "q_a_layernorm.weight", (q_lora,))
        weights.q_b_proj = loader.dense(prefix + "q_b_proj.weight", (heads * qk_dim, q_lora))
    return MLAttention(config, weights, rope)


SPEC = ArchSpec(
    moe_prefix="mlp",
    expert_proj_names=("gate_proj", "up_proj", "down_proj"),
    shared_experts_prefix="mlp.shared_experts",
    build_attention=build_mla,
    cache_shape=MLAttention.cache_shape,
)
