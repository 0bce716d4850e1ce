"""Normalised model configuration read from a Hugging Face model directory's config.json.

One frozen `ModelConfig` describes every supported family (DeepSeek-V3/R1/Kimi-K2, Qwen3-MoE, Mixtral) in
the same vocabulary, so that layers, the planner and the runtime never read raw HF fields. `families/` holds
one module per family (its parser, its checkpoint's weight names, its packaged models) and the registry;
the rest is shared: the dataclasses (`model_config`), typed field access (`fields`), rope, quantisation,
GQA attention and common fields. Imports nothing of ours outside this package, and no torch or numpy.
"""

from __future__ import annotations

from hybridmoe.config.errors import ConfigError
from hybridmoe.config.families import SUPPORTED_ARCHITECTURES, Family, WeightNames, family_of
from hybridmoe.config.load import load_config, parse_config
from hybridmoe.config.model_config import (AttentionConfig, ExpertQuantConfig, ModelConfig, MoEConfig, QuantConfig,
                                           RopeConfig)
from hybridmoe.config.rope import yarn_mscale

__all__ = ["SUPPORTED_ARCHITECTURES", "AttentionConfig", "ConfigError", "ExpertQuantConfig", "Family", "ModelConfig",
           "MoEConfig", "QuantConfig", "RopeConfig", "WeightNames", "family_of", "load_config", "parse_config",
           "yarn_mscale"]
