"""Stream-loading prefill (SLP): a large prompt chunk's routed experts run on the accelerator, streamed in per layer.

Prefill of a long chunk is compute-bound, and the CPU is too slow for it; the experts do not fit in accelerator
memory. So each MoE layer's routed experts are copied from host memory into two device slots of bounded size and
computed there as grouped matmuls over the chunk's tokens (`TorchExpertBackend` over a slot), while the next copy
runs on a copy stream (docs/hybrid.md, "Stream-loading prefill").

The experts travel in their stored format: FP8 bytes with their 128x128 block scales, int4/int8 codes with their
group scales, or bf16/fp16/fp32, the same bytes the CPU kernels read; they are dequantised on the device one expert
at a time as the grouped matmul reaches it (accel.dequant). Host memory is pageable (the memory-mapped checkpoint),
so copies go through bounded page-locked staging (`staging.HostStaging`).

Slots and splits: a slot holds n = max(1, slot_bytes // stride) experts (default slot_bytes: 1 GiB, the planner's
default slot; at most the largest layer's count). A layer's experts (all, or the chunk's activated ones) are cut
into consecutive splits of n; with MoE layers numbered 0..L-1 in model order, the pass streams the flat sequence
of (layer, split) units, and unit u uses slot u % 2. A layer that fits one slot is one unit (the whole layer). This
is the planner's model (placement/passes.py, `_slp_moe_units`: splits of `slot_bytes`, double-buffered;
placement/estimate.py `stream_slots`).

The schedule:
- each unit's copy waits (on the copy stream, an event) only for the compute that last read its slot, that of unit
  u - 2, and is issued as soon as that compute is issued; each unit's compute waits only for its own copy event,
  and computes the assignments whose expert is in the split, accumulated into the layer's output on the device.
- copy "all" (whole layers, prefetched): when a chunk reaches the first MoE layer every layer is queued; units 0
  and 1 are issued, then unit u + 2 right after unit u's compute is issued. So split i + 1's copy overlaps split
  i's compute, and the next layer's first split overlaps the current layer's last split (and the next layer's
  attention).
- copy "activated": which experts a layer needs is known only once its router has run, just before its MoE;
  so the layer's activated experts are queued (in splits) then, and its first copy overlaps the layer's shared
  experts, not the previous layer. It moves fewer bytes but gives up the prefetch across layers: it pays when a
  chunk activates clearly fewer experts than the layer has (short chunks, many experts). The planner models
  exactly these two variants (`_slp_moe_units`: the activated variant's first copy waits for the router;
  placement/estimate.py tries both).
- a callable `copy(tokens) -> "all" | "activated"` picks per chunk; `planned_copy` asks the planner.
A chunk's first MoE layer is not prefetched during the previous chunk (nothing here knows that another large
chunk follows); the planner assumes it is, which costs it one unit's copy per chunk of optimism.

On CUDA the copies are issued from a copy thread (host memcpy into staging, then async copies on the copy stream),
so that the host keeps issuing the layers' compute meanwhile. On the CPU stand-in the copy thread runs each copy
to completion before `load` returns (streams degrade to synchronous calls), so the trace is deterministic; with
overlap=True the stand-in's copies run on the copy thread while the caller computes, and each compute waits for its
own layer's copy to finish (how `bench costmodel` measures the overlapped schedule on the stand-in).

`ExpertStreamer` is the mechanism over any list of per-layer `ExpertWeights`; a streamer built over
`ExpertWeights.subset(owned)` of every layer streams and computes only those experts (expert parallelism: each
rank its share; topk ids are then indices into the subset). `StreamPrefill` attaches one to a model's MoE blocks
(`MoEBlock.prefill_experts`).

Legend: T tokens, H hidden, K top-k, E experts of a layer, n experts in a slot, A assignments in a split.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from hybridmoe.accel.accelerator import Accelerator, Event
from hybridmoe.layers.moe.backend import ExpertWeights
from hybridmoe.layers.moe.block import MoEBlock
from hybridmoe.layers.moe.staging import DEFAULT_STAGING_BYTES, HostStaging, Piece
from hybridmoe.layers.moe.torch_backend import TorchExpertBackend

ALIGN = 256  # byte alignment of each tensor in a slot
DEFAULT_SLOT_BYTES = 1 << 30  # a slot holds at most 1 GiB of experts: the planner's (placement/passes.py,
# default_slot_bytes: a whole layer's experts, at most 1 GiB, at least one expert)
COPY_MODES = ("all", "activated")


@dataclass(frozen=True)
class ExpertLayout:
    """Where one expert's tensors (ExpertWeights.expert_tensors order) sit in a slot: the expert at position p
    starts at p * stride; each tensor at its aligned offset within."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    offsets: tuple[int, ...]
    stride: int

    @classmethod
    def of(cls, weights: ExpertWeights) -> "ExpertLayout":
        tensors = weights.expert_tensors(0)
        offsets, at = [], 0
        for t in tensors:
            offsets.append(at)
            at += -(-t.nbytes // ALIGN) * ALIGN
        return cls(tuple(tuple(t.shape) for t in tensors), tuple(t.dtype for t in tensors), tuple(offsets), at)

    def check(self, weights: ExpertWeights, what: str) -> None:
        for e in range(weights.num_experts):
            tensors = weights.expert_tensors(e)
            if tuple(tuple(t.shape) for t in tensors) != self.shapes or tuple(t.dtype for t in tensors) != self.dtypes:
                raise ValueError(f"{what}: expert {e}'s tensors differ in shape or dtype from the first layer's "
                                 f"expert 0 ({self.shapes}, {self.dtypes}); one slot layout cannot hold both")

    def views(self, slot: torch.Tensor, position: int) -> list[torch.Tensor]:
        base = position * self.stride
        out = []
        for shape, dtype, offset in zip(self.shapes, self.dtypes, self.offsets):
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            out.append(slot[base + offset:base + offset + nbytes].view(dtype).view(shape))
        return out


@dataclass
class StreamStats:
    """What streaming moved and how fast (for the engine's metrics)."""

    passes: int = 0  # forward passes (prefill chunks) that streamed
    bytes: int = 0  # expert bytes copied to the accelerator, all passes
    copy_s: float = 0.0  # time the copies took, summed per layer (from the copy's start on its stream to its end)
    last_pass_bytes: int = 0
    last_pass_copy_s: float = 0.0
    layers_copied: int = 0
    splits_copied: int = 0  # copies into a slot (a layer larger than a slot takes several)
    staging: str = "pinned"  # "pinned" | "pageable" (page-locking failed)
    pinned_bytes: int = 0  # page-locked host staging held
    slot_bytes: int = 0  # device bytes of each of the two slots
    experts_per_slot: int = 0

    @property
    def copy_gbs(self) -> float:
        """Achieved copy bandwidth, GB/s (1e9), over all passes."""
        return self.bytes / self.copy_s / 1e9 if self.copy_s > 0 else 0.0

    @property
    def last_pass_gbs(self) -> float:
        return self.last_pass_bytes / self.last_pass_copy_s / 1e9 if self.last_pass_copy_s > 0 else 0.0


@dataclass
class _Unit:
    """One split of a layer: up to a slot's worth of the layer's experts, copied into one slot and computed there."""

    index: int  # in the pass's flat order of units: it uses slot index % slots
    layer: int
    split: int
    splits: int  # how many splits its layer has
    experts: list[int]  # the layer's expert ids (indices into its ExpertWeights) in slot-position order
    whole: bool  # the layer's experts 0..E-1, all of them: topk ids are already slot positions
    copied: Future | None = None  # -> the copy-done Event, once the copy is issued

    @property
    def name(self) -> str:
        return f"layer {self.layer}" if self.splits == 1 else f"layer {self.layer} split {self.split}"


@dataclass
class _Slot:
    buffer: torch.Tensor  # uint8 [capacity * stride] on the accelerator
    weights: ExpertWeights  # views into buffer, one per position
    unit: _Unit | None = None  # the unit it holds (or is receiving) until that unit is computed
    free: Event | None = None  # the compute that last read the slot


@dataclass
class _Timing:
    nbytes: int
    first: bool  # the first split of its layer (counts the layer as copied)
    seconds: float | None = None
    events: tuple | None = None  # CUDA (start, end) timing events until resolved
    pass_index: int = 0


class ExpertStreamer:
    """Streams per-layer experts through accelerator slots of bounded size and computes them there (module
    docstring).

    layers: one ExpertWeights per MoE layer, in the order `load`/`run` number them (every layer's experts must
    share shapes and dtypes); each may be a subset (`ExpertWeights.subset`) of a layer's experts: ids given to
    `load` and `run` are then indices into that subset. slot_bytes (default DEFAULT_SLOT_BYTES, the planner's
    slot) bounds each slot: it holds `capacity` = max(1, slot_bytes // layout.stride) experts, at most the largest
    layer's count; a layer with more experts (or more activated ones) is streamed as consecutive splits of that
    many. The slots are allocated at once on `accel`, in its ledger under `{name}.slot0/1`; `DeviceMemoryError`
    when over budget. overlap (default: on CUDA only) runs the copies on the copy thread while the caller goes on.

    load(layer, experts) queues the layer's splits as the next units of the pass; a unit's copy is issued as soon
    as its slot (unit index % slots) is no longer held by an earlier unit, i.e. once the compute of the unit
    `slots` earlier has been issued. run(layer, ...) computes the layer's splits in turn (the layer must be the
    next one queued) and issues the following units' copies as their slots free up.
    """

    def __init__(self, layers: list[ExpertWeights], accel: Accelerator, staging_bytes: int = DEFAULT_STAGING_BYTES,
                 name: str = "slp", slots: int = 2, overlap: bool | None = None, slot_bytes: int | None = None):
        if not layers:
            raise ValueError("ExpertStreamer needs at least one layer of experts")
        if slots < 2:
            raise ValueError(f"ExpertStreamer needs at least two slots, got {slots}")
        self.layers, self.accel, self.name = layers, accel, name
        self.overlap = accel.is_cuda if overlap is None else overlap  # copies run while the caller computes
        self.layout = ExpertLayout.of(layers[0])
        for l, w in enumerate(layers):
            self.layout.check(w, f"{name} layer {l}")
        wanted = int(slot_bytes if slot_bytes is not None else DEFAULT_SLOT_BYTES)
        largest = max(w.num_experts for w in layers)
        self.capacity = max(1, min(largest, wanted // self.layout.stride))  # experts per slot
        self.slots: list[_Slot] = []
        for i in range(slots):
            buffer = accel.empty((self.capacity * self.layout.stride,), torch.uint8, f"{name}.slot{i}")
            views = [self.layout.views(buffer, p) for p in range(self.capacity)]
            columns = list(zip(*views))  # per tensor kind: one view per position
            scales = [list(c) for c in columns[3:6]] if len(columns) > 3 else [None, None, None]
            weights = ExpertWeights(layers[0].fmt, list(columns[0]), list(columns[1]), list(columns[2]), *scales,
                                    block_size=layers[0].block_size)
            self.slots.append(_Slot(buffer, weights))
        self.staging = HostStaging(accel, staging_bytes)
        self.copies = accel.new_stream("copy")
        self._worker = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-copy")
        self._queue: deque[_Unit] = deque()  # units loaded and not yet computed, in stream order
        self._count = 0  # units loaded in this pass
        self._timings: list[_Timing] = []  # appended on the copy thread
        self._lock = threading.Lock()
        self._stats = StreamStats(staging=self.staging.mode, pinned_bytes=self.staging.pinned_bytes,
                                  slot_bytes=self.slots[0].buffer.nbytes, experts_per_slot=self.capacity)

    # --- the schedule's two calls ----------------------------------------------------------------------------
    def load(self, layer: int, experts: list[int] | None = None) -> None:
        """Queue `layer`'s experts (all, or the listed ids in that order) as the pass's next units, one per split
        of at most `capacity` experts, and issue the copies whose slots are free; each copy waits (on the copy
        stream) for the compute that last read its slot."""
        if any(unit.layer == layer for unit in self._queue):
            raise RuntimeError(f"{self.name}: layer {layer} is already loaded and not yet computed")
        count = self.layers[layer].num_experts
        ids = list(range(count)) if experts is None else [int(e) for e in experts]
        if any(not 0 <= e < count for e in ids):
            raise ValueError(f"{self.name}: layer {layer} has experts 0..{count - 1}, asked for {ids}")
        n = self.capacity
        groups = [ids[i:i + n] for i in range(0, len(ids), n)] or [[]]
        for split, group in enumerate(groups):
            whole = len(groups) == 1 and group == list(range(count))
            self._queue.append(_Unit(self._count, layer, split, len(groups), group, whole))
            self._count += 1
        self._issue()

    def run(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """hidden [T, H], topk_ids [T, K] (ids of `layer`'s experts), topk_weights [T, K] -> [T, H] on hidden's
        device: per split of the layer, on the compute stream after that split's copy event, the grouped matmul
        over the assignments whose expert is in the split, accumulated into the layer's output on the device."""
        units = []
        for unit in self._queue:
            if unit.layer != layer:
                break
            units.append(unit)
        if not units:
            queued = f" (the next loaded is layer {self._queue[0].layer})" if self._queue else ""
            raise RuntimeError(f"{self.name}: layer {layer} was not loaded{queued}")
        compute, device = self.accel.compute, self.accel.device
        x = hidden.to(device, non_blocking=True)  # [T, H]
        ids = topk_ids.to(device, non_blocking=True)
        weights = topk_weights.to(device, non_blocking=True)
        out = None
        for unit in units:
            self._issue()
            slot = self.slots[unit.index % len(self.slots)]
            compute.wait(unit.copied.result())
            self.accel.mark_compute(f"{unit.name} experts")
            out = self._compute(unit, slot, x, ids, weights, out)
            slot.free = compute.record(f"{unit.name} computed")
            slot.unit = None
            self._queue.popleft()
            self._issue()  # the next units' copies into the slot just read (prefetch)
        return out.to(hidden.device, non_blocking=True)

    def _compute(self, unit: _Unit, slot: _Slot, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 out: torch.Tensor | None) -> torch.Tensor:
        n = len(unit.experts)
        experts = slot.weights if n == self.capacity else slot.weights.subset(list(range(n)))
        if unit.whole:  # one split with the whole layer: the ids are the positions
            backend = TorchExpertBackend(experts)
            return backend.wait(backend.submit(x, ids, weights))
        if out is None:
            out = torch.zeros(x.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
        if n == 0:
            return out
        lookup = torch.full((self.layers[unit.layer].num_experts,), -1, dtype=torch.long, device=x.device)
        lookup[torch.tensor(unit.experts, dtype=torch.long, device=x.device)] = torch.arange(n, device=x.device)
        position = lookup[ids]  # [T, K] positions in the slot, -1 for experts of other splits
        token_of, k = (position >= 0).nonzero(as_tuple=True)  # [A], [A]: the split's assignments
        if token_of.numel():
            backend = TorchExpertBackend(experts)
            part = backend.wait(backend.submit(x[token_of], position[token_of, k][:, None],
                                               weights[token_of, k][:, None]))  # [A, H]
            out.index_add_(0, token_of, part.to(out.dtype))
        return out

    def _issue(self) -> None:
        """Issue, in stream order, the queued units' copies whose slots no earlier unit holds."""
        for unit in self._queue:
            if unit.copied is not None:
                continue
            index = unit.index % len(self.slots)
            slot = self.slots[index]
            if slot.unit is not None:
                break
            slot.unit = unit
            unit.copied = self._worker.submit(self._copy, unit, index, slot.free)
            if not self.overlap:
                unit.copied.result()  # the stand-in: the copy is done when it is issued

    # --- passes and stats ------------------------------------------------------------------------------------
    def begin_pass(self) -> None:
        """A new forward pass starts streaming from its first layer: what an interrupted pass left in flight is
        drained, and the per-pass stats start over."""
        self._drop_queue()
        self._resolve()
        self._stats.passes += 1
        self._stats.last_pass_bytes, self._stats.last_pass_copy_s = 0, 0.0

    def drain(self) -> None:
        """Block the host until every copy issued so far has landed (measurements that time compute alone)."""
        for unit in list(self._queue):
            if unit.copied is not None:
                unit.copied.result().synchronize()

    def stats(self) -> StreamStats:
        """A snapshot (on CUDA this waits for the copies issued so far, to read their timings)."""
        for unit in list(self._queue):
            if unit.copied is not None:
                unit.copied.result()
        self._resolve()
        return StreamStats(**{k: getattr(self._stats, k) for k in self._stats.__dataclass_fields__})

    def close(self) -> None:
        """Finish the copies in flight, stop the copy thread and give the slots' memory back to the ledger."""
        self._worker.shutdown(wait=True)
        self._queue.clear()
        for i in range(len(self.slots)):
            self.accel.release(f"{self.name}.slot{i}")
        self.slots = []

    def _drop_queue(self) -> None:
        for unit in self._queue:
            if unit.copied is not None:
                unit.copied.result()
        self._queue.clear()
        for slot in self.slots:
            slot.unit = None  # (slot.free stays: the next copy into it still waits for that compute)
        self._count = 0

    # --- on the copy thread ----------------------------------------------------------------------------------
    def _copy(self, unit: _Unit, slot_index: int, free: Event | None) -> Event:
        w, slot = self.layers[unit.layer], self.slots[slot_index]
        stride, offsets = self.layout.stride, self.layout.offsets
        pieces = [Piece(position * stride + offset, t) for position, e in enumerate(unit.experts)
                  for offset, t in zip(offsets, w.expert_tensors(e))]
        nbytes = sum(p.src.nbytes for p in pieces)
        if free is not None:
            self.copies.wait(free)
        timing = _Timing(nbytes, unit.split == 0, pass_index=self._stats.passes)
        if self.copies.native is not None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(self.copies.native)
        else:
            began = time.perf_counter()
        used = len(unit.experts) * stride
        self.staging.copy(self.copies, slot.buffer[:used], pieces, f"{unit.name} -> slot {slot_index}")
        done = self.copies.record(f"{unit.name} copied")
        if self.copies.native is not None:
            end.record(self.copies.native)
            timing.events = (start, end)
        else:
            timing.seconds = time.perf_counter() - began
        with self._lock:
            self._timings.append(timing)
        return done

    def _resolve(self) -> None:
        """Fold finished copies' timings into the stats."""
        s = self._stats
        with self._lock:
            timings, self._timings = self._timings, []
        for timing in timings:
            if timing.seconds is None:
                start, end = timing.events
                end.synchronize()
                timing.seconds = start.elapsed_time(end) / 1e3
            s.bytes += timing.nbytes
            s.copy_s += timing.seconds
            s.layers_copied += timing.first
            s.splits_copied += 1
            if timing.pass_index == s.passes:
                s.last_pass_bytes += timing.nbytes
                s.last_pass_copy_s += timing.seconds


class StreamedLayer:
    """The ExpertBackend a MoE block uses for prefill chunks (`MoEBlock.prefill_experts`): its layer of a
    `StreamPrefill`. submit() issues the copy of the activated experts (copy "activated"), wait() the compute."""

    def __init__(self, owner: "StreamPrefill", layer: int):
        self.owner, self.layer = owner, layer

    def submit(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
        return self.owner._submit(self.layer, hidden, topk_ids, topk_weights)

    def wait(self, handle) -> torch.Tensor:
        return self.owner._wait(self.layer, handle)


CopyChoice = str | Callable[[int], str]  # "all" | "activated", or chunk tokens -> one of them


class StreamPrefill:
    """Stream-loading prefill attached to a model: every MoE block runs chunks of at least `min_tokens` tokens
    through an `ExpertStreamer` over its layer's experts as loaded.

    copy: "all" (whole layers, prefetched as slots free up), "activated" (each layer's activated experts, once
    routed), or a callable of the chunk's token count returning one of them (`planned_copy`: the planner's
    choice). slot_bytes bounds each of the two slots (ExpertStreamer; `fitting_slot_bytes` for a budget). `stats()` reports bytes streamed per prefill and the achieved copy bandwidth; `detach()` restores
    the blocks and frees the slots.
    """

    def __init__(self, model, accel: Accelerator, min_tokens: int = 1, copy: CopyChoice = "all",
                 staging_bytes: int = DEFAULT_STAGING_BYTES, name: str = "slp", overlap: bool | None = None,
                 slot_bytes: int | None = None):
        if not callable(copy) and copy not in COPY_MODES:
            raise ValueError(f"copy must be one of {', '.join(COPY_MODES)} or a callable, got {copy!r}")
        if min_tokens < 1:
            raise ValueError(f"min_tokens must be >= 1, got {min_tokens}")
        self.blocks = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoEBlock)]
        if not self.blocks:
            raise ValueError("the model has no MoE layer: nothing to stream")
        self.streamer = ExpertStreamer([expert_weights_of(b) for b in self.blocks], accel, staging_bytes, name,
                                       overlap=overlap, slot_bytes=slot_bytes)
        self.copy, self.min_tokens = copy, min_tokens
        self.mode: str | None = None  # the current pass's copy mode
        for index, block in enumerate(self.blocks):
            block.prefill_experts, block.prefill_min_tokens = StreamedLayer(self, index), min_tokens

    def stats(self) -> StreamStats:
        return self.streamer.stats()

    def detach(self) -> None:
        for block in self.blocks:
            block.prefill_experts = None
        self.streamer.close()

    def _submit(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
        streamer = self.streamer
        if layer == 0:
            self.mode = self.copy(hidden.shape[0]) if callable(self.copy) else self.copy
            if self.mode not in COPY_MODES:
                raise ValueError(f"the copy choice returned {self.mode!r}, not one of {', '.join(COPY_MODES)}")
            streamer.begin_pass()
            if self.mode == "all":  # every layer queued: each copy is issued as soon as its slot is free
                for ahead in range(len(self.blocks)):
                    streamer.load(ahead)
        if self.mode == "activated":
            streamer.load(layer, torch.unique(topk_ids).tolist())  # the host learns the routing here
        return hidden, topk_ids, topk_weights

    def _wait(self, layer: int, handle) -> torch.Tensor:
        return self.streamer.run(layer, *handle)


def fitting_slot_bytes(accel: Accelerator, wanted: float | None = None, slots: int = 2) -> int:
    """`wanted` bytes a slot (default DEFAULT_SLOT_BYTES), cut so that `slots` of them fit what the accelerator's
    budget has left (unbounded: as wanted). Below one expert the streamer still takes one expert a slot, and
    allocating them raises DeviceMemoryError."""
    size = int(wanted if wanted is not None else DEFAULT_SLOT_BYTES)
    budget = accel.ledger.budget
    return size if budget is None else max(1, min(size, (budget - accel.ledger.total) // slots))


def expert_weights_of(block: MoEBlock) -> ExpertWeights:
    """The ExpertWeights a block's routed-expert backend was built from."""
    for holder in (block.experts,):
        for attribute in ("weights", "w"):
            weights = getattr(holder, attribute, None)
            if isinstance(weights, ExpertWeights):
                return weights
    raise TypeError(f"cannot find the expert weights of {type(block.experts).__name__} (it keeps no ExpertWeights "
                    "as .weights or .w)")


def planned_copy(builder, buffer_bytes: float | None = None) -> Callable[[int], str]:
    """copy(tokens) as the planner decides it: estimate.prefill over `builder` (a placement.passes.PassBuilder for
    this model and machine) with both copy variants, the faster one per chunk size (cached)."""
    from hybridmoe.placement import estimate

    chosen: dict[int, str] = {}

    def choose(tokens: int) -> str:
        if tokens not in chosen:
            best = estimate.prefill(builder, "slp", tokens, tokens, buffer_bytes=buffer_bytes, activated="auto")
            chosen[tokens] = "activated" if best.variant == "activated-only" else "all"
        return chosen[tokens]

    return choose
