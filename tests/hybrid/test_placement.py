"""Plan-driven placement on the CPU stand-in: the engine plans the model for a vram budget and places what the plan
makes resident (attention with its KV cache, routers, shared experts, dense layers, LM head, hot experts) on the
accelerator; the greedy tokens are the plain engine's on tiny DeepSeek-V3 (FP8), Qwen3-MoE and Mixtral models; the
device memory stays within the budget (the ledger's peak); a plan file from `hybridmoe plan --json` runs; budgets
and plans that cannot work fail naming the item."""

from __future__ import annotations

import json

import pytest
import torch

from hybridmoe import LLM, SamplingParams
from hybridmoe.accel.accelerator import DeviceMemoryError
from hybridmoe.checkpoint.fp8 import write_fp8_checkpoint
from hybridmoe.cli import main
from hybridmoe.kernels import isa
from hybridmoe.layers.device_linear import DeviceLinear
from hybridmoe.layers.moe.block import MoEBlock
from hybridmoe.layers.moe.hybrid_backend import HybridExpertBackend
from hybridmoe.models.placement import held_bytes
from hybridmoe.placement.planner import PlanError

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
KV_GB = 0.0005  # a small KV cache keeps the plan's KV item and activation scratch small
STATIC = ("attention", "router", "shared", "dense", "lm_head")


@pytest.fixture(autouse=True)
def exact_cpu_kernels():
    """The CPU kernels in float32 arithmetic (bf16 dot products and AMX round activations to bf16, enough to flip a
    greedy token of a random tiny model); the accelerator's parts compute in float32."""
    exact = next(name for name in ("avx512", "avx2", "scalar") if name in isa.available_isas())
    with isa.use_isa(exact):
        yield


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dir, tmp_path_factory):
    """model type -> directory: DeepSeek-V3 in its FP8 checkpoint format (a dense first layer, shared experts),
    Qwen3-MoE and Mixtral, each with enough experts that a partial budget leaves some on the CPU."""
    fp8 = write_fp8_checkpoint(tiny_model_dir("deepseek_v3", n_routed_experts=16),
                               tmp_path_factory.mktemp("fp8") / "deepseek_v3")
    return {"deepseek_v3": fp8, "qwen3_moe": tiny_model_dir("qwen3_moe", num_experts=16),
            "mixtral": tiny_model_dir("mixtral")}


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(6, 300, (n,), generator=gen).tolist() for n in (7, 19)]


def _tokens(llm: LLM) -> list[list[int]]:
    return [r.token_ids for r in llm.generate(_prompts(), GREEDY)]


def _llm(path, **options) -> LLM:
    return LLM(path, dtype="float32", kv_cache_gb=KV_GB, **options)


def _partial_budget(plain: LLM, full: LLM, hot: float) -> int:
    """A budget that holds what `full`'s plan placed before its hot experts, and `hot` experts more."""
    plan = full.engine.placement.plan
    before = sum(i.nbytes for i in plan.items if i.resident and i.kind != "expert")
    expert = next(i.nbytes / int(i.name.split("(")[1].split()[0]) for i in plan.items
                  if i.kind == "expert" and i.resident)
    return int(before + _excess(plain, full) + hot * expert)


def _excess(plain: LLM, full: LLM) -> float:
    """Bytes by which the model's tensors exceed the planner's sizes of them (the plan is made for the budget less
    this), from the plain engine's model and the plan that placed everything."""
    static = sum(i.nbytes for i in full.engine.placement.plan.items if i.kind in STATIC)
    return max(0.0, held_bytes(plain.engine.model) - static)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "qwen3_moe", "mixtral"])
def test_placed_model_gives_the_plain_engines_tokens_within_the_budget(model_dirs, model_type):
    path = model_dirs[model_type]
    plain_llm = _llm(path)
    plain = _tokens(plain_llm)
    full = _llm(path, vram="256MB")  # everything resident, every expert hot: no routed expert on the CPU
    assert _tokens(full) == plain
    budget = _partial_budget(plain_llm, full, hot=6.5)  # then the same with six hot experts and the rest on the CPU
    llm = _llm(path, vram=budget)
    assert _tokens(llm) == plain
    engine = llm.engine
    accel, placement = engine.accel, engine.placement
    assert accel.peak_bytes <= budget == accel.ledger.budget
    hot = sum(len(e) for e in placement.hot.values())
    assert hot == 6
    model = engine.model
    for i, layer in enumerate(model.layers):  # what the plan made resident is on the accelerator, the rest not
        assert placement.attention[i]  # this budget holds every layer's attention
        assert isinstance(layer.attention.w.o_proj, DeviceLinear)
        assert f"kv cache.{i}" in accel.ledger.held
        if isinstance(layer.mlp, MoEBlock):
            backend = layer.mlp.experts
            assert isinstance(backend, HybridExpertBackend) and backend.hot == placement.hot.get(i, ())
            assert isinstance(layer.mlp.router.gate, DeviceLinear)
            if layer.mlp.shared is not None:
                assert isinstance(layer.mlp.shared.gate_proj, DeviceLinear)
        else:
            assert isinstance(layer.mlp.gate_proj, DeviceLinear)
    assert isinstance(model.lm_head, DeviceLinear)
    held = {name.split(".")[0] for name in accel.ledger.held}
    assert {"attention", "kv cache", "router", "lm_head", "hot experts"} <= held
    phases = engine.run_stats.phases.values()
    assert sum(p.cpu_expert_assignments for p in phases) > 0 and sum(p.hot_expert_assignments for p in phases) > 0


def test_routers_left_on_the_host_keep_their_layers_moe_on_the_cpu(model_dirs):
    """A budget that holds the attention of every layer but not every router: the MoE halves without a resident
    router run on the host (residual stream moved back), and the tokens stay the plain engine's."""
    path = model_dirs["qwen3_moe"]
    plain_llm = _llm(path)
    plain = _tokens(plain_llm)
    full = _llm(path, vram="256MB")
    plan = full.engine.placement.plan
    upto_attention = sum(i.nbytes for i in plan.items if i.kind in ("reserve", "kv", "scratch", "attention"))
    router = next(i.nbytes for i in plan.items if i.kind == "router")
    llm = _llm(path, vram=int(upto_attention + _excess(plain_llm, full) + 1.5 * router))
    placement = llm.engine.placement
    assert all(placement.attention) and placement.router[0] and not any(placement.router[1:])
    assert not placement.lm_head and not placement.hot
    assert _tokens(llm) == plain
    assert not isinstance(llm.engine.model.layers[1].mlp.experts, HybridExpertBackend)


def test_too_small_budget_names_what_does_not_fit(model_dirs):
    path = model_dirs["mixtral"]
    with pytest.raises(PlanError, match=r"cannot hold .* the KV cache .*kv_cache_gb"):
        _llm(path, vram="100KB")


def _write_plan(path, tmp_path, name: str, vram: str) -> tuple:
    out = tmp_path / f"{name}.json"
    # the reference GPU profile keeps 1 GB for the CUDA context; the tiny model's parts come after it
    assert main(["plan", "--model", str(path), "--vram", vram, "--hardware", "rtx4090,desktop-2ch",
                 "--context", "64", "--dense", "fp32", "--json", str(out)]) == 0
    return out, json.loads(out.read_text())


def test_a_plan_file_from_hybridmoe_plan_runs_as_written(model_dirs, tmp_path, capsys):
    path = model_dirs["qwen3_moe"]
    plain = _tokens(_llm(path))
    _, everything = _write_plan(path, tmp_path, "all", "2GB")
    items = everything["items"]
    static = sum(i["bytes"] for i in items if i["kind"] != "expert")
    expert = next(i["bytes"] for i in items if i["kind"] == "expert" and not i["resident"]) or \
        next(i["bytes"] / int(i["name"].split("(")[1].split()[0]) for i in items if i["resident"] and i["kind"] == "expert")
    file, plan = _write_plan(path, tmp_path, "partial", f"{(static + 3.5 * expert) / 1e9:.9f}GB")
    capsys.readouterr()
    assert sum(len(v) for v in plan["hot_experts"].values()) == 3
    llm = _llm(path, plan=str(file))
    assert _tokens(llm) == plain
    placement = llm.engine.placement
    assert {str(l): list(e) for l, e in placement.hot.items()} == plan["hot_experts"]
    assert placement.source == f"plan file {file}"
    assert llm.engine.accel.ledger.budget == int(plan["budget_bytes"])  # the plan's budget, without --vram
    # the same plan under a smaller vram budget: the first item that does not fit is named
    with pytest.raises(DeviceMemoryError, match=r"placing attention\.0 .* over its budget"):
        _llm(path, plan=str(file), vram="10KB")


def test_a_plan_file_of_another_model_is_refused(model_dirs, tmp_path):
    file, _ = _write_plan(model_dirs["mixtral"], tmp_path, "mixtral", "2GB")
    with pytest.raises(ValueError, match=r"plan .* was made for another model"):
        _llm(model_dirs["qwen3_moe"], plan=str(file))
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(ValueError, match="not a plan written by `hybridmoe plan --json`"):
        _llm(model_dirs["qwen3_moe"], plan=str(tmp_path / "junk.json"))


def test_plain_engine_without_budget_on_the_stand_in(model_dirs):
    """No vram and no plan without a GPU: the plain all-CPU engine (nothing placed, no accelerator)."""
    llm = _llm(model_dirs["mixtral"])
    assert llm.engine.accel is None and llm.engine.placement is None
    assert not isinstance(llm.engine.model.layers[0].mlp.experts, HybridExpertBackend)


def test_attention_of_the_first_layer_only_puts_that_layers_kv_cache_alone_on_the_device(model_dirs):
    path = model_dirs["deepseek_v3"]
    plain_llm = _llm(path)
    plain = _tokens(plain_llm)
    full = _llm(path, vram="256MB")
    plan = full.engine.placement.plan
    required = sum(i.nbytes for i in plan.items if i.kind in ("reserve", "kv", "scratch"))
    attention = next(i.nbytes for i in plan.items if i.kind == "attention")
    llm = _llm(path, vram=int(required + _excess(plain_llm, full) + 1.5 * attention))
    placement, accel = llm.engine.placement, llm.engine.accel
    assert placement.attention == (True,) + (False,) * (len(placement.attention) - 1)
    assert not any(placement.router) and not placement.lm_head
    assert _tokens(llm) == plain
    assert sorted(n for n in accel.ledger.held if n.startswith("kv cache")) == ["kv cache.0"]
    assert accel.peak_bytes <= accel.ledger.budget
