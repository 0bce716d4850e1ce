"""`hybridmoe bench costmodel` plumbing: the on-the-fly Qwen3-shaped checkpoint is a real Qwen3-MoE checkpoint
(transformers loads it and agrees with our engine), the minimal-width copy keeps the architecture, and the
bench writes one row per case whose prediction the planner's cost model recomputes from the op tables it wrote
(whatever the CPU's roofline numbers). No timed assertions: whether predictions land within 15% is the bench's
report, not a test."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch

from hybridmoe.bench.predicted_vs_measured import PARTS, predict, qwen_shaped_model
from hybridmoe.config import load_config
from hybridmoe.kernels import isa
from hybridmoe.placement.hardware import CpuSpec
from hybridmoe.placement.op_tables import OpTables
from hybridmoe.profiling import op_tables as bench
from hybridmoe.profiling.op_tables import minimal_width_copy

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
    # the projections' kernels in float32 arithmetic: AMX and bf16 dot products round activations to bf16 (~2e-3)
    exact = next(name for name in ("avx512", "avx2", "scalar") if name in isa.available_isas())
    with torch.inference_mode(), isa.use_isa(exact):
        got = runner.forward([SequenceChunk(ids.tolist(), 0, [0, 1, 2, 3])], all_logits=True)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "qwen3_moe"])
def test_minimal_width_copy_keeps_the_architecture(tiny_model_dir, tmp_path, model_type):
    source = tiny_model_dir(model_type, hidden_size=96, moe_intermediate_size=48, intermediate_size=160,
                            **({"q_lora_rank": 40, "kv_lora_rank": 48} if model_type == "deepseek_v3" else {}))
    original, copy = load_config(source), load_config(minimal_width_copy(source, tmp_path / "copy"))
    assert copy.hidden_size == copy.intermediate_size == copy.moe.intermediate_size == bench.TINY_WIDTH
    assert copy.attention.head_dim <= original.attention.head_dim and copy.vocab_size <= 320
    for same in ("architecture", "num_layers", "moe_layers", "tie_word_embeddings"):
        assert getattr(copy, same) == getattr(original, same), same
    for same in ("kind", "num_heads", "num_kv_heads", "qk_norm"):
        assert getattr(copy.attention, same) == getattr(original.attention, same), same
    assert (copy.attention.q_lora_rank is None) == (original.attention.q_lora_rank is None)
    for same in ("num_experts", "num_experts_per_tok", "num_shared_experts", "scoring_func", "topk_method",
                 "n_group", "topk_group", "norm_topk_prob"):
        assert getattr(copy.moe, same) == getattr(original.moe, same), same


def test_bench_writes_a_row_per_case_predicted_from_the_tables_it_wrote(tiny_model_dir, tmp_path, monkeypatch,
                                                                         capsys):
    """Small grids keep this to seconds; the schema and the link prediction <- tables are what is checked."""
    from hybridmoe.cli import main

    for name, grid in (("LINEAR_TOKENS", (1, 16, 256)), ("ELEMENTS", (64, 4096)),
                       ("DECODE_CONTEXTS", (4, 64, 256)), ("PREFILL_TOKENS", (4, 64, 512)),
                       ("EXPERT_TOKENS", (1, 16, 256))):
        monkeypatch.setattr(bench, name, grid)
    monkeypatch.setattr(bench, "last_level_cache_bytes", lambda: 2**20)
    models = [tiny_model_dir("deepseek_v3"), qwen_shaped_model(1, tmp_path, shape=MINI)]
    out, tables_out = tmp_path / "rows.json", tmp_path / "tables.json"
    assert main(["bench", "costmodel", "--models", ",".join(map(str, models)), "--rounds", "2", "--repeats", "1",
                 "--case-seconds", "0", "--cases", "cpu", "--json", str(out), "--tables", str(tables_out)]) == 0
    assert "cases within 15%" in capsys.readouterr().out
    rows, tables = json.loads(out.read_text()), json.loads(tables_out.read_text())
    names = [f"{m.name} {case}" for m in models for case in ("decode(ctx=128)", "prefill(128)", "prefill(512)")]
    assert [r["name"] for r in rows] == names
    for row in rows:
        assert row["predicted_s"] > 0 and row["measured_s"] > 0 and math.isfinite(row["predicted_s"])
        assert row["ratio"] == pytest.approx(row["predicted_s"] / row["measured_s"])
        assert row["threads"] == 1 and len(row["load_average_1min"]) == 5 and len(row["rounds"]) == 2
        assert set(row["predicted_parts_s"]) == set(PARTS)
        assert sum(row["predicted_parts_s"].values()) == pytest.approx(row["predicted_s"])
        assert row["measured_s"] == pytest.approx(statistics.median(r["measured_s"] for r in row["rounds"]))
        label, case = row["name"].split(" ", 1)
        kind, tokens, context = ("decode", 1, 128) if case.startswith("decode") else ("prefill", int(case[8:-1]), 0)
        config = load_config(next(m for m in models if m.name == label))
        again = []
        for written in tables[label]["rounds"]:
            measured = OpTables.from_json(written)
            assert measured.threads == 1 and measured.dtype in ("float32", "bfloat16")
            cpu = CpuSpec("any", "", cores=1, memory_gb=1.0, memory_read_gbs=1.0, stream_efficiency=1.0,
                          peak_tflops=1e-3, matmul_efficiency=1.0, decode_gweights_s={}, op_tables=measured)
            again.append(predict(cpu, config, kind, tokens, context, tables[label]["routing"][case]).total_s)
        assert again == [r["predicted_s"] for r in row["rounds"]]
        assert row["predicted_s"] == sorted(again)[0]  # the lower median of two rounds
