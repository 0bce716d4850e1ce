"""The plan / simulate / profile commands end to end (through hybridmoe.cli)."""

from __future__ import annotations

import json
import os

import pytest

from hybridmoe.cli import main
from hybridmoe.commands.plan import parse_size
from hybridmoe.profiling.machine import matmul_shapes


def test_parse_size():
    assert parse_size("24GB") == 24e9 and parse_size("24") == 24e9 and parse_size("22.5GiB") == 22.5 * 2**30
    assert parse_size("512MB") == 512e6
    with pytest.raises(ValueError, match="24GB"):
        parse_size("lots")


def test_plan_prints_a_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = main(["plan", "--model", "qwen3-30b-a3b", "--vram", "12GB", "--hardware", "rtx4090,desktop-2ch",
                 "--experts", "int4", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0
    for words in ("What goes where", "attention", "hot experts", "Decode, per batch tier", "Prefill", "TTFT"):
        assert words in text
    data = json.loads(out.read_text())
    assert data["budget_bytes"] == 12e9 and data["resident_bytes"] <= 12e9 and data["expert_format"] == "int4"
    assert [c["prompt_tokens"] for c in data["prefill"]] == [1024, 8192, 32768]  # up to the default context


def test_plan_from_a_model_directory(tmp_path, capsys):
    from importlib import resources

    model = tmp_path / "my-mixtral"
    model.mkdir()
    config = resources.files("hybridmoe.placement").joinpath("data/models/mixtral-8x7b/config.json").read_text()
    (model / "config.json").write_text(config)
    assert main(["plan", "--model", str(model), "--vram", "24GB", "--hardware", "rtx4090,desktop-2ch"]) == 0
    text = capsys.readouterr().out
    assert "my-mixtral" in text and "0-31" in text  # Mixtral's 32 layers


@pytest.mark.parametrize("argv, message", [
    (["plan", "--model", "nope", "--vram", "24GB", "--hardware", "rtx4090,desktop-2ch"], "packaged"),
    (["plan", "--model", "deepseek-v3", "--vram", "lots", "--hardware", "rtx4090,desktop-2ch"], "cannot read 'lots' as a memory size"),
    (["plan", "--model", "deepseek-v3", "--vram", "24GB", "--profile", "/nonexistent.json"], "hybridmoe profile"),
    (["plan", "--model", "deepseek-v3", "--vram", "1GB", "--hardware", "rtx4090,epyc-genoa-2s"], "raise --vram"),
    (["simulate", "--model", "deepseek-v3"], "--hardware are required"),
    (["simulate", "--model", "deepseek-v3", "--hardware", "rtx9999,epyc-genoa-2s"], "unknown hardware"),
    (["profile", "--routing-model", "some-model-dir"], "--routing-model needs --out"),  # keeps the hardware profile
])
def test_errors_say_what_is_wrong(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_simulate_writes_the_issue_schema(tmp_path, capsys):
    out = tmp_path / "sim.json"
    code = main(["simulate", "--model", "qwen3-30b-a3b", "--hardware", "rtx4090,desktop-2ch", "--formats", "int4",
                 "--prompts", "2048", "--no-longest", "--json", str(out)])
    assert code == 0 and "prefill tok/s" in capsys.readouterr().out
    records = json.loads(out.read_text())
    assert {r["strategy"] for r in records} == {"cpu-only", "hybrid", "slp"}
    for r in records:
        assert {"model", "hardware", "gpus", "strategy", "weight_format", "prompt_tokens", "ttft_s",
                "prefill_tok_s", "decode_tok_s"} <= set(r)


@pytest.mark.slow
def test_simulate_paper_prints_the_comparison(capsys):
    assert main(["simulate", "--paper"]) == 0
    text = capsys.readouterr().out
    assert "EPYC 9654" in text and "fitted" in text and "predicted" in text


def test_matmul_shapes_reach_prefill_sizes_on_an_accelerator():
    """An accelerator's table runs to prefill-sized products (the planner holds the last row's rate beyond it);
    a CPU's stays small enough to time in seconds, quick smaller still."""
    for quick in (True, False):
        n, tokens = matmul_shapes(quick, accelerator=True)
        assert n >= 4096 and max(tokens) >= 8192 and tokens == tuple(sorted(tokens)) and tokens[0] == 1
        cpu_n, cpu_tokens = matmul_shapes(quick, accelerator=False)
        assert max(cpu_tokens) <= 512 and cpu_n <= n
    assert matmul_shapes(True, False)[0] < matmul_shapes(False, False)[0]


@pytest.mark.slow
def resident_bytes() -> int:
    """This process's resident memory (Linux)."""
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_profile_then_plan_with_it(tmp_path, capsys):
    """A quick measured profile of this machine (with the engine's op tables for the demo model) loads, says what
    it measured, and plans a model: the demo model from the op tables, another from the roofline."""
    from hybridmoe.checkpoint.default_model import default_model_dir

    out, demo = tmp_path / "profile.json", str(default_model_dir())
    rss_before = resident_bytes()
    assert main(["profile", "--quick", "--formats", "fp8", "--model", demo, "--out", str(out)]) == 0
    # the GBs of synthetic experts it measured are given back, not left resident (they starved later tests)
    assert resident_bytes() - rss_before < 1.5e9
    data = json.loads(out.read_text())
    assert data["kind"] == "machine" and data["version"] == 1
    assert data["expert_kernels"] and data["cpu"]["expert_table"]["fp8"][0][0] == 1
    if "C++" in data["expert_kernels"][0]:  # the pool's idle spin sets the dispatch cost it measures
        from hybridmoe.kernels import isa

        assert f"idle spin {isa.idle_spin_us()} us" in data["cpu"]["dispatch_us"]["source"]
        # and where short rows' far prefetch went sets the expert timings
        assert f"short rows prefetched to {isa.short_row_prefetch().upper()}" in data["expert_kernels"][0]
    if data["gpu"]["stand_in"]:
        assert "stand-in" in json.dumps(data["gpu"]) or "standing in" in json.dumps(data["gpu"])
    n, tokens = matmul_shapes(True, not data["gpu"]["stand_in"])  # the table says what it measured
    assert [row[0] for row in data["gpu"]["matmul_table"]["bf16"]] == list(tokens)
    assert f"{n}^2 weights" in data["gpu"]["matmul_table_source"]
    capsys.readouterr()
    assert main(["plan", "--model", "qwen3-30b-a3b", "--vram", "4GB", "--profile", str(out),
                 "--experts", "fp8", "--context", "2048"]) == 0
    printed = capsys.readouterr().out
    assert "What goes where" in printed and "op tables are for another model (it lacks matmul" in printed
    assert data["cpu"]["op_tables"]["attention_shape"][0] == "mla"
    assert main(["plan", "--model", demo, "--vram", "1GB", "--profile", str(out), "--context", "1024"]) == 0
    assert "CPU pieces costed from this engine's op tables measured on this machine" in capsys.readouterr().out


@pytest.mark.slow
def test_measured_routing_picks_the_hot_experts(tmp_path, capsys):
    """`profile --routing-model` counts the demo model's expert choices; the planner pins the most used first."""
    import numpy as np

    from hybridmoe.checkpoint.default_model import default_model_dir
    from hybridmoe.placement.hardware import machine
    from hybridmoe.placement.modelspec import ModelSpec, resolve_model
    from hybridmoe.placement.planner import Planner
    from hybridmoe.placement.routing import RoutingStats

    model, out = str(default_model_dir()), tmp_path / "routing.json"
    assert main(["profile", "--routing-model", model, "--out", str(out)]) == 0
    stats = RoutingStats.from_json(out)
    assert stats.measured and stats.probs.std() > 0.05  # a trained router is far from uniform
    spec = ModelSpec(resolve_model(model))
    roomy = Planner(spec, machine("rtx4090,desktop-2ch"), 24e9, context=256, routing=stats)
    held = sum(i.nbytes for i in roomy.items if i.resident and i.kind != "expert")
    three = Planner(spec, machine("rtx4090,desktop-2ch"), held + 3.5 * roomy.cost.expert_bytes, context=256,
                    routing=stats)
    pinned = {(row, e) for row, experts in enumerate(three.residency.hot) for e in experts}
    top3 = sorted(((stats.probs[r, e], r, e) for r in range(len(stats.layers)) for e in range(stats.num_experts)),
                  key=lambda t: (-t[0], t[1], t[2]))[:3]
    assert pinned == {(r, e) for _, r, e in top3}
    assert main(["plan", "--model", model, "--vram", "4GB", "--hardware", "rtx4090,desktop-2ch",
                 "--routing", str(out), "--context", "256"]) == 0
    assert "uniform" not in capsys.readouterr().out and np.isfinite(stats.probs).all()
