"""Routing statistics: how often each expert is chosen, and what that means for bytes moved.

`RoutingStats` holds, per MoE layer, the probability p[e] that a token picks expert e (sum over e = top-k).
It is measured by counting top-k choices on sample prompts (`from_counts`, `from_topk_ids`; saved as JSON) or
assumed uniform (p = K/E). From it:

- the expected number of distinct experts a batch or chunk of N tokens activates,
  E[distinct] = sum_e 1 - (1 - p_e)^N (each token draws its experts independently of the other tokens);
- the hot-expert order (most frequently routed first) that the planner pins in leftover VRAM.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROUTING_SCHEMA = "hybridmoe-routing-stats"


@dataclass(frozen=True)
class RoutingStats:
    layers: tuple[int, ...]  # decoder-layer index of each MoE layer
    probs: np.ndarray  # [num_moe_layers, E] float64, rows sum to top_k
    top_k: int
    tokens: int = 0  # tokens counted (0: assumed, not measured)

    def __post_init__(self):
        if self.probs.ndim != 2 or self.probs.shape[0] != len(self.layers):
            raise ValueError(f"routing probs must be [num_moe_layers={len(self.layers)}, E], got {self.probs.shape}")
        if np.any(self.probs < 0) or np.any(self.probs > 1 + 1e-9):
            raise ValueError("routing probabilities must lie in [0, 1]")
        if not np.allclose(self.probs.sum(axis=1), self.top_k, rtol=1e-6):
            raise ValueError(f"each layer's routing probabilities must sum to top_k={self.top_k}")

    @property
    def num_experts(self) -> int:
        return self.probs.shape[1]

    @property
    def measured(self) -> bool:
        return self.tokens > 0

    @classmethod
    def uniform(cls, moe_layers: tuple[int, ...], num_experts: int, top_k: int) -> "RoutingStats":
        probs = np.full((len(moe_layers), num_experts), top_k / num_experts)
        return cls(tuple(moe_layers), probs, top_k)

    @classmethod
    def from_counts(cls, moe_layers: tuple[int, ...], counts: np.ndarray, top_k: int) -> "RoutingStats":
        """counts [num_moe_layers, E]: how many tokens picked each expert (each token adds top_k counts)."""
        counts = np.asarray(counts, dtype=np.float64)
        totals = counts.sum(axis=1, keepdims=True)
        if np.any(totals <= 0):
            raise ValueError("every MoE layer needs at least one counted token")
        tokens = totals[:, 0] / top_k
        if not np.allclose(tokens, tokens[0]):
            raise ValueError("every MoE layer must count the same tokens (counts/top_k differ between layers)")
        return cls(tuple(moe_layers), counts / totals * top_k, top_k, int(round(tokens[0])))

    @classmethod
    def from_topk_ids(cls, topk_ids_by_layer: dict[int, np.ndarray], num_experts: int) -> "RoutingStats":
        """topk_ids_by_layer: decoder-layer index -> [T, K] expert ids chosen for T tokens."""
        layers = tuple(sorted(topk_ids_by_layer))
        if not layers:
            raise ValueError("no layers given")
        top_k = int(np.asarray(topk_ids_by_layer[layers[0]]).shape[1])
        counts = np.stack([np.bincount(np.asarray(topk_ids_by_layer[l]).reshape(-1), minlength=num_experts)
                           for l in layers])
        if counts.shape[1] != num_experts:
            raise ValueError(f"expert ids must be < num_experts={num_experts}")
        return cls.from_counts(layers, counts, top_k)

    # ---- what the planner asks ---------------------------------------------------------------------------
    def expected_distinct(self, row: int, tokens: float, exclude: np.ndarray | None = None) -> float:
        """Expected distinct experts of MoE layer `row` activated by `tokens` tokens (experts where `exclude`
        is True are not counted)."""
        p = self.probs[row]
        activated = 1.0 - np.power(1.0 - np.minimum(p, 1.0), tokens)
        if exclude is not None:
            activated = np.where(exclude, 0.0, activated)
        return float(activated.sum())

    def routed_fraction(self, row: int, experts: np.ndarray) -> float:
        """Fraction of the layer's (token, expert) pairs that go to the experts marked True."""
        return float(self.probs[row][experts].sum() / self.top_k)

    @functools.cached_property
    def hot_order(self) -> tuple[np.ndarray, np.ndarray]:
        """(rows, experts): every (MoE layer row, expert), most frequently routed first; ties by layer then
        expert (deterministic)."""
        rows, experts = np.meshgrid(np.arange(self.probs.shape[0]), np.arange(self.num_experts), indexing="ij")
        order = np.lexsort((experts.ravel(), rows.ravel(), -self.probs.ravel()))
        return rows.ravel()[order], experts.ravel()[order]

    # ---- files -----------------------------------------------------------------------------------------
    def to_json(self, path: str | Path, model: str = "") -> None:
        counts = np.rint(self.probs * self.tokens).astype(np.int64) if self.measured else None
        data = {"schema": ROUTING_SCHEMA, "version": 1, "model": model, "top_k": self.top_k,
                "tokens": self.tokens, "layers": {str(l): (counts[i].tolist() if counts is not None else
                                                           self.probs[i].tolist())
                                                  for i, l in enumerate(self.layers)},
                "values": "counts" if self.measured else "probabilities"}
        Path(path).write_text(json.dumps(data) + "\n")

    @classmethod
    def from_json(cls, path: str | Path) -> "RoutingStats":
        where = str(path)
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{where}: cannot read routing statistics ({e})") from None
        if not isinstance(data, dict) or data.get("schema") != ROUTING_SCHEMA:
            raise ValueError(f"{where}: field 'schema' must be {ROUTING_SCHEMA!r}")
        layers = data.get("layers")
        if not isinstance(layers, dict) or not layers:
            raise ValueError(f"{where}: field 'layers' must map layer index -> per-expert values")
        order = sorted(layers, key=int)
        values = np.array([layers[k] for k in order], dtype=np.float64)
        top_k = int(data.get("top_k", 0))
        if top_k < 1:
            raise ValueError(f"{where}: field 'top_k' must be a positive integer")
        keys = tuple(int(k) for k in order)
        if data.get("values") == "counts":
            return cls.from_counts(keys, values, top_k)
        return cls(keys, values, top_k)

    def check_model(self, moe_layers: tuple[int, ...], num_experts: int, top_k: int, where: str = "") -> None:
        """Raise ValueError if these statistics do not belong to a model of this shape."""
        if tuple(self.layers) != tuple(moe_layers) or self.num_experts != num_experts or self.top_k != top_k:
            raise ValueError(f"routing statistics {where} are for {len(self.layers)} MoE layers x "
                             f"{self.num_experts} experts, top-{self.top_k}; the model has {len(moe_layers)} x "
                             f"{num_experts}, top-{top_k}")
