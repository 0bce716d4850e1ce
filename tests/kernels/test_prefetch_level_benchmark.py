"""benchmarks/prefetch_level.py runs end to end on a tiny shape (few rounds) and prints one row per case, and
leaves the prefetch level as it found it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "prefetch_level.py"


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


@pytest.mark.slow
def test_prefetch_level_benchmark_prints_every_case():
    result = _run("--shapes", "256x96x16x4", "--formats", "fp8,int4", "--tokens", "1,2", "--rounds", "2",
                  "--seconds", "0.02", "--pool-mib", "4", HYBRIDMOE_SHORT_ROW_PREFETCH="l1")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "short rows prefetched to l1 in this process" in lines[0]
    rows = [line.split() for line in lines[2:] if line.strip()]
    assert [(r[0], r[1], r[2]) for r in rows] == [("256x96x16x4", f, t) for f in ("fp8", "int4") for t in ("1", "2")]
    for r in rows:
        l1_ms, l1_gbs, l2_ms, l2_gbs = map(float, r[3:7])
        assert min(l1_ms, l1_gbs, l2_ms, l2_gbs) > 0
        low, high = map(float, r[8].split("-"))
        assert low <= float(r[7].rstrip("x")) <= high


@pytest.mark.slow
def test_whole_engine_decode_at_both_levels(tiny_model_dir):
    """--model decodes with each level in turn in one engine: both give the same greedy tokens."""
    model = tiny_model_dir("qwen3_moe")
    result = _run("--model", str(model), "--rounds", "2", "--prompt-tokens", "12", "--decode-tokens", "4",
                  HYBRIDMOE_SHORT_ROW_PREFETCH="l1")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "whole-engine decode of 4 tokens after 12, medians of 2 alternating rounds" in lines[0]
    (row,) = [line for line in lines[1:] if line.startswith(str(model))]
    fields = row.split()
    assert float(fields[fields.index("L1") + 1]) > 0 and float(fields[fields.index("L2") + 1].rstrip(",")) > 0
    assert row.endswith("same tokens: True")


def test_bad_arguments_are_clear_errors():
    result = _run("--shapes", "256x96x16")
    assert result.returncode != 0 and "HIDDENxINTERxEXPERTSxTOPK" in result.stderr
    result = _run("--shapes", "256x96x4x8")
    assert result.returncode != 0 and "top-k 8 is more than its 4 experts" in result.stderr
    result = _run("--shapes", "256x96x16x4", "--formats", "fp4")
    assert result.returncode != 0 and "unknown format(s) ['fp4']" in result.stderr
    result = _run("--shapes", "256x96x16x4", "--rounds", "0")
    assert result.returncode != 0 and "must be positive" in result.stderr
    result = _run("--shapes", "256x96x16x4", "--pool-mib", "0")
    assert result.returncode != 0 and "must be positive" in result.stderr
    result = _run("--model", "unused", "--decode-tokens", "0")
    assert result.returncode != 0 and "--decode-tokens must be positive" in result.stderr
