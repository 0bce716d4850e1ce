"""Predicted times of whole requests: TTFT under each prefill strategy, decode steps (with dual-batch overlap)
and decode under intra-node prefill-decode disaggregation (PD).

- Prefill: the prompt is cut into chunks; the units of all chunks run through one schedule, so streaming of
  the next chunk's first layer overlaps the end of the previous chunk. Stream-loading tries both copy
  variants (whole layers prefetched, or only the activated experts once routed) and keeps the faster.
- Decode: one step for `batch` sequences; with dual-batch overlap the batch is split in two micro-batches so
  that the accelerator runs the attention of one while the CPU runs the routed experts of the other.
- PD: a prefill worker streams experts while the decode worker keeps decoding. The decode worker loses the
  host-memory bandwidth the copies take (copy slowdown) and its accelerator work is assumed to run first at
  every kernel boundary (a high-priority stream), so the prefill worker loses the accelerator time decode uses.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridmoe.placement.passes import PassBuilder, default_slot_bytes
from hybridmoe.placement.schedule import Timeline, Unit, copies_overlap, run


@dataclass(frozen=True)
class PrefillEstimate:
    strategy: str
    prompt_tokens: int
    chunk_tokens: int
    gpus: int
    ttft_s: float
    timeline: Timeline
    variant: str = ""  # slp: "whole-layer prefetch" | "activated-only"
    reload_s: float = 0.0  # reloading evicted resident layers after the first token (not in ttft_s)

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.ttft_s


@dataclass(frozen=True)
class DecodeEstimate:
    batch: int
    context: int
    step_s: float
    dual_batch: bool
    timeline: Timeline | None
    where: dict[str, str]

    @property
    def tok_s(self) -> float:
        """Tokens per second over all sequences of the batch."""
        return self.batch / self.step_s


def stream_slots(builder: PassBuilder, buffer_bytes: float | None, gpus: int = 1) -> tuple[float, int]:
    """Split a stream buffer into slots: a slot holds at most 1 GiB or this GPU's share of a layer's experts
    (at least one expert); returns (slot bytes, number of slots >= 2)."""
    cost = builder.cost
    layer = max((cost.layer_expert_bytes(l.index) for l in builder.spec.moe_layers), default=0.0) / gpus
    slot = max(cost.expert_bytes, min(layer, default_slot_bytes(cost)))
    if buffer_bytes is None:
        return slot, 2
    slot = max(cost.expert_bytes, min(slot, buffer_bytes / 2))
    return slot, max(2, int(buffer_bytes // slot))


ACTIVATED = ("auto", "never", "always")
CHUNK_DIVISORS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # stream-loading tries chunks of prompt/k


def prefill(builder: PassBuilder, strategy: str, prompt: int, chunk: int | None = None, gpus: int = 1,
            buffer_bytes: float | None = None, parallel: str = "tokens", prefetch: bool = True,
            activated: str = "auto") -> PrefillEstimate:
    """TTFT of a `prompt`-token prompt in chunks of `chunk` tokens (default: the whole prompt); stream-
    loading gets `buffer_bytes` of accelerator memory per GPU for its ring of expert slots, copies only the
    activated experts when `activated` is "always" (or when faster, "auto"), and prefetches the next layer
    unless prefetch=False."""
    if activated not in ACTIVATED:
        raise ValueError(f"activated must be one of {', '.join(ACTIVATED)}, got {activated!r}")
    if prompt < 1:
        raise ValueError(f"prompt must have at least one token, got {prompt}")
    chunk = min(prompt, chunk or prompt)
    slot, slots = stream_slots(builder, buffer_bytes, gpus)
    variants = {"auto": [False, True], "never": [False], "always": [True]}[activated] if strategy == "slp" else [False]
    if activated == "auto" and strategy == "slp" and not _fewer_activated(builder, chunk):
        variants = [False]  # every expert is activated: waiting for the router cannot pay
    best: PrefillEstimate | None = None
    for activated_only in variants:
        units: list[Unit] = []
        for offset in range(0, prompt, chunk):
            size = min(chunk, prompt - offset)
            units += builder.prefill_units(strategy, size, offset, last=offset + size >= prompt, gpus=gpus,
                                           slot_bytes=slot, activated_only=activated_only, parallel=parallel,
                                           prefetch=prefetch)
        timeline = run(units, buffers=slots, overlap=copies_overlap(builder.cost.gpu))
        variant = ("activated-only" if activated_only else "whole-layer prefetch") if strategy == "slp" else ""
        estimate = PrefillEstimate(strategy, prompt, chunk, gpus, timeline.total_s, timeline, variant)
        if best is None or estimate.ttft_s < best.ttft_s:
            best = estimate
    return best


def _fewer_activated(builder: PassBuilder, chunk: int) -> bool:
    """Whether a chunk leaves at least 2% of some layer's experts unactivated."""
    cost = builder.cost
    return any(cost.distinct_experts(l.index, chunk) < 0.98 * l.num_experts for l in builder.spec.moe_layers)


def slp_prefill(builder: PassBuilder, prompt: int, free_bytes: float, gpus: int = 1, parallel: str = "tokens",
                prefetch: bool = True, activated: str = "auto") -> PrefillEstimate | None:
    """The best stream-loading prefill when `free_bytes` of each GPU's memory must hold the chunk's
    activations and the stream buffer: tries chunks of prompt/k tokens (k in CHUNK_DIVISORS, at least 256
    tokens), gives each the rest as buffer, keeps the fastest. None if no chunk with two expert slots fits."""
    spec, cost = builder.spec, builder.cost
    best: PrefillEstimate | None = None
    tried: set[int] = set()
    for k in CHUNK_DIVISORS:
        chunk = min(prompt, -(-(-(-prompt // k)) // 256) * 256)
        if chunk in tried or (chunk < 256 and chunk < prompt):
            continue
        tried.add(chunk)
        local = -(-chunk // gpus) if parallel == "tokens" else chunk
        buffer = free_bytes - spec.activation_bytes(local, prompt)
        if buffer < 2 * cost.expert_bytes:
            continue
        estimate = prefill(builder, "slp", prompt, chunk, gpus, buffer, parallel, prefetch, activated)
        if best is None or estimate.ttft_s < best.ttft_s:
            best = estimate
    return best


def decode(builder: PassBuilder, batch: int, context: int, dual_batch: bool = False,
           experts_on: str = "cpu") -> DecodeEstimate:
    """One decode step of `batch` sequences with `context` tokens cached each."""
    if batch < 1:
        raise ValueError(f"decode batch must be >= 1, got {batch}")
    if dual_batch and batch >= 2:
        return _dual_batch(builder, batch, context, experts_on)
    units, where = builder.decode_units(batch, context, experts_on)
    timeline = run(units, overlap=copies_overlap(builder.cost.gpu))
    return DecodeEstimate(batch, context, timeline.total_s, False, timeline, where)


def _dual_batch(builder: PassBuilder, batch: int, context: int, experts_on: str) -> DecodeEstimate:
    """Two micro-batches ping-pong: accelerator ops (attention, shared/hot experts) of one micro-batch run
    while the CPU ops (routed experts) of the other run; each op waits for its micro-batch's previous op."""
    halves = (batch // 2, batch - batch // 2)
    plans = [builder.decode_units(h, context, experts_on) for h in halves]
    free = {"gpu": 0.0, "cpu": 0.0}
    ready = [0.0, 0.0]
    for step in zip(*(units for units, _ in plans)):
        for m, unit in enumerate(step):
            gpu_start = max(free["gpu"], ready[m])
            gpu_end = gpu_start + unit.gpu_s + unit.copy_s  # a streamed part's copy is not overlapped here
            free["gpu"] = gpu_end if unit.gpu_s or unit.copy_s else free["gpu"]
            if unit.cpu_s or unit.handoff_s:
                cpu_start = max(free["cpu"], ready[m])
                cpu_end = cpu_start + unit.cpu_s + unit.handoff_s
                free["cpu"] = cpu_end
                ready[m] = max(gpu_end, cpu_end)
            else:
                ready[m] = gpu_end
    step_s = max(ready)
    return DecodeEstimate(batch, context, step_s, True, None, plans[0][1])


@dataclass(frozen=True)
class DisaggregatedEstimate:
    decode_alone: DecodeEstimate
    decode_during_prefill_s: float  # step time while a prefill streams experts
    prefill_alone: PrefillEstimate
    ttft_during_decode_s: float

    @property
    def decode_slowdown(self) -> float:
        return self.decode_during_prefill_s / self.decode_alone.step_s - 1.0


def disaggregated(builder: PassBuilder, prefill_estimate: PrefillEstimate, batch: int,
                  context: int) -> DisaggregatedEstimate:
    """Decode `batch` sequences while `prefill_estimate` runs in a prefill worker on the same machine."""
    alone = decode(builder, batch, context)
    units, _ = builder.decode_units(batch, context)
    cost = builder.cost
    slowdown = cost.copy_slowdown() if prefill_estimate.strategy == "slp" else 1.0
    during = run([Unit(u.name, u.layer, u.gpu_s, u.cpu_s / slowdown, u.handoff_s, u.copy_s, u.copy_bytes)
                  for u in units], overlap=copies_overlap(cost.gpu)).total_s
    gpu_busy = sum(u.gpu_s for u in units) / during  # share of accelerator time decode takes
    ttft = prefill_estimate.ttft_s / max(1e-6, 1.0 - gpu_busy)
    return DisaggregatedEstimate(alone, during, prefill_estimate, ttft)


def longest_prompt_within(ttft_of, budget_s: float, upper: int) -> int:
    """Largest prompt length (tokens, multiple of 256, <= upper) whose predicted TTFT fits in budget_s;
    0 if even 256 tokens do not. `ttft_of(tokens) -> seconds` must grow with the prompt."""
    lo, hi = 0, upper // 256
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ttft_of(mid * 256) <= budget_s:
            lo = mid
        else:
            hi = mid - 1
    return lo * 256

