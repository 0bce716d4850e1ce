"""The shipped demo model is what MODEL_CARD.md says: its architecture, files, tokenizer and measured behaviour."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors import safe_open

MAX_ASSETS_BYTES = 60 * 1024 * 1024


def test_assets_fit_the_size_budget(demo_dir):
    total = sum(f.stat().st_size for f in demo_dir.parent.rglob("*") if f.is_file())
    assert 0 < total <= MAX_ASSETS_BYTES, f"assets take {total / 2**20:.1f} MiB"


def test_config_is_the_flagship_deepseek_v3_path(demo_dir, training_modules):
    config = json.loads((demo_dir / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["model_type"] == "deepseek_v3"
    assert config["scoring_func"] == "sigmoid" and config["topk_method"] == "noaux_tc"
    assert config["first_k_dense_replace"] == 1 and config["n_shared_experts"] == 1
    assert config["q_lora_rank"] and config["kv_lora_rank"]  # MLA with a compressed query
    assert config["n_group"] > 1 and config["topk_group"] < config["n_group"]  # group-limited routing
    for name in ("hidden_size", "intermediate_size", "moe_intermediate_size", "q_lora_rank", "kv_lora_rank"):
        assert config[name] % 128 == 0, f"{name}={config[name]} is not a multiple of the FP8 block"
    recipe_config = training_modules["recipe"].shipped_model_config()
    for name, value in recipe_config.items():
        if name in config:
            assert config[name] == value, f"config.json {name}={config[name]} but the recipe says {value}"


def test_weights_are_bf16_with_per_expert_keys_and_float32_router_bias(demo_dir):
    with safe_open(demo_dir / "model.safetensors", "pt") as f:
        names = list(f.keys())
        dtypes = {name: f.get_slice(name).get_dtype() for name in names}
    biases = [n for n in names if n.endswith("e_score_correction_bias")]
    assert biases and all(dtypes[n] == "F32" for n in biases)
    assert all(dtype == "BF16" for name, dtype in dtypes.items() if name not in biases)
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in names  # per-expert keys, as HF checkpoints
    assert "model.layers.0.mlp.gate_proj.weight" in names  # the dense first layer


def test_parameter_count_matches_the_card(demo_dir, eval_report, training_modules):
    with safe_open(demo_dir / "model.safetensors", "pt") as f:
        total = sum(torch.Size(f.get_slice(n).get_shape()).numel() for n in f.keys()
                    if not n.endswith("e_score_correction_bias"))  # a buffer, not a parameter
    assert total == eval_report["parameters"]
    card = training_modules["card"].CARD.read_text()
    assert f"{total:,}" in card, f"MODEL_CARD.md does not state the parameter count {total:,}"


def test_card_results_are_the_measured_ones(eval_report, training_modules):
    card = training_modules["card"]
    assert card.card_block(card.CARD.read_text()) == card.render_results(eval_report)


def test_tokenizer_chat_template_matches_training(demo_dir, training_modules):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_dir)
    template = (demo_dir / "chat_template.jinja").read_text()
    assert json.loads((demo_dir / "tokenizer_config.json").read_text())["chat_template"] == template
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count from 1 to 3."},
                {"role": "assistant", "content": "1, 2, 3."}, {"role": "user", "content": "Hi."}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == training_modules["chat_data"].render_chat(messages, add_generation_prompt=True)
    assert rendered.startswith("<|begin|><|system|>\nBe brief.<|end|>\n") and rendered.endswith("<|assistant|>\n")
    with pytest.raises(Exception, match="chat role"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_tokenizer_adds_bos_and_splits_digits(demo_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_dir)
    ids = tokenizer("The pass key is 40719.")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert [t for t in tokenizer.convert_ids_to_tokens(ids) if t.isdigit()] == list("40719")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "The pass key is 40719."


@pytest.mark.slow
def test_transformers_greedy_samples_are_the_cards(demo_dir, demo_model_fp32, eval_report):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_dir)
    for sample in eval_report["samples"][:2] + eval_report["samples"][-4:-3]:
        if "prompt" in sample:
            ids = tokenizer(sample["prompt"])["input_ids"]
        else:
            ids = list(tokenizer.apply_chat_template(sample["chat"], add_generation_prompt=True, return_dict=False))
        out = demo_model_fp32.generate(torch.tensor([ids]), max_new_tokens=60, do_sample=False,
                                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
        assert tokenizer.decode(out[0, len(ids):], skip_special_tokens=True) == sample["completion"]


@pytest.mark.slow
def test_fresh_passkey_accuracy_at_1k_agrees_with_the_card(demo_dir, demo_model_fp32, training_modules, eval_report):
    """8 fresh examples (a seed the evaluation did not use) land within 3/8 of the card's 1K accuracy."""
    from transformers import AutoTokenizer

    passkey = training_modules["passkey"]
    tokenizer = AutoTokenizer.from_pretrained(demo_dir)
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    rng = random.Random(12345)
    correct = 0
    for _ in range(8):
        example = passkey.make_passkey_example_near(rng, 1024, count)
        ids = tokenizer(example.prompt)["input_ids"]
        out = demo_model_fp32.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                                       pad_token_id=tokenizer.eos_token_id)
        correct += passkey.parse_answer(tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)) == example.key
    card_accuracy = eval_report["passkey_classic"]["1024"]["accuracy"]
    assert abs(correct / 8 - card_accuracy) <= 3 / 8, f"{correct}/8 fresh passkeys vs {card_accuracy:.0%} on the card"


@pytest.mark.slow
@pytest.mark.parametrize("copy", ["demo_model", "demo_model_fp8"])
def test_engine_retrieves_fresh_passkeys_at_1k(demo_dir, training_modules, copy):
    """hybridmoe's own engine (CPU expert kernels, its default dtype) on the BF16 model and the FP8 copy: fresh
    1K-token passkey prompts (a seed the evaluation did not use); the card measures 100% at 1K."""
    from transformers import AutoTokenizer

    from hybridmoe import LLM, SamplingParams

    passkey = training_modules["passkey"]
    tokenizer = AutoTokenizer.from_pretrained(demo_dir)
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    rng = random.Random(2024)
    examples = [passkey.make_passkey_example_near(rng, 1024, count) for _ in range(6)]
    results = LLM(demo_dir.parent / copy).generate([tokenizer(e.prompt)["input_ids"] for e in examples],
                                                   SamplingParams(temperature=0.0, max_tokens=8))
    found = [passkey.parse_answer(tokenizer.decode(r.token_ids, skip_special_tokens=True)) for r in results]
    correct = sum(answer == e.key for answer, e in zip(found, examples))
    assert correct >= 5, f"{correct}/6 passkeys at 1K: {found} vs {[e.key for e in examples]}"


def test_recipe_json_holds_the_recipe_and_facts_of_the_model_only(demo_dir, fp8_dir, training_modules):
    """Both copies ship the recipe train.py records plus what the model is (steps, tokens, parameters), nothing of
    the session that trained it (its time, where it resumed)."""
    import train

    shipped = json.loads((demo_dir / "recipe.json").read_text())
    assert json.loads((fp8_dir / "recipe.json").read_text()) == shipped
    assert set(shipped) == set(train.recipe_record(1)) | {"steps_trained", "tokens_seen", "parameters"}
