"""Stream-loading prefill (SLP): a large prompt chunk's routed experts run on the accelerator, streamed in per layer.

Prefill of a long chunk is compute-bound, and the CPU is too slow for it; the experts do not fit in accelerator
memory. So for each MoE layer the layer's routed experts are copied from host memory into one of two device
slots and computed there as a grouped matmul over the chunk's tokens (`TorchExpertBackend` over the slot), while
the copy of the next layer runs on a copy stream (docs/hybrid.md, "Stream-loading prefill").

The experts travel in their stored format: FP8 bytes with their 128x128 block scales, int4/int8 codes with their
group scales, or bf16/fp16/fp32, the same bytes the CPU kernels read; they are dequantised on the device one expert
at a time as the grouped matmul reaches it (accel.dequant). Host memory is pageable (the memory-mapped checkpoint),
so copies go through bounded page-locked staging (`staging.HostStaging`).

The schedule (MoE layers numbered 0..L-1 in model order, two slots; layer l uses slot l % 2):
- copy "all" (whole layers, prefetched): when a chunk reaches the first MoE layer, the copies of layers 0 and 1
  are issued; once layer l's experts are issued for compute, the copy of layer l + 2 is issued into the slot layer
  l just used, and the copy stream waits for that compute only (an event), not for the device. The copy of layer
  l + 1 is therefore in flight during all of layer l (its MoE, then layer l + 1's attention); the compute of
  layer l waits only for its own layer's copy event.
- copy "activated": which experts a layer needs is known only once its router has run, just before its MoE;
  so the copy of the chunk's activated experts of layer l is issued then (the copy stream waits for the compute
  of layer l - 2, the last user of the slot), and overlaps the layer's shared experts, not the previous layer.
  It moves fewer bytes but gives up the prefetch: it pays when a chunk activates clearly fewer experts than the
  layer has (short chunks, many experts). The planner models exactly these two variants (placement/passes.py,
  `_slp_moe_units`: the activated variant's first copy waits for the router; placement/estimate.py tries both).
- a callable `copy(tokens) -> "all" | "activated"` picks per chunk; `planned_copy` asks the planner.
A chunk's first MoE layer is not prefetched during the previous chunk (nothing here knows that another large
chunk follows); the planner assumes it is, which costs it one layer's copy per chunk of optimism.

On CUDA the copies are issued from a copy thread (host memcpy into staging, then async copies on the copy stream),
so that the host keeps issuing the layers' compute meanwhile. On the CPU stand-in the copy thread runs each copy
to completion before `load` returns (streams degrade to synchronous calls), so the trace is deterministic; with
overlap=True the stand-in's copies run on the copy thread while the caller computes, and each compute waits for its
own layer's copy to finish (how `bench costmodel` measures the overlapped schedule on the stand-in).

`ExpertStreamer` is the mechanism over any list of per-layer `ExpertWeights`; a streamer built over
`ExpertWeights.subset(owned)` of every layer streams and computes only those experts (expert parallelism: each
rank its share; topk ids are then indices into the subset). `StreamPrefill` attaches one to a model's MoE blocks
(`MoEBlock.prefill_experts`).

Legend: T tokens, H hidden, K top-k, E experts of a layer, n experts in a slot.
"""

from __future__ import annotations

import threading
import time
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
    staging: str = "pinned"  # "pinned" | "pageable" (page-locking failed)
    pinned_bytes: int = 0  # page-locked host staging held
    slot_bytes: int = 0  # device bytes of each of the two slots

    @property
    def copy_gbs(self) -> float:
        """Achieved copy bandwidth, GB/s (1e9), over all passes."""
        return self.bytes / self.copy_s / 1e9 if self.copy_s > 0 else 0.0

    @property
    def last_pass_gbs(self) -> float:
        return self.last_pass_bytes / self.last_pass_copy_s / 1e9 if self.last_pass_copy_s > 0 else 0.0


@dataclass
class _Slot:
    buffer: torch.Tensor  # uint8 [capacity * stride] on the accelerator
    weights: ExpertWeights  # views into buffer, one per position
    layer: int | None = None  # the layer whose experts it holds (or is receiving)
    experts: list[int] | None = None  # which of the layer's experts, in position order (None: all, position = id)
    copied: Future | None = None  # -> the copy-done Event, once the copy is issued
    free: Event | None = None  # the compute that last read the slot
    pending: bool = False  # loaded, not yet computed


@dataclass
class _Timing:
    nbytes: int
    seconds: float | None = None
    events: tuple | None = None  # CUDA (start, end) timing events until resolved
    pass_index: int = 0


class ExpertStreamer:
    """Streams per-layer experts into two accelerator slots and computes them there (module docstring).

    layers: one ExpertWeights per MoE layer, in the order `load`/`run` number them (every layer's experts must
    share shapes and dtypes); each may be a subset (`ExpertWeights.subset`) of a layer's experts: ids given to
    `load` and `run` are then indices into that subset. The two slots (each sized for the largest layer) are
    allocated at once on `accel`, in its ledger under `{name}.slot0/1`; `DeviceMemoryError` when over budget.
    overlap (default: on CUDA only) runs the copies on the copy thread while the caller goes on (module docstring).
    """

    def __init__(self, layers: list[ExpertWeights], accel: Accelerator, staging_bytes: int = DEFAULT_STAGING_BYTES,
                 name: str = "slp", slots: int = 2, overlap: bool | None = None):
        if not layers:
            raise ValueError("ExpertStreamer needs at least one layer of experts")
        self.layers, self.accel, self.name = layers, accel, name
        self.overlap = accel.is_cuda if overlap is None else overlap  # copies run while the caller computes
        self.layout = ExpertLayout.of(layers[0])
        for l, w in enumerate(layers):
            self.layout.check(w, f"{name} layer {l}")
        self.capacity = max(w.num_experts for w in layers)
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
        self._timings: list[_Timing] = []  # appended on the copy thread
        self._lock = threading.Lock()
        self._stats = StreamStats(staging=self.staging.mode, pinned_bytes=self.staging.pinned_bytes,
                                  slot_bytes=self.slots[0].buffer.nbytes)

    # --- the schedule's two calls ----------------------------------------------------------------------------
    def load(self, layer: int, experts: list[int] | None = None) -> None:
        """Issue the copy of `layer`'s experts (all, or the listed ids in that order) into slot layer % 2; the
        copy waits (on the copy stream) for the compute that last read the slot."""
        slot = self.slots[layer % len(self.slots)]
        if slot.pending:
            raise RuntimeError(f"{self.name}: slot {layer % len(self.slots)} still holds layer {slot.layer}, not yet "
                               f"computed; layer {layer} cannot be loaded into it before that layer runs")
        count = self.layers[layer].num_experts if experts is None else len(experts)
        if count > self.capacity:
            raise ValueError(f"{self.name}: {count} experts do not fit a slot of {self.capacity}")
        slot.layer, slot.experts, slot.pending = layer, experts, True
        slot.copied = self._worker.submit(self._copy, layer, experts, layer % len(self.slots), slot.free)
        if not self.overlap:
            slot.copied.result()  # the stand-in: the copy is done when it is issued

    def run(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """hidden [T, H], topk_ids [T, K] (ids of `layer`'s experts), topk_weights [T, K] -> [T, H] on hidden's
        device: the grouped matmul over the slot, issued on the compute stream after the layer's copy event."""
        slot = self.slots[layer % len(self.slots)]
        if not slot.pending or slot.layer != layer:
            raise RuntimeError(f"{self.name}: layer {layer} was not loaded (slot {layer % len(self.slots)} holds "
                               f"layer {slot.layer})")
        compute = self.accel.compute
        compute.wait(slot.copied.result())
        self.accel.mark_compute(f"layer {layer} experts")
        device = self.accel.device
        x = hidden.to(device, non_blocking=True)  # [T, H]
        ids = topk_ids.to(device, non_blocking=True)
        weights = slot.weights
        if slot.experts is not None:  # a subset of the layer's experts, packed from position 0
            lookup = torch.full((self.layers[layer].num_experts,), -1, dtype=torch.long, device=device)
            lookup[torch.tensor(slot.experts, dtype=torch.long, device=device)] = torch.arange(
                len(slot.experts), device=device)
            ids = lookup[ids]  # [T, K] positions in the slot
            weights = weights.subset(list(range(len(slot.experts))))
        elif self.layers[layer].num_experts < self.capacity:
            weights = weights.subset(list(range(self.layers[layer].num_experts)))
        backend = TorchExpertBackend(weights)
        out = backend.wait(backend.submit(x, ids, topk_weights.to(device, non_blocking=True)))
        slot.free = compute.record(f"layer {layer} computed")
        slot.pending = False
        return out.to(hidden.device, non_blocking=True)

    # --- passes and stats ------------------------------------------------------------------------------------
    def begin_pass(self) -> None:
        """A new forward pass starts streaming from its first layer: what an interrupted pass left in flight is
        drained, and the per-pass stats start over."""
        for slot in self.slots:
            if slot.copied is not None:
                slot.copied.result()
            slot.pending = False
        self._resolve()
        self._stats.passes += 1
        self._stats.last_pass_bytes, self._stats.last_pass_copy_s = 0, 0.0

    def stats(self) -> StreamStats:
        """A snapshot (on CUDA this waits for the copies issued so far, to read their timings)."""
        for slot in self.slots:
            if slot.copied is not None:
                slot.copied.result()
        self._resolve()
        return StreamStats(**{k: getattr(self._stats, k) for k in self._stats.__dataclass_fields__})

    def close(self) -> None:
        """Finish the copies in flight, stop the copy thread and give the slots' memory back to the ledger."""
        self._worker.shutdown(wait=True)
        for i in range(len(self.slots)):
            self.accel.release(f"{self.name}.slot{i}")
        self.slots = []

    # --- on the copy thread ----------------------------------------------------------------------------------
    def _copy(self, layer: int, experts: list[int] | None, slot_index: int, free: Event | None) -> Event:
        w, slot = self.layers[layer], self.slots[slot_index]
        ids = range(w.num_experts) if experts is None else experts
        stride, offsets = self.layout.stride, self.layout.offsets
        pieces = [Piece(position * stride + offset, t) for position, e in enumerate(ids)
                  for offset, t in zip(offsets, w.expert_tensors(e))]
        nbytes = sum(p.src.nbytes for p in pieces)
        if free is not None:
            self.copies.wait(free)
        timing = _Timing(nbytes, pass_index=self._stats.passes)
        if self.copies.native is not None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(self.copies.native)
        else:
            began = time.perf_counter()
        used = len(ids) * stride
        self.staging.copy(self.copies, slot.buffer[:used], pieces, f"layer {layer} -> slot {slot_index}")
        done = self.copies.record(f"layer {layer} copied")
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
            s.layers_copied += 1
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

    copy: "all" (whole layers, prefetched one layer ahead), "activated" (each layer's activated experts, once
    routed), or a callable of the chunk's token count returning one of them (`planned_copy`: the planner's
    choice). `stats()` reports bytes streamed per prefill and the achieved copy bandwidth; `detach()` restores
    the blocks and frees the slots.
    """

    def __init__(self, model, accel: Accelerator, min_tokens: int = 1, copy: CopyChoice = "all",
                 staging_bytes: int = DEFAULT_STAGING_BYTES, name: str = "slp", overlap: bool | None = None):
        if not callable(copy) and copy not in COPY_MODES:
            raise ValueError(f"copy must be one of {', '.join(COPY_MODES)} or a callable, got {copy!r}")
        if min_tokens < 1:
            raise ValueError(f"min_tokens must be >= 1, got {min_tokens}")
        self.blocks = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoEBlock)]
        if not self.blocks:
            raise ValueError("the model has no MoE layer: nothing to stream")
        self.streamer = ExpertStreamer([expert_weights_of(b) for b in self.blocks], accel, staging_bytes, name,
                                       overlap=overlap)
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
            if self.mode == "all":
                for first in range(min(len(streamer.slots), len(self.blocks))):
                    streamer.load(first)
        if self.mode == "activated":
            streamer.load(layer, torch.unique(topk_ids).tolist())  # the host learns the routing here
        return hidden, topk_ids, topk_weights

    def _wait(self, layer: int, handle) -> torch.Tensor:
        out = self.streamer.run(layer, *handle)
        ahead = layer + len(self.streamer.slots)
        if self.mode == "all" and ahead < len(self.blocks):
            self.streamer.load(ahead)  # into the slot this layer just used, once its compute is done
        return out


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
