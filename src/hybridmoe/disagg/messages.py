"""What the front and the workers send each other over their sockets (pickled; small: ids, text, names; the KV
itself travels in shared memory, see handoff.py)."""

from __future__ import annotations

from dataclasses import dataclass

from hybridmoe.disagg.handoff import PackedKV
from hybridmoe.runtime.engine import EngineConfig, RequestOutput
from hybridmoe.runtime.sampling_params import SamplingParams
from hybridmoe.runtime.scheduler import SchedulerStats

# ---- front -> worker ----


@dataclass
class Init:  # the first message: what the worker is and loads
    role: str
    model: str
    config: EngineConfig
    prefix: str  # its shared-memory segments' name prefix
    kv_budget: float
    cpus: list[int] | None = None  # the CPUs it runs on (None: all of the front's)
    kv_importance: str = "attention"  # what ranks the prompt's tokens below budget 1: "attention" | "position"
    kv_streaming: bool = True  # the prefill worker sends a prompt's KV layer by layer where the tiers allow it


@dataclass
class Add:  # to the prefill worker: a new request
    req_id: str
    prompt: str | list[int]
    params: SamplingParams


@dataclass
class Adopt:  # to the decode worker: a prefilled request, its KV in a segment, its first token sampled
    req_id: str
    prompt_ids: list[int]
    params: SamplingParams
    first_token: int
    kv: PackedKV
    generator_state: bytes | None  # a seeded request's sampler state after its first token


@dataclass
class KVStream:  # prefill worker -> front -> decode worker: a prompt's KV is being written into kv.segment, layer
    req_id: str  # by layer, as the prefill computes it; its Handoff / Adopt (first token) follows
    prompt_ids: list[int]
    params: SamplingParams
    kv: PackedKV


@dataclass
class Abort:
    req_id: str


@dataclass
class Stop:
    pass


# ---- worker -> front ----


@dataclass
class Ready:
    pid: int
    max_model_len: int
    stats: SchedulerStats


@dataclass
class LoadFailed:
    message: str


@dataclass
class Outputs:  # one engine step's outputs
    outputs: list[RequestOutput]
    stats: SchedulerStats


@dataclass
class Refused:  # add_request refused it (the caller gets a ValueError)
    req_id: str
    message: str


@dataclass
class Failed:  # these requests ended with an error (finish_reason "error")
    req_ids: list[str]
    message: str


@dataclass
class Handoff(Adopt):  # from the prefill worker: the same fields the decode worker takes
    pass
