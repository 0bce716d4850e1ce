"""The engine cost model (placement/engine.py): measured tables are read as measured, its op list is the op
sequence our engine really runs, and a prediction is the host cost plus every op's time above its table's
floor, computed from the tables (checked against sums written out by hand from the config)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hybridmoe.placement.engine import EngineTables, GridTable, predict_step
from hybridmoe.placement.engine_ops import engine_ops, expected_distinct_experts, weight_shapes
from hybridmoe.placement.modelspec import resolve_model

RNG = np.random.default_rng(7)


def power_table(axes, exponents, scale):
    grids = np.meshgrid(*[np.asarray(a, dtype=float) for a in axes], indexing="ij")
    return GridTable(tuple(tuple(a) for a in axes), scale * np.prod([g**p for g, p in zip(grids, exponents)], axis=0))


def random_tables(config) -> EngineTables:
    """Tables of fresh random power laws (each its own random scale and exponents), F.linear for every weight
    shape of `config`."""
    r = lambda lo, hi: float(RNG.uniform(lo, hi))
    return EngineTables(
        linear={shape: power_table(((1, 4, 16, 64, 256, 1024),), (r(0.3, 0.9),), np.prod(shape) * r(1e-9, 1e-8))
                for shape in weight_shapes(config) if len(shape) == 2},
        linear_floor=r(1e-6, 3e-6),
        batched={shape: power_table(((1, 4, 16, 64, 256, 1024),), (r(0.3, 0.9),), np.prod(shape) * r(1e-9, 1e-8))
                 for shape in weight_shapes(config) if len(shape) == 3},
        elementwise=power_table(((64, 1024, 16384, 262144),), (r(0.5, 1.0),), r(1e-8, 1e-7)),
        attention_decode=power_table(((4, 16, 64, 256, 1024),), (r(0.5, 1.0),), r(1e-6, 1e-5)),
        attention_prefill=power_table(((4, 16, 64, 256, 1024),), (r(1.2, 2.0),), r(1e-7, 1e-6)),
        experts=power_table(((1, 4, 16, 64, 256),), (r(0.3, 1.0),), r(1e-4, 1e-3)),
        host={k: {"step": r(1e-4, 1e-3), "dense_layer": r(1e-4, 1e-3), "moe_layer": r(1e-4, 1e-3)}
              for k in ("decode", "prefill")},
        threads=1, compute_dtype="float32")


# ---- tables -----------------------------------------------------------------------------------------------
def test_grid_table_is_exact_on_power_laws_and_proportional_beyond_its_last_point():
    table = power_table(((64, 256, 1024), (1, 16, 256)), (1.0, 0.5), 3e-7)
    for rows, tokens in RNG.uniform((64, 1), (1024, 256), size=(20, 2)):
        assert table(rows, tokens) == pytest.approx(3e-7 * rows * tokens**0.5, rel=1e-9)
    assert table(4096, 16) == pytest.approx(4 * table(1024, 16))  # more rows: the same work repeated
    assert table(1024, 1024) == pytest.approx(4 * table(1024, 256))
    assert table(8, 16) == pytest.approx(table(64, 16))  # below the grid: its first value
    assert table.floor == pytest.approx(3e-7 * 64) and table.above_floor(64, 1) == 0.0


def test_bad_tables_are_clear_errors():
    with pytest.raises(ValueError, match="does not match its axes"):
        GridTable(((1.0, 2.0),), np.array([1.0]))
    with pytest.raises(ValueError, match="ascending"):
        GridTable(((2.0, 1.0),), np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="positive"):
        GridTable(((1.0, 2.0),), np.array([1.0, 0.0]))
    with pytest.raises(ValueError, match="2 axes, got 1"):
        power_table(((1, 2), (1, 2)), (1, 1), 1.0)(1.5)
    good = random_tables(resolve_model("qwen3-30b-a3b"))
    with pytest.raises(ValueError, match="host costs of prefill lack moe_layer"):
        EngineTables(good.linear, good.linear_floor, good.batched, good.elementwise, good.attention_decode, good.attention_prefill,
                     good.experts, {"decode": good.host["decode"], "prefill": {"step": 1.0, "dense_layer": 1.0}}, 1,
                     "float32")
    with pytest.raises(ValueError, match="experts: not a measured table"):
        EngineTables.from_json({**good.to_json(), "experts": {"axes": [[1, 2]]}})
    with pytest.raises(ValueError, match="no F.linear measured for a 1536x7168 weight .measured: 128x2048"):
        predict_step(resolve_model("deepseek-v3"), good, "prefill", 16)


def test_tables_survive_json():
    t = random_tables(resolve_model("deepseek-v3"))
    back = EngineTables.from_json(json.loads(json.dumps(t.to_json())))
    assert back.host == t.host and back.linear_floor == t.linear_floor and back.threads == t.threads
    for name in EngineTables.TABLES:
        assert np.array_equal(getattr(back, name).seconds, getattr(t, name).seconds)
    for mine, theirs in ((back.linear, t.linear), (back.batched, t.batched)):
        assert mine.keys() == theirs.keys() and all(np.array_equal(mine[k].seconds, theirs[k].seconds) for k in mine)


# ---- the prediction is the sum of the engine's ops at the tables' rates --------------------------------------
@pytest.mark.parametrize("tokens", [1, 128, 512])
def test_qwen3_step_is_host_plus_each_op_above_its_floor(tokens):
    """Written out by hand from Qwen3-30B-A3B's config: every linear, the attention, the experts (uniform
    routing and counted routing), against the same random tables."""
    config = resolve_model("qwen3-30b-a3b")
    t = random_tables(config)
    kind, context = ("decode", 127) if tokens == 1 else ("prefill", 0)
    seq = context + tokens
    H, V, E, K = config.hidden_size, config.vocab_size, config.moe.num_experts, config.moe.num_experts_per_tok
    N, Nk, D, L = 32, 4, 128, config.num_layers
    above = t.linear_s
    linear = L * (above(N * D, H, tokens) + 2 * above(Nk * D, H, tokens) + above(H, N * D, tokens)
                  + above(E, H, tokens)) + above(V, H, 1)
    attention = L * (t.attention_decode.above_floor(seq) if kind == "decode" else
                     t.attention_prefill.above_floor(tokens))
    active = E * (1 - (1 - K / E) ** tokens)
    experts = L * active * t.experts(tokens * K / active)
    host = t.host[kind]["step"] + L * t.host[kind]["moe_layer"]
    got = predict_step(config, t, kind, tokens, context)
    assert got.parts["linear"] == pytest.approx(linear, rel=1e-12)
    assert got.parts["attention"] == pytest.approx(attention, rel=1e-12)
    assert got.parts["experts"] == pytest.approx(experts, rel=1e-12)
    assert got.parts["host"] == pytest.approx(host, rel=1e-12)
    assert got.seconds == pytest.approx(sum(got.parts.values()), rel=1e-12) and got.parts["elementwise"] > 0

    counts = [RNG.multinomial(tokens * K, RNG.dirichlet(np.ones(E) * 0.3)).tolist() for _ in range(L)]
    routed = predict_step(config, t, kind, tokens, context, routing=counts)
    assert routed.parts["experts"] == pytest.approx(sum(t.experts(n) for layer in counts for n in layer if n),
                                                    rel=1e-12)
    assert {k: v for k, v in routed.parts.items() if k != "experts"} == \
        {k: v for k, v in got.parts.items() if k != "experts"}


def test_each_part_follows_its_own_table():
    """Tripling one kind of table (its floor with it) triples exactly its part of the prediction."""
    config = resolve_model("deepseek-v3")
    t = random_tables(config)
    base = predict_step(config, t, "prefill", 256)
    triple = lambda g: GridTable(g.axes, g.seconds * 3)
    variants = {
        "linear": {"linear": {k: triple(g) for k, g in t.linear.items()}, "linear_floor": 3 * t.linear_floor,
                   "batched": {k: triple(g) for k, g in t.batched.items()}},
        "attention": {"attention_prefill": triple(t.attention_prefill)},
        "experts": {"experts": triple(t.experts)},
        "elementwise": {"elementwise": triple(t.elementwise)},
    }
    for part, changes in variants.items():
        got = predict_step(config, EngineTables(**{**t.__dict__, **changes}), "prefill", 256)
        for other, seconds in base.parts.items():
            assert got.parts[other] == pytest.approx(seconds * (3 if other == part else 1), rel=1e-12), (part, other)


def test_bad_steps_are_clear_errors():
    config = resolve_model("qwen3-30b-a3b")
    t = random_tables(config)
    with pytest.raises(ValueError, match="one new token"):
        predict_step(config, t, "decode", 4, 100)
    with pytest.raises(ValueError, match="kind must be"):
        predict_step(config, t, "train", 4)
    with pytest.raises(ValueError, match="routing counts given for 1 MoE layers, the model has 48"):
        predict_step(config, t, "prefill", 4, routing=[[0] * 128])
    with pytest.raises(ValueError, match="32 .token, expert. pairs"):
        predict_step(config, t, "prefill", 4, routing=[[1] * 128] * 48)


def test_expected_distinct_experts():
    assert expected_distinct_experts(128, 8, 1) == pytest.approx(8)
    assert expected_distinct_experts(256, 8, 10_000) == pytest.approx(256)
    draws = [len(set(np.concatenate([RNG.choice(64, 4, replace=False) for _ in range(20)]))) for _ in range(3000)]
    assert expected_distinct_experts(64, 4, 20) == pytest.approx(np.mean(draws), rel=0.01)


# ---- the op list is the engine's: traced on our engine (counted, not timed) ------------------------------
def traced_matmuls(model, queries: int, context: int) -> tuple[list, list, int]:
    """F.linear shapes (rows, cols, tokens), einsum shapes (batch, rows, cols, tokens) and SDPA calls of one
    step of our engine."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hybridmoe.runtime.model_runner import ModelRunner, SequenceChunk

    linears, einsums, attention = [], [], [0]

    class Trace(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.linear.default:
                x, w = args[0], args[1]
                linears.append((w.shape[0], w.shape[1], x.numel() // x.shape[-1]))
            elif func is torch.ops.aten.einsum.default:
                (a, b), out = args[0].split("->")[0].split(","), args[0].split("->")[1]
                x, w = args[1]
                batch = next(i for i in a if i in b and i in out)
                contracted = next(i for i in a if i in b and i not in out)
                produced = next(i for i in b if i not in a)
                einsums.append((w.shape[b.index(batch)], w.shape[b.index(produced)], w.shape[b.index(contracted)],
                                x.shape[a.index(next(i for i in a if i not in b))]))
            elif func is torch.ops.aten.scaled_dot_product_attention.default:
                attention[0] += 1
            return func(*args, **(kwargs or {}))

    runner = ModelRunner(model, 8, 16)
    tokens = list(range(3, 3 + context))
    with torch.inference_mode():
        if queries == 1:
            runner.forward([SequenceChunk(tokens[:-1], 0, list(range(8)))])
        with Trace():
            runner.forward([SequenceChunk(tokens[-queries:], context - queries, list(range(8)))])
    return sorted(linears), sorted(einsums), attention[0]


@pytest.mark.parametrize("model_type,overrides", [("deepseek_v3", {}), ("deepseek_v3", {"q_lora_rank": 24}),
                                                  ("qwen3_moe", {}), ("mixtral", {})])
@pytest.mark.parametrize("queries,context", [(1, 9), (12, 12)])
def test_listed_matmuls_are_the_ones_our_engine_runs(tiny_model_dir, model_type, overrides, queries, context):
    from hybridmoe.models.loader import load_model

    model = load_model(tiny_model_dir(model_type, **overrides), "float32", "cpu")
    linears, einsums, attention = traced_matmuls(model, queries, context)
    ops = engine_ops(model.config, queries, context)
    listed = sorted(tuple(int(v) for v in op.shape) for op in ops if op.kind == "linear" for _ in range(op.count))
    assert listed == linears
    assert sorted(tuple(int(v) for v in op.shape) for op in ops if op.kind == "batched_linear") == einsums
    assert sum(op.count for op in ops if op.kind == "attention") == attention == model.config.num_layers
    assert weight_shapes(model.config) == sorted({s[:2] for s in linears}) + sorted({s[:3] for s in einsums})
    moe_layers = sum(model.config.moe_layers)
    assert sum(1 for op in ops if op.kind == "experts") == moe_layers
