"""Routers: which experts each token goes to, and with what weight.

- softmax + greedy top-k (Qwen3-MoE, Mixtral), optionally renormalised over the top-k;
- DeepSeek-V3 "noaux_tc": sigmoid scores; experts are chosen by score + e_score_correction_bias inside the
  topk_group best groups (a group's rank is the sum of its two best biased scores), weighted by the unbiased
  scores, renormalised, times routed_scaling_factor.
Computed in float32, as the reference implementations do.

Legend: T tokens, H hidden, E experts, K top-k, G groups.
"""

from __future__ import annotations

import torch

from hybridmoe.config import MoEConfig
from hybridmoe.kernels import router as kernel
from hybridmoe.layers.linear import Linear


class Router:
    def __init__(self, config: MoEConfig, weight: torch.Tensor, correction_bias: torch.Tensor | None = None):
        self.cfg = config
        self.weight = weight.float()  # [E, H]
        self.gate = Linear.dense(self.weight)
        self.correction_bias = correction_bias  # [E] float32 (noaux_tc)
        if config.topk_method == "noaux_tc" and correction_bias is None:
            raise ValueError("noaux_tc routing needs e_score_correction_bias")
        noaux = config.topk_method == "noaux_tc"
        # the routing kernel's settings (kernels.router.route's keywords), the same for every call
        self.kernel_args = dict(k=config.num_experts_per_tok, sigmoid=config.scoring_func != "softmax",
                                bias=correction_bias if noaux else None, groups=config.n_group if noaux else 1,
                                topk_groups=config.topk_group if noaux else 1, normalize=config.norm_topk_prob,
                                norm_eps=1e-20 if noaux else 0.0, scale=config.routed_scaling_factor)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (topk_ids [T, K] int64, topk_weights [T, K] float32)."""
        cfg = self.cfg
        logits = self.gate(x.float())  # [T, E]
        if kernel.applies(logits):  # the same choice in one call (descending order, where torch's may differ)
            return kernel.route(logits, **self.kernel_args)
        if cfg.scoring_func == "softmax":
            scores = logits.softmax(dim=-1)
        else:
            scores = logits.sigmoid()
        if cfg.topk_method == "noaux_tc":
            choice = scores + self.correction_bias
            if cfg.n_group > 1:
                choice = self._mask_groups(choice)
            topk_ids = choice.topk(cfg.num_experts_per_tok, dim=-1, sorted=False).indices
            topk_weights = scores.gather(1, topk_ids)
            if cfg.norm_topk_prob:
                topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            topk_weights, topk_ids = scores.topk(cfg.num_experts_per_tok, dim=-1)
            if cfg.norm_topk_prob:
                topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        return topk_ids, topk_weights * cfg.routed_scaling_factor

    def _mask_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """choice [T, E] -> the same with experts outside each token's topk_group best groups at -inf."""
        cfg = self.cfg
        grouped = choice.view(choice.shape[0], cfg.n_group, -1)  # [T, G, E/G]
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        keep = group_scores.topk(cfg.topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)  # [T, G]
        return grouped.masked_fill(~group_mask[..., None], float("-inf")).view_as(choice)
