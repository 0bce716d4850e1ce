"""placement/ is numpy only: importing all of it (and planning) must not import torch."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys, pkgutil, importlib
import hybridmoe.placement as p
for m in pkgutil.iter_modules(p.__path__):
    importlib.import_module(f"hybridmoe.placement.{m.name}")
from hybridmoe.placement.modelspec import ModelSpec, resolve_model
from hybridmoe.placement.hardware import machine
from hybridmoe.placement.planner import Planner
Planner(ModelSpec(resolve_model("mixtral-8x7b")), machine("rtx4090,desktop-2ch"), 16e9, context=2048).plan()
print("torch" in sys.modules)
"""


def test_placement_never_imports_torch():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
