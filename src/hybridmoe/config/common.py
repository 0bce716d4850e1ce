"""The ModelConfig fields every family reads from the same config.json names (`common_fields`)."""

from __future__ import annotations

from typing import Any

from hybridmoe.config.fields import Fields
from hybridmoe.config.quant import parse_expert_quant, parse_fp8_quant


def common_fields(f: Fields, arch: str) -> dict[str, Any]:
    """Keyword arguments of ModelConfig that do not depend on the family (all but attention, rope, moe and
    moe_layers)."""
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
        quantization=parse_fp8_quant(f),
        expert_quantization=parse_expert_quant(f),
        torch_dtype=str(f.raw.get("torch_dtype") or f.raw.get("dtype") or "bfloat16"),
        source=f.source,
        raw=f.raw,
    )


def _eos_ids(f: Fields) -> tuple[int, ...]:
    eos = f.raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)
