"""`Request` and `RequestStatus`: one generation request's tokens, progress and end state (plain Python).

Token-level stop rules live here (`append_output_token`): max_tokens ends with "length"; an EOS id (unless
ignore_eos) or one of stop_token_ids ends with "stop". Stop *strings* need text, so the engine finds them with
the detokenizer and ends the request through the scheduler's `finish_request`.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from hybridmoe.runtime.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to recompute its KV
    RUNNING = "running"  # holds KV blocks and is scheduled step by step
    FINISHED_STOPPED = "finished_stopped"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens reached (or the KV cache cannot hold the sequence)
    FINISHED_ABORTED = "finished_aborted"  # the client went away or cancelled
    FINISHED_ERROR = "finished_error"  # the step running it failed; `Request.error` says why

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    }
)

# The OpenAI-style finish_reason each finished status reports unless the caller gives one.
FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)  # compared by identity: two requests are never "equal"
class Request:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # leading tokens of all_token_ids whose KV is in the cache
    block_hashes: list[bytes] = field(default_factory=list)  # of its full KV blocks so far, kept by the BlockManager
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    # A request adopted with a compressed prompt KV (hybridmoe.disagg): the prompt positions whose KV was dropped
    # (the engine's bool mask [prompt tokens], opaque here; attention masks them, their positions stay), and
    # whether its cache holds what a prefill here would compute (False: quantised or dropped tokens; its blocks
    # are then never offered to the prefix cache). Preemption, which recomputes the prompt, resets both.
    kv_dropped: object | None = None
    kv_exact: bool = True

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.eos_token_ids = tuple(self.eos_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by the output so far (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> bool:
        """Append a sampled id and apply the token-level stop rules; returns True when this ends the request."""
        if self.status.is_finished:
            raise ValueError(f"request {self.req_id} is already finished ({self.status.name}); cannot append")
        self.output_token_ids.append(token_id)
        params = self.sampling_params
        if (not params.ignore_eos and token_id in self.eos_token_ids) or token_id in params.stop_token_ids:
            self.finish(RequestStatus.FINISHED_STOPPED)
        elif self.num_output_tokens >= params.max_tokens:
            self.finish(RequestStatus.FINISHED_LENGTH)
        return self.status.is_finished

    def finish(self, status: RequestStatus, reason: str | None = None) -> None:
        """Mark the request finished with status; reason defaults to the status's finish_reason."""
        if not status.is_finished:
            raise ValueError(f"request {self.req_id}: {status.name} is not a finished status")
        self.status = status
        self.finish_reason = reason if reason is not None else FINISH_REASONS[status]

    def forget_compressed_kv(self) -> None:
        """Its KV is gone (preempted): the recomputed prompt has all its keys, at full precision."""
        self.kv_dropped, self.kv_exact = None, True
