"""`hybridmoe eval kv` end to end on a tiny model, and the passkey prompt's agreement with training/."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from hybridmoe.cli import main
from hybridmoe.commands import _kv_eval

ROOT = Path(__file__).resolve().parents[2]


def test_passkey_wording_matches_the_training_recipe():
    tree = ast.parse((ROOT / "training" / "passkey.py").read_text())
    consts = {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
              for t in node.targets if isinstance(node.value, ast.Constant)}
    intro = next(node.value for node in tree.body if isinstance(node, ast.Assign) and node.targets[0].id == "INTRO")
    consts["INTRO"] = ast.literal_eval(intro)
    for name in ("INTRO", "CLASSIC_FILLER", "NEEDLE", "QUESTION"):
        assert consts[name] == getattr(_kv_eval, name)
    prompt = _kv_eval.passkey_prompt("12345", 0.5, 300, lambda text: len(text.split()))
    assert prompt.startswith(_kv_eval.INTRO) and prompt.endswith(_kv_eval.QUESTION) and "12345" in prompt


@pytest.mark.slow
def test_eval_kv_writes_rows_and_plot(tiny_model_dir, tmp_path):
    model = tiny_model_dir("qwen3_moe")
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    out, png = tmp_path / "kv.json", tmp_path / "kv.png"
    assert main(["eval", "kv", "--model", str(model), "--budgets", "0.3", "--int4", "yes", "--json", str(out),
                 "--plot", str(png), "--prefix-tokens", "64", "--continuation-tokens", "16", "--windows", "1",
                 "--passkey-tokens", "96", "--depths", "1", "--bench-tokens", "64", "--text", str(text)]) == 0
    report = json.loads(out.read_text())  # a list of rows, the quality rows first, then the pack/unpack timings
    rows = [r for r in report if r["method"] != "pack-unpack"]
    timings = report[len(rows):]
    assert all(r["kind"] == "gqa" and r["model"] == str(model) and r["ladder"] == ["fp16", "int8", "int4"]
               for r in report) and png.stat().st_size > 0
    keys = {"method", "budget", "ppl", "ppl_delta_pct", "passkey_acc", "payload_bytes"}
    assert all(keys <= set(r) for r in rows)
    assert [t["budget"] for t in timings] == [0.3, 0.5] and all(t["pack_gbps"] > 0 < t["unpack_gbps"] for t in timings)
    names = {(r["method"], r["budget"]) for r in rows}
    assert {("full", 1.0), ("spectrumkv-attention", 0.3), ("spectrumkv-position", 0.3), ("pdtrim", 0.3),
            ("uniform-int8", 0.5), ("uniform-int4", 0.25)} <= names
    by = {(r["method"], r["budget"]): r for r in rows}
    assert by[("spectrumkv-attention", 0.3)]["payload_bytes"] < by[("uniform-int8", 0.5)]["payload_bytes"]
    assert by[("uniform-int4", 0.25)]["payload_bytes"] < by[("uniform-int8", 0.5)]["payload_bytes"]
    assert by[("full", 1.0)]["ppl_delta_pct"] == 0
