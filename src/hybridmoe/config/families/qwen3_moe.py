"""Qwen3-MoE: GQA with per-head q/k RMSNorm, softmax top-k router, no shared experts; dense MLP layers where
decoder_sparse_step / mlp_only_layers say so."""

from __future__ import annotations

from hybridmoe.config.attention import gqa_attention
from hybridmoe.config.common import common_fields
from hybridmoe.config.families.base import Family, WeightNames
from hybridmoe.config.fields import Fields
from hybridmoe.config.model_config import ModelConfig, MoEConfig
from hybridmoe.config.rope import parse_rope


def parse(f: Fields, arch: str) -> ModelConfig:
    use_sw = f.bool("use_sliding_window", False)
    attention, head_dim = gqa_attention(f, qk_norm=True,
                                        sliding_window=f.int("sliding_window", None) if use_sw else None)
    # official checkpoints write num_experts; transformers 5 writes num_local_experts
    n_experts = f.int("num_experts") if "num_experts" in f.raw else f.int("num_local_experts")
    top_k = f.int("num_experts_per_tok")
    if top_k > n_experts:
        raise f.error("num_experts_per_tok", f"must be <= num_experts ({n_experts}), got {top_k}")
    moe = MoEConfig(
        num_experts=n_experts, num_experts_per_tok=top_k,
        intermediate_size=f.int("moe_intermediate_size"),
        scoring_func="softmax", topk_method="greedy", norm_topk_prob=f.bool("norm_topk_prob", False),
    )
    num_layers = f.int("num_hidden_layers")
    step = f.int("decoder_sparse_step", 1)
    mlp_only = set(f.raw.get("mlp_only_layers") or [])
    moe_layers = tuple(i not in mlp_only and (i + 1) % step == 0 for i in range(num_layers))
    return ModelConfig(**common_fields(f, arch), attention=attention, rope=parse_rope(f, head_dim, False), moe=moe,
                       moe_layers=moe_layers)


FAMILY = Family(
    name="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    model_types=("qwen3_moe",),
    parse=parse,
    weights=WeightNames(moe_prefix="mlp", expert_projections=("gate_proj", "up_proj", "down_proj")),
    packaged=(("qwen3-235b-a22b",), ("qwen3-30b-a3b",)),
    tiny=dict(
        vocab_size=320, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=512,
        rope_theta=10000.0, tie_word_embeddings=False,
    ),
)
