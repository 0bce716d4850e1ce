"""What-if simulation: predicted TTFT and decode speed of a model on hardware we may not have.

For each weight format of the routed experts (FP8 and INT4 by default) and each strategy - "cpu-only"
(no accelerator), "hybrid" (attention etc. on the GPU, routed experts on the CPU kernels), "slp" (stream-
loading prefill on one GPU) and "slp-<N>gpu" (distributed stream-loading with small expert parallelism) - it
plans the model for the full memory of the GPU and reports TTFT, prefill tokens/s and decode tokens/s (one
sequence, decoding right after the prompt) at each prompt length, and the longest prompt served within 30 s.
Each prompt is planned with a KV cache of exactly its length. Decode always runs the hybrid way on one GPU.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from hybridmoe.placement import estimate
from hybridmoe.placement.hardware import Machine, machine
from hybridmoe.placement.modelspec import ModelSpec, resolve_model
from hybridmoe.placement.planner import HYBRID_CHUNK, Planner

SIM_PROMPTS = (8192, 32768, 65536)
SIM_FORMATS = ("fp8", "int4")
TTFT_BUDGET_S = 30.0
LONGEST_SEARCH_TOKENS = 262144


@dataclass(frozen=True)
class SimRecord:
    model: str
    hardware: str
    gpus: int
    strategy: str
    weight_format: str
    prompt_tokens: int
    ttft_s: float
    prefill_tok_s: float
    decode_tok_s: float
    longest_within_30s: bool = False  # this record is the longest prompt served within 30 s

    def to_json(self) -> dict:
        return asdict(self)


class Simulation:
    """Predictions for one model on one hardware description (see module docstring)."""

    def __init__(self, model: str, hardware: str, gpus: int | None = None, dense_format: str | None = None):
        self.spec = ModelSpec(resolve_model(model), model.lower().rsplit("/", 1)[-1])
        self.hardware = hardware
        self.full = machine(hardware)
        if gpus is not None and gpus < 1 and self.full.gpu is not None:
            raise ValueError(f"--gpus must be >= 1, got {gpus}")
        self.gpus = gpus if gpus is not None else (1 if self.full.gpu else 0)
        if self.gpus > 1 and self.full.gpu is None:
            raise ValueError(f"hardware {hardware!r} has no GPU part; --gpus {self.gpus} needs one")
        self.dense_format = dense_format
        self._ttft: dict[tuple[str, str, int], float] = {}

    def strategies(self) -> list[str]:
        out = ["cpu-only"]
        if self.full.gpu is not None:
            out += ["hybrid", "slp"]
            if self.gpus > 1:
                out.append(f"slp-{self.gpus}gpu")
        return out

    def _planner(self, fmt: str, prompt: int, gpus: int) -> Planner:
        cpu_only = Machine(self.full.cpu.name, self.full.cpu, None, 0)
        m = cpu_only if gpus == 0 else machine(self.hardware, gpus=gpus)
        return Planner(self.spec, m, None, expert_format=fmt, dense_format=self.dense_format, context=prompt)

    def prefill(self, strategy: str, fmt: str, prompt: int) -> estimate.PrefillEstimate | None:
        if strategy == "cpu-only":
            planner = self._planner(fmt, prompt, 0)
            return estimate.prefill(planner.builder, "cpu", prompt)
        if strategy == "hybrid":
            planner = self._planner(fmt, prompt, 1)
            return estimate.prefill(planner.builder, "hybrid", prompt, chunk=HYBRID_CHUNK)
        return self._planner(fmt, prompt, self.gpus if strategy != "slp" else 1).slp(prompt)

    def decode_tok_s(self, strategy: str, fmt: str, context: int) -> float:
        planner = self._planner(fmt, context, 0 if strategy == "cpu-only" else 1)
        return estimate.decode(planner.builder, 1, context).tok_s

    def ttft_s(self, strategy: str, fmt: str, prompt: int) -> float:
        key = (strategy, fmt, prompt)
        if key not in self._ttft:
            result = self.prefill(strategy, fmt, prompt)
            self._ttft[key] = float("inf") if result is None else result.ttft_s
        return self._ttft[key]

    def run(self, formats: tuple[str, ...] = SIM_FORMATS, prompts: tuple[int, ...] = SIM_PROMPTS,
            longest: bool = True) -> list[SimRecord]:
        records = []
        for fmt in formats:
            for strategy in self.strategies():
                gpus = {"cpu-only": 0, "hybrid": 1, "slp": 1}.get(strategy, self.gpus)
                for prompt in prompts:
                    records.append(self._record(strategy, fmt, prompt, gpus, self.ttft_s(strategy, fmt, prompt)))
                if longest:
                    upper = min(LONGEST_SEARCH_TOKENS, self.spec.config.max_position_embeddings)
                    n = estimate.longest_prompt_within(lambda p: self.ttft_s(strategy, fmt, p), TTFT_BUDGET_S, upper)
                    if n:
                        records.append(self._record(strategy, fmt, n, gpus, self.ttft_s(strategy, fmt, n), True))
        return records

    def _record(self, strategy: str, fmt: str, prompt: int, gpus: int, ttft: float, longest: bool = False):
        return SimRecord(self.spec.name, self.hardware, gpus, strategy, fmt, prompt, ttft,
                         prompt / ttft if ttft != float("inf") else 0.0,
                         self.decode_tok_s(strategy, fmt, prompt), longest)
