"""The MoE block: router -> top-k -> routed experts (through an ExpertBackend) + shared experts.

Legend: T tokens, H hidden, K top-k.
"""

from __future__ import annotations

import torch

from collections.abc import Callable
from dataclasses import dataclass

from hybridmoe.layers.mlp import GatedMLP
from hybridmoe.layers.moe.backend import ExpertBackend
from hybridmoe.layers.moe.router import Router


class MoEBlock:
    def __init__(self, router: Router, experts: ExpertBackend, shared: GatedMLP | None):
        self.router, self.experts, self.shared = router, experts, shared
        self.routing_observers: list[Callable[[torch.Tensor], None]] = []  # called with topk_ids [T, K]
        # stream-loading prefill (layers/moe/stream_prefill.py): chunks of at least prefill_min_tokens tokens run
        # their routed experts on prefill_experts instead of `experts`
        self.prefill_experts: ExpertBackend | None = None
        self.prefill_min_tokens = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]. The shared experts run between submit and wait, overlapping routed work; without
        shared experts a backend with a blocking call on this thread (`run`) takes it: nothing would overlap."""
        experts = self._experts_for(x)
        run = getattr(experts, "run", None) if self.shared is None else None
        if run is None:
            return self.finish(self._submit(x, experts))
        return run(x, *self._route(x))

    def start(self, x: torch.Tensor) -> "PendingMoE":
        """The first half of forward: route x [T, H] and submit its routed experts (they compute on the backend's
        own threads from here on); the caller may run other work before `finish` (dual-batch decode runs the
        other micro-batch's attention there: models/dual_batch.py)."""
        return self._submit(x, self._experts_for(x))

    def _submit(self, x: torch.Tensor, experts: ExpertBackend) -> "PendingMoE":
        return PendingMoE(x, experts, experts.submit(x, *self._route(x)))

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> topk_ids [T, K], topk_weights [T, K], seen by the routing observers."""
        topk_ids, topk_weights = self.router.route(x)
        for observe in self.routing_observers:
            observe(topk_ids)
        return topk_ids, topk_weights

    def _experts_for(self, x: torch.Tensor) -> ExpertBackend:
        """The stream-loading prefill's backend for chunks of prefill_min_tokens and more, else `experts`."""
        if self.prefill_experts is not None and x.shape[0] >= self.prefill_min_tokens:
            return self.prefill_experts
        return self.experts

    def finish(self, pending: "PendingMoE") -> torch.Tensor:
        """The second half: the shared experts, then wait for the routed ones -> [T, H]."""
        shared = self.shared.forward(pending.x) if self.shared is not None else None
        routed = pending.experts.wait(pending.handle)
        return routed if shared is None else routed + shared


@dataclass
class PendingMoE:
    """A MoE block's call between `start` and `finish`: its input and the routed experts' submitted handle."""

    x: torch.Tensor  # [T, H]
    experts: ExpertBackend  # the backend the work went to (the layer's, or the prefill one)
    handle: object
