"""Forward passes as lists of schedule units: a decode step and a prefill chunk under each strategy.

`Residency` says which parts sit in accelerator memory. Parts that do not are either computed on the CPU or
streamed to the accelerator before use, whichever the cost model says is faster for that step (the pipelined-
sharding decision, per part and per batch tier).

Prefill strategies (per chunk of C prompt tokens after `offset` earlier ones):
- "cpu":    everything on the CPU;
- "hybrid": attention, router, shared experts and hot experts on the accelerator, the other routed experts on
            the CPU kernels (the chunk's hidden states cross the link twice per MoE layer);
- "slp":    stream-loading: every layer's activated experts are copied to the accelerator in splits of
            `slot_bytes` and computed there, double-buffered (the copy of split i+1 and of the next layer's
            first split overlap compute). When the chunk activates fewer expert bytes than the whole layer,
            only those are copied, but only after the layer's router has run; otherwise the whole layer is
            prefetched during the previous one. The faster of the two is taken. prefetch=False models a
            design that copies a layer only once it reaches it (no overlap with the previous layer).
            With N GPUs (small expert parallelism) each GPU owns 1/N of every layer's experts: it streams and
            computes only those. parallel="experts" (the paper's SmallEP): attention and the dense parts are
            replicated on every GPU and the partial MoE outputs are summed across GPUs; parallel="tokens":
            each GPU also attends for only 1/N of the chunk's queries (data-parallel attention) and tokens
            travel to their experts' GPUs and back; parallel="rank0" (what the engine runs, hybridmoe.parallel):
            GPU 0 runs attention and the dense parts for the whole chunk and sends each other GPU the tokens that
            route to its experts, which send their partial outputs back. GPU<->GPU traffic goes through host memory
            without a peer link.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from hybridmoe.placement.costmodel import ROUTER_FORMAT, CostModel
from hybridmoe.placement.format_sizes import weight_format
from hybridmoe.placement.schedule import Unit

STRATEGIES = ("cpu", "hybrid", "slp")
PARALLEL = ("experts", "tokens", "rank0")  # several GPUs: split only the experts, the tokens too, or GPU 0 as hub
GiB = 1024**3


@dataclass(frozen=True)
class Residency:
    attention: tuple[bool, ...]  # per decoder layer
    router: tuple[bool, ...]
    shared: tuple[bool, ...]
    dense: tuple[bool, ...]
    lm_head: bool
    hot: tuple[tuple[int, ...], ...] = ()  # per MoE layer (in order): pinned expert ids

    @classmethod
    def none(cls, num_layers: int, moe_rows: int = 0) -> "Residency":
        off = (False,) * num_layers
        return cls(off, off, off, off, False, ((),) * moe_rows)

    @classmethod
    def all_but_experts(cls, num_layers: int, moe_rows: int = 0) -> "Residency":
        on = (True,) * num_layers
        return cls(on, on, on, on, True, ((),) * moe_rows)

    def hot_mask(self, row: int, num_experts: int) -> np.ndarray:
        mask = np.zeros(num_experts, dtype=bool)
        if self.hot:
            mask[list(self.hot[row])] = True
        return mask


def default_slot_bytes(cost: CostModel) -> float:
    """One streaming slot: a whole layer's experts, at most 1 GiB (but at least one expert)."""
    layer = max((cost.layer_expert_bytes(l.index) for l in cost.spec.moe_layers), default=0.0)
    return min(layer, max(cost.expert_bytes, 1.0 * GiB))


class PassBuilder:
    """Builds the units of decode steps and prefill chunks for one cost model and residency."""

    def __init__(self, cost: CostModel, residency: Residency):
        self.cost, self.res, self.spec = cost, residency, cost.spec
        self._moe_cache: dict[tuple, list[Unit]] = {}  # MoE units do not depend on the chunk's offset
        self._attention_cache: dict[tuple, tuple[Unit, str]] = {}

    # ---- pieces ----------------------------------------------------------------------------------------
    def _offloaded(self, name: str, layer: int, nbytes: float, gpu_s: float, cpu_s: float,
                   tokens: float) -> tuple[Unit, str]:
        """A part not resident on the accelerator: computed on the CPU or streamed, whichever is faster."""
        c = self.cost
        if c.gpu is None:
            return Unit(name, layer, cpu_s=cpu_s), "cpu"
        move = c.d2h_s(c.activations_bytes(tokens)) + c.h2d_s(c.activations_bytes(tokens))
        copy = c.h2d_s(nbytes)
        if max(copy, gpu_s) < cpu_s + move:
            return Unit(name, layer, gpu_s=gpu_s, copy_s=copy, copy_bytes=nbytes), "stream"
        return Unit(name, layer, cpu_s=cpu_s, handoff_s=move), "cpu"

    def attention_unit(self, layer: int, queries: int, context: int, sequences: int, on_cpu: bool,
                       share: float = 1.0) -> tuple[Unit, str]:
        """Every layer's attention half has the same shape: cost it once per residency and step."""
        c = self.cost
        gpu = not on_cpu and c.gpu is not None
        resident = gpu and self.res.attention[layer]
        key = (queries, context, sequences, gpu, resident, share)
        if key not in self._attention_cache:
            cpu_s = c.cpu_attention_s(queries, context, sequences) if not resident else 0.0
            gpu_s = c.gpu_attention_s(queries, context, sequences) * share if gpu else 0.0
            if not gpu:
                self._attention_cache[key] = (Unit("attention", 0, cpu_s=cpu_s), "cpu")
            elif resident:
                self._attention_cache[key] = (Unit("attention", 0, gpu_s=gpu_s), "gpu")
            else:
                self._attention_cache[key] = self._offloaded("attention", 0, c.part_bytes(layer, "attention"), gpu_s,
                                                             cpu_s, queries * sequences)
        unit, where = self._attention_cache[key]
        return replace(unit, layer=layer), where

    def _dense_part_s(self, layer: int, part: str, tokens: float, on_gpu: bool) -> float:
        c = self.cost
        if not on_gpu:
            return c.cpu_part_s(layer, part, tokens)
        shape = self.spec.layers[layer]
        weights = {"router": shape.router, "shared": shape.shared_experts, "dense": shape.dense_mlp}[part]
        return c.gpu_matmul_s(weights, tokens, c.dense_fmt if part != "router" else weight_format(ROUTER_FORMAT))

    def _host_units(self, kind: str, layer: int | None, tokens: float) -> list[Unit]:
        """The engine's own host cost of a step or a layer run on the CPU, where the profile measured it."""
        seconds = self.cost.cpu_host_s(kind, layer, tokens)
        return [Unit("host", -1 if layer is None else layer, cpu_s=seconds)] if seconds else []

    # ---- decode ----------------------------------------------------------------------------------------
    def decode_units(self, batch: int, context: int, experts_on: str = "cpu") -> tuple[list[Unit], dict]:
        """One decode step of `batch` sequences at `context` cached tokens each."""
        c, spec, res = self.cost, self.spec, self.res
        units: list[Unit] = []
        where: dict[str, str] = {}
        gpu = c.gpu is not None
        if gpu:
            units.append(Unit("embed", -1, handoff_s=c.h2d_s(c.activations_bytes(batch))))
        else:
            units += self._host_units("decode", None, batch)
        for shape in spec.layers:
            l = shape.index
            if not gpu:
                units += self._host_units("decode", l, batch)
            unit, where[f"attention.{l}"] = self.attention_unit(l, 1, context, batch, on_cpu=not gpu)
            units.append(unit)
            if not shape.is_moe:
                cpu_s = self._dense_part_s(l, "dense", batch, False)
                if gpu and res.dense[l]:
                    units.append(Unit("dense", l, gpu_s=self._dense_part_s(l, "dense", batch, True)))
                    where[f"dense.{l}"] = "gpu"
                elif gpu:
                    unit, where[f"dense.{l}"] = self._offloaded(
                        "dense", l, c.part_bytes(l, "dense"), self._dense_part_s(l, "dense", batch, True),
                        cpu_s, batch)
                    units.append(unit)
                else:
                    units.append(Unit("dense", l, cpu_s=cpu_s))
                continue
            units.extend(self._moe_decode_units(shape, batch, experts_on, where))
        units.append(self._lm_head_unit(batch))
        return units, where

    def _moe_decode_units(self, shape, batch: int, experts_on: str, where: dict[str, str]) -> list[Unit]:
        c, res = self.cost, self.res
        l, row = shape.index, c.row_of_layer[shape.index]
        gpu = c.gpu is not None
        hot = res.hot_mask(row, shape.num_experts) if gpu else np.zeros(shape.num_experts, dtype=bool)
        gpu_s = cpu_s = 0.0
        for part in ("router", "shared"):
            if c.part_bytes(l, part) == 0:
                continue
            resident = gpu and (res.router[l] if part == "router" else res.shared[l])
            if resident:
                gpu_s += self._dense_part_s(l, part, batch, True)
            else:
                cpu_s += self._dense_part_s(l, part, batch, False)
            where[f"{part}.{l}"] = "gpu" if resident else "cpu"
        pairs = batch * self.spec.top_k
        hot_share = c.routed_fraction(l, hot) if hot.any() else 0.0
        gpu_s += c.gpu_experts_s(c.distinct_experts(l, batch, exclude=~hot), pairs * hot_share) if hot.any() else 0.0
        cold = c.distinct_experts(l, batch, exclude=hot)
        if experts_on == "stream" and gpu:
            nbytes = cold * c.expert_bytes
            where[f"experts.{l}"] = "stream"
            return [Unit("moe", l, gpu_s=gpu_s + c.gpu_experts_s(cold, pairs * (1 - hot_share)),
                         cpu_s=cpu_s, copy_s=c.h2d_s(nbytes), copy_bytes=nbytes)]
        cpu_s += c.cpu_experts_s(cold, pairs * (1 - hot_share))
        where[f"experts.{l}"] = "cpu" if cold > 1e-9 else "gpu"
        move = c.d2h_s(c.activations_bytes(batch)) + c.h2d_s(c.activations_bytes(batch)) if gpu and cpu_s else 0.0
        return [Unit("moe", l, gpu_s=gpu_s, cpu_s=cpu_s, handoff_s=move)]

    def _lm_head_unit(self, tokens: int) -> Unit:
        c = self.cost
        weights = self.spec.lm_head or self.spec.embedding
        if c.gpu is not None and self.res.lm_head:
            return Unit("lm_head", len(self.spec.layers), gpu_s=c.gpu_matmul_s(weights, tokens, c.dense_fmt))
        return Unit("lm_head", len(self.spec.layers), cpu_s=c.cpu_part_s(0, "lm_head", tokens))

    # ---- prefill ---------------------------------------------------------------------------------------
    def prefill_units(self, strategy: str, chunk: int, offset: int, last: bool, gpus: int = 1,
                      slot_bytes: float | None = None, activated_only: bool = False,
                      parallel: str = "tokens", prefetch: bool = True) -> list[Unit]:
        """Units of one prefill chunk of `chunk` tokens after `offset` earlier prompt tokens, as seen by one
        of `gpus` GPUs (see module docstring for `parallel`)."""
        if parallel not in PARALLEL:
            raise ValueError(f"parallel must be one of {', '.join(PARALLEL)}, got {parallel!r}")
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown prefill strategy {strategy!r}; one of {', '.join(STRATEGIES)}")
        c, spec = self.cost, self.spec
        if strategy != "cpu" and c.gpu is None:
            raise ValueError(f"strategy {strategy!r} needs an accelerator; machine {c.machine.name} has none")
        on_cpu = strategy == "cpu"
        share = 1.0 / gpus if parallel == "tokens" else 1.0
        units = (self._host_units("prefill", None, chunk) if on_cpu else
                 [Unit("embed", -1, handoff_s=c.h2d_s(c.activations_bytes(chunk)))])
        slot = slot_bytes or default_slot_bytes(c)
        for shape in spec.layers:
            l = shape.index
            if on_cpu:
                units += self._host_units("prefill", l, chunk)
            units.append(self.attention_unit(l, chunk, offset, 1, on_cpu, share)[0])
            if not shape.is_moe:
                units.append(self._dense_prefill_unit(l, chunk, on_cpu, share))
            else:
                key = (l, strategy, chunk, gpus, slot, activated_only, parallel, prefetch)
                if key not in self._moe_cache:
                    self._moe_cache[key] = (
                        self._slp_moe_units(shape, chunk, gpus, slot, activated_only, parallel, prefetch)
                        if strategy == "slp" else [self._local_moe_unit(shape, chunk, on_cpu)])
                units.extend(self._moe_cache[key])
        if last:
            units.append(self._lm_head_unit(1))
        return units

    def _dense_prefill_unit(self, l: int, chunk: int, on_cpu: bool, share: float) -> Unit:
        c = self.cost
        cpu_s = self._dense_part_s(l, "dense", chunk, False)
        if on_cpu:
            return Unit("dense", l, cpu_s=cpu_s)
        gpu_s = self._dense_part_s(l, "dense", chunk * share, True)
        if self.res.dense[l]:
            return Unit("dense", l, gpu_s=gpu_s)
        return self._offloaded("dense", l, c.part_bytes(l, "dense"), gpu_s, cpu_s, chunk)[0]

    def _local_moe_unit(self, shape, chunk: int, on_cpu: bool) -> Unit:
        """MoE half of a chunk for the cpu and hybrid strategies (routed experts on the CPU kernels)."""
        c, res, l = self.cost, self.res, shape.index
        hot = np.zeros(shape.num_experts, dtype=bool) if on_cpu else res.hot_mask(c.row_of_layer[l], shape.num_experts)
        pairs = chunk * self.spec.top_k
        gpu_s = cpu_s = 0.0
        for part in ("router", "shared"):
            if not on_cpu and (res.router[l] if part == "router" else res.shared[l]):
                gpu_s += self._dense_part_s(l, part, chunk, True)
            else:
                cpu_s += self._dense_part_s(l, part, chunk, False)
        hot_share = c.routed_fraction(l, hot) if hot.any() else 0.0
        if hot.any():
            gpu_s += c.gpu_experts_s(c.distinct_experts(l, chunk, exclude=~hot), pairs * hot_share)
        cpu_s += c.cpu_experts_s(c.distinct_experts(l, chunk, exclude=hot), pairs * (1 - hot_share))
        move = 0.0 if on_cpu or not cpu_s else c.d2h_s(c.activations_bytes(chunk)) + c.h2d_s(c.activations_bytes(chunk))
        return Unit("moe", l, gpu_s=gpu_s, cpu_s=cpu_s, handoff_s=move)

    def _slp_moe_units(self, shape, chunk: int, gpus: int, slot: float, activated_only: bool,
                       parallel: str, prefetch: bool) -> list[Unit]:
        """Router and shared experts, then this GPU's share of the layer's experts in streamed splits."""
        c, res, l = self.cost, self.res, shape.index
        local_tokens = chunk / gpus if parallel == "tokens" else chunk
        units = []
        gpu_s = 0.0
        for part in ("router", "shared"):
            resident = res.router[l] if part == "router" else res.shared[l]
            seconds = self._dense_part_s(l, part, local_tokens, True)
            if resident:
                gpu_s += seconds
            else:
                nbytes = c.part_bytes(l, part)
                units.append(Unit(part, l, gpu_s=seconds, copy_s=c.h2d_s(nbytes), copy_bytes=nbytes))
        units.insert(0, Unit("router+shared", l, gpu_s=gpu_s))
        activated = c.distinct_experts(l, chunk)
        experts = (activated if activated_only else shape.num_experts) / gpus
        pairs = chunk * self.spec.top_k / gpus
        dispatch, combine = self._exchange_s(chunk, gpus, parallel)
        if dispatch:
            units.append(Unit("dispatch", l, handoff_s=dispatch))
        per_split = max(1, int(slot // c.expert_bytes))
        full, rest = divmod(experts, per_split)
        groups = [(per_split, int(full)), (rest, 1)] if rest > 1e-9 else [(per_split, int(full))]
        wait = activated_only or not prefetch  # the first split's copy waits for this layer's router
        if wait and groups[0][1] > 1:
            groups = [(per_split, 1), (per_split, groups[0][1] - 1)] + groups[1:]
        first = True
        for n, count in groups:
            if count < 1:
                continue
            nbytes = n * c.expert_bytes
            active = n if activated_only else n * activated / shape.num_experts
            units.append(Unit("experts", l, gpu_s=c.gpu_experts_s(active, pairs * n / experts),
                              copy_s=c.h2d_s(nbytes), copy_bytes=nbytes, copy_waits=first and wait,
                              repeat=count))
            first = False
        if combine:
            units.append(Unit("combine", l, handoff_s=combine))
        return units

    def _exchange_s(self, chunk: int, gpus: int, parallel: str) -> tuple[float, float]:
        """Per-layer traffic between GPUs (dispatch before the experts, combine after).
        "experts": every GPU holds every token; the partial MoE outputs are summed (all-reduce, each GPU
        moves 2(N-1)/N of the chunk's hidden states). "tokens": each GPU sends its tokens to the GPUs that own
        one of their experts and gets the results back (a token needs a given other GPU with probability
        1 - (1 - 1/N)^K). "rank0": GPU 0 holds every token and sends each of the N-1 others the tokens that need
        it, over its one link, and receives as many partial outputs back (the engine's exchange,
        hybridmoe/parallel/exchange.py; the expert ids and weights sent with each token are left out: 8K bytes
        against 2H)."""
        if gpus <= 1:
            return 0.0, 0.0
        c = self.cost
        if parallel == "experts":
            return 0.0, c.gpu_to_gpu_s(c.activations_bytes(chunk) * 2 * (gpus - 1) / gpus)
        needs = 1.0 - (1.0 - 1.0 / gpus) ** self.spec.top_k
        if parallel == "rank0":
            volume = c.activations_bytes(chunk) * (gpus - 1) * needs
            return c.gpu_to_gpu_s(volume), c.gpu_to_gpu_s(volume)
        volume = c.activations_bytes(chunk / gpus) * (gpus - 1) * needs
        return c.gpu_to_gpu_s(volume), c.gpu_to_gpu_s(volume)

