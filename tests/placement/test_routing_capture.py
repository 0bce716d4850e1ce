"""`hybridmoe profile --routing-model DIR` counts the experts a real model routes sample prompts to, through the
model's routing observers."""

from __future__ import annotations

import json

import torch

from hybridmoe.cli import main
from hybridmoe.models.loader import load_model
from hybridmoe.runtime.model_runner import ModelRunner, SequenceChunk


def test_routing_observer_sees_every_moe_layer(tiny_model_dir):
    model = load_model(tiny_model_dir("deepseek_v3"), "float32")
    seen: dict[int, torch.Tensor] = {}
    model.add_routing_observer(lambda index, ids: seen.__setitem__(index, ids))
    ModelRunner(model, num_blocks=2, block_size=8).forward([SequenceChunk([5, 6, 7, 8, 9], 0, [0])])
    moe_layers = [i for i, is_moe in enumerate(model.config.moe_layers) if is_moe]
    assert sorted(seen) == moe_layers
    for ids in seen.values():
        assert ids.shape == (5, model.config.moe.num_experts_per_tok)
        assert ids.min() >= 0 and ids.max() < model.config.moe.num_experts


def test_profile_routing_model_writes_counts(tiny_model_dir, tmp_path):
    out = tmp_path / "routing.json"
    model_dir = tiny_model_dir("qwen3_moe")
    assert main(["profile", "--routing-model", str(model_dir), "--out", str(out)]) == 0
    stats = json.loads(out.read_text())
    assert stats["values"] == "counts" and stats["top_k"] == 2 and stats["tokens"] > 0
    assert sorted(stats["layers"]) == ["0", "1", "2"]  # every layer of the tiny Qwen3 model is MoE
    for counts in stats["layers"].values():
        assert len(counts) == 8 and sum(counts) == stats["tokens"] * stats["top_k"]
