"""The planner: what goes into accelerator memory, what is streamed, what runs on the CPU, and how to prefill.

Accelerator memory (the VRAM budget) is filled in one fixed priority order, as a prefix: an item is placed
only if everything before it was, so a larger budget never places less (monotone) and the result never
depends on anything but the inputs (deterministic):

  1. runtime reserve, KV cache (context x concurrency), activation scratch (largest decode tier and a
     hybrid-prefill chunk)                                  -- required: the plan fails clearly without it
  2. attention halves, layer 0 .. L-1
  3. routers   4. shared experts   5. dense MLP layers   6. LM head
  7. hot routed experts, most frequently routed first (measured routing statistics, else uniform)

A long stream-loading prefill evicts the hot experts (and, when that is faster, part or all of items 2-6) and
uses that memory, the scratch and what is left for its chunk activations and stream buffers; what it evicted
is reloaded after the first token. The prompt's KV cache lives in the KV item, so prompts up to the context
length are planned.

Per decode batch tier the parts that are not resident run on the CPU or are streamed, whichever is faster,
with or without dual-batch overlap. The prefill strategy is chosen by prompt length; the crossover is the
prompt length from which stream-loading beats CPU and hybrid prefill.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from hybridmoe.placement import estimate
from hybridmoe.placement.costmodel import CostModel
from hybridmoe.placement.hardware import Machine
from hybridmoe.placement.modelspec import ModelSpec
from hybridmoe.placement.passes import PassBuilder, Residency
from hybridmoe.placement.routing import RoutingStats

HYBRID_CHUNK = 2048  # prompt tokens per hybrid-prefill step (its activations are reserved in item 1)
STATIC_KINDS = ("attention", "router", "shared", "dense", "lm_head")
KEEP_FRACTIONS = (1.0, 0.0)  # of the non-expert weights a stream-loading prefill may keep resident
REPORT_PROMPTS = (1024, 8192, 32768)
GB = 1e9


class PlanError(ValueError):
    """The inputs admit no plan (e.g. the budget cannot hold the KV cache); the message says what to change."""


@dataclass(frozen=True)
class Item:
    name: str
    kind: str  # reserve|kv|scratch|attention|router|shared|dense|lm_head|expert
    layer: int | None
    nbytes: float
    resident: bool


@dataclass(frozen=True)
class TierPlan:
    """One decode batch tier: `batch` sequences decoding one token each."""

    batch: int
    step_s: float
    tok_s: float
    dual_batch: bool
    experts_on: str  # cpu | stream
    streamed: tuple[str, ...]
    on_cpu: tuple[str, ...]


@dataclass(frozen=True)
class PrefillChoice:
    prompt_tokens: int
    strategy: str
    ttft_s: float
    ttft_by_strategy: dict[str, float]
    chunk_tokens: int


@dataclass(frozen=True)
class Plan:
    model: str
    machine: str
    expert_format: str
    dense_format: str
    budget_bytes: float
    context: int
    concurrency: int
    items: tuple[Item, ...]  # in priority order, resident or not
    residency: Residency
    tiers: tuple[TierPlan, ...]
    prefill: tuple[PrefillChoice, ...]
    crossover_tokens: int | None  # stream-loading wins from this prompt length on (None: never / no GPU)
    slp_free_bytes: float
    routing_measured: bool
    notes: tuple[str, ...] = field(default=())

    @property
    def resident_bytes(self) -> float:
        return sum(i.nbytes for i in self.items if i.resident)

    @property
    def decode_tok_s(self) -> float:
        """Tokens per second of one sequence decoding alone (tier 1)."""
        return self.tiers[0].tok_s if self.tiers[0].batch == 1 else self.tiers[0].tok_s / self.tiers[0].batch


def priority_items(cost: CostModel, context: int, concurrency: int, tiers: tuple[int, ...]) -> list[Item]:
    """Items 1-6 in priority order (see module docstring); `resident` is filled in by `fill`."""
    spec = cost.spec
    scratch = max(spec.activation_bytes(max(tiers), context),
                  spec.activation_bytes(min(HYBRID_CHUNK, context), context))
    items = [Item("runtime reserve", "reserve", None, cost.gpu.reserved_gb * GB if cost.gpu else 0.0, False),
             Item(f"KV cache ({context} tokens x {concurrency})", "kv", None,
                  float(context * concurrency * spec.kv_bytes_per_token()), False),
             Item("activation scratch", "scratch", None, scratch, False)]
    for kind in ("attention", "router", "shared", "dense"):
        for shape in spec.layers:
            size = cost.part_bytes(shape.index, kind)
            if size > 0:
                items.append(Item(f"{kind}.{shape.index}", kind, shape.index, size, False))
    items.append(Item("lm_head", "lm_head", None, cost.lm_head_bytes, False))
    return items


def fill(cost: CostModel, items: list[Item], budget: float) -> tuple[list[Item], int]:
    """Place `items` as a prefix within `budget`, then as many hot experts (item 7) as fit in what is left.
    Returns the items marked resident or not (hot experts grouped by layer) and the number of hot experts."""
    used, out, open_ = 0.0, [], True
    for item in items:
        fits = open_ and used + item.nbytes <= budget
        if fits:
            used += item.nbytes
        elif item.kind in ("reserve", "kv", "scratch"):
            need = sum(i.nbytes for i in items if i.kind in ("reserve", "kv", "scratch"))
            raise PlanError(f"a VRAM budget of {budget / GB:.1f} GB cannot hold the runtime reserve, the KV cache "
                            f"and activation scratch ({need / GB:.1f} GB); lower --context or --concurrency, "
                            "or raise --vram")
        open_ = fits
        out.append(replace(item, resident=fits))
    if not cost.spec.moe_layers:
        return out, 0
    rows, experts = cost.routing.hot_order
    hot = min(len(rows), int((budget - used) // cost.expert_bytes)) if open_ else 0
    for row in sorted(set(rows[:hot].tolist())):
        count = int((rows[:hot] == row).sum())
        layer = cost.routing.layers[row]
        out.append(Item(f"hot experts.{layer} ({count} of {cost.spec.num_experts})", "expert", layer,
                        count * cost.expert_bytes, True))
    cold = len(rows) - hot
    out.append(Item(f"routed experts in host memory ({cold})", "expert", None, cold * cost.expert_bytes, False))
    return out, hot


def _residency(spec: ModelSpec, cost: CostModel, items: list[Item], hot: int) -> Residency:
    on = {(i.kind, i.layer) for i in items if i.resident}
    layers = range(len(spec.layers))
    rows, experts = cost.routing.hot_order if spec.moe_layers else (np.zeros(0, int), np.zeros(0, int))
    pinned = [tuple(sorted(experts[:hot][rows[:hot] == row].tolist())) for row in range(len(spec.moe_layers))]
    return Residency(tuple(("attention", l) in on for l in layers), tuple(("router", l) in on for l in layers),
                     tuple(("shared", l) in on for l in layers), tuple(("dense", l) in on for l in layers),
                     ("lm_head", None) in on, tuple(pinned))


def _tier(builder: PassBuilder, batch: int, context: int) -> TierPlan:
    options = []
    for experts_on in (("cpu", "stream") if builder.cost.gpu else ("cpu",)):
        for dual in ((False, True) if batch >= 2 and experts_on == "cpu" else (False,)):
            options.append((estimate.decode(builder, batch, context, dual, experts_on), experts_on))
    best, experts_on = min(options, key=lambda o: (o[0].step_s, o[0].dual_batch, o[1]))
    where = best.where
    streamed = tuple(k for k, v in where.items() if v == "stream")
    on_cpu = tuple(k for k, v in where.items() if v == "cpu")
    return TierPlan(batch, best.step_s, best.tok_s, best.dual_batch, experts_on, streamed, on_cpu)


class Planner:
    """Plans one model on one machine for a VRAM budget (see module docstring)."""

    def __init__(self, spec: ModelSpec, machine: Machine, vram_bytes: float | None = None,
                 expert_format: str | None = None, dense_format: str | None = None, context: int = 8192,
                 concurrency: int = 1, tiers: tuple[int, ...] | None = None, routing: RoutingStats | None = None,
                 dispatch_us: float | None = None):
        if context < 1 or concurrency < 1:
            raise PlanError(f"context ({context}) and concurrency ({concurrency}) must be >= 1")
        self.spec, self.machine = spec, machine
        self.cost = CostModel(machine, spec, expert_format, dense_format, routing, dispatch_us=dispatch_us)
        gpu = machine.gpu
        if vram_bytes is None:
            vram_bytes = gpu.memory_gb * GB if gpu else 0.0
        if gpu is None and vram_bytes:
            raise PlanError(f"machine {machine.name} has no accelerator: a VRAM budget cannot be used")
        if gpu is not None and vram_bytes > gpu.memory_gb * GB * 1.0001:
            raise PlanError(f"VRAM budget {vram_bytes / GB:.1f} GB exceeds the {gpu.name}'s "
                            f"{gpu.memory_gb:.0f} GB")
        self.budget, self.context, self.concurrency = float(vram_bytes), context, concurrency
        self.tiers = tuple(sorted(set(tiers or (1, concurrency))))
        if min(self.tiers) < 1:
            raise PlanError(f"batch tiers must be >= 1, got {self.tiers}")
        cost = self.cost
        self.hot_experts = 0
        if cost.gpu is None:
            self.items: list[Item] = []
            self.residency = Residency.none(len(spec.layers), len(spec.moe_layers))
        else:
            self.items, self.hot_experts = fill(cost, priority_items(cost, context, concurrency, self.tiers),
                                                self.budget)
            self.residency = _residency(spec, cost, self.items, self.hot_experts)
        self.builder = PassBuilder(cost, self.residency)
        self._keep_builders: dict[int, PassBuilder] = {}
        # stream-loading reuses the scratch and the hot experts' memory; the prompt's KV is inside the KV item
        self.slp_free = self.budget - sum(i.nbytes for i in self.items
                                          if i.resident and i.kind not in ("scratch", "expert"))

    def plan(self) -> Plan:
        spec, cost, builder = self.spec, self.cost, self.builder
        tiers = tuple(_tier(builder, b, self.context) for b in self.tiers)
        prefill = tuple(self._prefill_choice(p) for p in REPORT_PROMPTS if p <= self.context)
        crossover = self._crossover() if cost.gpu else None
        notes = [f"{p}-token prompts exceed the context of {self.context}: not predicted"
                 for p in REPORT_PROMPTS if p > self.context]
        if not cost.routing.measured and spec.moe_layers:
            notes.append("routing statistics: uniform (none measured); hot experts are an arbitrary pick")
        if cost.ops is not None:
            notes.append("CPU pieces costed from this engine's op tables measured on this machine")
        elif cost.cpu.op_tables is not None:
            notes.append("the profile's op tables are for another model (it lacks "
                         f"{'; '.join(cost.ops_missing[:3])}): CPU pieces costed from the roofline")
        return Plan(spec.name, self.machine.name, cost.expert_fmt.name, cost.dense_fmt.name, self.budget,
                    self.context, self.concurrency, tuple(self.items), self.residency, tiers, prefill, crossover,
                    self.slp_free, cost.routing.measured, tuple(notes))

    # ---- prefill -----------------------------------------------------------------------------------------
    def slp(self, prompt: int, evict: str = "auto", prefetch: bool = True, activated: str = "auto",
            parallel: str = "tokens") -> estimate.PrefillEstimate | None:
        """Stream-loading prefill on all of the machine's GPUs.

        evict="never": the resident layers stay (a decode worker can keep running) and the prefill gets what
        is left; "auto": the prefill may also evict resident layers, keeping the first KEEP_FRACTIONS of the
        model's non-expert weights (in priority order) and streaming the rest with the experts; the fastest
        option wins. The options do not depend on the budget, so a larger budget never plans a slower
        prefill. Evicted layers are reloaded after the first token (`reload_s`, not part of the TTFT)."""
        if evict not in ("auto", "never"):
            raise ValueError(f"evict must be auto or never, got {evict!r}")
        gpus = max(1, self.machine.num_gpus)
        options = []
        if evict == "never":
            options.append(estimate.slp_prefill(self.builder, prompt, self.slp_free, gpus, parallel, prefetch,
                                                activated))
        else:
            static = [i for i in self.items if i.kind in STATIC_KINDS]
            held = sum(i.nbytes for i in self.items if i.resident and i.kind in ("reserve", "kv"))
            resident_static = sum(i.nbytes for i in static if i.resident)
            total = sum(i.nbytes for i in static)
            for fraction in KEEP_FRACTIONS:
                kept, kept_bytes = [], 0.0
                for item in static:
                    if kept_bytes + item.nbytes > fraction * total + 1e-6:
                        break
                    kept.append(item)
                    kept_bytes += item.nbytes
                if not all(i.resident for i in kept):
                    continue  # this budget cannot hold that much
                found = estimate.slp_prefill(self._builder_keeping(kept), prompt, self.budget - held - kept_bytes,
                                             gpus, parallel, prefetch, activated)
                if found is not None:
                    reload_s = (resident_static - kept_bytes) / (self.cost.h2d_gbs() * 1e9)
                    options.append(replace(found, reload_s=reload_s,
                                           variant=f"{found.variant}; keeps {kept_bytes / GB:.1f} GB of layers"))
        options = [o for o in options if o is not None]
        return min(options, key=lambda o: (o.ttft_s, o.reload_s)) if options else None

    def _builder_keeping(self, kept: list[Item]) -> PassBuilder:
        key = len(kept)
        if key not in self._keep_builders:
            residency = _residency(self.spec, self.cost, kept, 0)
            self._keep_builders[key] = PassBuilder(self.cost, residency)
        return self._keep_builders[key]

    def ttft_by_strategy(self, prompt: int) -> dict[str, estimate.PrefillEstimate]:
        """Predicted prefill of a `prompt`-token prompt under each strategy this machine can run."""
        out = {"cpu": estimate.prefill(self.builder, "cpu", prompt)}
        if self.cost.gpu is not None:
            out["hybrid"] = estimate.prefill(self.builder, "hybrid", prompt, chunk=HYBRID_CHUNK)
            slp = self.slp(prompt)
            if slp is not None:
                out["slp"] = slp
        return out

    def _prefill_choice(self, prompt: int) -> PrefillChoice:
        options = self.ttft_by_strategy(prompt)
        name = min(options, key=lambda k: (options[k].ttft_s, k))
        return PrefillChoice(prompt, name, options[name].ttft_s, {k: v.ttft_s for k, v in options.items()},
                             options[name].chunk_tokens)

    def _slp_wins(self, prompt: int) -> bool:
        options = self.ttft_by_strategy(prompt)
        return "slp" in options and options["slp"].ttft_s < min(v.ttft_s for k, v in options.items() if k != "slp")

    def _crossover(self) -> int | None:
        """Smallest prompt (multiple of 256, <= context) from which stream-loading is fastest; assumes one
        crossing (stream-loading pays a fixed copy cost that longer prompts amortise)."""
        top = max(256, self.context // 256 * 256)
        if not self._slp_wins(top):
            return None
        lo, hi = 1, top // 256  # answer in units of 256 tokens
        while lo < hi:
            mid = (lo + hi) // 2
            if self._slp_wins(mid * 256):
                hi = mid
            else:
                lo = mid + 1
        return lo * 256
