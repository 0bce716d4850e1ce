"""Rotary position embedding fields, shared by every family: `parse_rope` and YaRN's `yarn_mscale`."""

from __future__ import annotations

import math

from hybridmoe.config.fields import Fields
from hybridmoe.config.model_config import RopeConfig


def parse_rope(f: Fields, rotary_dim: int, interleaved: bool) -> RopeConfig:
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
