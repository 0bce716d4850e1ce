"""`hybridmoe bench costmodel` plumbing: the on-the-fly Qwen3-shaped checkpoint is a real Qwen3-MoE checkpoint
(transformers loads it and agrees with our engine), and the bench's cases run and are predicted."""

from __future__ import annotations

import math

import pytest
import torch

from hybridmoe.bench.costmodel import EngineCase, predict, qwen_shaped_model
from hybridmoe.placement.hardware import machine

pytestmark = pytest.mark.slow

MINI = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2)


def test_written_checkpoint_matches_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    from hybridmoe.models.loader import load_model
    from hybridmoe.runtime.model_runner import ModelRunner, SequenceChunk

    path = qwen_shaped_model(2, tmp_path, shape=MINI)
    ids = torch.randint(0, MINI["vocab_size"], (12,), generator=torch.Generator().manual_seed(3))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]  # [T, V]
    ours = load_model(path, "float32", "torch", show_progress=False)
    runner = ModelRunner(ours, 4, 16)
    with torch.inference_mode():
        got = runner.forward([SequenceChunk(ids.tolist(), 0, [0, 1, 2, 3])], all_logits=True)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_cases_run_and_are_predicted(tmp_path):
    case = EngineCase(qwen_shaped_model(1, tmp_path, shape=MINI))
    decode_s, decode_ops = case.decode_s(128, repeats=1)
    prefill_s, prefill_ops = case.prefill_s(128, repeats=1)
    assert decode_s > 0 and prefill_s > 0 and 0 < decode_ops < prefill_ops * 10
    m = machine("rtx4090,desktop-2ch")
    for kind, tokens, ops in (("decode", 128, decode_ops), ("prefill", 128, prefill_ops)):
        predicted = predict(m, case.config, kind, tokens, ops)
        assert math.isfinite(predicted) and predicted > 0
