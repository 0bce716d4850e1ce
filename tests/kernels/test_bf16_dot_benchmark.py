"""benchmarks/bf16_dot.py runs end to end (tiny pool, one round) and prints one row per case."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bf16_dot.py"


@pytest.mark.slow
def test_bf16_dot_benchmark_prints_every_case():
    result = subprocess.run([sys.executable, str(SCRIPT), "--formats", "fp8,bf16", "--tokens", "1,6", "--rounds", "1",
                             "--pool-mib", "64", "--seconds", "0.02"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines()[1:] if line.strip()]
    # format, tokens, threads (1, then all), rows in; the two ISAs' GFLOP/s and B's speedup
    assert [(r[0], r[1], r[3]) for r in rows] == [
        (f, t, where) for f in ("fp8", "bf16") for t in ("1", "6") for _ in range(2) for where in ("cache", "memory")]
    assert rows[0][2] == "1"  # one thread first
    assert all(float(r[4]) > 0 and float(r[5]) > 0 and r[6].endswith("x") for r in rows)


@pytest.mark.slow
def test_each_side_runs_its_own_path():
    """--paths: the same ISA on two paths (auto against a forced GEMM), named in the header."""
    result = subprocess.run([sys.executable, str(SCRIPT), "--isas", "scalar,scalar", "--paths", "auto,gemm",
                             "--formats", "bf16", "--tokens", "2", "--rounds", "1", "--pool-mib", "16",
                             "--seconds", "0.01"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    header, *rows = [line for line in result.stdout.splitlines() if line.strip()]
    assert "scalar auto GFLOP/s" in header and "scalar gemm GFLOP/s" in header
    assert len(rows) == 4


def test_a_side_without_a_path_is_a_clear_error():
    result = subprocess.run([sys.executable, str(SCRIPT), "--isas", "scalar,scalar", "--paths", "auto"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "--isas and --paths each take two names" in result.stderr
