"""The import direction of ARCHITECTURE.md, checked by import-linter's layers contract (pyproject.toml)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_imports_only_go_downwards():
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    if not Path(exe).exists():
        pytest.fail("import-linter is not installed (pip install -r requirements-test.txt)")
    result = subprocess.run([exe, "--config", str(ROOT / "pyproject.toml")], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
