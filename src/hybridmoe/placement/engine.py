"""Step times of our own engine on the CPU, predicted by summing the ops it runs at rates measured here.

A decode step or a prefill chunk of our engine (models/decoder.py, layers/) is a fixed sequence of torch ops
and C++ expert-kernel calls. `engine_ops` lists that sequence from the model's config - which linears with which
weight shapes, which attention at which context, which expert-kernel calls with how many tokens per expert, how
many elementwise passes over which activations - and `predict_step` costs each op from `EngineTables`, tables
measured on this machine (by `hybridmoe bench costmodel`, in the same run as the timings it is compared with):

    step = host + sum over ops of (table value at the op's shape - the table's smallest entry)

- host: our engine's own Python and per-op dispatch cost, measured by running the engine on the same
  architecture at minimal widths (head, expert and layer counts kept), per step and per layer kind (dense MLP
  layer, MoE layer), for decode and for prefill: what a step costs when its arithmetic is negligible;
- linear: seconds of one F.linear call against tokens, for each weight shape (rows, columns) the model uses,
  the weights rotated through as many bytes as the model's weights hold (at most twice the last-level cache),
  so they come from where the engine finds them; its fixed cost is that of a 16x16 linear; MLA's two
  absorption einsums (batched over heads, on the engine's strided views of kv_b_proj) likewise per shape;
- attention: seconds of the engine's context attention of one sequence (gather from the paged cache + SDPA) at
  the model's head shape, against the context (one query: decode) or the chunk length (a prefill from 0);
- experts: seconds per active expert of one expert-kernel call against tokens per expert, at the model's
  expert shape and format (the call's fixed cost measured apart and left out), summed over the experts the
  step's tokens route to: counted from the router's choices when given (`routing`), else uniform routing;
- elementwise: seconds of one elementwise op against its element count.

Each table's smallest entry (for linears: the 16x16 call) is that op's fixed cost, already inside the host
measurement: subtracting it keeps it from being counted twice. Tables are read by multilinear interpolation in
log space; beyond a table's last point the time grows in proportion (more tokens repeat the same work).
Nothing here sees a measured step time.

Legend: T tokens of the step (queries), C context (keys), H hidden, V vocabulary, N heads, Nk kv heads, D head
dim, L kv_lora_rank, Lq q_lora_rank, R rope dims, P no-rope q/k dims, Dv value dims, E experts, K top-k,
I intermediate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hybridmoe.config import ModelConfig

KINDS = ("decode", "prefill")
HOST_PARTS = ("step", "dense_layer", "moe_layer")
COST_PARTS = ("host", "linear", "attention", "experts", "elementwise")


@dataclass(frozen=True)
class GridTable:
    """Seconds measured on a grid: axes (each ascending, positive) -> seconds[i0, i1, ...]."""

    axes: tuple[tuple[float, ...], ...]
    seconds: np.ndarray

    def __post_init__(self):
        shape = tuple(len(a) for a in self.axes)
        if self.seconds.shape != shape:
            raise ValueError(f"table of shape {self.seconds.shape} does not match its axes {shape}")
        if not np.all(np.isfinite(self.seconds)) or np.any(self.seconds <= 0):
            raise ValueError("table seconds must be positive and finite")
        for axis in self.axes:
            if not axis or any(b <= a for a, b in zip(axis, axis[1:])) or axis[0] <= 0:
                raise ValueError(f"table axis {axis} must be positive and strictly ascending")

    def __call__(self, *point: float) -> float:
        """Multilinear interpolation of log(seconds) in log(coordinates); below an axis' first point its first
        value, above its last point the last value times (coordinate / last point)."""
        if len(point) != len(self.axes):
            raise ValueError(f"table has {len(self.axes)} axes, got {len(point)} coordinates")
        scale = 1.0
        corners: list[tuple[tuple[int, float], ...]] = []
        for axis, x in zip(self.axes, point):
            if x > axis[-1]:
                scale *= x / axis[-1]
            x = min(max(x, axis[0]), axis[-1])
            if len(axis) == 1:
                corners.append(((0, 1.0),))
                continue
            logs = np.log(axis)
            i = int(np.clip(np.searchsorted(logs, math.log(x)) - 1, 0, len(axis) - 2))
            w = (math.log(x) - logs[i]) / (logs[i + 1] - logs[i])
            corners.append(((i, 1.0 - w), (i + 1, w)))
        log_seconds = np.log(self.seconds)
        total = 0.0
        for combo in np.ndindex(*(len(c) for c in corners)):
            weight, index = 1.0, []
            for axis_corners, k in zip(corners, combo):
                i, w = axis_corners[k]
                weight *= w
                index.append(i)
            total += weight * log_seconds[tuple(index)]
        return float(math.exp(total) * scale)

    @property
    def floor(self) -> float:
        """The smallest entry: the op's fixed cost."""
        return float(self.seconds.min())

    def above_floor(self, *point: float) -> float:
        return max(0.0, self(*point) - self.floor)

    def to_json(self) -> dict[str, Any]:
        return {"axes": [list(a) for a in self.axes], "seconds": self.seconds.tolist()}

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str = "table") -> "GridTable":
        try:
            axes = tuple(tuple(float(v) for v in axis) for axis in data["axes"])
            return cls(axes, np.asarray(data["seconds"], dtype=float))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where}: not a measured table ({e})") from None


@dataclass(frozen=True)
class EngineTables:
    """What `predict_step` needs, measured on one machine for one model (see module docstring)."""

    linear: dict[tuple[int, int], GridTable]  # weight (rows, cols) -> (tokens,) -> seconds of one F.linear
    linear_floor: float  # seconds of a 16x16 F.linear of one token: the call's fixed cost
    batched: dict[tuple[int, int, int], GridTable]  # MLA einsum (heads, rows, cols) -> (tokens,) -> seconds
    elementwise: GridTable  # (elements,) -> seconds of one elementwise op
    attention_decode: GridTable  # (context,) -> seconds, one query
    attention_prefill: GridTable  # (tokens,) -> seconds, a chunk of T queries from position 0
    experts: GridTable  # (tokens per expert,) -> seconds per active expert of one kernel call
    host: dict[str, dict[str, float]]  # kind -> part (HOST_PARTS) -> seconds
    threads: int
    compute_dtype: str
    notes: dict[str, str] = field(default_factory=dict, compare=False)  # how each table was measured

    def __post_init__(self):
        for kind in KINDS:
            missing = [p for p in HOST_PARTS if p not in self.host.get(kind, {})]
            if missing:
                raise ValueError(f"engine tables: host costs of {kind} lack {', '.join(missing)}")

    TABLES = ("elementwise", "attention_decode", "attention_prefill", "experts")

    def linear_s(self, rows: float, cols: float, tokens: float) -> float:
        """Seconds of one F.linear of `tokens` tokens through a rows x cols weight, above the call's fixed cost."""
        table = self.linear.get((int(rows), int(cols)))
        if table is None:
            raise ValueError(f"engine tables: no F.linear measured for a {int(rows)}x{int(cols)} weight (measured: "
                             f"{', '.join(f'{r}x{c}' for r, c in sorted(self.linear))}); measure this model's tables")
        return max(0.0, table(tokens) - self.linear_floor)

    def batched_s(self, batch: float, rows: float, cols: float, tokens: float) -> float:
        """Seconds of one MLA absorption einsum above its fixed cost (its own table's smallest entry)."""
        key = (int(batch), int(rows), int(cols))
        if key not in self.batched:
            raise ValueError(f"engine tables: no einsum measured for {key[0]} heads of {key[1]}x{key[2]}; measure "
                             "this model's tables")
        return self.batched[key].above_floor(tokens)

    def to_json(self) -> dict[str, Any]:
        return {"axes": [list(a) for a in self.axes], "seconds": self.seconds.tolist()}

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str = "table") -> "GridTable":
        try:
            axes = tuple(tuple(float(v) for v in axis) for axis in data["axes"])
            return cls(axes, np.asarray(data["seconds"], dtype=float))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where}: not a measured table ({e})") from None


@dataclass(frozen=True)
class EngineTables:
    """What `predict_step` needs, measured on one machine for one model (see module docstring)."""

    linear: dict[tuple[int, int], GridTable]  # weight (rows, cols) -> (tokens,) -> seconds of one F.linear
    linear_floor: float  # seconds of a 16x16 F.linear of one token: the call's fixed cost
    batched: dict[tuple[int, int, int], GridTable]  # MLA einsum (heads, rows, cols) -> (tokens,) -> seconds
    elementwise: GridTable  # (elements,) -> seconds of one elementwise op
    attention_decode: GridTable  # (context,) -> seconds, one query
    attention_prefill: GridTable  # (tokens,) -> seconds, a chunk of T queries from position 0
    experts: GridTable  # (tokens per expert,) -> seconds per active expert of one kernel call
    host: dict[str, dict[str, float]]  # kind -> part (HOST_PARTS) -> seconds
    threads: int
    compute_dtype: str
    notes: dict[str, str] = field(default_factory=dict, compare=False)  # how each table was measured

    def __post_init__(self):
        for kind in KINDS:
            missing = [p for p in HOST_PARTS if p not in self.host.get(kind, {})]
            if missing:
                raise ValueError(f"engine tables: host costs of {kind} lack {', '.join(missing)}")

    TABLES = ("elementwise", "attention_decode", "attention_prefill", "experts")

    def linear_s(self, rows: float, cols: float, tokens: float) -> float:
        """Seconds of one F.linear of `tokens` tokens through a rows x cols weight, above the call's fixed cost."""
        table = self.linear.get((int(rows), int(cols)))
        if table is None:
            raise ValueError(f"engine tables: no F.linear measured for a {int(rows)}x{int(cols)} weight (measured: "
                             f"{', '.join(f'{r}x{c}' for r, c in sorted(self.linear))}); measure this model's tables")
        return max(0.0, table(tokens) - self.linear_floor)

    def batched_s(self, batch: float, rows: float, cols: float, tokens: float) -> float:
        """Seconds of one MLA absorption einsum above its fixed cost (its own table's smallest entry)."""
        key = (int(batch), int(rows), int(cols))
        if key not in self.batched:
            raise ValueError(f"engine tables: no einsum measured for {key[0]} heads of {key[1]}x{key[2]}; measure "
                             "this model's tables")
        return self.batched[key].above_floor(tokens)

    @classmethod
    def median(cls, rounds: list["EngineTables"]) -> "EngineTables":
        """Entry by entry, the median of tables measured in several rounds (on the same grids)."""
        first = rounds[0]

        def median_table(name: str, grids: list[GridTable]) -> GridTable:
            if any(g.axes != grids[0].axes for g in grids):
                raise ValueError(f"engine tables: rounds measured '{name}' on different grids")
            return GridTable(grids[0].axes, np.median([g.seconds for g in grids], axis=0))

        tables = {name: median_table(name, [getattr(t, name) for t in rounds]) for name in cls.TABLES}
        if any(t.linear.keys() != first.linear.keys() for t in rounds):
            raise ValueError("engine tables: rounds measured F.linear for different weight shapes")
        linear = {shape: median_table(f"linear {shape}", [t.linear[shape] for t in rounds]) for shape in first.linear}
        if any(t.batched.keys() != first.batched.keys() for t in rounds):
            raise ValueError("engine tables: rounds measured einsums for different shapes")
        batched = {k: median_table(f"einsum {k}", [t.batched[k] for t in rounds]) for k in first.batched}
        host = {kind: {part: float(np.median([t.host[kind][part] for t in rounds])) for part in parts}
                for kind, parts in first.host.items()}
        return cls(linear=linear, linear_floor=float(np.median([t.linear_floor for t in rounds])), batched=batched,
                   **tables,
                   host=host, threads=first.threads, compute_dtype=first.compute_dtype,
                   notes={**first.notes, "rounds": f"median of {len(rounds)} rounds"})

    def to_json(self) -> dict[str, Any]:
        return {"threads": self.threads, "compute_dtype": self.compute_dtype, "host_s": self.host,
                "linear": {f"{r}x{c}": t.to_json() for (r, c), t in self.linear.items()},
                "linear_floor_s": self.linear_floor,
                "batched": {"x".join(map(str, k)): t.to_json() for k, t in self.batched.items()},
                **{name: getattr(self, name).to_json() for name in self.TABLES}, "notes": self.notes}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "EngineTables":
        tables = {name: GridTable.from_json(data.get(name, {}), name) for name in cls.TABLES}
        try:
            linear = {tuple(int(v) for v in key.split("x")): GridTable.from_json(t, f"linear {key}")
                      for key, t in data["linear"].items()}
            floor = float(data["linear_floor_s"])
            batched = {tuple(int(v) for v in key.split("x")): GridTable.from_json(t, f"einsum {key}")
                       for key, t in data.get("batched", {}).items()}
        except (KeyError, ValueError, AttributeError) as e:
            raise ValueError(f"engine tables: no F.linear tables ({e})") from None
        host = {k: {p: float(v) for p, v in parts.items()} for k, parts in data.get("host_s", {}).items()}
        return cls(linear=linear, linear_floor=floor, batched=batched, **tables, host=host, threads=int(data["threads"]),
                   compute_dtype=str(data["compute_dtype"]), notes=dict(data.get("notes", {})))


# ---- the engine's op sequence ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Op:
    """One op (or `count` identical ops) of a step: what it is, where it belongs, and its shape."""

    kind: str  # "linear" | "batched_linear" | "attention" | "experts" | "elementwise"
    part: str  # "attention" | "mlp" | "moe" | "model" (embedding, final norm, LM head)
    shape: tuple[float, ...]  # linear (rows, cols, tokens); batched_linear (batch, rows, cols, tokens);
    # attention (queries, context); experts (experts, tokens each); elementwise (elements,)
    count: int = 1


def _norm(part: str, elements: float) -> list[Op]:
    """rms_norm: pow, mean, x * rsqrt, weight * x over every element (the float32 casts are no-ops)."""
    return [Op("elementwise", part, (elements,), 4)]


def _rope(part: str, tokens: int, heads: int, dims: int) -> list[Op]:
    """RotaryEmbedding.apply: four products, a difference and a sum over half the dims, then a cat."""
    return [Op("elementwise", part, (tokens * heads * dims / 2,), 6), Op("elementwise", part, (tokens * heads * dims,))]


def _gqa_ops(c: ModelConfig, T: int, C: int) -> list[Op]:
    a, H = c.attention, c.hidden_size
    N, Nk, D = a.num_heads, a.num_kv_heads, a.head_dim
    ops = [Op("linear", "attention", (N * D, H, T)), Op("linear", "attention", (Nk * D, H, T), 2)]
    if a.qk_norm:
        ops += _norm("attention", T * N * D) + _norm("attention", T * Nk * D)
    ops += [Op("elementwise", "attention", (T * c.rope.rotary_dim / 2,), 6)]  # cos/sin of the positions
    ops += _rope("attention", T, N, D) + _rope("attention", T, Nk, D)
    ops += [Op("elementwise", "attention", (T * Nk * D,), 2),  # K and V into the paged cache
            Op("attention", "attention", (T, C)), Op("linear", "attention", (H, N * D, T))]
    return ops


def _mla_ops(c: ModelConfig, T: int, C: int) -> list[Op]:
    a, H = c.attention, c.hidden_size
    N, L, R, P, Dv = a.num_heads, a.kv_lora_rank, a.qk_rope_head_dim, a.qk_nope_head_dim, a.v_head_dim
    if a.q_lora_rank is None:
        ops = [Op("linear", "attention", (N * (P + R), H, T))]
    else:
        Lq = a.q_lora_rank
        ops = [Op("linear", "attention", (Lq, H, T))] + _norm("attention", T * Lq)
        ops += [Op("linear", "attention", (N * (P + R), Lq, T))]
    ops += [Op("linear", "attention", (L + R, H, T))] + _norm("attention", T * L)
    ops += [Op("elementwise", "attention", (T * R / 2,), 6)]  # cos/sin of the positions
    ops += _rope("attention", T, N, R) + _rope("attention", T, 1, R)
    ops += [Op("elementwise", "attention", (T * (L + R),), 2),  # cat(latent, k_pe) and its cache write
            Op("batched_linear", "attention", (N, L, P, T)),  # q_nope absorbed through W_uk
            Op("elementwise", "attention", (T * N * (L + R),)),  # cat(q_lat, q_pe)
            Op("attention", "attention", (T, C)),
            Op("batched_linear", "attention", (N, Dv, L, T)),  # attention-weighted latent through W_uv
            Op("elementwise", "attention", (T * N * Dv,)),  # its [T, N, Dv] view reshaped (a copy)
            Op("linear", "attention", (H, N * Dv, T))]
    return ops


def _mlp_ops(part: str, H: int, I: int, T: int) -> list[Op]:
    """GatedMLP: gate and up, silu and product over [T, I], down."""
    return [Op("linear", part, (I, H, T), 2), Op("elementwise", part, (T * I,), 2), Op("linear", part, (H, I, T))]


def expected_distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected number of distinct experts `tokens` tokens route to, each choosing top_k of num_experts
    uniformly: sum over experts of 1 - (1 - K/E)^T."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def _expert_ops(c: ModelConfig, T: int, counts: Sequence[int] | None) -> list[Op]:
    """The expert-kernel call of one MoE layer as (experts, tokens each) groups: from the (token, expert)
    counts of the step's routing when given, else uniform routing (expected distinct experts, even split)."""
    E, K = c.moe.num_experts, c.moe.num_experts_per_tok
    if counts is None:
        active = expected_distinct_experts(E, K, T)
        return [Op("experts", "moe", (active, T * K / active))]
    if len(counts) != E or sum(counts) != T * K:
        raise ValueError(f"routing counts must give {E} experts {T * K} (token, expert) pairs in all, got "
                         f"{len(counts)} experts and {sum(counts)} pairs")
    values, experts = np.unique([n for n in counts if n > 0], return_counts=True)
    return [Op("experts", "moe", (float(e), float(v))) for v, e in zip(values, experts)]


def _moe_ops(c: ModelConfig, T: int, counts: Sequence[int] | None) -> list[Op]:
    m, H = c.moe, c.hidden_size
    ops = [Op("linear", "moe", (m.num_experts, H, T))]  # router logits (float32 weights)
    # scores, top-k and weights over [T, E]: softmax + top-k, or sigmoid + bias + group mask + top-k
    ops += [Op("elementwise", "moe", (T * m.num_experts,), 2 if m.topk_method != "noaux_tc" else 5)]
    ops += _expert_ops(c, T, counts)
    if m.num_shared_experts:
        ops += _mlp_ops("moe", H, m.shared_intermediate_size, T) + [Op("elementwise", "moe", (T * H,))]
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
    ops = [Op("elementwise", "model", (T * H,))]  # embedding rows
    for is_moe in c.moe_layers:
        ops += _norm("attention", T * H) + attention(c, T, context) + [Op("elementwise", "attention", (T * H,))]
        ops += _norm("mlp", T * H)
        if is_moe:
            ops += _moe_ops(c, T, next(counts) if counts is not None else None)
        else:
            ops += _mlp_ops("mlp", H, c.intermediate_size, T)
        ops += [Op("elementwise", "mlp", (T * H,))]  # residual add
    ops += _norm("model", H) + [Op("linear", "model", (c.vocab_size, H, 1))]  # last token's logits
    return ops


def weight_shapes(config: ModelConfig) -> list[tuple[int, ...]]:
    """Every (rows, cols) weight shape the engine runs F.linear with, then every (heads, rows, cols) of the
    MLA absorption einsums: the shapes `EngineTables` must hold for this model."""
    ops = engine_ops(config, 1, 1)
    linear = {tuple(int(v) for v in op.shape[:2]) for op in ops if op.kind == "linear"}
    batched = {tuple(int(v) for v in op.shape[:3]) for op in ops if op.kind == "batched_linear"}
    return sorted(linear) + sorted(batched)


# ---- costing ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EnginePrediction:
    kind: str
    queries: int
    context: int
    seconds: float
    parts: dict[str, float]  # COST_PARTS -> seconds


def op_seconds(op: Op, tables: EngineTables, kind: str) -> float:
    """One op's time above its fixed cost (see module docstring), times its count."""
    if op.kind == "linear":
        seconds = tables.linear_s(*op.shape)
    elif op.kind == "batched_linear":
        seconds = tables.batched_s(*op.shape)
    elif op.kind == "attention":
        queries, context = op.shape
        if kind == "decode":
            seconds = tables.attention_decode.above_floor(context)
        else:
            seconds = tables.attention_prefill.above_floor(queries)
    elif op.kind == "experts":
        active, per_expert = op.shape
        seconds = active * tables.experts(per_expert)
    elif op.kind == "elementwise":
        seconds = tables.elementwise.above_floor(*op.shape)
    else:
        raise ValueError(f"unknown op kind {op.kind!r}")
    return seconds * op.count


def host_seconds(config: ModelConfig, tables: EngineTables, kind: str) -> float:
    host = tables.host[kind]
    moe = sum(config.moe_layers)
    return host["step"] + moe * host["moe_layer"] + (config.num_layers - moe) * host["dense_layer"]


def predict_step(config: ModelConfig, tables: EngineTables, kind: str, tokens: int, context: int = 0,
                 routing: Sequence[Sequence[int]] | None = None) -> EnginePrediction:
    """Seconds of one engine step of one sequence: kind "decode" (one new token after `context` cached ones)
    or "prefill" (`tokens` prompt tokens from position 0); `routing` as for engine_ops."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if kind == "decode":
        if tokens != 1:
            raise ValueError(f"a decode step has one new token per sequence, got {tokens}")
        queries, seq_len = 1, context + 1
    else:
        if context:
            raise ValueError("prefill is predicted from position 0 (the attention table was measured so)")
        queries, seq_len = tokens, tokens
    parts = dict.fromkeys(COST_PARTS, 0.0)
    parts["host"] = host_seconds(config, tables, kind)
    for op in engine_ops(config, queries, seq_len, routing):
        parts[op.kind if op.kind != "batched_linear" else "linear"] += op_seconds(op, tables, kind)
    return EnginePrediction(kind, queries, seq_len, sum(parts.values()), parts)
