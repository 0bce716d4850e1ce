"""Mixtral: GQA (optional sliding window), softmax top-k over num_local_experts renormalised, every layer MoE;
experts named block_sparse_moe.experts.N.w1 (gate), w3 (up), w2 (down)."""

from __future__ import annotations

from hybridmoe.config.attention import gqa_attention
from hybridmoe.config.common import common_fields
from hybridmoe.config.families.base import Family, WeightNames
from hybridmoe.config.fields import Fields
from hybridmoe.config.model_config import ModelConfig, MoEConfig
from hybridmoe.config.rope import parse_rope


def parse(f: Fields, arch: str) -> ModelConfig:
    attention, head_dim = gqa_attention(f, qk_norm=False, sliding_window=f.int("sliding_window", None))
    n_experts = f.int("num_local_experts")
    top_k = f.int("num_experts_per_tok")
    if top_k > n_experts:
        raise f.error("num_experts_per_tok", f"must be <= num_local_experts ({n_experts}), got {top_k}")
    inter = f.int("intermediate_size")
    moe = MoEConfig(num_experts=n_experts, num_experts_per_tok=top_k, intermediate_size=inter,
                    scoring_func="softmax", topk_method="greedy", norm_topk_prob=True)
    num_layers = f.int("num_hidden_layers")
    return ModelConfig(**common_fields(f, arch), attention=attention, rope=parse_rope(f, head_dim, False), moe=moe,
                       moe_layers=(True,) * num_layers)


FAMILY = Family(
    name="mixtral",
    architectures=("MixtralForCausalLM",),
    model_types=("mixtral",),
    parse=parse,
    weights=WeightNames(moe_prefix="block_sparse_moe", expert_projections=("w1", "w3", "w2")),
    packaged=(("mixtral-8x7b", "mixtral-8x7b-v0.1", "mixtral-8x7b-instruct-v0.1"),),
    tiny=dict(
        vocab_size=320, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=512,
        rope_theta=10000.0, sliding_window=None, tie_word_embeddings=False,
    ),
)
