"""`AsyncLLMEngine`: the engine behind an asyncio front, for servers and streaming clients.

One engine thread owns the `LLMEngine`: it loads the model, then drives `step()` while requests are unfinished
and sleeps on its inbox when there are none. Requests and aborts enter through that thread-safe inbox, drained
between steps; each request's outputs reach its caller through the caller's own asyncio.Queue (one
`call_soon_threadsafe` per step and event loop). Torch and the C++ kernels release the GIL while they compute, so
the event loop keeps serving connections during a step.

    engine = AsyncLLMEngine("demo"); engine.start(); await engine.wait_ready()
    async for out in engine.generate("Hello", SamplingParams(max_tokens=8)):
        print(out.new_text, end="")

With stream_interval N > 1 (`hybridmoe serve --stream-interval`, as vLLM's and SGLang's) a request's outputs are
held on the engine thread until N new tokens have gathered (its first output and its last go at once), so that a
streaming client gets one merged output per N tokens: fewer events to write, less server CPU per token.

A caller that stops iterating early (its task cancelled: a client gone) aborts its request; the engine frees its KV
blocks before its next step. A model failure ends only the requests of its step (finish_reason "error", see
LLMEngine.step); a failure that escapes `step()` itself ends the requests then in flight the same way. The thread
keeps serving in both cases.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

from hybridmoe.runtime.engine import EngineConfig, LLMEngine, RequestOutput
from hybridmoe.runtime.sampling_params import SamplingParams
from hybridmoe.runtime.scheduler import SchedulerStats


class EngineNotReadyError(RuntimeError):
    """The model is still loading, failed to load, or the engine has shut down."""


class EngineStepError(RuntimeError):
    """The engine failed outside the model run while this request was in flight; the request has ended."""


class StreamBuffer:
    """A request's outputs held until `interval` new tokens have gathered; its first output and its last are due
    at once. push() returns the outputs due now (all of them, in order: the caller's drain merges them)."""

    __slots__ = ("interval", "held", "tokens", "started")

    def __init__(self, interval: int = 1):
        if interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {interval}")
        self.interval, self.held, self.tokens, self.started = interval, [], 0, False

    def push(self, out: RequestOutput) -> list[RequestOutput]:
        if self.interval == 1:
            return [out]
        self.held.append(out)
        self.tokens += len(out.new_token_ids)
        if not (out.finished or not self.started or self.tokens >= self.interval):
            return []
        self.started = True
        due, self.held, self.tokens = self.held, [], 0
        return due


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # RequestOutput items, or an exception that ends the request
    buffer: StreamBuffer  # outputs held back until due (stream_interval)


_STOP = object()


class AsyncLLMEngine:
    def __init__(self, model: str | Path, config: EngineConfig | None = None,
                 on_request_finished: Callable[[RequestOutput], None] | None = None,
                 engine_factory: Callable[[], LLMEngine] | None = None, stream_interval: int = 1):
        """model, config: as LLMEngine takes them (loaded on the engine thread by start()). on_request_finished
        (also settable as the attribute, before start) is called on the engine thread with the last output of every
        request (finished, aborted or failed).
        engine_factory, when given, builds the LLMEngine instead (model and config are then only names).
        stream_interval: a request's outputs reach its caller every that many new tokens (StreamBuffer)."""
        StreamBuffer(stream_interval)  # checks it
        self.model, self.stream_interval = model, stream_interval
        self._factory = engine_factory or (lambda: LLMEngine(model, config))
        self.on_request_finished = on_request_finished
        self.engine: LLMEngine | None = None  # set once loaded, None again after shutdown; the engine thread's
        self._tokenizer, self._max_model_len = None, 0
        self.load_error: BaseException | None = None
        self._loaded = threading.Event()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        # Guards _streams and _closed: the engine thread and event loops both touch them (reentrant: the thread's
        # last drain of the inbox holds it while failing the requests it finds)
        self._lock = threading.RLock()
        self._ids = itertools.count()
        self._stats: SchedulerStats | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="hybridmoe-engine", daemon=True)

    # ---- life cycle ------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; it loads the model first (see is_ready, wait_ready)."""
        self._thread.start()

    @property
    def is_ready(self) -> bool:
        """True once the model is loaded and until shutdown."""
        return self.engine is not None and not self._closed

    async def wait_ready(self) -> None:
        """Wait until the model is loaded; raises EngineNotReadyError when loading failed."""
        await asyncio.get_running_loop().run_in_executor(None, self._loaded.wait)
        if self.load_error is not None:
            raise EngineNotReadyError(f"the model failed to load: {self.load_error}") from self.load_error

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Refuse new requests, abort those in flight (their callers get finish_reason "abort"), stop the thread
        and close the engine (LLMEngine.close)."""
        with self._lock:
            self._closed = True
        self._inbox.put(_STOP)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # ---- requests --------------------------------------------------------------------------------------

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       req_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as the engine produces them, the last with finished=True. Raises ValueError
        (the prompt cannot be served, as LLMEngine.add_request says) before the first output, and
        EngineNotReadyError before the model is loaded or after shutdown.

        A caller slower than the engine gets the outputs that are waiting merged into one (as vLLM's
        AsyncLLM does): new_token_ids, new_text and new_logprobs of all of them, the rest from the latest. So
        one output may carry several tokens; joined, the outputs' new_text is the request's text either way."""
        req_id = req_id if req_id is not None else f"req-{next(self._ids)}"
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), StreamBuffer(self.stream_interval))
        with self._lock:  # with the thread's last drain of the inbox, no request can be left in it unanswered
            if not self.is_ready:
                raise EngineNotReadyError("the engine has shut down" if self._closed else "the model is not loaded")
            if req_id in self._streams:
                raise ValueError(f"request id {req_id!r} is already in use")
            self._streams[req_id] = stream
            self._inbox.put(("add", req_id, prompt, params or SamplingParams()))
        async for item in drain(stream.queue, lambda: self.abort(req_id)):
            yield item

    def abort(self, req_id: str) -> None:
        """End req_id (thread-safe; unknown or finished ids are ignored); its KV blocks are freed before the next
        step and its caller gets a last output with finish_reason "abort"."""
        self._inbox.put(("abort", req_id))

    @property
    def tokenizer(self):
        """The model's Tokenizer (runtime.tokenizer); once loaded."""
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        """The most tokens (prompt + output) one request may hold; once loaded."""
        return self._max_model_len

    @property
    def num_unfinished_requests(self) -> int:
        """Requests handed to generate() that have not finished yet (queued here, waiting or running)."""
        return len(self._streams)

    def stats(self) -> SchedulerStats | None:
        """The scheduler's counters as of the engine thread's last pass (None before the model is loaded)."""
        return self._stats

    # ---- the engine thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.engine = self._factory()
        except BaseException as error:  # reported by wait_ready; the server decides what to do
            self.load_error = error
            return
        finally:
            self._loaded.set()
        engine = self.engine
        self._tokenizer, self._max_model_len = engine.tokenizer, engine.max_model_len
        self._stats = engine.stats()
        stopping = False
        while not (stopping and not engine.has_unfinished_requests()):
            if self._handle_commands(block=not engine.has_unfinished_requests() and not stopping):
                stopping = True
                for req_id in list(self._streams):
                    engine.abort_request(req_id)
            self._stats = engine.stats()
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except Exception as error:  # a bug outside the model run: end what is in flight, keep serving
                self._fail_in_flight(error)
                continue
            self._stats = engine.stats()
            self._deliver(outputs)
        self._stats = engine.stats()
        with self._lock:
            self._closed = True
            self._handle_commands(block=False)  # requests that arrived during the shutdown are refused
        engine.close()  # worker ranks and device slots the engine started beside the model
        self.engine = None  # its KV cache and model go now, not when some cycle through a caller is collected

    def _handle_commands(self, block: bool) -> bool:
        """Apply the inbox's adds and aborts (waiting for one when block); True when shutdown was asked."""
        stop = False
        try:
            command = self._inbox.get() if block else self._inbox.get_nowait()
            while True:
                if command is _STOP:
                    stop = True
                elif command[0] == "add":
                    self._add(*command[1:])
                else:
                    self.engine.abort_request(command[1])
                command = self._inbox.get_nowait()
        except queue.Empty:
            pass
        return stop

    def _add(self, req_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        with self._lock:
            stream = self._streams.get(req_id)
        if stream is None:
            return
        try:
            if self._closed:
                raise EngineNotReadyError("the engine has shut down")
            self.engine.add_request(prompt, params, req_id=req_id)
        except (ValueError, TypeError, EngineNotReadyError) as error:  # refused: the caller raises it
            with self._lock:
                self._streams.pop(req_id, None)
            self._post(stream, error)

    def _fail_in_flight(self, error: Exception) -> None:
        """Each request in flight raises EngineStepError in its caller; the engine forgets them."""
        with self._lock:
            streams, self._streams = self._streams, {}
        for req_id, stream in streams.items():
            self.engine.abort_request(req_id)
            self._post(stream, EngineStepError(f"the engine step failed: {type(error).__name__}: {error}"))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for out in outputs:
            with self._lock:
                stream = self._streams.pop(out.req_id, None) if out.finished else self._streams.get(out.req_id)
            if out.finished and self.on_request_finished is not None:
                self.on_request_finished(out)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).extend((stream.queue, due) for due in stream.buffer.push(out))
        for loop, items in by_loop.items():
            if not items:
                continue
            try:
                loop.call_soon_threadsafe(put_all, items)
            except RuntimeError:  # that event loop has closed: nobody is listening
                pass

    @staticmethod
    def _post(stream: _Stream, item) -> None:
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:
            pass


async def drain(q: asyncio.Queue, abort: Callable[[], None]) -> AsyncIterator[RequestOutput]:
    """Yield a request's outputs from q (RequestOutput items, or an exception that ends the request and is
    raised), those waiting merged into one (_coalesce), up to the finished one; abort() when the caller stops
    early."""
    finished = False
    try:
        while not finished:
            item = await q.get()
            if not isinstance(item, BaseException) and not item.finished and not q.empty():
                item = _coalesce(item, q)
            if isinstance(item, BaseException):
                finished = True
                raise item
            finished = item.finished
            yield item
    finally:
        if not finished:
            abort()


def _coalesce(first: RequestOutput, q: asyncio.Queue) -> RequestOutput | BaseException:
    """first merged with the outputs waiting in q, up to and including a finished one (an exception waiting
    behind them wins: the request has failed)."""
    outs = [first]
    while not q.empty() and not outs[-1].finished:
        item = q.get_nowait()
        if isinstance(item, BaseException):
            return item
        outs.append(item)
    last = outs[-1]
    logprobs = None
    if any(out.new_logprobs is not None for out in outs):
        logprobs = [lp for out in outs for lp in (out.new_logprobs or ())]
    return dataclasses.replace(last, new_token_ids=[t for out in outs for t in out.new_token_ids],
                               new_text="".join(out.new_text for out in outs), new_logprobs=logprobs,
                               first_token_time=first.first_token_time or last.first_token_time,
                               prompt_logprobs=last.prompt_logprobs if last.prompt_logprobs is not None
                               else next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), None))


def put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    """Each item into its queue, in one event-loop callback: a caller woken by the first finds the others waiting
    (and merges them), rather than running between them."""
    for q, out in items:
        q.put_nowait(out)
