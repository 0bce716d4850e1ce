"""Config normalisation for the three architectures and errors that name the field and the file."""

from __future__ import annotations

import json

import pytest

from hybridmoe.config import ConfigError, load_config, parse_config

DEEPSEEK_V3_OFFICIAL = {  # the fields of deepseek-ai/DeepSeek-V3's config.json that matter here
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
}


def test_deepseek_v3_official_config():
    cfg = parse_config(DEEPSEEK_V3_OFFICIAL)
    assert cfg.attention.kind == "mla" and cfg.attention.kv_lora_rank == 512 and cfg.attention.q_lora_rank == 1536
    assert cfg.moe_layers == (False,) * 3 + (True,) * 58 and cfg.num_moe_layers == 58
    assert (cfg.moe.scoring_func, cfg.moe.topk_method, cfg.moe.n_group, cfg.moe.topk_group) == ("sigmoid", "noaux_tc", 8, 4)
    assert cfg.rope.scaling_type == "yarn" and cfg.rope.factor == 40 and cfg.rope.rotary_dim == 64
    # yarn mscale_all_dim=1: softmax scale = 192^-0.5 * (0.1 ln 40 + 1)^2
    assert cfg.attention.softmax_scale == pytest.approx(192 ** -0.5 * (0.1 * 3.6888794541139363 + 1) ** 2)
    assert cfg.rope.attention_factor == pytest.approx(1.0)
    assert cfg.quantization.block_size == (128, 128) and cfg.num_nextn_predict_layers == 1


def test_deepseek_routing_defaults_when_transformers_omits_them():
    raw = {k: v for k, v in DEEPSEEK_V3_OFFICIAL.items() if k not in ("scoring_func", "topk_method")}
    cfg = parse_config(raw)
    assert (cfg.moe.scoring_func, cfg.moe.topk_method) == ("sigmoid", "noaux_tc")


def test_rope_parameters_as_transformers_5_writes_them():
    raw = dict(DEEPSEEK_V3_OFFICIAL)
    raw.pop("rope_scaling"), raw.pop("rope_theta")
    raw["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 8.0, "mscale": 0.707,
                              "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096}
    cfg = parse_config(raw)
    assert cfg.rope.theta == 5000.0 and cfg.rope.factor == 8.0 and cfg.rope.scaling_type == "yarn"


def test_qwen3_moe_layer_pattern():
    raw = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
           "moe_intermediate_size": 16, "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 2,
           "mlp_only_layers": [3], "norm_topk_prob": True}
    cfg = parse_config(raw)
    assert cfg.moe_layers == (False, True, False, False, False, True)
    assert cfg.attention.qk_norm and cfg.attention.head_dim == 16 and cfg.attention.num_kv_heads == 2


def _write(tmp_path, raw) -> str:
    (tmp_path / "config.json").write_text(json.dumps(raw) if isinstance(raw, dict) else raw)
    return str(tmp_path)


def test_errors_name_the_field_and_the_file(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match=r"config\.json: invalid JSON"):
        load_config(_write(tmp_path, "{not json"))
    with pytest.raises(ConfigError, match=r"config\.json: unsupported architecture 'LlamaForCausalLM'"):
        load_config(_write(tmp_path, {"architectures": ["LlamaForCausalLM"]}))
    missing = {k: v for k, v in DEEPSEEK_V3_OFFICIAL.items() if k != "kv_lora_rank"}
    with pytest.raises(ConfigError, match=r"config\.json: field 'kv_lora_rank' is missing"):
        load_config(_write(tmp_path, missing))
    with pytest.raises(ConfigError, match="field 'hidden_size' must be an integer, got '7168'"):
        load_config(_write(tmp_path, {**DEEPSEEK_V3_OFFICIAL, "hidden_size": "7168"}))
    with pytest.raises(ConfigError, match=r"field 'n_group' must divide n_routed_experts \(256\), got 7"):
        load_config(_write(tmp_path, {**DEEPSEEK_V3_OFFICIAL, "n_group": 7}))
    with pytest.raises(ConfigError, match="field 'scoring_func' must be one of"):
        load_config(_write(tmp_path, {**DEEPSEEK_V3_OFFICIAL, "scoring_func": "relu"}))
    with pytest.raises(ConfigError, match="quant_method 'awq' is not supported"):
        load_config(_write(tmp_path, {**DEEPSEEK_V3_OFFICIAL, "quantization_config": {"quant_method": "awq"}}))


def test_binary_config_names_the_file(tmp_path):
    (tmp_path / "config.json").write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe")  # e.g. a file saved under the wrong name
    with pytest.raises(ConfigError, match=r"config\.json: not UTF-8 text"):
        load_config(tmp_path)


def test_config_without_architectures_reads_as_its_model_types_family():
    raw = {k: v for k, v in DEEPSEEK_V3_OFFICIAL.items() if k != "architectures"}
    assert parse_config({**raw, "model_type": "kimi_k2"}).architecture == "DeepseekV3ForCausalLM"
    with pytest.raises(ConfigError, match="unsupported architecture 'llama'.*supported: DeepseekV3ForCausalLM, "
                                          "Qwen3MoeForCausalLM, MixtralForCausalLM"):
        parse_config({**raw, "model_type": "llama"})


def test_each_packaged_model_parses_as_the_family_that_lists_it():
    from hybridmoe.config.families import FAMILIES, family_of
    from hybridmoe.placement.modelspec import resolve_model

    for family in FAMILIES:
        for names in family.packaged:
            for name in names:
                assert family_of(resolve_model(name)) is family, name


def test_two_families_claiming_one_name_fail_at_import():
    from hybridmoe.config.families import FAMILIES, _index

    with pytest.raises(ValueError, match="'deepseek_v3' and 'qwen3_moe' both claim architecture 'X'"):
        _index("architecture", [("X", FAMILIES[0]), ("X", FAMILIES[1])])
