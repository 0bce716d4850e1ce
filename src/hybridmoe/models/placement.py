"""Executing a Plan at load: which parts of a built model move onto the accelerator, and moving them.

`plan_placement(config, accel, ...)` plans the model for this machine with the planner (placement/planner.py):
the machine is the measured profile `hybridmoe profile` saved (~/.cache/hybridmoe/profile.json) when there is one,
else packaged reference numbers, and on the CPU stand-in an accelerator part derived from the host's CPU part
(the plan's notes say which). `load_plan_file(path, config)` reads a plan written by `hybridmoe plan --json`
instead, after checking that it was made for this model. Both give a `Placement`: per decoder layer whether its
attention, router, shared experts and dense MLP are resident, whether the LM head is, and each MoE layer's hot
experts.

`place_model(model, placement, accel, stats)` then moves those parts of an already built `MoEDecoderModel`:
attention projections become `DeviceLinear`s and its norms and tensors device copies (the runner allocates that
layer's KV cache on the accelerator); a resident router runs its gate there and the layer's routed experts go
through a `HybridExpertBackend` (hot experts on the accelerator, the others on the CPU backend they had); shared
experts and dense MLPs become `DeviceLinear`s; the LM head and the final norm too. Every copy goes through the
accelerator's ledger under the item's name ("attention.3", "router.3", "shared.3", "dense.0", "lm_head",
"hot experts.3"), so a budget that cannot hold an item fails with its name. A layer's shared and hot experts are
placed only where its router is (the MoE block runs where its router runs); the planner's priority order always
places routers first.

Legend: E experts, H hidden.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path

import torch

from hybridmoe.accel.accelerator import Accelerator
from hybridmoe.accel.stats import RunStats
from hybridmoe.config import ModelConfig
from hybridmoe.layers.attention_mla import Absorption
from hybridmoe.layers.device_linear import DeviceLinear
from hybridmoe.layers.linear import Linear
from hybridmoe.layers.mlp import GatedMLP
from hybridmoe.layers.moe.block import MoEBlock
from hybridmoe.layers.moe.hybrid_backend import HybridExpertBackend, TimedOnDevice
from hybridmoe.placement.hardware import (CpuSpec, GpuSpec, Machine, ProfileError, load_profile,
                                          reference_profile)
from hybridmoe.placement.modelspec import ModelSpec
from hybridmoe.placement.costmodel import CostModel
from hybridmoe.placement.planner import GB, Plan, PlanError, Planner, priority_items
from hybridmoe.placement.routing import RoutingStats

DEFAULT_PROFILE = Path("~/.cache/hybridmoe/profile.json")  # where `hybridmoe profile` saves this machine's
FALLBACK_CPU = "desktop-2ch"  # packaged CPU part used when no profile was measured
FALLBACK_GPU = "rtx4090"  # packaged GPU part whose efficiencies stand for an unknown CUDA device
DENSE_FORMATS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class Placement:
    """What is resident on the accelerator: per decoder layer, the LM head, and hot experts by decoder layer."""

    attention: tuple[bool, ...]
    router: tuple[bool, ...]
    shared: tuple[bool, ...]
    dense: tuple[bool, ...]
    lm_head: bool
    hot: dict[int, tuple[int, ...]] = field(default_factory=dict)  # decoder layer -> expert ids
    source: str = ""  # where it came from (for --verbose)
    plan: Plan | None = None  # the plan, when planned here
    builder: object = None  # its placement.passes.PassBuilder (stream-loading prefill's copy choice), when planned here
    notes: tuple[str, ...] = ()

    @property
    def anything(self) -> bool:
        return any(self.attention + self.router + self.shared + self.dense) or self.lm_head or any(self.hot.values())


# ---- the machine the plan is made for --------------------------------------------------------------------------
def stand_in_gpu(cpu: CpuSpec, budget_bytes: float) -> GpuSpec:
    """An accelerator part for the CPU standing in for one: its numbers are the host CPU part's (memory bandwidth,
    matmul rate; a copy reads and writes host memory, so the link runs at half the read bandwidth), its memory
    the budget, no runtime reserve (the stand-in has no CUDA context)."""
    rate = cpu.peak_tflops * cpu.matmul_efficiency
    return GpuSpec(name="cpu stand-in", description=f"the CPU standing in for an accelerator ({cpu.name}'s numbers)",
                   memory_gb=max(budget_bytes, 1.0) / GB, reserved_gb=0.0,
                   memory_gbs=cpu.memory_read_gbs * cpu.stream_efficiency, memory_efficiency=1.0,
                   peak_tflops={"fp32": rate, "bf16": rate}, matmul_efficiency=1.0,
                   h2d_gbs=cpu.memory_read_gbs / 2, d2h_gbs=cpu.memory_read_gbs / 2, link_latency_us=1.0,
                   stand_in=True,
                   sources={"*": f"stand-in: derived from the host CPU part {cpu.name!r}, not measured as a device"})


def _cuda_gpu(accel: Accelerator) -> tuple[GpuSpec, str]:
    """A packaged GPU part whose name matches the CUDA device, else the fallback's efficiencies with this device's
    memory size."""
    props = torch.cuda.get_device_properties(accel.device)
    name = props.name.lower().replace(" ", "")
    for key in ("rtx5090", "rtx4090", "h200"):
        if key in name:
            return reference_profile(key).gpu, f"accelerator numbers: the packaged {key} profile"
    gpu = reference_profile(FALLBACK_GPU).gpu
    return (replace(gpu, name=props.name, memory_gb=props.total_memory / GB),
            f"accelerator numbers: the packaged {FALLBACK_GPU} profile's rates with this {props.name}'s memory "
            "(no measured profile of it; run `hybridmoe profile`)")


def plan_machine(accel: Accelerator, budget_bytes: float, num_gpus: int = 1,
                 profile: str | Path | None = None) -> tuple[Machine, list[str]]:
    """The machine to plan for, and notes saying where its numbers came from."""
    path = Path(profile or DEFAULT_PROFILE).expanduser()
    notes, cpu, gpu = [], None, None
    if path.is_file():
        measured = load_profile(path)
        cpu = measured.cpu
        if measured.gpu is not None and measured.gpu.stand_in == (not accel.is_cuda):
            gpu = measured.gpu
        notes.append(f"hardware: the measured profile {path}")
    elif profile is not None:
        raise ProfileError(f"{path}: no such profile file")
    if cpu is None:
        cpu = reference_profile(FALLBACK_CPU).cpu
        notes.append(f"hardware: no measured profile at {path}; the CPU's numbers are the packaged {FALLBACK_CPU} "
                     "reference (run `hybridmoe profile` for this machine's)")
    if gpu is not None and gpu.stand_in and gpu.memory_gb * GB < budget_bytes:
        gpu = replace(gpu, memory_gb=budget_bytes / GB)
    if gpu is None:
        if accel.is_cuda:
            gpu, note = _cuda_gpu(accel)
        else:
            gpu = stand_in_gpu(cpu, budget_bytes)
            note = (f"accelerator: the CPU stand-in, its numbers derived from the CPU part ({cpu.name}); predicted "
                    "times describe the stand-in, not a GPU")
        notes.append(note)
    return Machine(f"{cpu.name}+{gpu.name}", cpu, gpu, num_gpus), notes


def _dense_format(spec: ModelSpec, dtype: torch.dtype) -> str:
    """The other weights' format as the engine holds them: FP8/int as stored, float in the compute dtype."""
    return spec.dense_format if spec.dense_format in ("fp8", "int4", "int8") else DENSE_FORMATS[dtype]


def _routing(config: ModelConfig, routing: str | Path | RoutingStats | None) -> RoutingStats | None:
    if routing is None or isinstance(routing, RoutingStats):
        stats = routing
    else:
        stats = RoutingStats.from_json(routing)
    if stats is not None:
        moe = config.moe
        stats.check_model(tuple(i for i, m in enumerate(config.moe_layers) if m), moe.num_experts,
                          moe.num_experts_per_tok, f"({routing})")
    return stats


def held_bytes(model) -> int:
    """Bytes of the parts a plan may place (attention with the layer norms, routers, shared experts, dense MLPs,
    LM head with the final norm) as this built model holds them."""
    def size(obj) -> int:
        if obj is None:
            return 0
        if isinstance(obj, Linear):
            return obj.nbytes + (obj.bias.nbytes if obj.bias is not None else 0)
        if isinstance(obj, torch.Tensor):
            return obj.nbytes
        if isinstance(obj, GatedMLP) or is_dataclass(obj):
            return sum(size(getattr(obj, f.name)) for f in fields(obj))
        return 0

    total = size(model.lm_head) + size(model.norm)
    for layer in model.layers:
        total += size(layer.attention.w) + size(layer.input_norm) + size(layer.post_attention_norm)
        block = layer.mlp
        if isinstance(block, MoEBlock):
            total += size(block.router.gate) + size(block.router.correction_bias) + size(block.shared)
        else:
            total += size(block)
    return total


def plan_placement(model, accel: Accelerator, budget_bytes: float, kv_cache_bytes: int, max_num_seqs: int = 1,
                   num_gpus: int = 1, routing: str | Path | RoutingStats | None = None,
                   profile: str | Path | None = None, name: str | None = None) -> Placement:
    """Plan the built `model` for this machine within `budget_bytes` of accelerator memory.

    The plan's KV item is sized to the engine's cache (its context is the cache's tokens at the planner's bytes
    per token), its batch tiers are 1 and max_num_seqs, its dense format is the one the engine holds. Where the
    model's tensors weigh more than the planner's sizes of them (a float32 router, MLA's kv_b_proj expanded to the
    compute dtype), the plan is made for the budget less that excess, so that whatever it places fits."""
    config = model.config
    spec = ModelSpec(config, name)
    machine, notes = plan_machine(accel, budget_bytes, num_gpus, profile)
    context = max(1, math.ceil(kv_cache_bytes / spec.kv_bytes_per_token()))
    make = lambda budget: Planner(spec, machine, budget, dense_format=_dense_format(spec, model.dtype),  # noqa: E731
                                  context=context, concurrency=1, tiers=(1, max_num_seqs),
                                  routing=_routing(config, routing))
    try:
        planner = make(budget_bytes)
    except PlanError:
        cost = CostModel(machine, spec, None, _dense_format(spec, model.dtype), _routing(config, routing))
        need = {i.kind: i.nbytes for i in priority_items(cost, context, 1, (1, max_num_seqs))
                if i.kind in ("reserve", "kv", "scratch")}
        raise PlanError(f"a vram budget of {budget_bytes / 2**20:.2f} MiB cannot hold what the plan needs first: "
                        f"the KV cache ({need['kv'] / 2**20:.2f} MiB for the engine's {kv_cache_bytes / 2**20:.2f} "
                        f"MiB cache; lower kv_cache_gb), the activation scratch ({need['scratch'] / 2**20:.2f} MiB) "
                        f"and the runtime reserve ({need['reserve'] / 2**20:.2f} MiB); raise vram") from None
    cost = planner.cost
    planned = cost.lm_head_bytes + sum(cost.part_bytes(layer.index, kind) for layer in spec.layers
                                       for kind in ("attention", "router", "shared", "dense"))
    excess = held_bytes(model) - planned
    if excess > 0:
        planner = make(max(0.0, budget_bytes - excess))
        notes.append(f"planned within {(budget_bytes - excess) / 2**20:.2f} MiB: the budget less the "
                     f"{excess / 2**20:.2f} MiB by which the model's tensors exceed the planner's sizes")
    plan = planner.plan()
    plan = _with_notes(plan, notes)
    moe_layers = [i for i, m in enumerate(config.moe_layers) if m]
    res = plan.residency
    hot = {layer: tuple(res.hot[row]) for row, layer in enumerate(moe_layers) if res.hot and res.hot[row]}
    return Placement(res.attention, res.router, res.shared, res.dense, res.lm_head, hot,
                     source=f"planned for {machine.name}", plan=plan, notes=plan.notes, builder=planner.builder)


def _with_notes(plan: Plan, notes: list[str]) -> Plan:
    return replace(plan, notes=tuple(notes) + plan.notes)


# ---- a plan file (`hybridmoe plan --json`) -----------------------------------------------------------------------
def load_plan_file(path: str | Path, config: ModelConfig, dtype: torch.dtype,
                   routing: str | Path | RoutingStats | None = None) -> tuple[Placement, float]:
    """The placement a plan file describes, and its budget in bytes. Raises ValueError naming the file when it is
    not a plan or was made for another model (layers, MoE layers, experts, or the sizes of its parts differ)."""
    where = str(path)
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"plan {where}: cannot read it ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("items"), list) or "budget_bytes" not in data:
        raise ValueError(f"plan {where}: not a plan written by `hybridmoe plan --json` (needs 'items' and "
                         "'budget_bytes')")
    spec = ModelSpec(config)
    n = config.num_layers
    moe_layers = [i for i, m in enumerate(config.moe_layers) if m]
    on = {k: [False] * n for k in ("attention", "router", "shared", "dense")}
    lm_head, hot_counts, experts_total = False, {}, 0
    fmt = data.get("dense_format") or spec.dense_format
    try:
        sizes = CostModel(Machine("sizes", reference_profile(FALLBACK_CPU).cpu), spec, data.get("expert_format"),
                          fmt)
    except (ValueError, ProfileError) as e:
        raise ValueError(f"plan {where}: {e}") from None
    plan_model = data.get("model", "?")

    def mismatch(why: str) -> ValueError:
        return ValueError(f"plan {where} was made for another model ({plan_model!r}): {why}; this model has "
                          f"{n} layers ({len(moe_layers)} MoE, {config.moe.num_experts} experts each). Make a plan "
                          "for it with `hybridmoe plan --model DIR --json FILE`")

    for item in data["items"]:
        kind, layer, resident = item.get("kind"), item.get("layer"), bool(item.get("resident"))
        if kind in on:
            if not isinstance(layer, int) or not 0 <= layer < n:
                raise mismatch(f"its item {item.get('name')!r} names layer {layer}")
            expected = sizes.part_bytes(layer, kind)
            if expected <= 0 or not math.isclose(float(item.get("bytes", -1)), expected, rel_tol=1e-6):
                raise mismatch(f"its {item.get('name')!r} holds {item.get('bytes')} bytes, this model's "
                               f"{expected:.0f} ({fmt})")
            on[kind][layer] = resident
        elif kind == "lm_head":
            lm_head = resident
        elif kind == "expert":
            count = int(item.get("bytes", 0) / sizes.expert_bytes) if sizes.expert_bytes else 0
            experts_total += count
            if resident:
                if layer not in moe_layers:
                    raise mismatch(f"its hot experts are in layer {layer}, not an MoE layer")
                hot_counts[layer] = hot_counts.get(layer, 0) + count
    if moe_layers and experts_total != len(moe_layers) * config.moe.num_experts:
        raise mismatch(f"it places {experts_total} routed experts")
    stats = _routing(config, routing)
    listed = {int(k): tuple(v) for k, v in (data.get("hot_experts") or {}).items()}
    hot = {}
    for layer, count in hot_counts.items():
        if layer in listed:
            hot[layer] = listed[layer]
        elif stats is not None:  # the most frequently routed, as the planner picks them
            row = stats.layers.index(layer)
            hot[layer] = tuple(sorted(int(e) for e in (-stats.probs[row]).argsort(kind="stable")[:count]))
        else:  # uniform routing: the planner's tie-break takes the lowest ids
            hot[layer] = tuple(range(count))
    placement = Placement(tuple(on["attention"]), tuple(on["router"]), tuple(on["shared"]), tuple(on["dense"]),
                          lm_head, hot, source=f"plan file {where}", notes=tuple(data.get("notes", ())))
    return placement, float(data["budget_bytes"])


# ---- moving the parts ----------------------------------------------------------------------------------------
def _to_device(obj, accel: Accelerator, name: str):
    """Linear -> DeviceLinear, tensor -> device copy, dataclass -> its fields moved in place; counted under name."""
    if isinstance(obj, Linear):
        return DeviceLinear(obj, accel, name)
    if isinstance(obj, torch.Tensor):
        return accel.to_device(obj, name)
    if isinstance(obj, GatedMLP):
        return GatedMLP(*(DeviceLinear(getattr(obj, f), accel, name) for f in ("gate_proj", "up_proj", "down_proj")))
    if is_dataclass(obj):
        for f in fields(obj):
            value = getattr(obj, f.name)
            if isinstance(value, (Linear, torch.Tensor)):
                setattr(obj, f.name, _to_device(value, accel, name))
        return obj
    raise TypeError(f"cannot place {type(obj).__name__} ({name}) on the accelerator")


def _place_attention(attention, accel: Accelerator, name: str) -> None:
    _to_device(attention.w, accel, name)
    if hasattr(attention, "absorption"):  # MLA: kv_b_proj's per-head products from the device copies, torch's bmm
        attention.absorption = Absorption(attention.w.w_uk_t, attention.w.w_uv, kernels=False)


@dataclass
class DevicePlacement:
    """What the decoder's forward needs to know: where each part runs."""

    accel: Accelerator
    stats: RunStats
    attention: tuple[bool, ...]
    mlp: tuple[bool, ...]  # the layer's MLP half (dense MLP, or MoE block whose router is resident)
    lm_head: bool
    placement: Placement


def place_model(model, placement: Placement, accel: Accelerator, stats: RunStats) -> DevicePlacement:
    """Move the parts `placement` marks resident onto the accelerator (see module docstring); returns what the
    forward needs and sets it as `model.device_placement`."""
    n = model.config.num_layers
    if len(placement.attention) != n:
        raise ValueError(f"placement has {len(placement.attention)} layers, the model {n}")
    mlp_on = []
    for i, layer in enumerate(model.layers):
        if placement.attention[i]:
            _place_attention(layer.attention, accel, f"attention.{i}")
            layer.input_norm = accel.to_device(layer.input_norm, f"attention.{i}")
        block = layer.mlp
        if isinstance(block, MoEBlock):
            if not placement.router[i]:
                mlp_on.append(False)
                continue
            router = block.router
            router.gate = DeviceLinear(router.gate, accel, f"router.{i}")
            if router.correction_bias is not None:
                router.correction_bias = accel.to_device(router.correction_bias, f"router.{i}")
            layer.post_attention_norm = accel.to_device(layer.post_attention_norm, f"router.{i}")
            block.router = TimedOnDevice(router, stats)
            if block.shared is not None and placement.shared[i]:
                block.shared = TimedOnDevice(_to_device(block.shared, accel, f"shared.{i}"), stats)
            hot = tuple(placement.hot.get(i, ()))
            hot_weights = None
            if hot:
                if layer.experts is None:
                    raise ValueError(f"layer {i}: its expert weights were not kept at load; hot experts need them")
                hot_weights = layer.experts.subset(list(hot)).to_device(accel, f"hot experts.{i}")
            block.experts = HybridExpertBackend(block.experts, hot, hot_weights, model.config.moe.num_experts,
                                                accel, stats)
            mlp_on.append(True)
        else:
            if placement.dense[i]:
                layer.mlp = _to_device(block, accel, f"dense.{i}")
                layer.post_attention_norm = accel.to_device(layer.post_attention_norm, f"dense.{i}")
            mlp_on.append(bool(placement.dense[i]))
    if placement.lm_head:
        model.lm_head = DeviceLinear(model.lm_head, accel, "lm_head")
        model.norm = accel.to_device(model.norm, "lm_head")
    result = DevicePlacement(accel, stats, tuple(placement.attention), tuple(mlp_on), placement.lm_head, placement)
    model.device_placement = result
    return result


def _layers(flags) -> str:
    """(True, True, False, True) -> "0-1, 3"; "-" when none."""
    on = [i for i, f in enumerate(flags) if f]
    runs, start = [], None
    for i in on + [None]:
        if start is not None and (i is None or i != prev + 1):
            runs.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = None
        if i is not None and start is None:
            start = i
        prev = i
    return ", ".join(runs) or "-"


def placement_report(placement: Placement, accel: Accelerator) -> str:
    """What `--verbose` prints at load: the plan (when planned here), then what was placed, by kind."""
    from hybridmoe.placement.report import format_plan

    lines = [format_plan(placement.plan), ""] if placement.plan is not None else [f"plan: {placement.source}"]
    lines += [f"placed on the accelerator ({accel.name}, budget "
              f"{accel.ledger.budget / 2**20:.1f} MiB):" if accel.ledger.budget is not None else
              f"placed on the accelerator ({accel.name}, no budget):",
              f"  attention + KV cache: layers {_layers(placement.attention)}",
              f"  routers (and their MoE blocks): layers {_layers(placement.router)}",
              f"  shared experts: layers {_layers(tuple(a and b for a, b in zip(placement.shared, placement.router)))}",
              f"  dense MLP: layers {_layers(placement.dense)}",
              f"  LM head: {'yes' if placement.lm_head else 'no'}"]
    hot = {l: e for l, e in placement.hot.items() if e and placement.router[l]}
    if hot:
        lines.append("  hot experts: " + "; ".join(f"layer {l}: {len(e)} ({', '.join(map(str, e[:8]))}"
                                                   f"{', ...' if len(e) > 8 else ''})" for l, e in sorted(hot.items())))
    held = {}
    for name, nbytes in accel.ledger.held.items():
        held[name.split(".")[0]] = held.get(name.split(".")[0], 0) + nbytes
    lines.append("  bytes: " + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in held.items())
                 + f"; {accel.ledger.total / 2**20:.2f} MiB in all")
    lines.append("  the other routed experts: on the CPU kernels")
    return "\n".join(lines)
