"""DeepSeek-V3 / R1 / Kimi-K2: MLA attention, sigmoid group-limited router with correction bias, shared
experts, dense first layers. Checkpoint names as in the official and Hugging Face checkpoints; the
multi-token-prediction layers (model.layers.{num_hidden_layers + k}) are not used for inference and are
left unread.
"""

from __future__ import annotations

from hybridmoe.config.common import common_fields
from hybridmoe.config.families.base import Family, WeightNames
from hybridmoe.config.fields import Fields
from hybridmoe.config.model_config import AttentionConfig, ModelConfig, MoEConfig
from hybridmoe.config.rope import parse_rope


def parse(f: Fields, arch: str) -> ModelConfig:
    num_layers = f.int("num_hidden_layers")
    num_heads = f.int("num_attention_heads")
    qk_nope, qk_rope = f.int("qk_nope_head_dim"), f.int("qk_rope_head_dim")
    v_head = f.int("v_head_dim")
    rope = parse_rope(f, qk_rope, interleaved=f.bool("rope_interleave", True))
    scale = (qk_nope + qk_rope) ** -0.5 * rope.softmax_mscale
    attention = AttentionConfig(
        kind="mla", num_heads=num_heads, num_kv_heads=num_heads, head_dim=qk_nope + qk_rope,
        softmax_scale=scale, bias=f.bool("attention_bias", False),
        q_lora_rank=f.int("q_lora_rank", None), kv_lora_rank=f.int("kv_lora_rank"),
        qk_nope_head_dim=qk_nope, qk_rope_head_dim=qk_rope, v_head_dim=v_head,
    )
    n_experts = f.int("n_routed_experts")
    n_group = f.int("n_group", 1)
    topk_group = f.int("topk_group", 1)
    if n_experts % n_group:
        raise f.error("n_group", f"must divide n_routed_experts ({n_experts}), got {n_group}")
    if topk_group > n_group:
        raise f.error("topk_group", f"must be <= n_group ({n_group}), got {topk_group}")
    top_k = f.int("num_experts_per_tok")
    if top_k > n_experts:
        raise f.error("num_experts_per_tok", f"must be <= n_routed_experts ({n_experts}), got {top_k}")
    moe_inter = f.int("moe_intermediate_size")
    n_shared = f.int("n_shared_experts", 0, minimum=0)
    # Official checkpoints carry scoring_func/topk_method; transformers 5 omits them: default to V3's.
    moe = MoEConfig(
        num_experts=n_experts, num_experts_per_tok=top_k, intermediate_size=moe_inter,
        num_shared_experts=n_shared, shared_intermediate_size=n_shared * moe_inter,
        scoring_func=f.choice("scoring_func", ("sigmoid", "softmax"), "sigmoid"),
        topk_method=f.choice("topk_method", ("noaux_tc", "greedy"), "noaux_tc"),
        n_group=n_group, topk_group=topk_group,
        norm_topk_prob=f.bool("norm_topk_prob", True),
        routed_scaling_factor=f.float("routed_scaling_factor", 1.0),
    )
    first_dense = f.int("first_k_dense_replace", 0, minimum=0)
    freq = f.int("moe_layer_freq", 1)
    moe_layers = tuple(i >= first_dense and i % freq == 0 for i in range(num_layers))
    return ModelConfig(
        **common_fields(f, arch), attention=attention, rope=rope, moe=moe, moe_layers=moe_layers,
        num_nextn_predict_layers=f.int("num_nextn_predict_layers", 0, minimum=0),
    )


FAMILY = Family(
    name="deepseek_v3",
    architectures=("DeepseekV3ForCausalLM",),
    model_types=("deepseek_v3", "kimi_k2"),
    parse=parse,
    weights=WeightNames(moe_prefix="mlp", expert_projections=("gate_proj", "up_proj", "down_proj"),
                        shared_experts_prefix="mlp.shared_experts"),
    packaged=(("deepseek-v3", "deepseek-r1", "deepseek-v3-0324"),
              ("kimi-k2", "kimi-k2-instruct", "kimi-k2-base")),
    tiny=dict(
        vocab_size=320, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
        topk_group=1, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, routed_scaling_factor=2.5,
        max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False,
        # official checkpoints name the routing; transformers 5 omits it unless given
        scoring_func="sigmoid", topk_method="noaux_tc",
    ),
)
