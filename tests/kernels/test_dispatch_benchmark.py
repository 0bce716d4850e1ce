"""benchmarks/dispatch.py runs end to end (few calls, one round) and prints one row per case."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "dispatch.py"


@pytest.mark.slow
def test_dispatch_benchmark_prints_every_case():
    result = subprocess.run([sys.executable, str(SCRIPT), "--threads", "1,2", "--spins-us", "0,200000", "--pauses-us",
                             "0,2000", "--calls", "40", "--rounds", "1"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines()[2:] if line.strip()]
    # threads, spin, pause, then direct and submit + wait as "median (range)", then sleeps per call
    assert [(r[0], r[1], r[2]) for r in rows] == [
        (t, s, p) for t in ("1", "2") for s in ("0", "200000") for p in ("0", "2000")]
    assert all(float(r[3]) > 0 and float(r[5]) > 0 for r in rows)
    sleeps = {(r[0], r[1], r[2]): float(r[7]) for r in rows}
    assert sleeps[("2", "0", "2000")] >= 1  # no spin: the worker sleeps through every pause
    assert sleeps[("2", "200000", "2000")] == 0  # a spin longer than the pause: it never sleeps
    assert sleeps[("1", "0", "2000")] == 0  # one thread: no workers


def test_bad_spin_is_a_clear_error():
    result = subprocess.run([sys.executable, str(SCRIPT), "--threads", "1", "--spins-us", "-5", "--calls", "1",
                             "--rounds", "1"], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "idle spin must be between 0 and 10000000 microseconds, got -5" in result.stderr
