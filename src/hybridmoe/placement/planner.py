"""The planner: what goes into accelerator memory, what is streamed, what runs on the CPU, and how to prefill.

Accelerator memory (the VRAM budget) is filled in one fixed priority order, as a prefix: an item is placed
only if everything before it was, so a larger budget never places less (monotone) and the result never
depends on anything but the inputs (deterministic):

  1. runtime reserve, KV cache (context x concurrency), activation scratch (largest decode tier and a
     hybrid-prefill chunk)                                  -- required: the plan fails clearly without it
  2. attention halves, layer 0 .. L-1
  3. routers   4. shared experts   5. dense MLP layers   6. LM head
  7. hot routed experts, most frequently routed first (measured routing statistics, else uniform)

A long stream-loading prefill evicts the hot experts and uses their memory, the scratch and what is left
for its chunk activations and stream buffers (the hot experts are reloaded afterwards, in the background);
the prompt's KV cache lives in the KV item, so prompts up to the context length are planned.

Per decode batch tier the parts that are not resident run on the CPU or are streamed, whichever is faster,
with or without dual-batch overlap. The prefill strategy is chosen by prompt length; the crossover is the
prompt length from which stream-loading beats CPU and hybrid prefill.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from hybridmoe.placement import estimate
from hybridmoe.placement.costmodel import CostModel
from hybridmoe.placement.hardware import Machine
from hybridmoe.placement.modelspec import ModelSpec
from hybridmoe.placement.passes import PassBuilder, Residency
from hybridmoe.placement.routing import RoutingStats

HYBRID_CHUNK = 2048  # prompt tokens per hybrid-prefill step (its activations are reserved in item 1)
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

    def tier(self, batch: int) -> TierPlan:
        for t in self.tiers:
            if t.batch == batch:
                return t
        raise KeyError(f"no tier for batch {batch}; tiers: {[t.batch for t in self.tiers]}")

    @property
    def decode_tok_s(self) -> float:
        """Tokens per second of one sequence decoding alone (tier 1)."""
        return self.tiers[0].tok_s if self.tiers[0].batch == 1 else self.tiers[0].tok_s / self.tiers[0].batch


def priority_items(cost: CostModel, context: int, concurrency: int, tiers: tuple[int, ...]) -> list[Item]:
    """All placeable items in priority order (see module docstring); `resident` is filled in later."""
    spec = cost.spec
    items = [Item("runtime reserve", "reserve", None, cost.gpu.reserved_gb * GB if cost.gpu else 0.0, False),
             Item(f"KV cache ({context} tokens x {concurrency})", "kv", None,
                  float(context * concurrency * spec.kv_bytes_per_token()), False),
             Item("activation scratch", "scratch", None,
                  max(spec.activation_bytes(max(tiers), context), spec.activation_bytes(min(HYBRID_CHUNK, context),
                                                                                       context)), False)]
    for kind in ("attention", "router", "shared", "dense"):
        for shape in spec.layers:
            size = cost.part_bytes(shape.index, kind)
            if size > 0:
                items.append(Item(f"{kind}.{shape.index}", kind, shape.index, size, False))
    items.append(Item("lm_head", "lm_head", None, cost.lm_head_bytes, False))
    for row, expert in cost.routing.hot_order():
        layer = cost.routing.layers[row]
        items.append(Item(f"expert.{layer}.{expert}", "expert", layer, cost.expert_bytes, False))
    return items


def _fill(items: list[Item], budget: float) -> list[Item]:
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
        out.append(Item(item.name, item.kind, item.layer, item.nbytes, fits))
    return out


def _residency(spec: ModelSpec, cost: CostModel, items: list[Item]) -> Residency:
    on = {(i.kind, i.layer) for i in items if i.resident}
    layers = range(len(spec.layers))
    hot: dict[int, list[int]] = {}
    for i in items:
        if i.kind == "expert" and i.resident:
            hot.setdefault(i.layer, []).append(int(i.name.rsplit(".", 1)[1]))
    return Residency(tuple(("attention", l) in on for l in layers), tuple(("router", l) in on for l in layers),
                     tuple(("shared", l) in on for l in layers), tuple(("dense", l) in on for l in layers),
                     ("lm_head", None) in on, tuple(tuple(sorted(hot.get(l.index, []))) for l in spec.moe_layers))


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
                 concurrency: int = 1, tiers: tuple[int, ...] | None = None, routing: RoutingStats | None = None):
        if context < 1 or concurrency < 1:
            raise PlanError(f"context ({context}) and concurrency ({concurrency}) must be >= 1")
        self.spec, self.machine = spec, machine
        self.cost = CostModel(machine, spec, expert_format, dense_format, routing)
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
        if cost.gpu is None:
            self.items: list[Item] = []
            self.residency = Residency.none(len(spec.layers), len(spec.moe_layers))
        else:
            self.items = _fill(priority_items(cost, context, concurrency, self.tiers), self.budget)
            self.residency = _residency(spec, cost, self.items)
        self.builder = PassBuilder(cost, self.residency)
        # stream-loading reuses the scratch and the hot experts' memory; the prompt's KV is inside the KV item
        self.slp_free = self.budget - sum(i.nbytes for i in self.items
                                          if i.resident and i.kind not in ("scratch", "expert"))

    def plan(self) -> Plan:
        spec, cost, builder = self.spec, self.cost, self.builder
        tiers = tuple(_tier(builder, b, self.context) for b in self.tiers)
        prefill = tuple(self._prefill_choice(p) for p in REPORT_PROMPTS if p <= self.context)
        crossover = self._crossover() if cost.gpu else None
        notes = []
        if not cost.routing.measured and spec.moe_layers:
            notes.append("routing statistics: uniform (none measured); hot experts are an arbitrary pick")
        return Plan(spec.name, self.machine.name, cost.expert_fmt.name, cost.dense_fmt.name, self.budget,
                    self.context, self.concurrency, tuple(self.items), self.residency, tiers, prefill, crossover,
                    self.slp_free, cost.routing.measured, tuple(notes))

    # ---- prefill -----------------------------------------------------------------------------------------
    def slp(self, prompt: int, evict: str = "auto", prefetch: bool = True, activated: str = "auto",
            parallel: str = "tokens") -> estimate.PrefillEstimate | None:
        """Stream-loading prefill on all of the machine's GPUs. evict="never" keeps the resident layers in
        place (a decode worker can keep running); "always" streams them too, using the whole budget for the
        stream, and pays for reloading them afterwards; "auto" takes the faster."""
        gpus = max(1, self.machine.num_gpus)
        options = []
        if evict in ("auto", "never"):
            options.append(estimate.slp_prefill(self.builder, prompt, self.slp_free, gpus, parallel, prefetch,
                                                activated))
        if evict in ("auto", "always"):
            spec = self.spec
            bare = PassBuilder(self.cost, Residency.none(len(spec.layers), len(spec.moe_layers)))
            held = sum(i.nbytes for i in self.items if i.resident and i.kind in ("reserve", "kv"))
            evicted = estimate.slp_prefill(bare, prompt, self.budget - held, gpus, parallel, prefetch, activated)
            if evicted is not None:
                static = sum(i.nbytes for i in self.items if i.resident
                             and i.kind not in ("reserve", "kv", "scratch"))
                reload_s = self.cost.h2d_s(static)
                options.append(replace(evicted, ttft_s=evicted.ttft_s + reload_s,
                                       variant=f"{evicted.variant}, residents evicted (+{reload_s:.2f} s reload)"))
        options = [o for o in options if o is not None]
        return min(options, key=lambda o: o.ttft_s) if options else None

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
