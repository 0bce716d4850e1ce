"""The thread pool's task sets under ThreadSanitizer (pool_stress.cpp, built here with the C++ compiler): calls
back to back on more threads than CPUs, workers spinning and sleeping, flat and split over nodes. A data race in
joining, leaving or waking fails it, as does a task run twice or not at all; a lost wake-up hangs it (timeout)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
CSRC = HERE.parents[1] / "csrc"


@pytest.mark.slow
def test_pool_task_sets_under_thread_sanitizer(tmp_path):
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    assert cxx, "a C++ compiler is needed (it builds the package)"
    exe = tmp_path / "pool_stress"
    build = subprocess.run([cxx, "-std=c++17", "-O1", "-g", "-fsanitize=thread", f"-I{CSRC}",
                            str(HERE / "pool_stress.cpp"), str(CSRC / "thread_pool.cpp"), str(CSRC / "numa.cpp"),
                            "-pthread", "-o", str(exe)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    # setarch -R: without address-space randomisation (ThreadSanitizer's shadow memory can clash with the
    # mappings of kernels that randomise more bits); TSAN_OPTIONS: fail on the first report
    setarch = shutil.which("setarch")
    command = [setarch, platform.machine(), "-R", str(exe)] if setarch else [str(exe)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, TSAN_OPTIONS="halt_on_error=1 exitcode=66"))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert result.stdout.strip() == "ok"
