"""The normalised configuration: frozen dataclasses in one vocabulary for every family.

Layers, the planner and the runtime read only these, never raw Hugging Face fields; each family's parser
(config/families/) fills them in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rotary_dim: int  # how many leading dims of each q/k head are rotated
    scaling_type: str = "default"  # "default" | "yarn" | "linear"
    factor: float = 1.0
    original_max_position: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True  # yarn: round the correction range to whole dims
    attention_factor: float = 1.0  # yarn: multiplies cos/sin (mscale / mscale_all_dim correction)
    softmax_mscale: float = 1.0  # yarn: softmax scale multiplier (mscale_all_dim correction, squared)
    interleaved: bool = False  # DeepSeek's rope dims come interleaved (x0,y0,x1,y1,..)


@dataclass(frozen=True)
class AttentionConfig:
    kind: str  # "gqa" | "mla"
    num_heads: int
    num_kv_heads: int
    head_dim: int  # GQA: q/k/v head dim; MLA: qk_nope + qk_rope (the q/k head dim)
    softmax_scale: float
    qk_norm: bool = False  # Qwen3: RMSNorm over each q and k head before rope
    bias: bool = False
    sliding_window: int | None = None
    # MLA only
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int  # per routed expert
    num_shared_experts: int = 0
    shared_intermediate_size: int = 0  # total width of the shared expert MLP (n_shared * moe_intermediate)
    scoring_func: str = "softmax"  # "softmax" | "sigmoid"
    topk_method: str = "greedy"  # "greedy" | "noaux_tc" (score + e_score_correction_bias picks experts)
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0


@dataclass(frozen=True)
class QuantConfig:
    method: str  # "fp8"
    fmt: str = "e4m3"
    block_size: tuple[int, int] = (128, 128)
    modules_to_not_convert: tuple[str, ...] = ()


@dataclass(frozen=True)
class ExpertQuantConfig:
    """Weights stored as int4/int8 per group (written by `hybridmoe quantize`): the routed experts, and with scope
    "all" every other projection too (the LM head in int8; embeddings, norms, routers and MLA's kv_b stay)."""

    method: str  # "int4" | "int8"
    group_size: int  # 32 | 128 columns per scale
    scale_dtype: str = "bfloat16"  # "bfloat16" | "float16"
    scope: str = "experts"  # "experts" | "all"


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    intermediate_size: int  # dense MLP layers
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention: AttentionConfig
    rope: RopeConfig
    moe: MoEConfig
    moe_layers: tuple[bool, ...]  # per decoder layer: routed-expert MoE block (True) or dense MLP
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    quantization: QuantConfig | None = None
    expert_quantization: ExpertQuantConfig | None = None
    num_nextn_predict_layers: int = 0  # DeepSeek multi-token-prediction layers (not used for inference)
    torch_dtype: str = "bfloat16"
    source: str = ""  # path of the config.json this came from
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)
