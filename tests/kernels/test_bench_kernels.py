"""`hybridmoe bench kernels` end to end on tiny shapes: the JSON it writes has the fields the issue names."""

from __future__ import annotations

import argparse
import json

import pytest

from hybridmoe.bench import kernels as bench
from hybridmoe.kernels import numa


@pytest.mark.slow
def test_bench_writes_the_report(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "SHAPES", {"tiny": (256, 96, 16, 4)})
    monkeypatch.setattr(bench, "QUICK_TOKENS", {"tiny": (1, 9)})
    out = tmp_path / "kernels.json"
    assert bench.run(argparse.Namespace(quick=True, json=str(out), formats="fp8,int4,bf16")) == 0
    report = json.loads(out.read_text())
    assert report["memory_bandwidth_gbs"] > 0 and report["threads"] >= 1 and report["isa"]
    assert report["expert_memory"] == bench.EXPERT_MEMORY[numa.topology()["copy_shards"]]
    assert [(r["format"], r["tokens"]) for r in report["results"]] == [
        (f, t) for f in ("fp8", "int4", "bf16") for t in (1, 9)]
    for row in report["results"]:
        for key in ("shape", "weight_gbs", "bandwidth_fraction", "speedup_vs_bf16_torch", "speedup_vs_dequant_torch"):
            assert key in row
        assert row["weight_gbs"] > 0 and row["speedup_vs_bf16_torch"] > 0
        # fractions are of the case's own probes (taken beside it), which the run's best probe bounds
        assert row["bandwidth_fraction"] == pytest.approx(row["weight_gbs"] / row["probe_gbs"])
        assert row["flops_fraction"] == pytest.approx(row["gflops"] / row["probe_gflops"])
        assert 0 < row["probe_gbs"] <= report["memory_bandwidth_gbs"]
        assert row["bandwidth_fraction_of_best"] == pytest.approx(row["weight_gbs"] / report["memory_bandwidth_gbs"])
    # the opening and closing probes, and per format one before its first case and one after each case
    assert len(report["memory_bandwidth_gbs_probes"]) == 2 + 3 * (1 + 2)
    assert report["memory_bandwidth_gbs"] == max(report["memory_bandwidth_gbs_probes"])


def test_unknown_formats_are_refused():
    with pytest.raises(SystemExit, match="unknown format"):
        bench.run(argparse.Namespace(quick=True, json=None, formats="fp4"))
