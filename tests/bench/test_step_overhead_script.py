"""benchmarks/step_overhead.py, shortened (a 2-layer model, 2 rounds): the variants decode and their times and ratios
are printed; --variants picks some."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "step_overhead.py"


def _run(model, *extra) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--model", str(model), "--rounds", "2", *extra],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_the_script_times_every_variant(tiny_model_dir):
    model = tiny_model_dir("qwen3_moe", num_hidden_layers=2)
    result = _run(model)
    assert result.returncode == 0, result.stderr[-2000:]
    line = result.stdout.strip().splitlines()[-1]
    times = re.search(r"median of 2 rounds: stack ([\d.]+), kernels ([\d.]+), torch ([\d.]+), "
                      r"torch / kernels ([\d.]+)x, kernels / stack ([\d.]+)x$", line)
    assert times, line
    stack, kernels, torch_ms, _, _ = map(float, times.groups())
    assert stack > 0 and kernels > 0 and torch_ms > 0
    picked = _run(model, "--variants", "kernels,stack")
    assert picked.returncode == 0, picked.stderr[-2000:]
    assert re.search(r"kernels [\d.]+, stack [\d.]+, stack / kernels [\d.]+x$", picked.stdout.strip())
    bad = _run(model, "--variants", "stack,gpu")
    assert bad.returncode != 0 and "--variants: some of stack, kernels, torch" in bad.stderr
