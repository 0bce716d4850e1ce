"""`PDEngine`: prefill/decode disaggregation behind the server's `EngineClient`.

    engine = PDEngine("demo", EngineConfig(), kv_budget=1.0); engine.start(); await engine.wait_ready()
    async for out in engine.generate("Hello", SamplingParams(max_tokens=8)):
        print(out.new_text, end="")

Two worker processes (disagg/worker.py), spawned, each with its own LLMEngine over the same checkpoint: the
prefill worker takes new prompts; their KV goes to the decode worker as a SpectrumKV payload in a shared-memory
segment (streamed layer by layer while the prefill computes it, where the tiers are known before: a `KVStream`
passed on at the first layer), and once a prompt's first token is sampled (its `Handoff`) the request continues
there. The caller sees one stream: the
first output comes from the prefill worker, the rest from the decode worker (with the first's arrival and
first-token times, and its prompt logprobs on the last output).

One watcher thread per worker reads its socket and delivers outputs to each request's asyncio queue. A worker that
dies (its socket closes) fails the requests it held with finish_reason "error" and a message naming the worker and
its exit code (the server answers 500), and is started again; requests that arrive meanwhile wait in its
backlog. `shutdown()` stops both, ends the requests in flight with "abort" and removes every shared-memory
segment under this front's prefix (the workers do the same when the front itself dies).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

from hybridmoe.checkpoint.default_model import resolve_model_dir
from hybridmoe.disagg import messages as m
from hybridmoe.disagg.cpus import check_cpus
from hybridmoe.disagg.handoff import check_budget, check_importance
from hybridmoe.disagg.shm import owner_prefix, remove, sweep
from hybridmoe.disagg.worker import DECODE, PREFILL
from hybridmoe.runtime.async_engine import EngineNotReadyError, StreamBuffer, drain, put_all
from hybridmoe.runtime.engine import EngineConfig, RequestOutput
from hybridmoe.runtime.sampling_params import SamplingParams
from hybridmoe.runtime.scheduler import SchedulerStats
from hybridmoe.runtime.tokenizer import load_tokenizer

STOP_GRACE_S = 10.0  # how long a worker may take to exit after Stop before it is killed


class WorkerDiedError(RuntimeError):
    """A worker process died while a request was in it."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # RequestOutput items, or an exception that ends the request
    buffer: StreamBuffer  # outputs held back until due (stream_interval)
    phase: str = PREFILL  # where the request is: the prefill worker, or (after its handoff) the decode worker
    segment: str | None = None  # its KV payload's segment while it is on its way to the decode worker
    last: RequestOutput | None = None  # the latest output delivered
    first: RequestOutput | None = None  # the prefill worker's output with the first token
    aborted: bool = False  # abort() was asked: a handoff still on its way ends it instead of moving it
    streamed: bool = False  # its KV streams to the decode worker during its prefill (KVStream)
    refused: str | None = None  # why the decode worker refused its streamed KV (it ends with that error)


@dataclass
class _WorkerSlot:
    role: str
    process: subprocess.Popen | None = None
    conn: object = None
    pid: int | None = None
    ready: bool = False
    backlog: list = field(default_factory=list)  # messages for a worker that is (re)starting
    stats: SchedulerStats | None = None
    restarts: int = 0


class PDEngine:
    def __init__(self, model: str | Path, config: EngineConfig | None = None, kv_budget: float = 1.0,
                 on_request_finished: Callable[[RequestOutput], None] | None = None,
                 prefill_cpus: list[int] | str | None = None, decode_cpus: list[int] | str | None = None,
                 kv_importance: str = "attention", kv_streaming: bool = True, stream_interval: int = 1):
        """model, config: as LLMEngine takes them (each worker builds its own engine with this config).
        kv_budget: the SpectrumKV budget of the handoff (1.0: every token at full precision, the same tokens as
        one engine; 0.5: INT8 for the less important half; lower: INT4 where the model's cached probe verdict
        allows it, then the least important tokens dropped and masked by the decode worker; down to 0.05).
        kv_importance: what ranks the prompt's tokens below budget 1: "attention" (attention importance, computed
        during the prefill) or "position" (position only, the paper's baseline).
        prefill_cpus, decode_cpus: the CPUs each worker runs on (a list, or text like "0-3,8"; None: all of this
        process's), see disagg/cpus.py.
        kv_streaming: the prompt's KV goes to the decode worker layer by layer while the prefill computes it (where
        the tiers are known before the prefill: budget 1, or position importance); False: packed after it.
        stream_interval: a request's outputs reach its caller every that many new tokens (StreamBuffer)."""
        StreamBuffer(stream_interval)  # checks it
        self.model, self.stream_interval = model, stream_interval
        self.config = config or EngineConfig()
        self.kv_budget = check_budget(kv_budget)
        self.kv_importance = check_importance(kv_importance)
        self.kv_streaming = bool(kv_streaming)
        self.cpus = {PREFILL: check_cpus(prefill_cpus, "prefill_cpus"), DECODE: check_cpus(decode_cpus, "decode_cpus")}
        self.on_request_finished = on_request_finished
        self.load_error: BaseException | None = None
        self.prefix = owner_prefix()
        self._tokenizer = None
        self._max_model_len: int | None = None
        self._lock = threading.RLock()  # guards streams, phases, the slots' connections and backlogs
        self._streams: dict[str, _Stream] = {}
        self._slots = {PREFILL: _WorkerSlot(PREFILL), DECODE: _WorkerSlot(DECODE)}
        self._first_ready = {PREFILL: threading.Event(), DECODE: threading.Event()}
        self._ids = itertools.count()
        self._closed = False
        self._watchers: list[threading.Thread] = []
        self.kv_streams = 0  # requests whose KV streamed to the decode worker during their prefill

    # ---- life cycle ------------------------------------------------------------------------------------

    def start(self) -> None:
        """Spawn both workers (each loads the model; see is_ready, wait_ready)."""
        try:
            self._model_dir = resolve_model_dir(self.model)
            self._tokenizer = load_tokenizer(self._model_dir)
        except BaseException as error:  # noqa: BLE001 - reported by wait_ready
            self.load_error = error
            for event in self._first_ready.values():
                event.set()
            return
        for role in (PREFILL, DECODE):
            thread = threading.Thread(target=self._watch, args=(role,), name=f"hybridmoe-pd-{role}", daemon=True)
            self._watchers.append(thread)
            thread.start()

    @property
    def is_ready(self) -> bool:
        """True once both workers have loaded the model, until shutdown (also while one restarts)."""
        return (self.load_error is None and not self._closed
                and all(event.is_set() for event in self._first_ready.values()))

    async def wait_ready(self) -> None:
        """Wait until both workers have loaded the model; raises EngineNotReadyError when loading failed."""
        loop = asyncio.get_running_loop()
        for event in self._first_ready.values():
            await loop.run_in_executor(None, event.wait)
        if self.load_error is not None:
            raise EngineNotReadyError(f"the model failed to load: {self.load_error}") from self.load_error

    def wait_ready_sync(self, timeout: float | None = None) -> None:
        """wait_ready for callers without an event loop."""
        for event in self._first_ready.values():
            if not event.wait(timeout):
                raise TimeoutError(f"the PD workers did not load within {timeout} s")
        if self.load_error is not None:
            raise EngineNotReadyError(f"the model failed to load: {self.load_error}") from self.load_error

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._streams)

    def worker_pids(self) -> dict[str, int | None]:
        """{"prefill": pid, "decode": pid} of the workers now running (None while one starts)."""
        with self._lock:
            return {role: slot.pid if slot.ready else None for role, slot in self._slots.items()}

    def requests_in(self, role: str) -> int:
        """Requests now held by the worker of role ("prefill", "decode"), or on their way to it."""
        with self._lock:
            return sum(1 for stream in self._streams.values() if stream.phase == role)

    def worker_restarts(self) -> dict[str, int]:
        with self._lock:
            return {role: slot.restarts for role, slot in self._slots.items()}

    def stats(self) -> SchedulerStats | None:
        """The two workers' scheduler counters added up (as of their last steps)."""
        parts = [slot.stats for slot in self._slots.values() if slot.stats is not None]
        if not parts:
            return None
        return SchedulerStats(**{f.name: sum(getattr(p, f.name) for p in parts)
                                 for f in dataclasses.fields(SchedulerStats)})

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Refuse new requests, stop both workers, end the requests in flight with finish_reason "abort", and
        remove this front's shared-memory segments."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            slots = list(self._slots.values())
            for slot in slots:
                self._send_locked(slot, m.Stop())
        deadline = time.monotonic() + (STOP_GRACE_S if timeout is None else min(timeout, STOP_GRACE_S))
        for slot in slots:
            if slot.process is not None:
                _reap(slot.process, max(0.0, deadline - time.monotonic()))
        for thread in self._watchers:
            if thread is not threading.current_thread():
                thread.join(5)
        with self._lock:
            streams, self._streams = self._streams, {}
        for req_id, stream in streams.items():
            self._finish(req_id, stream, "abort", None)
        sweep(self.prefix)

    # ---- requests --------------------------------------------------------------------------------------

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       req_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """As AsyncLLMEngine.generate: the request's outputs, the last with finished=True; ValueError when the
        prefill worker refuses the prompt, EngineNotReadyError before loading or after shutdown. A worker dying
        under the request ends it with finish_reason "error"."""
        req_id = req_id if req_id is not None else f"pd-{next(self._ids)}"
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), StreamBuffer(self.stream_interval))
        with self._lock:
            if not self.is_ready:
                raise EngineNotReadyError("the engine has shut down" if self._closed else
                                          f"the model failed to load: {self.load_error}" if self.load_error else
                                          "the model is not loaded")
            if req_id in self._streams:
                raise ValueError(f"request id {req_id!r} is already in use")
            self._streams[req_id] = stream
            self._send_locked(self._slots[PREFILL], m.Add(req_id, prompt, params or SamplingParams()))
        async for item in drain(stream.queue, lambda: self.abort(req_id)):
            yield item

    def abort(self, req_id: str) -> None:
        """End req_id wherever it is (unknown or finished ids are ignored); its caller gets finish_reason "abort"."""
        with self._lock:
            stream = self._streams.get(req_id)
            if stream is not None:
                stream.aborted = True
                self._send_locked(self._slots[stream.phase], m.Abort(req_id))

    # ---- the workers -----------------------------------------------------------------------------------

    def _send_locked(self, slot: _WorkerSlot, message) -> None:
        if slot.ready:
            try:
                slot.conn.send(message)
                return
            except (OSError, ValueError):  # the worker died; its watcher fails and restarts it
                pass
        if not isinstance(message, m.Stop):
            slot.backlog.append(message)

    def _watch(self, role: str) -> None:
        """Start the worker, read its messages until its socket closes, then restart it (until shutdown)."""
        slot = self._slots[role]
        while not self._closed:
            process, parent = self._spawn(role)
            with self._lock:
                slot.process, slot.conn = process, parent
            try:
                first = parent.recv()
            except (EOFError, OSError):
                first = m.LoadFailed(f"the {role} worker exited with code {process.wait()} while loading")
            if isinstance(first, m.LoadFailed):  # at start, or at a restart: the server stops being ready (503)
                _reap(process)
                self.load_error = RuntimeError(f"{role} worker: {first.message}")
                for event in self._first_ready.values():
                    event.set()
                self._fail_role(role, f"the {role} worker could not be (re)started: {first.message}")
                return
            with self._lock:
                slot.pid, slot.stats, slot.ready = first.pid, first.stats, True
                if role == PREFILL:
                    self._max_model_len = first.max_model_len
                backlog, slot.backlog = slot.backlog, []
                for message in backlog:
                    self._send_locked(slot, message)
                if self._closed:  # shut down while it loaded
                    self._send_locked(slot, m.Stop())
            self._first_ready[role].set()
            self._read(role, parent)
            _reap(process)
            with self._lock:
                slot.ready, slot.pid = False, None
            parent.close()
            if self._closed:
                return
            slot.restarts += 1
            self._fail_role(role, f"the {role} worker (pid {first.pid}) died (exit code {process.returncode}); "
                                  "it is being restarted")

    def _spawn(self, role: str) -> tuple[subprocess.Popen, Connection]:
        """`python -m hybridmoe.disagg.worker` on one end of a socket pair; it gets its Init first."""
        ours, theirs = socket.socketpair()
        try:
            process = subprocess.Popen([sys.executable, "-m", "hybridmoe.disagg.worker", "--fd", str(theirs.fileno())],
                                       pass_fds=[theirs.fileno()], start_new_session=True)
        finally:
            theirs.close()
        conn = Connection(ours.detach())
        conn.send(m.Init(role, str(self._model_dir), self.config, self.prefix, self.kv_budget, self.cpus[role],
                         self.kv_importance, self.kv_streaming))
        return process, conn

    def _read(self, role: str, conn) -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return
            if isinstance(message, m.Outputs):
                self._slots[role].stats = message.stats
                for out in message.outputs:
                    self._deliver(role, out)
            elif isinstance(message, m.KVStream):
                self._stream_kv(message)
            elif isinstance(message, m.Handoff):
                self._forward(message)
            elif isinstance(message, m.Failed):
                for req_id in message.req_ids:
                    self._end_with_error(req_id, message.message, role)
            elif isinstance(message, m.Refused):
                with self._lock:
                    stream = self._streams.pop(message.req_id, None)
                if stream is not None:
                    self._post(stream, ValueError(message.message))

    def _deliver(self, role: str, out: RequestOutput) -> None:
        with self._lock:
            stream = self._streams.get(out.req_id)
            if stream is None or stream.phase != role:
                return
            if role == PREFILL:
                stream.first = out
            elif stream.first is not None:  # the request's own times and prompt logprobs, from its prefill
                first = stream.first
                out = dataclasses.replace(out, arrival_time=first.arrival_time,
                                          first_token_time=first.first_token_time,
                                          prompt_logprobs=first.prompt_logprobs if out.finished else None)
            stream.last = out
            if out.finished:
                del self._streams[out.req_id]
                self._drop_stream_locked(out.req_id, stream)
        if out.finished and stream.refused is not None and out.finish_reason == "abort":
            self._finish(out.req_id, stream, "error", stream.refused)  # stopped because its KV had nowhere to go
            return
        if out.finished and self.on_request_finished is not None:
            self.on_request_finished(out)
        self._post_outputs(stream, stream.buffer.push(out))

    def _stream_kv(self, message: m.KVStream) -> None:
        """A prompt's KV starts streaming: the decode worker reserves its blocks and unpacks the layers as they
        come."""
        with self._lock:
            stream = self._streams.get(message.req_id)
            if stream is not None and stream.phase == PREFILL and not stream.aborted:
                stream.segment, stream.streamed = message.kv.segment, True
                self.kv_streams += 1
                self._send_locked(self._slots[DECODE], message)
                return
        remove(message.kv.segment)  # nobody waits for it (the writer keeps its mapping)

    def _drop_stream_locked(self, req_id: str, stream: _Stream) -> None:
        """A request ended before its handoff: the decode worker gives up the KV streaming to it."""
        if stream.streamed and stream.phase == PREFILL:
            self._send_locked(self._slots[DECODE], m.Abort(req_id))

    def _forward(self, handoff: m.Handoff) -> None:
        """A prefilled request on its way to the decode worker."""
        with self._lock:
            stream = self._streams.get(handoff.req_id)
            if stream is not None and (stream.aborted or stream.refused is not None):  # ends here, not moved
                del self._streams[handoff.req_id]
                self._drop_stream_locked(handoff.req_id, stream)
            elif stream is not None and stream.phase == PREFILL:
                stream.phase, stream.segment = DECODE, handoff.kv.segment
                adopt = m.Adopt(*(getattr(handoff, f.name) for f in dataclasses.fields(m.Adopt)))
                self._send_locked(self._slots[DECODE], adopt)
                return
            else:
                stream = None
        remove(handoff.kv.segment)  # nobody waits for it any more
        if stream is not None:
            self._finish(handoff.req_id, stream, *(("abort", None) if stream.refused is None
                                                   else ("error", stream.refused)))

    def _fail_role(self, role: str, message: str) -> None:
        """End every request held by the worker of role, or on its way to it, with an error."""
        with self._lock:
            doomed = [req_id for req_id, stream in self._streams.items() if stream.phase == role]
            dropped, self._slots[role].backlog = self._slots[role].backlog, []
        for msg in dropped:
            if isinstance(msg, m.Adopt):
                remove(msg.kv.segment)
        for req_id in doomed:
            self._end_with_error(req_id, message)

    def _end_with_error(self, req_id: str, message: str, failed_in: str | None = None) -> None:
        """End req_id with an error; failed_in: the worker that failed it. A decode worker that refused a prompt's
        streamed KV while the prompt is still in the prefill worker stops it there, and the request ends when the
        prefill worker's answer comes: with the error once stopped, or as it is if it had ended meanwhile (at its
        first token: it never needed the decode worker, whose refusal may be of a segment already given up)."""
        with self._lock:
            stream = self._streams.get(req_id)
            if stream is not None and failed_in == DECODE and stream.phase == PREFILL:
                stream.refused = message
                self._send_locked(self._slots[PREFILL], m.Abort(req_id))
                return
            stream = self._streams.pop(req_id, None)
            if stream is not None:
                self._drop_stream_locked(req_id, stream)
        if stream is None:
            return
        if stream.segment is not None:
            remove(stream.segment)
        self._finish(req_id, stream, "error", message)

    def _finish(self, req_id: str, stream: _Stream, reason: str, error: str | None) -> None:
        last = stream.last
        out = RequestOutput(req_id, last.prompt_token_ids if last else [], list(last.token_ids) if last else [],
                            last.text if last else "", finished=True, finish_reason=reason, error=error,
                            first_token_time=last.first_token_time if last else None,
                            arrival_time=last.arrival_time if last else 0.0)
        if self.on_request_finished is not None:
            self.on_request_finished(out)
        self._post_outputs(stream, stream.buffer.push(out))  # with the outputs held back before it

    @staticmethod
    def _post_outputs(stream: _Stream, outputs: list[RequestOutput]) -> None:
        """The outputs due into the stream's queue in one callback (put_all)."""
        if outputs:
            try:
                stream.loop.call_soon_threadsafe(put_all, [(stream.queue, out) for out in outputs])
            except RuntimeError:  # that event loop has closed
                pass

    @staticmethod
    def _post(stream: _Stream, item) -> None:
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # that event loop has closed
            pass


def _reap(process: subprocess.Popen, timeout: float = 5.0) -> None:
    """Wait for process to exit (killing it after timeout)."""
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
