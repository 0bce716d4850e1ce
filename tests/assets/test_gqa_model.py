"""The shipped GQA companion (Qwen3-MoE) is what MODEL_CARD.md says: its architecture, files and measured
behaviour (the engine against transformers: test_engine_vs_transformers.py)."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors import safe_open

from hybridmoe.checkpoint.default_model import resolve_model_dir


def test_config_is_qwen3_moe_with_grouped_kv_heads_as_the_recipe_says(gqa_dir, training_modules):
    from transformers import AutoConfig

    raw = json.loads((gqa_dir / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3MoeForCausalLM"] and raw["model_type"] == "qwen3_moe"
    config = AutoConfig.from_pretrained(gqa_dir)  # maps the recipe's names (num_experts) to the file's
    assert config.num_key_value_heads < config.num_attention_heads  # GQA
    recipe = training_modules["recipe"]
    expected = {**recipe.GQA_MODEL_CONFIG, **recipe.VARIANTS["gqa_companion"]["model"]}
    for name, value in expected.items():
        assert getattr(config, name) == value, f"config.json {name}={getattr(config, name)} but the recipe says {value}"


def test_it_shares_the_demo_models_tokenizer_and_is_named_demo_gqa(gqa_dir, demo_dir):
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (gqa_dir / name).read_bytes() == (demo_dir / name).read_bytes(), name
    assert resolve_model_dir("demo-gqa") == gqa_dir


def test_weights_are_bf16_and_the_parameter_count_is_the_cards(gqa_dir, gqa_eval_report, training_modules):
    with safe_open(gqa_dir / "model.safetensors", "pt") as f:
        names = list(f.keys())
        assert all(f.get_slice(n).get_dtype() == "BF16" for n in names)
        total = sum(torch.Size(f.get_slice(n).get_shape()).numel() for n in names)
    assert "model.layers.1.self_attn.k_norm.weight" in names and "model.layers.0.mlp.gate_proj.weight" in names
    assert total == gqa_eval_report["parameters"]
    assert f"{total:,}" in training_modules["card"].CARD.read_text()


def test_card_results_are_the_measured_ones(gqa_eval_report, training_modules):
    card = training_modules["card"]
    assert card.card_block(card.CARD.read_text(), card.GQA_BEGIN, card.GQA_END) == card.render_results(gqa_eval_report)


@pytest.mark.slow
def test_engine_passkey_accuracy_at_1k_agrees_with_the_card(gqa_dir, training_modules, gqa_eval_report):
    """hybridmoe's engine (its default dtype) on 8 fresh 1K-token passkey prompts (a seed the evaluation did not
    use) lands within 3/8 of the card's accuracy."""
    from transformers import AutoTokenizer

    from hybridmoe import LLM, SamplingParams

    passkey = training_modules["passkey"]
    tokenizer = AutoTokenizer.from_pretrained(gqa_dir)
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    rng = random.Random(4321)
    examples = [passkey.make_passkey_example_near(rng, 1024, count) for _ in range(8)]
    results = LLM(gqa_dir).generate([tokenizer(e.prompt)["input_ids"] for e in examples],
                                    SamplingParams(temperature=0.0, max_tokens=8))
    correct = sum(passkey.parse_answer(tokenizer.decode(r.token_ids, skip_special_tokens=True)) == e.key
                  for r, e in zip(results, examples))
    card_accuracy = gqa_eval_report["passkey_classic"]["1024"]["accuracy"]
    assert abs(correct / 8 - card_accuracy) <= 3 / 8, f"{correct}/8 fresh passkeys vs {card_accuracy:.0%} on the card"
