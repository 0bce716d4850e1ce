"""`Scheduler`: which requests run how many tokens in the next step (plain Python, no torch).

Policy (first come, first served; "older" means added to the scheduler earlier):
  1. Running requests, oldest first: each decoding request gets its one token; a request in the middle of
     a chunked prefill continues with as much of its prompt as the token budget has left.
  2. Waiting requests are admitted in order while the step's token budget (max_num_batched_tokens), the
     number of running requests (max_num_seqs) and the free KV blocks allow; a prompt longer than the
     remaining budget is prefilled in chunks over several steps. Admission stops at the first request that
     does not fit (no overtaking), and is skipped in a step that had to preempt.
A request is only admitted when every running request has finished its prefill in the same step, so at most
one running request is mid-prefill and it is the newest: step 1 puts all decode tokens before any prefill.
When a running request cannot get the KV blocks it needs, the newest running request is preempted (its
blocks are freed, it goes back to the front of the waiting queue with num_computed_tokens = 0 and later
recomputes its prompt and the output so far) and the allocation is retried. The oldest running request thus
always makes progress, so no request waits forever. A request that alone needs more blocks than the whole
cache has ends with finish reason "length".

With prefix caching (the BlockManager's), a request being admitted, new or preempted, starts with the cached
blocks matching its leading tokens as computed and runs only the tokens after them; full blocks are offered to
the cache as soon as their KV is computed. `min_computed_tail` (default 1) is how many of a request's last
tokens admission computes even when they are cached (the engine's prompt importance needs the prompt's last
queries).

One step: `schedule()` -> run the model on each scheduled request's tokens
all_token_ids[num_computed_tokens : num_computed_tokens + num_new_tokens] -> `update_from_output()` with a
sampled id for every request that reached the end of its known tokens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from hybridmoe.runtime.block_manager import BlockManager
from hybridmoe.runtime.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    block_table: list[int]  # covers num_computed_tokens + num_new_tokens tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted: list[str]  # req_ids preempted in this step (their KV is gone; they wait to recompute)
    num_batched_tokens: int


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot of the scheduler's load and the KV cache's use (counters are cumulative since it started)."""

    num_running_requests: int
    num_waiting_requests: int  # queued, or preempted and waiting to recompute
    kv_blocks_total: int
    kv_blocks_used: int  # held by at least one request
    kv_blocks_free: int  # held by none (kv_blocks_total - kv_blocks_used), cached evictable ones included
    kv_blocks_cached: int  # holding a full block in the prefix cache, in use or evictable
    prefix_cache_queries: int  # tokens looked up in the prefix cache: all tokens of each admitted request
    prefix_cache_hits: int  # of those, tokens found cached, whose KV was reused instead of computed
    computed_tokens: int  # tokens the model computed: prompts (past their cached prefix), recomputation, decode
    num_preemptions: int  # running requests sent back to wait for KV blocks


@dataclass
class _Step:
    """The step being planned: num_new_tokens per scheduled req_id (in scheduling order) and the budget left.

    Preemption victims are always newer than the request that needs room, and requests are scheduled oldest
    first, so a victim has not been scheduled in this step yet."""

    token_budget: int
    num_new_tokens: dict[str, int] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)


class Scheduler:
    def __init__(
        self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
        max_model_len_source: str = "",
    ) -> None:
        """max_model_len_source: what sets max_model_len, named in the error of a request that exceeds it."""
        for name, value in (
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_model_len", max_model_len),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Scheduler: {name} must be an integer >= 1, got {value!r}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.max_model_len_source = max_model_len_source
        self.waiting: deque[Request] = deque()  # oldest first; preempted requests rejoin at the front
        self.running: list[Request] = []  # oldest first (admission order == arrival order)
        self._unfinished: dict[str, Request] = {}
        self._finished_while_scheduling: list[Request] = []
        self._computed_tokens = 0
        self._num_preemptions = 0
        self.min_computed_tail = 1  # tokens at the end of a request that admission computes, cached or not

    # ---- requests in and out -------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request; raises ValueError when it can never be served."""
        req_id = request.req_id
        if req_id in self._unfinished:
            raise ValueError(f"request id {req_id!r} is already queued or running")
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens or request.output_token_ids:
            raise ValueError(f"request {req_id!r} must be new (WAITING, no output, nothing computed)")
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            raise ValueError(f"request {req_id!r}: the prompt is empty")
        max_tokens = request.sampling_params.max_tokens
        if num_prompt + max_tokens > self.max_model_len:
            raise ValueError(
                f"request {req_id!r}: prompt too long: {num_prompt} tokens + max_tokens {max_tokens} > "
                f"max_model_len {self.max_model_len}"
                + (f" ({self.max_model_len_source})" if self.max_model_len_source else "")
            )
        blocks = self.block_manager.blocks_needed(num_prompt)
        if blocks > self.block_manager.num_blocks:
            raise ValueError(
                f"request {req_id!r}: prompt too long: {num_prompt} tokens need {blocks} KV blocks of "
                f"{self.block_manager.block_size} tokens, the whole cache has {self.block_manager.num_blocks}"
            )
        self._unfinished[req_id] = request
        self.waiting.append(request)

    def abort_request(self, req_id: str) -> None:
        """End req_id with finish reason "abort" (ignored when it is unknown or already finished)."""
        self.finish_request(req_id, RequestStatus.FINISHED_ABORTED, "abort")

    def finish_request(self, req_id: str, status: RequestStatus, reason: str | None = None) -> None:
        """End req_id now (stop string found, abort, error): frees its blocks. Unknown ids are ignored."""
        request = self._unfinished.get(req_id)
        if request is None:
            return
        request.finish(status, reason)
        self._release(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self._unfinished)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._unfinished)

    def stats(self) -> SchedulerStats:
        manager = self.block_manager
        return SchedulerStats(
            num_running_requests=len(self.running), num_waiting_requests=len(self.waiting),
            kv_blocks_total=manager.num_blocks, kv_blocks_used=manager.num_used_blocks,
            kv_blocks_free=manager.num_free_blocks, kv_blocks_cached=manager.num_cached_blocks,
            prefix_cache_queries=manager.prefix_cache_queries, prefix_cache_hits=manager.prefix_cache_hits,
            computed_tokens=self._computed_tokens, num_preemptions=self._num_preemptions,
        )

    # ---- one step ------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        step = _Step(token_budget=self.max_num_batched_tokens)
        for request in list(self.running):  # oldest first: decodes, then the one mid-prefill (if any)
            if step.token_budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted or ended earlier in this step
            num_pending = request.num_tokens - request.num_computed_tokens
            if num_pending < 1:
                raise RuntimeError(
                    f"request {request.req_id!r} is running with no token to compute: "
                    f"update_from_output was not given its sampled token"
                )
            self._schedule_running(request, min(num_pending, step.token_budget), step)
        if not step.preempted:
            self._admit_waiting(step)

        scheduled = [
            ScheduledRequest(self._unfinished[req_id], num_new, self.block_manager.get_block_table(req_id))
            for req_id, num_new in step.num_new_tokens.items()
        ]
        return SchedulerOutput(scheduled, step.preempted, sum(step.num_new_tokens.values()))

    def update_from_output(self, scheduler_output: SchedulerOutput, sampled: Mapping[str, int]) -> list[Request]:
        """Record a finished step; sampled holds the new id of every request that reached the end of its known
        tokens. Returns the requests that finished (now or in the last schedule), their blocks freed."""
        finished, self._finished_while_scheduling = self._finished_while_scheduling, []
        self._computed_tokens += scheduler_output.num_batched_tokens
        for item in scheduler_output.scheduled:
            request = item.request
            if request.status is not RequestStatus.RUNNING:
                continue  # ended (abort, stop string, error) after it was scheduled
            request.num_computed_tokens += item.num_new_tokens
            self.block_manager.cache_full_blocks(request)
            if request.num_computed_tokens < request.num_tokens:
                continue  # mid-prefill: the logits of this chunk are not used
            if request.req_id not in sampled:
                raise ValueError(
                    f"update_from_output: request {request.req_id!r} computed all its "
                    f"{request.num_tokens} tokens this step but has no sampled token"
                )
            if request.append_output_token(sampled[request.req_id]):
                self._release(request)
                finished.append(request)
        return finished

    # ---- internals -----------------------------------------------------------------------------------

    def _schedule_running(self, request: Request, num_new_tokens: int, step: _Step) -> None:
        """Give a running request its blocks, preempting newer requests while needed."""
        while not self.block_manager.allocate_slots(request, num_new_tokens):
            newest = self.running[-1]
            if newest is not request:
                self._preempt(newest, step)
                continue
            if len(self.running) == 1:  # it alone needs more blocks than the cache has
                request.finish(RequestStatus.FINISHED_LENGTH)
                self._release(request)
                self._finished_while_scheduling.append(request)
            else:  # it is the newest: step back so the older requests keep their blocks
                self._preempt(request, step)
            return
        step.num_new_tokens[request.req_id] = num_new_tokens
        step.token_budget -= num_new_tokens

    def _admit_waiting(self, step: _Step) -> None:
        while self.waiting and step.token_budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]  # holds no blocks, has computed nothing (new, or preempted)
            # prompt logprobs need the logits of every prompt position; the cache holds only their KV
            cached = ([] if request.sampling_params.prompt_logprobs is not None
                      else self.block_manager.find_cached_prefix(request))
            while cached and request.num_tokens - len(cached) * self.block_manager.block_size < self.min_computed_tail:
                cached.pop()
            num_cached_tokens = len(cached) * self.block_manager.block_size
            num_new_tokens = min(request.num_tokens - num_cached_tokens, step.token_budget)
            if not self.block_manager.allocate_slots(request, num_new_tokens, cached):
                return  # first come, first served: nobody overtakes the oldest waiting request
            request.num_computed_tokens = num_cached_tokens
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            step.num_new_tokens[request.req_id] = num_new_tokens
            step.token_budget -= num_new_tokens

    def _preempt(self, request: Request, step: _Step) -> None:
        self.running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.forget_compressed_kv()  # an adopted request's dropped keys come back with the recomputation
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        step.preempted.append(request.req_id)
        self._num_preemptions += 1

    def _release(self, request: Request) -> None:
        """Forget a finished request: out of the queues, blocks freed."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.block_manager.free(request)
        del self._unfinished[request.req_id]
