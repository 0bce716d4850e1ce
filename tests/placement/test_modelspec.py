"""ModelSpec against Hugging Face's own modules (exact parameter counts on tiny configs), against published
model sizes, and its attention arithmetic against brute-force counts and torch's FLOP counter."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from torch.utils.flop_counter import FlopCounterMode

from hybridmoe.config import parse_config
from hybridmoe.placement.modelspec import PACKAGED_MODELS, ModelSpec, resolve_model

TINY = {
    "deepseek_v3": dict(vocab_size=320, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                        num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
                        q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
    "qwen3_moe": dict(vocab_size=320, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                      num_experts_per_tok=2, mlp_only_layers=[1]),
    "mixtral": dict(vocab_size=320, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
}


def hf_model(model_type: str, **overrides):
    config = AutoConfig.for_model(model_type, **{**TINY[model_type], **overrides})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return config, model


def spec_of(config) -> ModelSpec:
    return ModelSpec(parse_config(config.to_dict()), "tiny")


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_weights_match_hugging_face_exactly(model_type):
    config, model = hf_model(model_type)
    spec = spec_of(config)
    hf_total = sum(p.numel() for p in model.parameters())
    hf_total += sum(b.numel() for n, b in model.named_buffers() if "e_score_correction_bias" in n)
    assert spec.total_weights() == hf_total
    index = next(l.index for l in spec.layers if l.is_moe)
    layer = model.model.layers[index]
    attention = sum(p.numel() for p in layer.self_attn.parameters())
    attention += layer.input_layernorm.weight.numel() + layer.post_attention_layernorm.weight.numel()
    assert spec.layers[index].attention == attention
    moe = getattr(layer, "mlp", None) or layer.block_sparse_moe
    expected = spec.layers[index].expert * spec.layers[index].num_experts
    assert expected == sum(p.numel() for p in moe.experts.parameters())


def test_dense_layers_follow_the_config():
    config, model = hf_model("qwen3_moe")
    spec = spec_of(config)
    assert [l.is_moe for l in spec.layers] == [True, False, True]
    assert spec.layers[1].dense_mlp == sum(p.numel() for p in model.model.layers[1].mlp.parameters())


@pytest.mark.parametrize("name, total_b, active_b", [
    ("deepseek-v3", 671.0, 37.0),  # published: 671B total, 37B activated
    ("kimi-k2", 1026.0, 32.0),  # "1T total, 32B activated" (1.04T with the embedding counted once more)
    ("qwen3-235b-a22b", 235.0, 22.0),
    ("mixtral-8x7b", 46.7, 12.9),  # 12.9B active counts the embedding
])
def test_published_model_sizes(name, total_b, active_b):
    spec = ModelSpec(resolve_model(name), name)
    assert spec.total_weights() / 1e9 == pytest.approx(total_b, rel=0.01)
    active = spec.active_weights() + (spec.embedding if name == "mixtral-8x7b" else 0)
    assert active / 1e9 == pytest.approx(active_b, rel=0.03)


def test_packaged_names_resolve_and_errors_name_the_choices():
    for name in PACKAGED_MODELS:
        assert resolve_model(name).num_layers > 0
    assert resolve_model("deepseek-ai/DeepSeek-V3").moe.num_experts == 256
    assert resolve_model("Qwen/Qwen3-30B-A3B").moe.intermediate_size == 768
    with pytest.raises(ValueError, match="packaged: deepseek-v3"):
        resolve_model("llama-7b")


def test_kv_bytes_per_token():
    ds = ModelSpec(resolve_model("deepseek-v3"))
    assert ds.kv_bytes_per_token() == 61 * (512 + 64) * 2  # latent + rope key, bf16
    qw = ModelSpec(resolve_model("qwen3-30b-a3b"))
    assert qw.kv_bytes_per_token() == 48 * 2 * 4 * 128 * 2


@pytest.mark.parametrize("queries, before, window", [(1, 0, None), (7, 0, None), (5, 11, None), (9, 3, 6),
                                                     (4, 20, 8), (30, 0, 7)])
def test_attention_pairs_match_a_brute_force_mask(queries, before, window):
    config, _ = hf_model("mixtral", sliding_window=window)
    spec = spec_of(config)
    q = np.arange(before, before + queries)[:, None]
    k = np.arange(before + queries)[None, :]
    mask = (k <= q) & ((q - k < window) if window else True)
    assert spec.attention_pairs(queries, before) == mask.sum()


@pytest.mark.parametrize("model_type", ["deepseek_v3", "qwen3_moe"])
def test_attention_flops_match_torch_flop_counter(model_type):
    """HF attention over T fresh tokens: projections + score and value matmuls over all T x T pairs."""
    config, _ = hf_model(model_type)
    config._attn_implementation = "eager"  # plain matmuls, all counted
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    spec = spec_of(config)
    tokens = 12
    attn = model.model.layers[1].self_attn
    hidden = torch.randn(1, tokens, config.hidden_size)
    rotary = model.model.rotary_emb(hidden, torch.arange(tokens)[None])
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        attn(hidden_states=hidden, position_embeddings=rotary, attention_mask=None)
    full_square = tokens * tokens  # the counter counts every (query, key) pair
    expected = (spec.attention_linear_flops(tokens, 0, "expanded")
                + full_square * spec.attention_pair_flops(1, 0, "expanded") / spec.attention_pairs(1, 0))
    assert counter.get_total_flops() == pytest.approx(expected, rel=1e-9)


def test_mla_forms_trade_per_token_for_per_pair_work():
    spec = ModelSpec(resolve_model("deepseek-v3"))
    assert spec.mla_form(1) == "absorbed" and spec.mla_form(4096) == "expanded"
    # absorbed: more work per pair, less per context token
    assert spec.attention_pair_flops(1, 1000, "absorbed") > spec.attention_pair_flops(1, 1000, "expanded")
    assert spec.attention_linear_flops(1, 1000, "absorbed") < spec.attention_linear_flops(1, 1000, "expanded")


def test_activation_bytes_grow_with_chunk_and_context():
    spec = ModelSpec(resolve_model("deepseek-v3"))
    assert spec.activation_bytes(8192, 8192) < spec.activation_bytes(16384, 16384)
    assert spec.activation_bytes(4096, 8192) < spec.activation_bytes(4096, 32768)
