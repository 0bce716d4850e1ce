"""The INT4 probe: its decision on the demo model (tolerates INT4 KV) and on a copy that does not (two latent
channels scaled up 32x in every layer, with kv_b_proj scaled down to match: the same function, but per-token
absmax INT4 of the latent then flattens every other channel); the same on the GQA companion, whose keys and
values get the outliers; and its verdict cache."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3MoeForCausalLM

from hybridmoe.checkpoint.default_model import default_model_dir, resolve_model_dir
from hybridmoe.commands.eval import probe_verdict
from hybridmoe.commands._kv_eval import KVHarness
from hybridmoe.kv.allocation import LADDER_2, LADDER_3
from hybridmoe.kv.probe import ProbeVerdict, VerdictCache, decide, ladder_for, model_fingerprint


def scale_latent_outliers(src, dst, factor: float = 32.0, channels=(0, 1)):
    """A copy of an MLA model whose cached latent has outlier channels; exact in bf16 for powers of two."""
    shutil.copytree(src, dst)
    weights = load_file(str(src / "model.safetensors"))
    for name in [n for n in weights if n.endswith("kv_a_layernorm.weight")]:
        prefix = name[: -len("kv_a_layernorm.weight")]
        norm, kv_b = weights[name].clone(), weights[prefix + "kv_b_proj.weight"].clone()
        for c in channels:
            norm[c] *= factor
            kv_b[:, c] /= factor
        weights[name], weights[prefix + "kv_b_proj.weight"] = norm, kv_b
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def scale_kv_outliers(src, dst, factor: float = 32.0, channels=(0, 1)):
    """A copy of a Qwen3 (GQA) model whose cached keys and values have outlier channels, computing the same
    function: k_norm's channels and their rotary partners (half a head away) scaled up and q_norm's down (RoPE
    turns each pair together, so every attention logit is unchanged), v_proj's channels of every KV head scaled up
    and the matching o_proj columns of the query heads that read them down; exact in bf16 for powers of two. Key
    outliers alone do not break the 3-tier policy: attention importance lifts the needle to INT8, and INT4 values
    of the rest stay readable."""
    shutil.copytree(src, dst)
    config = json.loads((src / "config.json").read_text())
    head_dim, group = config["head_dim"], config["num_attention_heads"] // config["num_key_value_heads"]
    weights = load_file(str(src / "model.safetensors"))
    for name in [n for n in weights if n.endswith("self_attn.k_norm.weight")]:
        k_norm, q_norm = weights[name].clone(), weights[name.replace("k_norm", "q_norm")].clone()
        rows = [c + half for c in channels for half in (0, head_dim // 2)]
        k_norm[rows] *= factor
        q_norm[rows] /= factor
        v_name, o_name = name.replace("k_norm", "v_proj"), name.replace("k_norm", "o_proj")
        v_proj, o_proj = weights[v_name].clone(), weights[o_name].clone()  # [kv_heads * head_dim, H], [H, heads * head_dim]
        for kv_head in range(config["num_key_value_heads"]):
            v_proj[[kv_head * head_dim + c for c in channels]] *= factor
            o_proj[:, [q * head_dim + c for q in range(kv_head * group, (kv_head + 1) * group) for c in channels]] /= factor
        weights.update({name: k_norm, name.replace("k_norm", "q_norm"): q_norm, v_name: v_proj, o_name: o_proj})
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_decision_and_ladder():
    assert decide([True, True, False]) and not decide([True, False, False])
    assert ladder_for(True) == LADDER_3 and ladder_for(False) == LADDER_2


def test_verdict_cache_and_fingerprint(tmp_path, monkeypatch):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"abc")
    fp = model_fingerprint(model)
    (model / "model.safetensors").write_bytes(b"abd")
    assert model_fingerprint(model) != fp
    cache = VerdictCache(tmp_path / "cache")
    assert cache.get(fp) is None
    cache.put(ProbeVerdict(fp, False, [False, True, False]))
    assert cache.get(fp).int4_allowed is False and cache.get(fp).label == "int4-refused"
    monkeypatch.setenv("HYBRIDMOE_CACHE", str(tmp_path / "hm"))
    assert VerdictCache().directory == tmp_path / "hm" / "kv-probe"


@pytest.mark.slow
def test_probe_allows_int4_on_the_demo_model_and_refuses_it_with_key_outliers(tmp_path):
    logs = []
    demo = KVHarness(default_model_dir())
    verdict = probe_verdict(demo, tokens=512, cache_dir=tmp_path, log=logs.append)
    assert verdict.int4_allowed and sum(verdict.successes) >= 2
    outlier = KVHarness(scale_latent_outliers(default_model_dir(), tmp_path / "outlier"))
    assert outlier.fingerprint != demo.fingerprint
    refused = probe_verdict(outlier, tokens=512, cache_dir=tmp_path, log=logs.append)
    assert not refused.int4_allowed and sum(refused.successes) <= 1
    again = probe_verdict(outlier, tokens=512, cache_dir=tmp_path, log=logs.append)  # cached
    assert again == refused and logs[-1].startswith("cached verdict")


@pytest.mark.slow
def test_probe_allows_int4_on_the_gqa_companion_and_refuses_it_with_kv_outliers(tmp_path):
    companion = KVHarness(resolve_model_dir("demo-gqa"))
    verdict = probe_verdict(companion, tokens=512, cache_dir=tmp_path, log=lambda _: None)
    assert verdict.int4_allowed and sum(verdict.successes) >= 2
    outlier_dir = scale_kv_outliers(resolve_model_dir("demo-gqa"), tmp_path / "outlier")
    refused = probe_verdict(KVHarness(outlier_dir), tokens=512, cache_dir=tmp_path, log=lambda _: None)
    assert not refused.int4_allowed and sum(refused.successes) <= 1
    ids = torch.arange(3, 67).unsqueeze(0)  # [1, 64] token ids
    same, scaled = (Qwen3MoeForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
                    for d in (resolve_model_dir("demo-gqa"), outlier_dir))
    with torch.no_grad():  # the copy computes the same function: only its KV cache's channels differ
        torch.testing.assert_close(scaled(ids).logits, same(ids).logits, rtol=1e-4, atol=1e-4)
