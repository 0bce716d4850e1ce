"""benchmarks/step_overhead.py, shortened (a 2-layer model, 2 rounds): both variants decode and their times and
ratio are printed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "step_overhead.py"


@pytest.mark.slow
def test_the_script_times_both_variants(tiny_model_dir):
    model = tiny_model_dir("qwen3_moe", num_hidden_layers=2)
    result = subprocess.run([sys.executable, str(SCRIPT), "--model", str(model), "--rounds", "2"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    line = result.stdout.strip().splitlines()[-1]
    assert "ms a decode step, median of 2 rounds: torch " in line and line.endswith("x")
    torch_ms = float(line.split("torch ")[1].split(",")[0])
    kernels_ms = float(line.split("kernels ")[1].split(",")[0])
    assert torch_ms > 0 and kernels_ms > 0
