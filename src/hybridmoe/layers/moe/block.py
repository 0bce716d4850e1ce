"""The MoE block: router -> top-k -> routed experts (through an ExpertBackend) + shared experts.

Legend: T tokens, H hidden, K top-k.
"""

from __future__ import annotations

import torch

from collections.abc import Callable

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
        """x [T, H] -> [T, H]. The shared experts run between submit and wait, overlapping routed work."""
        topk_ids, topk_weights = self.router.route(x)  # [T, K], [T, K]
        for observe in self.routing_observers:
            observe(topk_ids)
        experts = self.experts
        if self.prefill_experts is not None and x.shape[0] >= self.prefill_min_tokens:
            experts = self.prefill_experts
        handle = experts.submit(x, topk_ids, topk_weights)
        shared = self.shared.forward(x) if self.shared is not None else None
        routed = experts.wait(handle)
        return routed if shared is None else routed + shared
