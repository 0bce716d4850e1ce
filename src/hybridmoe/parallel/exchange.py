"""The dispatch/combine protocol between rank 0 and a worker rank, over point-to-point messages.

gloo (the CPU stand-in's backend) has no all-to-all with uneven splits, and rank 0 is the only rank that holds the
tokens (it runs attention; the workers hold experts only), so the exchange is a star of sends and receives, sizes
first. Per MoE layer of a prefill chunk and per worker:

    rank 0 -> worker  header int64 [5] = (OP_COMPUTE, layer, n, K, copy mode)   sizes first
    rank 0 -> worker  hidden [n, H] (compute dtype)                     the n tokens that route to its experts
    rank 0 -> worker  local ids int32 [n, K] (-1: another rank's expert) and weights float32 [n, K]
    worker -> rank 0  partial output [n, H] (compute dtype)             summed into those tokens' rows

A worker that owns none of the experts the layer's tokens chose gets the header alone (n = 0) and sends nothing
back: every worker sees every layer of a chunk, in order, and streams its share of each (share.ShareStreamer,
with the copy mode rank 0 chose for the chunk). OP_STATS asks a worker for its streaming figures (float64 [4]:
passes, bytes copied, copy seconds, bytes of the last pass); OP_STOP ends it.
Each kind of message has its own tag, and messages between two ranks arrive in the order they were sent.

Bytes per layer and worker: n * (2 H * dtype bytes + 8 K); n = the tokens with at least one expert on that worker
(T * (1 - (1 - 1/N)^K) on average with uniform routing). This is what the planner's exchange model costs for
parallel="rank0" (placement/passes.py).

Legend: T tokens of the chunk, n tokens sent to one rank, H hidden, K top-k, E experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

OP_STOP, OP_COMPUTE, OP_STATS = 0, 1, 2
TAG_HEADER, TAG_HIDDEN, TAG_IDS, TAG_WEIGHTS, TAG_OUTPUT, TAG_STATS = 1, 2, 3, 4, 5, 6
COPY_CODES = ("all", "activated")  # the copy mode's code in a header
HEADER_SIZE = 5


@dataclass
class Dispatch:
    """The part of a chunk that goes to one rank."""

    rank: int
    rows: torch.Tensor  # [n] int64: the chunk's token rows that route to at least one of the rank's experts
    local_ids: torch.Tensor  # [n, K] int32: the rank's own expert index, -1 where another rank owns the expert
    weights: torch.Tensor  # [n, K] float32

    @property
    def num_tokens(self) -> int:
        return int(self.rows.numel())


def split_by_owner(topk_ids: torch.Tensor, topk_weights: torch.Tensor, owner: torch.Tensor, local: torch.Tensor,
                   world_size: int) -> list[Dispatch]:
    """topk_ids/topk_weights [T, K] -> one Dispatch per rank 0..N-1 (rank 0's keeps every row, so its output is
    [T, H] and the workers' partial outputs are added into it; the workers' keep only their tokens)."""
    ranks = owner[topk_ids]  # [T, K]
    ids = local[topk_ids]  # [T, K]
    weights = topk_weights.float()
    out = []
    for rank in range(world_size):
        mine = ranks == rank  # [T, K]
        rows = torch.arange(topk_ids.shape[0]) if rank == 0 else mine.any(dim=1).nonzero().flatten()
        local_ids = torch.where(mine, ids, -1).to(torch.int32)[rows]
        out.append(Dispatch(rank, rows, local_ids, weights[rows]))
    return out


def header(op: int, layer: int = 0, num_tokens: int = 0, top_k: int = 0, copy: str = "all") -> torch.Tensor:
    return torch.tensor([op, layer, num_tokens, top_k, COPY_CODES.index(copy)], dtype=torch.int64)


def message_bytes(num_tokens: int, hidden: int, top_k: int, dtype: torch.dtype) -> int:
    """Bytes that one dispatch of `num_tokens` tokens and its reply put on the wire (both directions)."""
    if num_tokens == 0:
        return 0
    item = torch.empty((), dtype=dtype).element_size()
    return HEADER_SIZE * 8 + num_tokens * (2 * hidden * item + top_k * 8)
