"""`ExpertParallelBackend`: one MoE layer's routed experts computed by all ranks, as an ExpertBackend.

submit(hidden [T, H], topk_ids [T, K], topk_weights [T, K]) sends each worker the tokens that route to its experts
(exchange.py), posts the receive of its partial output, then streams and computes rank 0's own share on the
engine's accelerator (share.ShareStreamer); wait() receives the workers' outputs (each bounded by the group's
timeout) and adds them into the tokens' rows. The MoE block runs the shared experts between the two calls, while
the workers compute. The result comes back on hidden's device and dtype. The copy mode ("all" or "activated") is
chosen per chunk at its first MoE layer and sent to the workers with every layer's header.

Legend: T tokens, H hidden, K top-k, n tokens sent to one rank.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hybridmoe.parallel.exchange import (OP_COMPUTE, TAG_HEADER, TAG_HIDDEN, TAG_IDS, TAG_OUTPUT, TAG_WEIGHTS,
                                         Dispatch, header, message_bytes, split_by_owner)
from hybridmoe.parallel.group import RankGroup
from hybridmoe.parallel.ownership import owner_tables
from hybridmoe.parallel.share import ShareStreamer


@dataclass
class ExchangeStats:
    """What the exchange moved, summed over calls (for tests, --verbose and metrics)."""

    calls: int = 0
    tokens: int = 0  # tokens of the chunks submitted
    tokens_sent: dict[int, int] = field(default_factory=dict)  # worker rank -> tokens dispatched to it
    bytes: int = 0  # both directions, headers included


@dataclass
class PassState:
    """What a model's layers share: the copy mode of the chunk in flight, chosen at its first MoE layer by
    `choose(tokens) -> "all" | "activated"`, and the exchanges submitted but not yet waited for (a forward that
    failed between a layer's submit and wait leaves them; the next submit drains them, so that a worker's late
    answer is never read as another layer's)."""

    choose: Callable[[int], str]
    first_layer: int
    mode: str = "all"
    unclaimed: list = field(default_factory=list)


@dataclass(eq=False)
class _Pending:
    dispatch: Dispatch
    out: torch.Tensor  # [n, H] receive buffer
    works: list  # the sends' and the receive's work objects (the receive last)
    keep: list  # tensors a send reads until it completes


class ExpertParallelBackend:
    def __init__(self, group: RankGroup, layer: int, num_experts: int, local: ShareStreamer,
                 local_device: torch.device, state: PassState, stats: ExchangeStats | None = None):
        self.group, self.layer, self.local, self.local_device, self.state = group, layer, local, local_device, state
        self.owner, self.local_index = owner_tables(num_experts, group.world_size)
        self.stats = stats if stats is not None else ExchangeStats()
        self.comm = local_device if group.backend == "nccl" else torch.device("cpu")
        self.timeout = datetime.timedelta(seconds=group.timeout_s)

    def submit(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
        self.group.check()
        state = self.state
        while state.unclaimed:
            self._receive(state.unclaimed.pop())  # answers nobody waited for: read and dropped
        top_k = topk_ids.shape[1]
        if self.layer == state.first_layer:
            state.mode = state.choose(hidden.shape[0])
        parts = split_by_owner(topk_ids.cpu(), topk_weights.cpu(), self.owner, self.local_index,
                               self.group.world_size)
        pending = [self._send(part, hidden, top_k) for part in parts[1:]]
        state.unclaimed.append(pending)
        self.stats.calls += 1
        self.stats.tokens += hidden.shape[0]
        mine = parts[0]
        out = self.local.run(self.layer, hidden.to(self.local_device), mine.local_ids.to(self.local_device),
                             mine.weights.to(self.local_device), state.mode)  # [T, H]
        return hidden, out, pending

    def wait(self, handle) -> torch.Tensor:
        hidden, out, pending = handle
        self.state.unclaimed = [u for u in self.state.unclaimed if u is not pending]
        for p in self._receive(pending):
            out.index_add_(0, p.dispatch.rows.to(out.device), p.out.to(out.device))
        return out.to(device=hidden.device, dtype=hidden.dtype)

    def _receive(self, pending: list[_Pending]) -> list[_Pending]:
        """Wait for the sends and the receive of each worker's exchange (each wait bounded by the timeout)."""
        for p in pending:
            try:
                for work in p.works:
                    work.wait(self.timeout)
            except RuntimeError as error:
                raise self.group.failed(p.dispatch.rank, error) from None
        return pending

    def _send(self, part: Dispatch, hidden: torch.Tensor, top_k: int) -> _Pending:
        pg, rank, n = self.group.pg, part.rank, part.num_tokens
        tensors = [(header(OP_COMPUTE, self.layer, n, top_k, self.state.mode).to(self.comm), TAG_HEADER)]
        if n:
            tensors += [(hidden[part.rows.to(hidden.device)].to(self.comm).contiguous(), TAG_HIDDEN),
                        (part.local_ids.to(self.comm), TAG_IDS), (part.weights.to(self.comm), TAG_WEIGHTS)]
        out = torch.empty(n, hidden.shape[1], dtype=hidden.dtype, device=self.comm)
        try:
            works = [pg.send([t], rank, tag) for t, tag in tensors]
            if n:
                works.append(pg.recv([out], rank, TAG_OUTPUT))
        except RuntimeError as error:
            raise self.group.failed(rank, error) from None
        self.stats.tokens_sent[rank] = self.stats.tokens_sent.get(rank, 0) + n
        self.stats.bytes += message_bytes(n, hidden.shape[1], top_k, hidden.dtype)
        return _Pending(part, out, works, [t for t, _ in tensors])
