"""Hybrid decode on the CPU stand-in: hot experts on the accelerator while the CPU kernels compute the others (each
token's hot assignments redirected to its own cold expert at weight 0), the combine equal to the CPU backend's
over all experts; hot experts chosen from measured routing statistics; prefill and decode steps use what is
resident without uploading it again; the CLI flags, `generate --verbose` and the server's metrics of what ran
where."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridmoe import LLM, SamplingParams
from hybridmoe.accel.accelerator import Accelerator
from hybridmoe.accel.stats import RunStats
from hybridmoe.checkpoint.fp8 import quantize_fp8
from hybridmoe.cli import build_parser, main
from hybridmoe.commands._generation import engine_config
from hybridmoe.kernels import isa
from hybridmoe.layers.moe.backend import ExpertWeights
from hybridmoe.layers.moe.cpu_backend import CpuExpertBackend
from hybridmoe.layers.moe.hybrid_backend import HybridExpertBackend, redirect_hot
from hybridmoe.models.placement import held_bytes
from hybridmoe.placement.routing import RoutingStats
from hybridmoe.serve.metrics import ServerMetrics

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
H, I, E, K = 64, 32, 8, 3


@pytest.fixture(autouse=True)
def exact_cpu_kernels():
    """The CPU kernels in float32 arithmetic (bf16 dot products and AMX round activations to bf16)."""
    exact = next(name for name in ("avx512", "avx2", "scalar") if name in isa.available_isas())
    with isa.use_isa(exact):
        yield


def test_redirect_hot_gives_the_cpu_only_cold_work():
    ids = torch.tensor([[0, 5, 2], [1, 3, 4], [6, 0, 1], [2, 7, 0]])
    weights = torch.tensor([[.5, .3, .2], [.6, .3, .1], [.4, .4, .2], [.7, .2, .1]])
    hot = torch.zeros(E, dtype=torch.bool)
    hot[[0, 1, 6]] = True
    rows, cpu_ids, cpu_weights = redirect_hot(ids, weights, hot[ids])
    assert rows.tolist() == [0, 1, 3]  # token 2 routes to hot experts only: not submitted
    # each hot assignment stands on the token's first cold expert, with weight 0
    assert cpu_ids.tolist() == [[5, 5, 2], [3, 3, 4], [2, 7, 2]]
    assert torch.equal(cpu_weights, torch.tensor([[0.0, .3, .2], [0.0, .3, .1], [.7, .2, 0.0]]))


def _experts(fmt: str, seed: int) -> ExpertWeights:
    gen = torch.Generator().manual_seed(seed)
    mats = {p: [torch.randn(shape, generator=gen) * 0.2 for _ in range(E)]
            for p, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I)))}
    if fmt == "dense":
        return ExpertWeights("dense", mats["gate"], mats["up"], mats["down"])
    q = {p: [quantize_fp8(w, (16, 16)) for w in ws] for p, ws in mats.items()}
    return ExpertWeights("fp8", *[[w for w, _ in q[p]] for p in ("gate", "up", "down")],
                         *[[s for _, s in q[p]] for p in ("gate", "up", "down")], block_size=(16, 16))


@pytest.mark.parametrize("fmt", ["dense", "fp8"])
@pytest.mark.parametrize("hot", [(), (1,), (0, 3, 6), tuple(range(E))])
def test_hot_plus_cpu_experts_equal_the_cpu_backend_over_all_experts(fmt, hot):
    weights = _experts(fmt, seed=len(hot))
    gen = torch.Generator().manual_seed(7)
    tokens = 9
    hidden = torch.randn(tokens, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)])  # [T, K] distinct per token
    ids[0] = torch.tensor([0, 3, 6])  # a token routed to hot experts only (when 0, 3, 6 are hot)
    topk_weights = torch.rand(tokens, K, generator=gen)
    expected = CpuExpertBackend(weights).wait(CpuExpertBackend(weights).submit(hidden, ids, topk_weights))
    accel, stats = Accelerator("cpu"), RunStats()
    device_copy = weights.subset(list(hot)).to_device(accel, "hot experts.0") if hot else None
    backend = HybridExpertBackend(CpuExpertBackend(weights), hot, device_copy, E, accel, stats)
    stats.begin_step("decode")
    out = backend.wait(backend.submit(hidden, ids, topk_weights))
    stats.end_step(tokens)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    on_hot = int(torch.isin(ids, torch.tensor(hot, dtype=torch.long)).sum())
    assert stats.last.hot_expert_assignments == on_hot
    assert stats.last.cpu_expert_assignments == ids.numel() - on_hot
    assert accel.held_bytes == (sum(weights.expert_bytes(e) for e in hot))


@pytest.fixture(scope="module")
def qwen(tiny_model_dir):
    return tiny_model_dir("qwen3_moe", num_experts=16)


def _prompts(lengths=(9, 26)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(6, 300, (n,), generator=gen).tolist() for n in lengths]


def test_hot_experts_come_from_measured_routing_statistics(qwen, tmp_path):
    plain_llm = LLM(qwen, dtype="float32")
    plain = [r.token_ids for r in plain_llm.generate(_prompts(), GREEDY)]
    moe_layers = (0, 1, 2)
    counts = np.full((3, 16), 125)  # 1000 tokens, top-2: 2000 choices per layer
    counts[0] = 21
    counts[0, [11, 4, 0]] = (900, 800, 27)  # layer 0 routes most to experts 11 and 4
    counts[2] = 70
    counts[2, 9] = 950  # layer 2 to expert 9
    routing = tmp_path / "routing.json"
    RoutingStats.from_counts(moe_layers, counts, 2).to_json(routing)
    reference = LLM(qwen, dtype="float32", kv_cache_gb=0.0005, vram="256MB").engine.placement.plan
    need = sum(i.nbytes for i in reference.items if i.kind != "expert")
    static = sum(i.nbytes for i in reference.items if i.kind in ("attention", "router", "shared", "dense", "lm_head"))
    excess = held_bytes(plain_llm.engine.model) - static  # the plan is made for the budget less this
    expert = next(i.nbytes / int(i.name.split("(")[1].split()[0]) for i in reference.items
                  if i.kind == "expert" and i.resident)
    llm = LLM(qwen, dtype="float32", kv_cache_gb=0.0005, vram=int(need + max(0, excess) + 3.5 * expert),
              routing=str(routing))
    assert llm.engine.placement.hot == {0: (4, 11), 2: (9,)}  # the three most frequently routed
    assert llm.engine.placement.plan.routing_measured
    assert [r.token_ids for r in llm.generate(_prompts(), GREEDY)] == plain


def _device_tensors(model) -> dict[str, int]:
    """data_ptr of every weight placed on the accelerator, by a path name."""
    out = {}
    for i, layer in enumerate(model.layers):
        out[f"attention.{i}.o_proj"] = layer.attention.w.o_proj.data.data_ptr()
        out[f"norm.{i}"] = layer.input_norm.data_ptr()
        backend = getattr(layer.mlp, "experts", None)
        if getattr(backend, "hot_backend", None) is not None:
            out[f"hot.{i}"] = backend.hot_backend.w.gate[0].data_ptr()
    out["lm_head"] = model.lm_head.data.data_ptr()
    return out


@pytest.mark.parametrize("stream_prefill", ["off", "on"])
def test_prefill_and_decode_steps_use_what_is_resident_without_uploading_it_again(qwen, stream_prefill):
    llm = LLM(qwen, dtype="float32", kv_cache_gb=0.0005, vram="256MB", stream_prefill=stream_prefill,
              max_num_batched_tokens=16)  # a 26-token prompt prefills in two chunks, then decodes
    engine = llm.engine
    held, tensors = dict(engine.accel.ledger.held), _device_tensors(engine.model)
    plain = [r.token_ids for r in LLM(qwen, dtype="float32").generate(_prompts(), GREEDY)]
    for _ in range(2):  # prefill and decode, twice: nothing placed again, nothing more held
        assert [r.token_ids for r in llm.generate(_prompts(), GREEDY)] == plain
        assert engine.accel.ledger.held == held and _device_tensors(engine.model) == tensors
    phases = engine.run_stats.phases
    assert phases["prefill"].steps >= 4 and phases["decode"].steps >= 5
    if stream_prefill == "on":
        assert any(name.startswith("slp") for name in held)  # the slots: allocated once, at load
        assert phases["prefill"].bytes_streamed > 0 and phases["decode"].bytes_streamed == 0
    engine.close()


def test_cli_flags_reach_the_engine_config():
    parser = build_parser()
    for command in (["generate", "--prompt", "x"], ["chat"], ["serve"]):
        args = parser.parse_args(command + ["--device", "cpu", "--vram", "24GB", "--gpus", "2", "--stream-prefill",
                                            "on", "--plan", "p.json", "--routing", "r.json", "--verbose"])
        cfg = engine_config(args)
        assert (cfg.device, cfg.vram, cfg.num_gpus, cfg.stream_prefill, cfg.plan, cfg.routing, cfg.verbose) == \
            ("cpu", "24GB", 2, "on", "p.json", "r.json", True)
    defaults = engine_config(parser.parse_args(["generate", "--prompt", "x"]))
    assert (defaults.device, defaults.vram, defaults.num_gpus, defaults.stream_prefill, defaults.plan) == \
        ("auto", None, 1, "auto", None)
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--prompt", "x", "--stream-prefill", "sometimes"])
    with pytest.raises(ValueError, match="cannot read 'lots' as a memory size"):
        engine_config(parser.parse_args(["generate", "--prompt", "x", "--vram", "lots"]))


def test_generate_verbose_prints_the_plan_and_what_ran_where(qwen, capsys):
    assert main(["generate", "--model", str(qwen), "--prompt", "The quick brown fox", "--max-tokens", "4",
                 "--ignore-eos", "--dtype", "float32", "--kv-cache-gb", "0.0005", "--vram", "3MB", "--verbose"]) == 0
    err = capsys.readouterr().err
    assert "What goes where" in err and "placed on the accelerator (cpu stand-in" in err
    assert "note: accelerator: the CPU stand-in" in err
    assert "on the accelerator:" in err and "kv cache" in err
    assert "decode: 3 steps" in err and "CPU experts" in err


def test_generate_with_a_budget_too_small_is_a_clear_error(qwen, capsys):
    assert main(["generate", "--model", str(qwen), "--prompt", "x", "--dtype", "float32", "--kv-cache-gb", "0.0005",
                 "--vram", "10KB"]) == 2
    assert "error: a vram budget of 0.01 MiB cannot hold" in capsys.readouterr().err


def test_server_metrics_report_what_ran_where(qwen):
    llm = LLM(qwen, dtype="float32", kv_cache_gb=0.0005, vram="3MB")
    llm.generate(_prompts(), GREEDY)
    text = ServerMetrics("m", lambda: None, lambda: llm.engine.run_stats).render().decode()
    assert 'hybridmoe:accelerator_bytes{kind="attention",model_name="m"}' in text
    assert 'hybridmoe:accelerator_bytes{kind="kv cache",model_name="m"}' in text
    decode = llm.engine.run_stats.phases["decode"]
    assert f'hybridmoe:engine_steps_total{{model_name="m",phase="decode"}} {float(decode.steps)}' in text
    assert 'hybridmoe:cpu_experts_seconds_total{model_name="m",phase="decode"}' in text
    assert f'hybridmoe:expert_assignments_total{{model_name="m",phase="decode",where="cpu"}} ' \
           f'{float(decode.cpu_expert_assignments)}' in text
    assert "hybridmoe:stream_copy_gbs" in text
    # before the model is loaded there is nothing to report
    assert "accelerator_bytes" not in ServerMetrics("m", lambda: None, lambda: None).render().decode()


@pytest.mark.slow
def test_two_ranks_of_expert_parallelism_through_the_engine(qwen):
    plain = [r.token_ids for r in LLM(qwen, dtype="float32").generate(_prompts(), GREEDY)]
    llm = LLM(qwen, dtype="float32", kv_cache_gb=0.0005, vram="3MB", num_gpus=2, stream_prefill="on")
    try:
        assert [r.token_ids for r in llm.generate(_prompts(), GREEDY)] == plain
        assert "over 2 ranks" in llm.engine.prefill_note
    finally:
        llm.engine.close()
