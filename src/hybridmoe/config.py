"""Normalised model configuration read from a Hugging Face model directory's config.json.

One frozen `ModelConfig` describes every supported architecture (DeepSeek-V3/R1/Kimi-K2, Qwen3-MoE,
Mixtral) in the same vocabulary, so that layers, the planner and the runtime never read raw HF fields.
Imports nothing of ours.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("DeepseekV3ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM")


class ConfigError(ValueError):
    """A model configuration that cannot be used; the message names the file and the field."""


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
    """Routed experts stored as int4/int8 per group (written by `hybridmoe quantize`)."""

    method: str  # "int4" | "int8"
    group_size: int  # 32 | 128 columns per scale
    scale_dtype: str = "bfloat16"  # "bfloat16" | "float16"


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


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read `model_dir/config.json` and normalise it; raises ConfigError naming the file and field."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: no config.json in model directory {model_dir}")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object at top level")
    return parse_config(raw, source=str(path))


def parse_config(raw: dict[str, Any], source: str = "<config>") -> ModelConfig:
    """Normalise a config.json dictionary (see load_config)."""
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else _ARCH_BY_MODEL_TYPE.get(raw.get("model_type", ""))
    if arch not in _PARSERS:
        raise ConfigError(
            f"{source}: unsupported architecture {arch or raw.get('model_type')!r} "
            f"(field 'architectures'); supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return _PARSERS[arch](_Fields(raw, source), arch)


class _Fields:
    """Typed access to config.json fields with errors that name the field and the file."""

    def __init__(self, raw: dict[str, Any], source: str):
        self.raw, self.source = raw, source

    def error(self, name: str, why: str) -> ConfigError:
        return ConfigError(f"{self.source}: field '{name}' {why}")

    def int(self, name: str, default: Any = ..., minimum: int = 1) -> Any:
        value = self._get(name, default)
        if value is None and default is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(name, f"must be an integer, got {value!r}")
        if value < minimum:
            raise self.error(name, f"must be >= {minimum}, got {value}")
        return value

    def float(self, name: str, default: Any = ..., positive: bool = True) -> Any:
        value = self._get(name, default)
        if value is None and default is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.error(name, f"must be a number, got {value!r}")
        if positive and value <= 0:
            raise self.error(name, f"must be > 0, got {value}")
        return float(value)

    def bool(self, name: str, default: Any = ...) -> bool:
        value = self._get(name, default)
        if not isinstance(value, bool):
            raise self.error(name, f"must be true or false, got {value!r}")
        return value

    def choice(self, name: str, options: tuple[str, ...], default: Any = ...) -> str:
        value = self._get(name, default)
        if value not in options:
            raise self.error(name, f"must be one of {list(options)}, got {value!r}")
        return value

    def _get(self, name: str, default: Any) -> Any:
        if name in self.raw and self.raw[name] is not None:
            return self.raw[name]
        if default is ...:
            raise self.error(name, "is missing")
        return default


def _eos_ids(f: _Fields) -> tuple[int, ...]:
    eos = f.raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _rope(f: _Fields, rotary_dim: int, interleaved: bool) -> RopeConfig:
    # transformers 5 writes `rope_parameters` (with rope_theta inside); official checkpoints write
    # `rope_theta` + `rope_scaling`.
    params = f.raw.get("rope_parameters") or {}
    scaling = f.raw.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise f.error("rope_scaling", "must be an object")
    merged = {**params, **scaling}
    theta = merged.get("rope_theta", f.raw.get("rope_theta", 10000.0))
    kind = merged.get("rope_type", merged.get("type", "default")) or "default"
    if kind not in ("default", "yarn", "linear"):
        raise f.error("rope_scaling", f"rope type {kind!r} is not supported (default, linear, yarn)")
    orig = merged.get("original_max_position_embeddings")
    if kind == "yarn" and orig is None:
        raise f.error("rope_scaling", "yarn needs original_max_position_embeddings")
    factor = merged.get("factor")
    if factor is None:  # DeepSeek convention: the ratio of the extended to the original context
        factor = f.int("max_position_embeddings", 4096) / orig if kind == "yarn" else 1.0
    factor = float(factor)
    attention_factor, softmax_mscale = 1.0, 1.0
    if kind == "yarn":
        mscale, mscale_all_dim = merged.get("mscale"), merged.get("mscale_all_dim")
        attention_factor = merged.get("attention_factor")
        if attention_factor is None:
            attention_factor = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
                                if mscale and mscale_all_dim else yarn_mscale(factor))
        if mscale_all_dim:
            softmax_mscale = yarn_mscale(factor, mscale_all_dim) ** 2
    return RopeConfig(
        theta=float(theta),
        rotary_dim=rotary_dim,
        scaling_type=kind,
        factor=factor,
        original_max_position=int(orig) if orig is not None else None,
        beta_fast=float(merged.get("beta_fast") or 32.0),
        beta_slow=float(merged.get("beta_slow") or 1.0),
        truncate=bool(merged.get("truncate", True)),
        attention_factor=float(attention_factor),
        softmax_mscale=softmax_mscale,
        interleaved=interleaved,
    )


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN attention-magnitude correction (DeepSeek's yarn_get_mscale)."""
    return 1.0 if scale <= 1.0 else 0.1 * mscale * math.log(scale) + 1.0


def _quant(f: _Fields) -> QuantConfig | None:
    q = f.raw.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method != "fp8":
        raise f.error("quantization_config", f"quant_method {method!r} is not supported (fp8)")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise f.error("quantization_config", f"fmt {fmt!r} is not supported (e4m3)")
    block = q.get("weight_block_size") or [128, 128]
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise f.error("quantization_config", f"weight_block_size must be two positive ints, got {block}")
    return QuantConfig(method="fp8", fmt=fmt, block_size=(block[0], block[1]),
                       modules_to_not_convert=tuple(q.get("modules_to_not_convert") or ()))


def _expert_quant(f: _Fields) -> ExpertQuantConfig | None:
    q = f.raw.get("expert_quantization")
    if not q:
        return None
    if not isinstance(q, dict):
        raise f.error("expert_quantization", "must be an object")
    sub = _Fields(q, f"{f.source} (expert_quantization)")
    return ExpertQuantConfig(method=sub.choice("method", ("int4", "int8")),
                             group_size=int(sub.choice("group_size", (32, 128))),
                             scale_dtype=sub.choice("scale_dtype", ("bfloat16", "float16"), "bfloat16"))


def _common(f: _Fields, arch: str) -> dict[str, Any]:
    return dict(
        architecture=arch,
        model_type=f.raw.get("model_type", ""),
        vocab_size=f.int("vocab_size"),
        hidden_size=f.int("hidden_size"),
        num_layers=f.int("num_hidden_layers"),
        intermediate_size=f.int("intermediate_size"),
        rms_norm_eps=f.float("rms_norm_eps", 1e-6),
        max_position_embeddings=f.int("max_position_embeddings", 4096),
        tie_word_embeddings=f.bool("tie_word_embeddings", False),
        bos_token_id=f.raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(f),
        quantization=_quant(f),
        expert_quantization=_expert_quant(f),
        torch_dtype=str(f.raw.get("torch_dtype") or f.raw.get("dtype") or "bfloat16"),
        source=f.source,
        raw=f.raw,
    )


def _parse_deepseek_v3(f: _Fields, arch: str) -> ModelConfig:
    num_layers = f.int("num_hidden_layers")
    num_heads = f.int("num_attention_heads")
    qk_nope, qk_rope = f.int("qk_nope_head_dim"), f.int("qk_rope_head_dim")
    v_head = f.int("v_head_dim")
    rope = _rope(f, qk_rope, interleaved=f.bool("rope_interleave", True))
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
        **_common(f, arch), attention=attention, rope=rope, moe=moe, moe_layers=moe_layers,
        num_nextn_predict_layers=f.int("num_nextn_predict_layers", 0, minimum=0),
    )


def _gqa_attention(f: _Fields, qk_norm: bool, sliding_window: int | None) -> tuple[AttentionConfig, int]:
    num_heads = f.int("num_attention_heads")
    num_kv = f.int("num_key_value_heads", num_heads)
    if num_heads % num_kv:
        raise f.error("num_key_value_heads", f"must divide num_attention_heads ({num_heads}), got {num_kv}")
    head_dim = f.int("head_dim", None) or f.int("hidden_size") // num_heads
    attention = AttentionConfig(
        kind="gqa", num_heads=num_heads, num_kv_heads=num_kv, head_dim=head_dim,
        softmax_scale=head_dim ** -0.5, qk_norm=qk_norm, bias=f.bool("attention_bias", False),
        sliding_window=sliding_window,
    )
    return attention, head_dim


def _parse_qwen3_moe(f: _Fields, arch: str) -> ModelConfig:
    use_sw = f.bool("use_sliding_window", False)
    attention, head_dim = _gqa_attention(f, qk_norm=True,
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
    return ModelConfig(**_common(f, arch), attention=attention, rope=_rope(f, head_dim, False), moe=moe,
                       moe_layers=moe_layers)


def _parse_mixtral(f: _Fields, arch: str) -> ModelConfig:
    attention, head_dim = _gqa_attention(f, qk_norm=False, sliding_window=f.int("sliding_window", None))
    n_experts = f.int("num_local_experts")
    top_k = f.int("num_experts_per_tok")
    if top_k > n_experts:
        raise f.error("num_experts_per_tok", f"must be <= num_local_experts ({n_experts}), got {top_k}")
    inter = f.int("intermediate_size")
    moe = MoEConfig(num_experts=n_experts, num_experts_per_tok=top_k, intermediate_size=inter,
                    scoring_func="softmax", topk_method="greedy", norm_topk_prob=True)
    num_layers = f.int("num_hidden_layers")
    return ModelConfig(**_common(f, arch), attention=attention, rope=_rope(f, head_dim, False), moe=moe,
                       moe_layers=(True,) * num_layers)


_PARSERS = {
    "DeepseekV3ForCausalLM": _parse_deepseek_v3,
    "Qwen3MoeForCausalLM": _parse_qwen3_moe,
    "MixtralForCausalLM": _parse_mixtral,
}
_ARCH_BY_MODEL_TYPE = {"deepseek_v3": "DeepseekV3ForCausalLM", "kimi_k2": "DeepseekV3ForCausalLM",
                       "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
