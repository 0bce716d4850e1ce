"""Paths of the shipped demo model and its GQA companion (as installed with the package) and of the training recipe
they came from."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import hybridmoe

ASSETS = Path(hybridmoe.__file__).resolve().parent / "assets"
REPO_ROOT = Path(__file__).resolve().parents[2]
TRAINING_DIR = REPO_ROOT / "training"


@pytest.fixture(scope="session")
def demo_dir() -> Path:
    path = ASSETS / "demo_model"
    assert (path / "config.json").is_file(), f"the demo model is missing from {path}"
    return path


@pytest.fixture(scope="session")
def fp8_dir() -> Path:
    path = ASSETS / "demo_model_fp8"
    assert (path / "config.json").is_file(), f"the FP8 demo model is missing from {path}"
    return path


@pytest.fixture(scope="session")
def gqa_dir() -> Path:
    path = ASSETS / "gqa_model"
    assert (path / "config.json").is_file(), f"the GQA companion model is missing from {path}"
    return path


@pytest.fixture(scope="session")
def eval_report() -> dict:
    return json.loads((TRAINING_DIR / "results" / "eval.json").read_text())


@pytest.fixture(scope="session")
def gqa_eval_report() -> dict:
    return json.loads((TRAINING_DIR / "results" / "eval_gqa.json").read_text())


@pytest.fixture(scope="session")
def training_modules():
    """The training scripts' modules (passkey, chat_data, card, recipe), importable by name."""
    if str(TRAINING_DIR) not in sys.path:
        sys.path.insert(0, str(TRAINING_DIR))
    import card
    import chat_data
    import passkey
    import recipe

    return {"card": card, "chat_data": chat_data, "passkey": passkey, "recipe": recipe}


@pytest.fixture(scope="session")
def demo_model_fp32(demo_dir):
    import torch
    from transformers import DeepseekV3ForCausalLM

    return DeepseekV3ForCausalLM.from_pretrained(demo_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def gqa_model_fp32(gqa_dir):
    import torch
    from transformers import Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM.from_pretrained(gqa_dir, dtype=torch.float32).eval()
