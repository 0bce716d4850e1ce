"""Precision tiers per token under a budget b: a fraction of the full-precision (16-bit) bytes.

Paper cost of a token: FP16 1, INT8 1/2, INT4 1/4, DROP 0 (values only); b = mean cost over the n tokens.
Greedy: every token starts at the ladder's cheapest tier; when even that does not fit, only the highest ranked
floor(b n / cost) tokens keep it and the rest are dropped. Then, tier by tier upwards, the highest ranked tokens
are upgraded while the budget lasts. With the three-tier ladder this gives the closed form
  0.25 <= b <= 0.5: f8 = 4b - 1, f4 = 2 - 4b;   0.5 <= b <= 1: f16 = 2b - 1, f8 = 2 - 2b,
and tiers are monotone in importance (a higher ranked token never gets a cheaper tier). `real_costs` gives the
costs with the scales counted (float16 per group and token), to allocate under the real bytes instead.
"""

from __future__ import annotations

import math
from enum import IntEnum

import torch

from hybridmoe.kv.layout import KVLayout


class Tier(IntEnum):  # the 2-bit codes of the tier map
    FULL = 0  # 16-bit (the model's FP16/BF16), or the cache's own float32 when a payload asks for it
    INT8 = 1
    INT4 = 2
    DROP = 3


TIER_NAMES = {Tier.FULL: "fp16", Tier.INT8: "int8", Tier.INT4: "int4", Tier.DROP: "drop"}
PAPER_COSTS = {Tier.FULL: 1.0, Tier.INT8: 0.5, Tier.INT4: 0.25}
LADDER_3 = (Tier.FULL, Tier.INT8, Tier.INT4)  # when the model tolerates INT4 KV (the probe)
LADDER_2 = (Tier.FULL, Tier.INT8)


def real_costs(layout: KVLayout) -> dict[Tier, float]:
    """Each tier's bytes per token over the 16-bit bytes, scales (float16 per group) included."""
    width, groups = layout.row_width, layout.num_groups
    return {Tier.FULL: 1.0, Tier.INT8: (width + 2 * groups) / (2 * width),
            Tier.INT4: (width / 2 + 2 * groups) / (2 * width)}


def tier_counts(num_tokens: int, budget: float, ladder: tuple[Tier, ...],
                costs: dict[Tier, float] | None = None) -> list[int]:
    """How many tokens get each of FULL, INT8, INT4, DROP (the same for any importance)."""
    costs = costs or PAPER_COSTS
    ladder = tuple(sorted(ladder, key=lambda t: -costs[t]))  # dearest first
    if not ladder:
        raise ValueError("empty tier ladder")
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    total = budget * num_tokens
    cheapest = ladder[-1]
    kept = min(num_tokens, math.floor(total / costs[cheapest] + 1e-9))
    counts = {t: 0 for t in Tier}
    counts[cheapest] = kept
    counts[Tier.DROP] = num_tokens - kept
    left = total - kept * costs[cheapest]
    upgraded = kept  # tokens at the tier being upgraded (the highest ranked of them first)
    for lower, upper in zip(ladder[::-1], ladder[-2::-1]):
        step = costs[upper] - costs[lower]
        m = min(upgraded, math.floor(left / step + 1e-9))
        counts[lower] -= m
        counts[upper] += m
        left -= m * step
        upgraded = m
    return [counts[t] for t in Tier]


def allocate(importance: torch.Tensor, budget: float, ladder: tuple[Tier, ...] = LADDER_3,
             costs: dict[Tier, float] | None = None) -> torch.Tensor:
    """importance [n] -> tiers uint8 [n] (Tier codes): the highest ranked tokens get the dearest tiers."""
    n = importance.shape[0]
    counts = tier_counts(n, budget, ladder, costs)
    order = torch.argsort(importance.float(), descending=True, stable=True)  # ties: earlier token first
    ranked = torch.repeat_interleave(torch.arange(len(Tier), dtype=torch.uint8), torch.tensor(counts))
    tiers = torch.empty(n, dtype=torch.uint8)
    tiers[order] = ranked
    return tiers


def paper_budget(tiers: torch.Tensor) -> float:
    """The paper's b of a tier map: mean cost, values only."""
    return sum(PAPER_COSTS.get(Tier(t), 0.0) * int((tiers == t).sum()) for t in Tier) / max(1, tiers.shape[0])
