"""Mixtral: GQA (optional sliding window), softmax top-k over num_local_experts renormalised, experts named
block_sparse_moe.experts.N.w1 (gate), w3 (up), w2 (down)."""

from __future__ import annotations

from hybridmoe.layers.attention_gqa import GQAttention
from hybridmoe.models.decoder import ArchSpec
from hybridmoe.models.gqa_loading import build_gqa

SPEC = ArchSpec(
    moe_prefix="block_sparse_moe",
    expert_proj_names=("w1", "w3", "w2"),
    shared_experts_prefix=None,
    build_attention=build_gqa,
    cache_shape=GQAttention.cache_shape,
)
