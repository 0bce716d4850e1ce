"""The op sequence of one step of our engine, listed from the model's config (what `placement.engine` costs).

A decode step or a prefill chunk of our engine (models/decoder.py, layers/) is a fixed sequence of torch ops
and C++ expert-kernel calls. `engine_ops` lists the ones whose cost depends on the model's shapes: every
F.linear with its weight shape, MLA's two absorption einsums, the context attention of each layer, the
expert-kernel call of each MoE layer as (experts, tokens each) groups, and the elementwise passes over
activations. Views, casts to a tensor's own dtype and ops over [T] or [T, 1] are left out: their cost is in
the measured host cost. tests/placement/test_engine.py traces our forward and checks the listed shapes.

Legend: T tokens of the step (queries), C context (keys), H hidden, V vocabulary, N heads, Nk kv heads, D head
dim, L kv_lora_rank, Lq q_lora_rank, R rope dims, P no-rope q/k dims, Dv value dims, E experts, K top-k,
I intermediate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hybridmoe.config import ModelConfig
from hybridmoe.placement.routing import RoutingStats


@dataclass(frozen=True)
class Op:
    """One op (or `count` identical ops) of a step: what it is and its shape."""

    kind: str  # "linear" | "batched_linear" | "attention" | "experts" | "elementwise"
    shape: tuple[float, ...]  # linear (rows, cols, tokens); batched_linear (batch, rows, cols, tokens);
    # attention (queries, context); experts (experts, tokens each); elementwise (elements,)
    count: int = 1


def _norm(elements: float) -> list[Op]:
    """rms_norm: pow, mean, x * rsqrt, weight * x over every element (the float32 casts are no-ops)."""
    return [Op("elementwise", (elements,), 4)]


def _rope(tokens: int, heads: int, dims: int) -> list[Op]:
    """RotaryEmbedding.apply: four products, a difference and a sum over half the dims, then a cat."""
    return [Op("elementwise", (tokens * heads * dims / 2,), 6), Op("elementwise", (tokens * heads * dims,))]


def _gqa_ops(c: ModelConfig, T: int, C: int) -> list[Op]:
    a, H = c.attention, c.hidden_size
    N, Nk, D = a.num_heads, a.num_kv_heads, a.head_dim
    ops = [Op("linear", (N * D, H, T)), Op("linear", (Nk * D, H, T), 2)]
    if a.qk_norm:
        ops += _norm(T * N * D) + _norm(T * Nk * D)
    ops += [Op("elementwise", (T * c.rope.rotary_dim / 2,), 6)]  # cos/sin of the positions
    ops += _rope(T, N, D) + _rope(T, Nk, D)
    ops += [Op("elementwise", (T * Nk * D,), 2),  # K and V into the paged cache
            Op("attention", (T, C)), Op("linear", (H, N * D, T))]
    return ops


def _mla_ops(c: ModelConfig, T: int, C: int) -> list[Op]:
    a, H = c.attention, c.hidden_size
    N, L, R, P, Dv = a.num_heads, a.kv_lora_rank, a.qk_rope_head_dim, a.qk_nope_head_dim, a.v_head_dim
    if a.q_lora_rank is None:
        ops = [Op("linear", (N * (P + R), H, T))]
    else:
        Lq = a.q_lora_rank
        ops = [Op("linear", (Lq, H, T))] + _norm(T * Lq)
        ops += [Op("linear", (N * (P + R), Lq, T))]
    ops += [Op("linear", (L + R, H, T))] + _norm(T * L)
    ops += [Op("elementwise", (T * R / 2,), 6)]  # cos/sin of the positions
    ops += _rope(T, N, R) + _rope(T, 1, R)
    ops += [Op("elementwise", (T * (L + R),), 2),  # cat(latent, k_pe) and its cache write
            Op("batched_linear", (N, L, P, T)),  # q_nope absorbed through W_uk
            Op("elementwise", (T * N * (L + R),)),  # cat(q_lat, q_pe)
            Op("attention", (T, C)),
            Op("batched_linear", (N, Dv, L, T)),  # attention-weighted latent through W_uv
            Op("elementwise", (T * N * Dv,)),  # its [T, N, Dv] view reshaped (a copy)
            Op("linear", (H, N * Dv, T))]
    return ops


def _mlp_ops(H: int, I: int, T: int) -> list[Op]:
    """GatedMLP: gate and up, silu and product over [T, I], down."""
    return [Op("linear", (I, H, T), 2), Op("elementwise", (T * I,), 2), Op("linear", (H, I, T))]


def expected_distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected number of distinct experts `tokens` tokens route to, each choosing top_k of num_experts
    uniformly."""
    return RoutingStats.uniform((0,), num_experts, top_k).expected_distinct(0, tokens)


def _expert_ops(c: ModelConfig, T: int, counts: Sequence[int] | None) -> list[Op]:
    """The expert-kernel call of one MoE layer as (experts, tokens each) groups: from the (token, expert)
    counts of the step's routing when given, else uniform routing (expected distinct experts, even split)."""
    E, K = c.moe.num_experts, c.moe.num_experts_per_tok
    if counts is None:
        active = expected_distinct_experts(E, K, T)
        return [Op("experts", (active, T * K / active))]
    if len(counts) != E or sum(counts) != T * K:
        raise ValueError(f"routing counts must give {E} experts {T * K} (token, expert) pairs in all, got "
                         f"{len(counts)} experts and {sum(counts)} pairs")
    values, experts = np.unique([n for n in counts if n > 0], return_counts=True)
    return [Op("experts", (float(e), float(v))) for v, e in zip(values, experts)]


def _moe_ops(c: ModelConfig, T: int, counts: Sequence[int] | None) -> list[Op]:
    m, H = c.moe, c.hidden_size
    ops = [Op("linear", (m.num_experts, H, T))]  # router logits (float32 weights)
    # scores, top-k and weights over [T, E]: softmax + top-k, or sigmoid + bias + group mask + top-k
    ops += [Op("elementwise", (T * m.num_experts,), 2 if m.topk_method != "noaux_tc" else 5)]
    ops += _expert_ops(c, T, counts)
    if m.num_shared_experts:
        ops += _mlp_ops(H, m.shared_intermediate_size, T) + [Op("elementwise", (T * H,))]
    return ops


def engine_ops(config: ModelConfig, queries: int, context: int,
               routing: Sequence[Sequence[int]] | None = None) -> list[Op]:
    """The ops of one step of one sequence: `queries` new tokens extending its context to `context` tokens
    (decode: queries 1; a prefill from 0: context == queries). `routing`: per MoE layer (in order), how many of
    the step's tokens each expert receives (counted from the router's choices); None: uniform routing.
    Views, casts to the dtype a tensor already has, and ops over [T] or [T, 1] are not listed: their cost is
    in the measured host cost."""
    if queries < 1 or context < queries:
        raise ValueError(f"a step needs 1 <= queries <= context, got queries={queries}, context={context}")
    c, T, H = config, queries, config.hidden_size
    moe_layers = sum(c.moe_layers)
    if routing is not None and len(routing) != moe_layers:
        raise ValueError(f"routing counts given for {len(routing)} MoE layers, the model has {moe_layers}")
    counts = iter(routing) if routing is not None else None
    attention = _mla_ops if c.attention.kind == "mla" else _gqa_ops
    ops = [Op("elementwise", (T * H,))]  # embedding rows
    for is_moe in c.moe_layers:
        ops += _norm(T * H) + attention(c, T, context) + [Op("elementwise", (T * H,))]
        ops += _norm(T * H)
        if is_moe:
            ops += _moe_ops(c, T, next(counts) if counts is not None else None)
        else:
            ops += _mlp_ops(H, c.intermediate_size, T)
        ops += [Op("elementwise", (T * H,))]  # residual add
    ops += _norm(H) + [Op("linear", (c.vocab_size, H, 1))]  # last token's logits
    return ops


def weight_shapes(config: ModelConfig) -> list[tuple[int, ...]]:
    """Every (rows, cols) weight shape the engine runs F.linear with, then every (heads, rows, cols) of the
    MLA absorption einsums: the shapes `EngineTables` must hold for this model."""
    ops = engine_ops(config, 1, 1)
    linear = {tuple(int(v) for v in op.shape[:2]) for op in ops if op.kind == "linear"}
    batched = {tuple(int(v) for v in op.shape[:3]) for op in ops if op.kind == "batched_linear"}
    return sorted(linear) + sorted(batched)
