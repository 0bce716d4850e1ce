"""Qwen3-MoE: GQA with per-head q/k RMSNorm, softmax top-k router, no shared experts; dense MLP layers where
decoder_sparse_step / mlp_only_layers say so."""

from __future__ import annotations

from hybridmoe.layers.attention_gqa import GQAttention
from hybridmoe.models.decoder import ArchSpec
from hybridmoe.models.gqa_loading import build_gqa

SPEC = ArchSpec(
    moe_prefix="mlp",
    expert_proj_names=("gate_proj", "up_proj", "down_proj"),
    shared_experts_prefix=None,
    build_attention=build_gqa,
    cache_shape=GQAttention.cache_shape,
)
