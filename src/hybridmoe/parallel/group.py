"""The engine's worker ranks: spawned, supervised, joined in a process group, and shut down.

`RankGroup(model_dir, world_size, ...)` starts world_size - 1 worker processes (`python -m
hybridmoe.parallel.worker`, plain subprocesses: nothing of the caller's script is re-imported, unlike
multiprocessing's spawn), waits until each has loaded its share of the experts, and joins them in a
torch.distributed process group of its own (not the global default group, so several engines can live in one
process): NCCL when the ranks sit on CUDA devices, gloo on the CPU stand-in. The engine process is rank 0.

Failure, bounded: a thread per worker waits on its process, so a worker that dies is known at once; every receive
waits at most `timeout_s` (a worker that hangs), and a closed connection (a worker that died mid-exchange) fails
the receive at once. Either becomes a `RankFailedError` that names the rank, its pid and its exit status; the
group is then broken and every later call fails the same way, at once. Workers watch their parent: a worker whose
engine process died exits by itself.

Shutdown: `close()` (idempotent) sends every worker a stop message, waits for it to exit, and terminates (then
kills) one that does not; a finaliser runs the same at interpreter exit or when the group is collected, so no
worker outlives the engine.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from hybridmoe.parallel.exchange import OP_STATS, OP_STOP, TAG_HEADER, TAG_STATS, header

STARTUP_TIMEOUT_S = 300.0  # a worker loads its share of the experts before it joins
STOP_WAIT_S = 10.0  # a stopped worker has this long to exit before it is terminated


class RankFailedError(RuntimeError):
    """A worker rank died or stopped answering; the engine cannot compute that rank's experts."""


class RankGroup:
    def __init__(self, model_dir: str | Path, world_size: int, dtype: torch.dtype, device_kind: str = "cpu",
                 timeout_s: float = 300.0, threads: int | None = None, budget_bytes: int | None = None,
                 staging_bytes: int = 64 << 20, overlap: bool | None = None,
                 startup_timeout_s: float = STARTUP_TIMEOUT_S):
        if world_size < 2:
            raise ValueError(f"a rank group needs at least 2 ranks, got {world_size}")
        if device_kind not in ("cpu", "cuda"):
            raise ValueError(f"device_kind must be 'cpu' (the stand-in) or 'cuda', got {device_kind!r}")
        self.world_size, self.timeout_s, self.device_kind = world_size, timeout_s, device_kind
        self.backend = "nccl" if device_kind == "cuda" else "gloo"
        self._state = _State()
        self._finalizer = weakref.finalize(self, self._state.close)
        state = self._state
        state.store = dist.TCPStore("127.0.0.1", 0, world_size, True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=startup_timeout_s))
        prefix = f"hybridmoe-ep-{uuid.uuid4().hex}/"
        dtype_name = str(dtype).removeprefix("torch.")
        for rank in range(1, world_size):
            command = [sys.executable, "-m", "hybridmoe.parallel.worker", "--rank", str(rank),
                       "--world-size", str(world_size), "--port", str(state.store.port), "--prefix", prefix,
                       "--model", str(model_dir), "--dtype", dtype_name, "--device", device_kind,
                       "--timeout", str(timeout_s), "--startup-timeout", str(startup_timeout_s),
                       "--parent", str(os.getpid()), "--staging", str(staging_bytes),
                       "--overlap", {None: "auto", True: "on", False: "off"}[overlap]]
            if threads is not None:
                command += ["--threads", str(threads)]
            if budget_bytes is not None:
                command += ["--budget", str(budget_bytes)]
            state.procs[rank] = subprocess.Popen(command)
            threading.Thread(target=self._watch, args=(weakref.ref(state), rank), daemon=True,
                             name=f"hybridmoe-ep-watch-{rank}").start()
        try:
            self._wait_loaded(prefix, startup_timeout_s)
            store = dist.PrefixStore(prefix, state.store)
            timeout = datetime.timedelta(seconds=timeout_s)
            if self.backend == "gloo":
                state.pg = dist.ProcessGroupGloo(store, 0, world_size, timeout)
            else:
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                state.pg = dist.ProcessGroupNCCL(store, 0, world_size, options)
        except BaseException:
            self.close()
            raise

    # --- what the backends use ---------------------------------------------------------------------------------
    @property
    def pg(self):
        return self._state.pg

    @property
    def pids(self) -> dict[int, int]:
        """Worker rank -> its process id."""
        return {rank: p.pid for rank, p in self._state.procs.items()}

    @property
    def closed(self) -> bool:
        return self._state.closed

    def check(self) -> None:
        """Raise RankFailedError if a worker died (or the group broke, or was closed)."""
        state = self._state
        if state.closed:
            raise RankFailedError("the expert-parallel ranks were shut down (the engine was closed)")
        if state.failure is not None:
            raise RankFailedError(state.failure)

    def failed(self, rank: int, error: BaseException) -> RankFailedError:
        """The error to raise when an exchange with `rank` failed with `error`: the group is broken from now on.
        A worker that died is reported with its exit status (its death is awaited briefly: the connection closes a
        moment before the process is reaped)."""
        state = self._state
        proc = state.procs.get(rank)
        if proc is not None:
            try:
                proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                pass
        if state.failure is None:
            alive = proc is not None and proc.poll() is None
            what = (f"did not answer within {self.timeout_s:g} s (pid {proc.pid} is still running: it hangs or is "
                    f"far slower than the timeout allows)" if alive else _exit_text(rank, proc))
            state.failure = (f"expert-parallel rank {rank} {what}; its share of the routed experts is gone, so the "
                             f"engine cannot continue. Restart the engine (or run with num_gpus=1). "
                             f"[{self.backend}: {str(error).strip()[:300]}]")
        return RankFailedError(state.failure)

    def worker_stream_stats(self, rank: int) -> tuple[int, int, float, int]:
        """Worker `rank`'s streaming figures: (passes, bytes copied, copy seconds, bytes of the last pass)."""
        self.check()
        figures = torch.empty(4, dtype=torch.float64)
        try:
            self.pg.send([header(OP_STATS)], rank, TAG_HEADER).wait(datetime.timedelta(seconds=self.timeout_s))
            self.pg.recv([figures], rank, TAG_STATS).wait(datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as error:
            raise self.failed(rank, error) from None
        passes, nbytes, copy_s, last = figures.tolist()
        return int(passes), int(nbytes), copy_s, int(last)

    def close(self) -> None:
        """Stop every worker and wait for it to exit (idempotent)."""
        self._finalizer()

    # --- internals ---------------------------------------------------------------------------------------------
    @staticmethod
    def _watch(state_ref: "weakref.ref[_State]", rank: int) -> None:
        state = state_ref()
        if state is None:
            return
        proc = state.procs[rank]
        del state
        proc.wait()
        state = state_ref()
        if state is not None and not state.closed and state.failure is None:
            state.failure = (f"expert-parallel rank {rank} {_exit_text(rank, proc)}; its share of the routed experts "
                             "is gone, so the engine cannot continue. Restart the engine (or run with num_gpus=1).")

    def _wait_loaded(self, prefix: str, timeout_s: float) -> None:
        """Until every worker has loaded its share (or reported why it could not, or died, or the time is up)."""
        state, deadline = self._state, time.monotonic() + timeout_s
        pending = set(state.procs)
        while pending:
            for rank in sorted(pending):
                if state.store.check([f"{prefix}error/{rank}"]):
                    reason = state.store.get(f"{prefix}error/{rank}").decode(errors="replace")
                    raise RankFailedError(f"expert-parallel rank {rank} could not start: {reason}")
                if state.store.check([f"{prefix}loaded/{rank}"]):
                    pending.discard(rank)
            if state.failure is not None:
                raise RankFailedError(state.failure)
            if time.monotonic() > deadline:
                raise RankFailedError(f"expert-parallel ranks {sorted(pending)} did not load their experts within "
                                      f"{timeout_s:g} s")
            time.sleep(0.02)


class _State:
    """What the finaliser needs (the group itself must be collectable)."""

    def __init__(self):
        self.procs: dict[int, subprocess.Popen] = {}
        self.store: dist.TCPStore | None = None
        self.pg = None
        self.failure: str | None = None
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.pg is not None and self.failure is None:
            for rank, proc in self.procs.items():
                if proc.poll() is None:
                    try:
                        self.pg.send([header(OP_STOP)], rank, TAG_HEADER).wait(datetime.timedelta(seconds=5))
                    except RuntimeError:
                        pass
        stopped = self.pg is not None and self.failure is None  # the workers were told to stop: let them exit
        deadline = time.monotonic() + (STOP_WAIT_S if stopped else 0.0)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self.procs.values():  # a failed group's workers may hang: killed at once
            for stop in (proc.terminate, proc.kill) if self.failure is None else (proc.kill,):
                if proc.poll() is None:
                    stop()
                    try:
                        proc.wait(timeout=5.0)
                    except subprocess.TimeoutExpired:
                        pass
        if self.pg is not None:
            try:
                self.pg.shutdown()
            except (RuntimeError, AttributeError):
                pass
        self.pg = None
        self.store = None


def _exit_text(rank: int, proc: subprocess.Popen | None) -> str:
    if proc is None:
        return "is unknown"
    code = proc.returncode
    if code is None:
        return f"(pid {proc.pid}) stopped answering"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"(pid {proc.pid}) was killed by {name}"
    return f"(pid {proc.pid}) exited with status {code}"
