"""benchmarks/gemv_ab.sh compiles a git ref's kernel headers beside the working tree's and times both: with HEAD
as the base and csrc/ unchanged, the two sides must compute the same outputs bit for bit, with the matrices on
4 KB or (HM_AB_HUGE_PAGES=1) huge pages, fp8 with subnormal codes (HM_AB_SUBNORMALS=1), and for int formats with
scale groups of 128 or (HM_AB_INT_GROUP=32) 32, on one thread or (HM_AB_THREADS=2) two at once, with short rows
prefetched to L1 or (HM_AB_SHORT_ROW_PREFETCH=l2) L2, and long rows with and (HM_AB_LONG_ROW_PREFETCH=off) without
the next row's prefetch."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from hybridmoe.kernels import isa

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gemv_ab.sh"


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    """One build of the harness for the module's runs (HM_AB_BUILD_DIR): the settings below are all run time."""
    return tmp_path_factory.mktemp("gemv_ab")


@pytest.mark.slow
@pytest.mark.parametrize("fmt,cols,env", [
    ("fp8", 256, {"HM_AB_HUGE_PAGES": "0"}), ("fp8", 256, {"HM_AB_HUGE_PAGES": "1"}),
    ("fp8", 256, {"HM_AB_SUBNORMALS": "1"}), ("int4", 256, {"HM_AB_INT_GROUP": "32"}),
    ("int4", 256, {"HM_AB_THREADS": "2"}), ("fp8", 256, {"HM_AB_SHORT_ROW_PREFETCH": "l2"}),
    ("bf16", 2048, {"HM_AB_LONG_ROW_PREFETCH": "off"})])
def test_gemv_ab_times_head_against_the_working_tree(fmt, cols, env, build_dir):
    if shutil.which("git") is None or _git("rev-parse", "HEAD").returncode != 0:
        pytest.skip("not a git checkout")
    if "avx2" not in isa.available_isas():
        pytest.skip("the harness needs AVX2")
    result = subprocess.run(["bash", str(SCRIPT), "--isa", "avx2", fmt, "64", str(cols), "1", "5"],
                            capture_output=True, text=True, timeout=600,
                            env={**os.environ, "HM_AB_POOL_BYTES": "2000000", "HM_AB_BUILD_DIR": str(build_dir),
                                 **env})
    assert result.returncode == 0, result.stderr
    assert (build_dir / "stamp").exists()
    lines = result.stdout.splitlines()
    assert lines[0].startswith("base ") and "ISA avx2" in lines[0]
    assert lines[0].endswith(f"short rows prefetched to {env.get('HM_AB_SHORT_ROW_PREFETCH', 'l1')}, long rows' "
                             f"next-row prefetch {env.get('HM_AB_LONG_ROW_PREFETCH', 'on')}, "
                             f"{env.get('HM_AB_THREADS', '1')} thread(s)")
    rows = [line.split() for line in lines[2:]]
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [(fmt, "64", str(cols), "1"), (fmt, "64", str(cols), "5")]
    for r in rows:
        assert float(r[4]) > 0 and float(r[5]) > 0 and r[6].endswith("x") and float(r[7]) > 0
    if not _git("status", "--porcelain", "--", "csrc").stdout.strip():  # HEAD's headers are the working tree's
        assert all(float(r[8]) == 0.0 for r in rows)


def test_gemv_ab_rejects_bad_arguments():
    result = subprocess.run(["bash", str(SCRIPT), "--isa", "sse2", "fp8", "64", "256", "1"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and "--isa must be" in result.stderr
    result = subprocess.run(["bash", str(SCRIPT), "int4", "64", "256", "1"], capture_output=True, text=True,
                            timeout=60, env={**os.environ, "HM_AB_INT_GROUP": "64"})
    assert result.returncode == 2 and "HM_AB_INT_GROUP must be 32 or 128" in result.stderr
    for threads in ("0", "65", "two"):
        result = subprocess.run(["bash", str(SCRIPT), "int4", "64", "256", "1"], capture_output=True, text=True,
                                timeout=60, env={**os.environ, "HM_AB_THREADS": threads})
        assert result.returncode == 2 and "HM_AB_THREADS must be 1..64" in result.stderr, threads
    result = subprocess.run(["bash", str(SCRIPT), "fp8", "64", "256", "1"], capture_output=True, text=True,
                            timeout=60, env={**os.environ, "HM_AB_SHORT_ROW_PREFETCH": "l3"})
    assert result.returncode == 2 and "HM_AB_SHORT_ROW_PREFETCH must be l1 or l2, got l3" in result.stderr
    result = subprocess.run(["bash", str(SCRIPT), "bf16", "64", "2048", "1"], capture_output=True, text=True,
                            timeout=60, env={**os.environ, "HM_AB_LONG_ROW_PREFETCH": "no"})
    assert result.returncode == 2 and "HM_AB_LONG_ROW_PREFETCH must be on or off, got no" in result.stderr
