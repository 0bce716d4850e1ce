"""This engine's own op times on this machine: the measured tables the cost model reads for CPU execution.

A measured hardware profile may carry `op_tables` for one model's shapes (`hybridmoe profile --model DIR`, or
`hybridmoe bench costmodel`, which measures them in the same run as the step times it compares them with).
Where they cover the model (`OpTables.covers`), `CostModel` costs every CPU piece from them instead of from
the roofline:

- linear: seconds of one matmul against tokens, per weight shape (rows, cols) the model's parts multiply
  (`ModelSpec.part_matmuls`), weights rotated so that they come from where the engine finds them; its fixed
  cost is that of a 16x16 matmul (`linear_floor_s`); MLA's two absorption products (one bmm over the heads each) likewise per
  (heads, rows, cols);
- attention: seconds of the engine's context attention of one sequence (paged-cache gather + attend) at the
  model's head shape, against the context (one query: decode) or the chunk (a prefill from position 0);
- experts: seconds per active expert of one expert-kernel call against tokens per expert, at the model's
  expert shape and format, the call's fixed cost left out;
- elementwise: seconds of one elementwise op against its element count;
- host: the engine's Python and per-op dispatch cost, measured on a minimal-width copy of the architecture, per
  step and per layer kind (dense, MoE), for decode and prefill: what a step costs when its arithmetic is
  negligible. It holds every op's fixed cost, so the tables are read above their floors (their smallest entry).

Tables are read by linear interpolation in log-log space; beyond the last point time grows in proportion
(more tokens repeat the same work), below the first point it is the first value. Numpy only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

KINDS = ("decode", "prefill")
HOST_PARTS = ("step", "dense_layer", "moe_layer")


@dataclass(frozen=True)
class SecondsTable:
    """Seconds measured at ascending positive points x."""

    x: tuple[float, ...]
    seconds: tuple[float, ...]

    def __post_init__(self):
        if len(self.x) != len(self.seconds) or not self.x:
            raise ValueError(f"a table needs as many seconds as points, got {len(self.seconds)} for {len(self.x)}")
        if self.x[0] <= 0 or any(b <= a for a, b in zip(self.x, self.x[1:])):
            raise ValueError(f"table points {self.x} must be positive and strictly ascending")
        if not all(math.isfinite(s) and s > 0 for s in self.seconds):
            raise ValueError("table seconds must be positive and finite")

    def __call__(self, x: float) -> float:
        if x >= self.x[-1]:
            return self.seconds[-1] * x / self.x[-1]
        if x <= self.x[0]:
            return self.seconds[0]
        return float(np.exp(np.interp(math.log(x), np.log(self.x), np.log(self.seconds))))

    @property
    def floor(self) -> float:
        """The smallest entry: the op's fixed cost."""
        return min(self.seconds)

    def above_floor(self, x: float) -> float:
        return max(0.0, self(x) - self.floor)

    def to_json(self) -> list[list[float]]:
        return [[x, s] for x, s in zip(self.x, self.seconds)]

    @classmethod
    def from_json(cls, rows: Any, where: str) -> "SecondsTable":
        try:
            return cls(tuple(float(r[0]) for r in rows), tuple(float(r[1]) for r in rows))
        except (TypeError, ValueError, IndexError) as e:
            raise ValueError(f"{where}: not a measured table of [x, seconds] rows ({e})") from None


def _key(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


def _shape(key: str, where: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in key.split("x"))
    except ValueError:
        raise ValueError(f"{where}: {key!r} is not a shape like 128x2048") from None


@dataclass(frozen=True)
class OpTables:
    """Measured op times of this engine on one machine for one model's shapes (see module docstring)."""

    linear: dict[tuple[int, int], SecondsTable]  # weight (rows, cols) -> tokens -> seconds
    linear_floor_s: float
    batched: dict[tuple[int, int, int], SecondsTable]  # MLA absorption (heads, rows, cols) -> tokens -> seconds
    elementwise: SecondsTable  # elements -> seconds
    attention_shape: tuple  # (kind, heads, kv heads, key dim, value dim, sliding window or 0)
    attention_decode: SecondsTable  # context -> seconds, one query
    attention_prefill: SecondsTable  # tokens -> seconds, a chunk from position 0
    expert_shape: tuple  # (format, hidden, intermediate)
    experts: SecondsTable  # tokens per expert -> seconds per active expert of one call
    host: dict[str, dict[str, float]]  # kind -> HOST_PARTS -> seconds
    threads: int
    dtype: str
    notes: dict[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self):
        for kind in KINDS:
            missing = [p for p in HOST_PARTS if p not in self.host.get(kind, {})]
            if missing:
                raise ValueError(f"op tables: host costs of {kind} lack {', '.join(missing)}")

    def missing_for(self, linear: set, batched: set, attention_shape: tuple, expert_shape: tuple | None) -> list[str]:
        """What these tables lack to cost a model with these shapes (empty: they cover it)."""
        missing = [f"matmul {_key(s)}" for s in sorted(linear - set(self.linear))]
        missing += [f"absorption {_key(s)}" for s in sorted(batched - set(self.batched))]
        if tuple(attention_shape) != tuple(self.attention_shape):
            missing.append(f"attention {attention_shape} (measured {self.attention_shape})")
        if expert_shape is not None and tuple(expert_shape) != tuple(self.expert_shape):
            missing.append(f"experts {expert_shape} (measured {self.expert_shape})")
        return missing

    def linear_s(self, rows: int, cols: int, tokens: float) -> float:
        """One matmul of `tokens` tokens through a rows x cols weight, above the call's fixed cost."""
        return max(0.0, self.linear[(rows, cols)](tokens) - self.linear_floor_s)

    def batched_s(self, shape: tuple[int, int, int], tokens: float) -> float:
        return self.batched[shape].above_floor(tokens)

    def attention_s(self, queries: int, context_before: int) -> float:
        """One sequence's context attention above its fixed cost: decode (one query) from the decode table; a
        chunk after `context_before` cached tokens as the prefill of the whole sequence so far, scaled by the
        share of its query-key pairs that the chunk computes."""
        if queries == 1:
            return self.attention_decode.above_floor(context_before + 1)
        total = context_before + queries
        share = (queries * context_before + queries * (queries + 1) / 2) / (total * (total + 1) / 2)
        return self.attention_prefill.above_floor(total) * share

    def to_json(self) -> dict[str, Any]:
        return {"threads": self.threads, "dtype": self.dtype, "host_s": self.host,
                "linear": {_key(k): t.to_json() for k, t in self.linear.items()},
                "linear_floor_s": self.linear_floor_s,
                "batched": {_key(k): t.to_json() for k, t in self.batched.items()},
                "elementwise": self.elementwise.to_json(),
                "attention_shape": list(self.attention_shape), "attention_decode": self.attention_decode.to_json(),
                "attention_prefill": self.attention_prefill.to_json(),
                "expert_shape": list(self.expert_shape), "experts": self.experts.to_json(), "notes": self.notes}

    @classmethod
    def from_json(cls, data: Any, where: str = "op_tables") -> "OpTables":
        if not isinstance(data, dict):
            raise ValueError(f"{where}: must be an object")
        try:
            tables = {name: SecondsTable.from_json(data[name], f"{where}.{name}")
                      for name in ("elementwise", "attention_decode", "attention_prefill", "experts")}
            linear = {_shape(k, where): SecondsTable.from_json(v, f"{where}.linear.{k}")
                      for k, v in data["linear"].items()}
            batched = {_shape(k, where): SecondsTable.from_json(v, f"{where}.batched.{k}")
                       for k, v in data.get("batched", {}).items()}
            host = {k: {p: float(v) for p, v in parts.items()} for k, parts in data["host_s"].items()}
            return cls(linear=linear, linear_floor_s=float(data["linear_floor_s"]), batched=batched,
                       attention_shape=tuple(data["attention_shape"]), expert_shape=tuple(data["expert_shape"]),
                       host=host, threads=int(data["threads"]), dtype=str(data["dtype"]),
                       notes=dict(data.get("notes", {})), **tables)
        except KeyError as e:
            raise ValueError(f"{where}: field {e.args[0]!r} is missing") from None
        except (TypeError, AttributeError, ValueError) as e:
            if str(e).startswith(where):
                raise
            raise ValueError(f"{where}: malformed ({e})") from None
