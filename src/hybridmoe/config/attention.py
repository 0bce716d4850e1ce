"""Grouped-query attention as Hugging Face's Llama-style configs write it (`gqa_attention`), shared by the
families that use it (Qwen3-MoE, Mixtral). MLA is DeepSeek-V3's own and is parsed there."""

from __future__ import annotations

from hybridmoe.config.fields import Fields
from hybridmoe.config.model_config import AttentionConfig


def gqa_attention(f: Fields, qk_norm: bool, sliding_window: int | None) -> tuple[AttentionConfig, int]:
    """The attention config and its head dim (which the family's rope rotates whole)."""
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
