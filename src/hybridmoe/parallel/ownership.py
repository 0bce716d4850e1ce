"""Which rank owns which routed experts: rank r of N owns the contiguous block [E*r/N, E*(r+1)/N) of every MoE
layer's experts (the same split in every layer, the planner's 1/N per GPU).

Contiguous blocks keep the choice explicit and cheap to look up; with uniform routing every rank gets 1/N of the
(token, expert) pairs on average. DeepSeek-V3's group-limited routing sends a token to at most `topk_group` groups
of consecutive experts, so contiguous blocks also keep a token's experts on few ranks.
"""

from __future__ import annotations

import torch


def owned_experts(num_experts: int, world_size: int, rank: int) -> range:
    """The expert ids rank `rank` of `world_size` owns (every rank owns at least one when E >= N)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a group of {world_size}")
    if num_experts < world_size:
        raise ValueError(f"{num_experts} experts cannot be split over {world_size} ranks; "
                         f"use num_gpus <= {num_experts}")
    return range(num_experts * rank // world_size, num_experts * (rank + 1) // world_size)


def owner_tables(num_experts: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(owner [E] int64: the rank owning each expert, local [E] int64: its index among that rank's experts)."""
    owner = torch.empty(num_experts, dtype=torch.long)
    local = torch.empty(num_experts, dtype=torch.long)
    for rank in range(world_size):
        ids = owned_experts(num_experts, world_size, rank)
        owner[ids.start:ids.stop] = rank
        local[ids.start:ids.stop] = torch.arange(len(ids))
    return owner, local
