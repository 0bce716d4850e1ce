"""`EngineClient`: what the server needs of an engine. `runtime.async_engine.AsyncLLMEngine` is one; an engine that
runs elsewhere (hybrid execution, prefill/decode workers) plugs in by offering the same."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Protocol

from hybridmoe.runtime.engine import RequestOutput
from hybridmoe.runtime.sampling_params import SamplingParams
from hybridmoe.runtime.scheduler import SchedulerStats
from hybridmoe.runtime.tokenizer import Tokenizer


class EngineClient(Protocol):
    load_error: BaseException | None  # why loading failed, else None
    on_request_finished: Callable[[RequestOutput], None] | None  # called with every request's last output

    @property
    def is_ready(self) -> bool: ...  # loaded and not shut down

    @property
    def tokenizer(self) -> Tokenizer: ...  # once ready

    @property
    def max_model_len(self) -> int: ...  # once ready

    @property
    def num_unfinished_requests(self) -> int: ...

    def start(self) -> None: ...

    async def wait_ready(self) -> None: ...  # raises when loading failed

    def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                 req_id: str | None = None) -> AsyncIterator[RequestOutput]: ...  # ValueError: refused

    def abort(self, req_id: str) -> None: ...

    def stats(self) -> SchedulerStats | None: ...

    def shutdown(self, timeout: float | None = 30.0) -> None: ...
