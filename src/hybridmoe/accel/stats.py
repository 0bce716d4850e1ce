"""What ran where: counters that the parts of a hybrid forward add to, read by `generate --verbose` and /metrics.

One `RunStats` per engine. The decoder times the work it issues on the accelerator (`accel_section`), the hybrid
expert backend times the routed experts it hands to the CPU kernels (`add_cpu_experts`), a stream-loading prefill
adds the bytes it copied and the time the copies took (`add_streamed`). The engine brackets each step
(`begin_step` / `end_step`) so that per-step figures are known for decode steps and prefill steps apart.

On CUDA the accelerator's time comes from CUDA events (elapsed between a start and an end event recorded on the
compute stream, read once the step has synchronised); on the CPU stand-in it is the host's wall time of the same
sections.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class PhaseTotals:
    """Sums over the steps of one phase ("decode" or "prefill")."""

    steps: int = 0
    tokens: int = 0
    step_s: float = 0.0  # wall time of the steps
    accel_s: float = 0.0  # accelerator sections (attention, router, shared and hot experts, dense, LM head)
    cpu_experts_s: float = 0.0  # CPU expert kernels: from submit until the result was in hand, summed over layers
    cpu_wait_s: float = 0.0  # of that, time the forward waited for them (not hidden behind accelerator work)
    cpu_expert_assignments: int = 0  # (token, expert) pairs computed on the CPU
    hot_expert_assignments: int = 0  # (token, expert) pairs computed by hot experts on the accelerator
    bytes_streamed: int = 0  # host -> accelerator bytes copied for stream-loading prefill
    copy_s: float = 0.0  # time those copies took (copy stream)

    @property
    def copy_gbs(self) -> float:
        return self.bytes_streamed / self.copy_s / 1e9 if self.copy_s > 0 else 0.0


@dataclass
class RunStats:
    """Counters of one engine (see module docstring). `ledger` is the accelerator's (bytes held by name)."""

    ledger: object | None = None
    is_cuda: bool = False
    phases: dict[str, PhaseTotals] = field(default_factory=lambda: {"decode": PhaseTotals(), "prefill": PhaseTotals()})
    last: PhaseTotals = field(default_factory=PhaseTotals)  # the last step alone
    _phase: str = "decode"
    _start: float = 0.0
    _pending: list = field(default_factory=list)  # CUDA event pairs of this step

    # ---- the engine's step ---------------------------------------------------------------------------------
    def begin_step(self, phase: str) -> None:
        self._phase, self._start, self.last, self._pending = phase, time.perf_counter(), PhaseTotals(), []

    def end_step(self, tokens: int) -> None:
        """Close the step (after the forward's result reached the host, so CUDA events are complete)."""
        for start, end in self._pending:
            self.last.accel_s += start.elapsed_time(end) / 1e3
        self._pending = []
        self.last.steps, self.last.tokens = 1, tokens
        self.last.step_s = time.perf_counter() - self._start
        totals = self.phases[self._phase]
        for name in PhaseTotals.__dataclass_fields__:
            setattr(totals, name, getattr(totals, name) + getattr(self.last, name))

    # ---- what the parts add ----------------------------------------------------------------------------------
    @contextmanager
    def accel_section(self) -> Iterator[None]:
        """Time work issued on the accelerator inside the block."""
        if self.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._pending.append((start, end))
            return
        t0 = time.perf_counter()
        yield
        self.last.accel_s += time.perf_counter() - t0

    def add_cpu_experts(self, busy_s: float, wait_s: float, cpu_assignments: int, hot_assignments: int) -> None:
        self.last.cpu_experts_s += busy_s
        self.last.cpu_wait_s += wait_s
        self.last.cpu_expert_assignments += cpu_assignments
        self.last.hot_expert_assignments += hot_assignments

    def add_streamed(self, nbytes: int, copy_s: float) -> None:
        """Stream-loading prefill: `nbytes` copied host -> accelerator in `copy_s` seconds of copy-stream time."""
        self.last.bytes_streamed += nbytes
        self.last.copy_s += copy_s

    # ---- what the reports read -------------------------------------------------------------------------------
    def device_bytes_by_kind(self) -> dict[str, int]:
        """Bytes held on the accelerator, by kind: the ledger's names up to their first '.' ("attention.3" ->
        "attention", "hot experts.5" -> "hot experts", "kv cache.0" -> "kv cache")."""
        out: dict[str, int] = {}
        held = getattr(self.ledger, "held", {}) if self.ledger is not None else {}
        for name, nbytes in held.items():
            kind = name.split(".")[0]
            out[kind] = out.get(kind, 0) + nbytes
        return out

    def summary(self) -> str:
        """A few lines for `--verbose`: bytes on the device by kind, and per phase the time per step where it went."""
        lines = []
        by_kind = self.device_bytes_by_kind()
        if by_kind:
            total = sum(by_kind.values())
            parts = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1]))
            peak = getattr(self.ledger, "peak", total)
            lines.append(f"on the accelerator: {total / 2**20:.1f} MiB (peak {peak / 2**20:.1f} MiB): {parts} (MiB)")
        for phase in ("prefill", "decode"):
            t = self.phases[phase]
            if not t.steps:
                continue
            per = lambda s: f"{s / t.steps * 1e3:.2f} ms"  # noqa: E731
            line = (f"{phase}: {t.steps} steps, {t.tokens} tokens; per step {per(t.step_s)}: accelerator "
                    f"{per(t.accel_s)}, CPU experts {per(t.cpu_experts_s)} (waited for {per(t.cpu_wait_s)}); "
                    f"expert assignments on the CPU {t.cpu_expert_assignments}, hot on the accelerator "
                    f"{t.hot_expert_assignments}")
            if t.bytes_streamed:
                line += f"; streamed {t.bytes_streamed / 1e9:.3f} GB at {t.copy_gbs:.1f} GB/s"
            lines.append(line)
        return "\n".join(lines)
