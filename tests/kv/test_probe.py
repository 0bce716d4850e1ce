"""The INT4 probe: its decision on the demo model (tolerates INT4 KV) and on a copy that does not (two latent
channels scaled up 32x in every layer, with kv_b_proj scaled down to match: the same function, but per-token
absmax INT4 of the latent then flattens every other channel), and its verdict cache."""

from __future__ import annotations

import shutil

import pytest
from safetensors.torch import load_file, save_file

from hybridmoe.checkpoint.default_model import default_model_dir
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
