"""The accelerator the engine places weights on: CUDA when present, else the CPU standing in for it.

Everything that runs "on the accelerator" goes through one `Accelerator`: placing a tensor (`to_device`, `empty`),
copy streams and events, pinned host staging, and a ledger of the bytes it holds against the VRAM budget. On CUDA
these are torch.cuda calls (async copies on a side stream, events that the compute stream waits on). On the CPU
stand-in the same calls run the same code: a "device" tensor is a separate host tensor (placing one is a real copy,
counted in the ledger), a copy runs at once on the caller, an event is recorded done, and waiting on one returns.
Tests exercise the stand-in; the CUDA path is selected at run time.

`trace` (when enabled) records every copy, event record and wait in issue order, with their labels, so that tests
can assert a schedule (which slot a copy went to, which event a compute waited for) on either kind.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

RESERVE_BYTES = 1 << 30  # left free on a CUDA device when no budget is given (CUDA context, allocator slack)


class DeviceMemoryError(MemoryError):
    """A placement would exceed the accelerator's budget; the message names what and by how much."""


@dataclass(frozen=True)
class TraceEvent:
    kind: str  # "copy" | "record" | "wait" | "compute"
    label: str  # what the caller named it, e.g. "experts.3 -> slot 1"
    stream: str  # the stream it was issued on
    time: float  # time.perf_counter() at issue


class Event:
    """A point in a stream's work; `wait` on another stream orders work after it."""

    def __init__(self, accel: "Accelerator", label: str, native: "torch.cuda.Event | None"):
        self.accel, self.label, self.native = accel, label, native

    def synchronize(self) -> None:
        """Block the host until the event's work is done (no-op on the stand-in: work ran at issue)."""
        if self.native is not None:
            self.native.synchronize()


class Stream:
    """An ordered queue of accelerator work: the compute stream, or a side stream for copies."""

    def __init__(self, accel: "Accelerator", name: str, native: "torch.cuda.Stream | None"):
        self.accel, self.name, self.native = accel, name, native

    def copy(self, dst: torch.Tensor, src: torch.Tensor, label: str) -> None:
        """dst.copy_(src) issued on this stream (async on CUDA from pinned memory)."""
        self.accel._trace("copy", label, self.name)
        if self.native is None:
            dst.copy_(src)
            return
        with torch.cuda.stream(self.native):
            dst.copy_(src, non_blocking=True)

    def record(self, label: str) -> Event:
        """An event marking everything issued on this stream so far."""
        self.accel._trace("record", label, self.name)
        if self.native is None:
            return Event(self.accel, label, None)
        event = torch.cuda.Event()
        event.record(self.native)
        return Event(self.accel, label, event)

    def wait(self, event: Event) -> None:
        """Work issued on this stream from now on starts after `event` (the host does not block)."""
        self.accel._trace("wait", event.label, self.name)
        if event.native is not None:
            self.native.wait_event(event.native)

    @contextmanager
    def use(self) -> Iterator[None]:
        """Issue torch ops inside the block on this stream."""
        if self.native is None:
            yield
            return
        with torch.cuda.stream(self.native):
            yield


@dataclass
class Ledger:
    """Bytes held on the accelerator, by name, against a budget (None: unbounded)."""

    budget: int | None
    held: dict[str, int] = field(default_factory=dict)
    peak: int = 0

    @property
    def total(self) -> int:
        return sum(self.held.values())

    def take(self, name: str, nbytes: int) -> None:
        total = self.total + nbytes
        if self.budget is not None and total > self.budget:
            raise DeviceMemoryError(f"placing {name} ({nbytes / 2**20:.1f} MiB) on the accelerator needs "
                                    f"{total / 2**20:.1f} MiB, over its budget of {self.budget / 2**20:.1f} MiB "
                                    f"({self.total / 2**20:.1f} MiB already held); give a larger vram budget or "
                                    "place less")
        self.held[name] = self.held.get(name, 0) + nbytes
        self.peak = max(self.peak, total)

    def give(self, name: str) -> int:
        return self.held.pop(name, 0)


class Accelerator:
    """One accelerator (`kind` "cuda" or "cpu", the stand-in) with a memory budget in bytes (None: unbounded)."""

    def __init__(self, kind: str = "cpu", budget_bytes: int | None = None, index: int = 0, trace: bool = False):
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"accelerator kind must be 'cpu' (the stand-in) or 'cuda', got {kind!r}")
        if kind == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' was asked for, but torch sees no CUDA device "
                             f"(torch {torch.__version__}); use device 'cpu'")
        self.kind = kind
        self.device = torch.device("cuda", index) if kind == "cuda" else torch.device("cpu")
        self.ledger = Ledger(budget_bytes)
        self.events: list[TraceEvent] | None = [] if trace else None
        self._lock = threading.Lock()
        self.compute = Stream(self, "compute", torch.cuda.current_stream(self.device) if self.is_cuda else None)

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def name(self) -> str:
        if self.is_cuda:
            return f"cuda:{self.device.index} ({torch.cuda.get_device_name(self.device)})"
        return "cpu stand-in"

    # --- memory ------------------------------------------------------------------------------------------------
    def to_device(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """A copy of `tensor` on the accelerator, counted under `name` (a real copy on the stand-in too)."""
        self.ledger.take(name, tensor.nbytes)
        if self.is_cuda:
            return tensor.to(self.device)
        return tensor.clone()

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, name: str) -> torch.Tensor:
        """An uninitialised accelerator tensor, counted under `name`."""
        out = torch.empty(shape, dtype=dtype, device=self.device)
        self.ledger.take(name, out.nbytes)
        return out

    def release(self, name: str) -> int:
        """Forget what is held under `name` (the caller drops its tensors); returns the bytes freed."""
        return self.ledger.give(name)

    @property
    def held_bytes(self) -> int:
        return self.ledger.total

    @property
    def peak_bytes(self) -> int:
        """The most the ledger held at once (on CUDA, torch.cuda.max_memory_allocated is the allocator's view)."""
        return self.ledger.peak

    def pinned(self, tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """A page-locked host copy of `tensor` for async copies, and whether pinning worked. On the stand-in, or
        when pinning fails (locked-memory limit), the tensor itself (pageable) and False, with a warning on CUDA."""
        if not self.is_cuda:
            return tensor, False
        try:
            return tensor.pin_memory(), True
        except RuntimeError as error:
            warnings.warn(f"pinning {tensor.nbytes / 2**20:.1f} MiB of host memory failed ({error}); copies to the "
                          "accelerator fall back to pageable memory (slower, synchronous)", RuntimeWarning,
                          stacklevel=2)
            return tensor, False

    # --- streams -----------------------------------------------------------------------------------------------
    def new_stream(self, name: str) -> Stream:
        return Stream(self, name, torch.cuda.Stream(self.device) if self.is_cuda else None)

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def mark_compute(self, label: str) -> None:
        """Record in the trace that compute `label` was issued (schedule assertions)."""
        self._trace("compute", label, "compute")

    def _trace(self, kind: str, label: str, stream: str) -> None:
        if self.events is not None:
            with self._lock:
                self.events.append(TraceEvent(kind, label, stream, time.perf_counter()))


def free_device_bytes(kind: str, index: int = 0) -> int | None:
    """The memory a placement may use when no budget is given: the CUDA device's free memory minus a reserve;
    None on the stand-in (no device memory of its own: nothing is placed unless a budget is given)."""
    if kind != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(index)
    return max(0, free - RESERVE_BYTES)


def select_accelerator(device: str | None = None, budget_bytes: int | None = None, trace: bool = False) -> Accelerator:
    """device None/"auto": CUDA when torch sees one, else the CPU stand-in; "cuda", "cuda:N" or "cpu" to choose."""
    if device in (None, "auto"):
        device = "cuda" if torch.cuda.is_available() else "cpu"
    kind, _, index = str(device).partition(":")
    if kind not in ("cpu", "cuda") or (index and not index.isdigit()):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
    index = int(index or 0)
    if budget_bytes is None:
        budget_bytes = free_device_bytes(kind, index) if kind == "cuda" and torch.cuda.is_available() else None
    return Accelerator(kind, budget_bytes, index, trace)


def parse_bytes(text: str | int | float | None) -> int | None:
    """'24GB', '512MiB', '1.5G', 2e9 -> bytes (GB = 1e9, GiB = 2**30); None stays None."""
    if text is None or isinstance(text, (int, float)) and not isinstance(text, bool):
        return None if text is None else int(text)
    units = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
             "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}
    raw = str(text).strip().lower().replace(" ", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in units or not value >= 0:
        raise ValueError(f"cannot read {text!r} as a memory size; write e.g. 24GB, 512MiB or 2e9")
    return int(value * units[unit])
