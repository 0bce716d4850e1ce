"""What a `bench serve` run measured: one RequestRecord per request sent, and the RunResult holding them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from hybridmoe.bench._serving.workload import WorkloadSpec

STATUSES = ("ok", "error", "cancelled")  # cancelled: still in flight when the run's time ran out


@dataclass
class RequestRecord:
    """One request's timings, in seconds; times of day are seconds from the run's start."""

    index: int  # the order in which the requests were sent
    kind: str  # "long" or "chat"
    user: int
    turn: int
    start_s: float
    status: str = "pending"  # then one of STATUSES
    error: str | None = None
    ttft_s: float | None = None  # to the first chunk carrying output (text, or the finish of an empty reply)
    tpot_s: float | None = None  # (last output chunk - first) / (output tokens - 1), from 2 output tokens
    e2e_s: float | None = None  # to the end of the stream
    prompt_tokens: int | None = None  # the server's usage, when it sends one
    output_tokens: int = 0  # the server's usage, else the chunks that carried text
    finish_reason: str | None = None


@dataclass
class RunResult:
    """A workload's run against one server: its settings, every request's record and the run's wall time (from
    the first request sent to the last one ended or cancelled)."""

    url: str
    model: str
    spec: WorkloadSpec
    records: list[RequestRecord] = field(default_factory=list)
    duration_s: float = 0.0
    started: str = ""  # local time of day the run began, ISO 8601
    client_cpu_s: float = 0.0  # CPU time the load generator used, taken from the server where they share CPUs

    def settings(self) -> dict:
        return {"url": self.url, "model": self.model, "workload": self.spec.as_dict()}

    def run_info(self) -> dict:
        return {"started": self.started, "duration_s": self.duration_s, "client_cpu_s": self.client_cpu_s}

    def records_as_dicts(self) -> list[dict]:
        return [asdict(r) for r in self.records]
