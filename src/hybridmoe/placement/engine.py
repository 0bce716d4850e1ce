"""Step times of our own engine on the CPU, predicted by summing the ops it runs at rates measured here.

`placement.engine_ops` lists the ops of a decode step or a prefill chunk of our engine from the model's config
(which linears with which weight shapes, which attention at which context, which expert-kernel calls with how
many tokens per expert, how many elementwise passes over which activations); `predict_step` costs each from
`EngineTables`, tables measured on this machine (by `hybridmoe bench costmodel`, in the same run as the
timings it is compared with):

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
measurement: subtracting it keeps it from being counted twice. The bench times the ops as the engine runs them
(see hybridmoe.bench.costmodel: after a step of the engine's code, one thread). Tables are read by multilinear interpolation in
log space; beyond a table's last point the time grows in proportion (more tokens repeat the same work).
Nothing here sees a measured step time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hybridmoe.config import ModelConfig
from hybridmoe.placement.engine_ops import Op, engine_ops

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
        return cls(linear=linear, linear_floor=floor, batched=batched, **tables, host=host,
                   threads=int(data["threads"]), compute_dtype=str(data["compute_dtype"]),
                   notes=dict(data.get("notes", {})))


# ---- costing ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EnginePrediction:
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
    return EnginePrediction(sum(parts.values()), parts)
