"""The planner's cost model fed with this engine's op tables (placement/op_tables.py): tables are read as
measured, a CPU step is the host cost plus every piece at its table's rate (checked against sums written out by
hand from the config), tables that do not cover a model leave the roofline in charge, and the matrices the
model spec lists are the ones our engine really multiplies (traced, not timed)."""

from __future__ import annotations

import json
from dataclasses import replace
from importlib import resources

import numpy as np
import pytest
import torch

from hybridmoe.placement import estimate
from hybridmoe.placement.costmodel import CostModel
from hybridmoe.placement.hardware import CpuSpec, Machine, ProfileError, machine, parse_profile
from hybridmoe.placement.modelspec import ModelSpec, resolve_model
from hybridmoe.placement.op_tables import OpTables, SecondsTable
from hybridmoe.placement.passes import PassBuilder, Residency

RNG = np.random.default_rng(7)
TOKENS = (1, 4, 16, 64, 256, 1024)


def power(points, exponent: float, scale: float) -> SecondsTable:
    return SecondsTable(tuple(float(p) for p in points), tuple(scale * p**exponent for p in points))


def random_tables(spec: ModelSpec) -> OpTables:
    """Tables of fresh random power laws (each its own scale and exponent) for every shape of `spec`."""
    r = lambda lo, hi: float(RNG.uniform(lo, hi))
    linear = {s for l in spec.layers for part in ("attention", "router", "shared", "dense")
              for s in spec.part_matmuls(part, l.index)} | set(spec.part_matmuls("lm_head"))
    return OpTables(
        linear={s: power(TOKENS, r(0.3, 0.9), np.prod(s) * r(1e-9, 1e-8)) for s in linear},
        linear_floor_s=r(1e-6, 3e-6),
        batched={s: power(TOKENS, r(0.3, 0.9), np.prod(s) * r(1e-9, 1e-8)) for s in spec.absorption_matmuls},
        elementwise=power((64, 1024, 16384, 262144), r(0.5, 1.0), r(1e-8, 1e-7)),
        attention_shape=spec.attention_shape,
        attention_decode=power((4, 16, 64, 256, 1024), r(0.5, 1.0), r(1e-6, 1e-5)),
        attention_prefill=power((4, 16, 64, 256, 1024), r(1.2, 2.0), r(1e-7, 1e-6)),
        expert_shape=(spec.expert_format, spec.hidden, spec.expert_intermediate),
        experts=power((1, 4, 16, 64, 256), r(0.3, 1.0), r(1e-4, 1e-3)),
        host={k: {"step": r(1e-4, 1e-3), "dense_layer": r(1e-4, 1e-3), "moe_layer": r(1e-4, 1e-3)}
              for k in ("decode", "prefill")},
        threads=1, dtype="float32")


def cpu_with(tables: OpTables | None) -> CpuSpec:
    return replace(machine("desktop-2ch").cpu, op_tables=tables)


def builder(spec: ModelSpec, tables: OpTables | None) -> PassBuilder:
    cost = CostModel(Machine("test", cpu_with(tables)), spec)
    return PassBuilder(cost, Residency.none(len(spec.layers), len(spec.moe_layers)))


# ---- tables ---------------------------------------------------------------------------------------------
def test_table_is_exact_on_power_laws_proportional_beyond_and_flat_below():
    table = power((1, 16, 256), 0.5, 3e-7)
    for x in RNG.uniform(1, 256, size=20):
        assert table(x) == pytest.approx(3e-7 * x**0.5, rel=1e-9)
    assert table(1024) == pytest.approx(4 * table(256))  # more tokens: the same work repeated
    assert table(0.5) == table(1) and table.floor == pytest.approx(3e-7) and table.above_floor(1) == 0.0


def test_bad_tables_are_clear_errors():
    with pytest.raises(ValueError, match="as many seconds as points"):
        SecondsTable((1.0, 2.0), (1.0,))
    with pytest.raises(ValueError, match="ascending"):
        SecondsTable((2.0, 1.0), (1.0, 2.0))
    with pytest.raises(ValueError, match="positive and finite"):
        SecondsTable((1.0, 2.0), (1.0, 0.0))
    good = random_tables(ModelSpec(resolve_model("qwen3-30b-a3b"))).to_json()
    with pytest.raises(ValueError, match="host costs of prefill lack moe_layer"):
        OpTables.from_json({**good, "host_s": {"decode": good["host_s"]["decode"],
                                               "prefill": {"step": 1.0, "dense_layer": 1.0}}})
    with pytest.raises(ValueError, match="op_tables.experts: not a measured table"):
        OpTables.from_json({**good, "experts": [[1, 2, 3], "x"]})
    with pytest.raises(ValueError, match="field 'linear' is missing"):
        OpTables.from_json({k: v for k, v in good.items() if k != "linear"})


def test_tables_survive_json_and_ride_in_a_profile():
    spec = ModelSpec(resolve_model("deepseek-v3"))
    t = random_tables(spec)
    back = OpTables.from_json(json.loads(json.dumps(t.to_json())))
    assert back == t
    profile = json.loads(resources.files("hybridmoe.placement").joinpath("data/hardware/desktop-2ch.json").read_text())
    profile["cpu"]["op_tables"] = t.to_json()
    assert parse_profile(profile, "p.json").cpu.op_tables == t
    profile["cpu"]["op_tables"]["linear_floor_s"] = "fast"
    with pytest.raises(ProfileError, match="p.json: cpu.op_tables: malformed"):
        parse_profile(profile, "p.json")


# ---- the planner's CPU step at the tables' rates ---------------------------------------------------------
@pytest.mark.parametrize("tokens", [1, 512])
def test_qwen3_cpu_step_is_host_plus_each_piece_at_its_table(tokens):
    """Written out by hand from Qwen3-30B-A3B's config against the same random tables (uniform routing)."""
    spec = ModelSpec(resolve_model("qwen3-30b-a3b"))
    t = random_tables(spec)
    H, V, E, K, L = spec.hidden, spec.config.vocab_size, spec.num_experts, spec.top_k, len(spec.layers)
    N, Nk, D = 32, 4, 128
    kind, context = ("decode", 127) if tokens == 1 else ("prefill", 0)
    lin = t.linear_s
    linear = L * (lin(N * D, H, tokens) + 2 * lin(Nk * D, H, tokens) + lin(H, N * D, tokens) + lin(E, H, tokens))
    linear += lin(V, H, 1 if kind == "prefill" else tokens)
    attention = L * (t.attention_decode.above_floor(context + 1) if kind == "decode" else
                     t.attention_prefill.above_floor(tokens))
    active = E * (1 - (1 - K / E) ** tokens)
    experts = L * active * t.experts(tokens * K / active)
    elements = tokens * (10 * H + 8 * (N + Nk) * D + 2 * Nk * D + 2 * E)
    host = t.host[kind]["step"] + L * (t.host[kind]["moe_layer"] + t.elementwise.above_floor(elements))
    b = builder(spec, t)
    assert b.cost.ops is t
    timeline = estimate.decode(b, 1, context).timeline if kind == "decode" else \
        estimate.prefill(b, "cpu", tokens).timeline
    assert timeline.total_s == pytest.approx(linear + attention + experts + host, rel=1e-9)


def test_each_piece_follows_its_own_table():
    """Tripling one kind of table (its floor with it) adds exactly twice that piece to a prefill's time."""
    spec = ModelSpec(resolve_model("deepseek-v3"))
    t = random_tables(spec)
    base = estimate.prefill(builder(spec, t), "cpu", 256).timeline.total_s
    triple = lambda g: SecondsTable(g.x, tuple(3 * s for s in g.seconds))
    for field, changed in (("experts", triple(t.experts)), ("attention_prefill", triple(t.attention_prefill))):
        again = estimate.prefill(builder(spec, replace(t, **{field: changed})), "cpu", 256).timeline.total_s
        alone = replace(t, **{field: SecondsTable(changed.x, tuple(1e-30 + 0 * s for s in changed.seconds))})
        without = estimate.prefill(builder(spec, alone), "cpu", 256).timeline.total_s
        assert again - base == pytest.approx(2 * (base - without), rel=1e-6), field


def test_tables_that_do_not_cover_the_model_leave_the_roofline():
    qwen, deepseek = ModelSpec(resolve_model("qwen3-30b-a3b")), ModelSpec(resolve_model("deepseek-v3"))
    tables = random_tables(qwen)
    cost = CostModel(Machine("test", cpu_with(tables)), deepseek)
    assert cost.ops is None and any("matmul 1536x7168" in m for m in cost.ops_missing)
    assert any(m.startswith("attention ('mla'") for m in cost.ops_missing)
    plain = estimate.decode(builder(deepseek, None), 1, 1000).step_s
    assert estimate.decode(builder(deepseek, tables), 1, 1000).step_s == plain
    other_format = CostModel(Machine("test", cpu_with(tables)), qwen, expert_format="int4")
    assert other_format.ops is None and other_format.ops_missing == ["experts ('int4', 2048, 768) (measured "
                                                                     "('bf16', 2048, 768))"]


# ---- the shapes are the engine's: traced on our engine (counted, not timed) ------------------------------
def traced_matmuls(model, queries: int, context: int) -> tuple[list, list, int]:
    """Projections (rows, cols, tokens) run through layers.linear.Linear (a LinearGroup's members one by one),
    absorption shapes (batch, rows, cols, tokens: torch's bmm or the kernels' per-head matmul) and attention calls
    (SDPA or the paged attention kernel) of one step of our engine."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hybridmoe.layers import attention_mla, paged_attention
    from hybridmoe.layers.linear import Linear, LinearGroup
    from hybridmoe.models import decode_stack
    from hybridmoe.runtime.model_runner import ModelRunner, SequenceChunk

    linears, absorptions, attention = [], [], [0]

    class Trace(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.bmm.default:  # MLA's absorption per head: x [N, T, K] @ w [N, K, M]
                x, w = args
                absorptions.append((w.shape[0], w.shape[2], w.shape[1], x.shape[1]))
            elif func is torch.ops.aten.scaled_dot_product_attention.default:
                attention[0] += 1
            return func(*args, **(kwargs or {}))

    runner = ModelRunner(model, 8, 16)
    tokens = list(range(3, 3 + context))
    project, kernel, per_head_kernel = Linear.__call__, paged_attention.decode_attention, attention_mla.matmul_heads
    grouped = LinearGroup.__call__

    def separately(self, x, out_dtype=None):  # a group's members one by one, each recorded (the same outputs)
        return [m(x, out_dtype) for m in self.members]

    def recording(self, x, out_dtype=None):
        linears.append((self.rows, self.cols, x.numel() // x.shape[-1]))
        return project(self, x, out_dtype)

    def counted_kernel(*args, **kwargs):
        attention[0] += 1
        return kernel(*args, **kwargs)

    def recorded_heads(heads, x, *args, **kwargs):  # MLA's absorption on the kernels: x [T, N, K], W_n [M, K]
        absorptions.append((heads.heads, heads.rows, heads.cols, x.shape[0]))
        return per_head_kernel(heads, x, *args, **kwargs)

    with torch.inference_mode():
        if queries == 1:
            runner.forward([SequenceChunk(tokens[:-1], 0, list(range(8)))])
        Linear.__call__, paged_attention.decode_attention, LinearGroup.__call__ = recording, counted_kernel, separately
        attention_mla.matmul_heads = recorded_heads
        decode_stack.ENABLED = False  # the layers' calls from Python, where they can be recorded (the stack's are these)
        try:
            with Trace():
                runner.forward([SequenceChunk(tokens[-queries:], context - queries, list(range(8)))])
        finally:
            Linear.__call__, paged_attention.decode_attention, LinearGroup.__call__ = project, kernel, grouped
            attention_mla.matmul_heads = per_head_kernel
            decode_stack.ENABLED = True
    return sorted(linears), sorted(absorptions), attention[0]


@pytest.mark.parametrize("model_type,overrides", [("deepseek_v3", {}), ("deepseek_v3", {"q_lora_rank": 24}),
                                                  ("qwen3_moe", {}), ("mixtral", {})])
@pytest.mark.parametrize("queries,context", [(1, 9), (12, 12), (64, 64)])  # MLA: kernels, kernels, bmm
def test_listed_matmuls_are_the_ones_our_engine_runs(tiny_model_dir, model_type, overrides, queries, context):
    from hybridmoe.models.loader import load_model

    model = load_model(tiny_model_dir(model_type, **overrides), "float32", "cpu")
    linears, absorptions, attention = traced_matmuls(model, queries, context)
    spec = ModelSpec(model.config)
    listed = [(*s, queries) for l in spec.layers for part in ("attention", "router", "shared", "dense")
              for s in spec.part_matmuls(part, l.index)] + [(*spec.part_matmuls("lm_head")[0], 1)]
    assert sorted(listed) == linears
    assert sorted((*s, queries) for _ in spec.layers for s in spec.absorption_matmuls) == absorptions
    assert attention == model.config.num_layers
