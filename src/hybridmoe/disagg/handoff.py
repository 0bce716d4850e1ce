"""A request's prompt KV from one engine's paged cache into a SpectrumKV payload in shared memory, and from the
payload into another engine's cache.

The payload is kv/payload.py's, unchanged: prefix and JSON header (format version, model fingerprint, KV layout,
full-precision dtype, tier ladder, INT4 probe verdict, token count, budget), the 2-bit tier map, one segment per
layer. At budget 1.0 (the default) every token is in the full tier, in the cache's own dtype, so the receiver's
cache holds exactly what the sender's held and decoding gives the same tokens. Below 1.0 (`--kv-budget`) the
tokens are ranked by importance (`KVPolicy.importance`: the prompt's attention importance, which the prefill
worker's engine computes during the prefill, or position only, the paper's baseline) and kv/allocation.py gives
them tiers from the ladder: FULL/INT8, with INT4 only when the model's cached INT4 probe verdict
(`hybridmoe eval kv-probe`) allows it; below the cheapest tier's cost the least important tokens are dropped. The
receiver masks the dropped positions (`AdoptedKV.dropped`, the engine's per-request mask of dropped keys) and
keeps their positions.

The shared-memory segment holds a progress word (the number of layers written so far, 8 bytes), then the
payload. The sender (`LayerWriter`) writes the head, then each layer's segment straight into it, raising the
progress word after each; the receiver (`LayerReader`) validates the head (model, layout, version: `PayloadError`
otherwise), then unpacks each layer the progress word says is there into its cache. So a prompt's KV can stream:
the prefill worker writes layer i as soon as its forward has computed it (when the tiers are known before the
forward: budget 1, or position importance) and the decode worker unpacks the layers that are in between its own
steps, while the prefill computes the rest. On x86 stores become visible to other cores in program order, so a
reader that sees the progress word at n also sees the first n layers' bytes.

Legend: n prompt tokens, W row width.
"""

from __future__ import annotations

import math
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridmoe.disagg.shm import Segment
from hybridmoe.kv.allocation import LADDER_2, TIER_NAMES, Tier, allocate
from hybridmoe.kv.importance import position_importance
from hybridmoe.kv.layout import KVLayout, config_fingerprint
from hybridmoe.kv.payload import FULL_DTYPES, PayloadError, PayloadReader, PayloadWriter
from hybridmoe.kv.probe import VerdictCache, ladder_for, model_fingerprint
from hybridmoe.runtime.engine import AdoptedKV
from hybridmoe.runtime.model_runner import torch_threads_for_step

DTYPE_NAMES = {dtype: name for name, dtype in FULL_DTYPES.items()}
# The lowest budget: 1/20 of the 16-bit bytes keeps the top 10% of the tokens at INT8 (20% at INT4), still above
# the sinks and the observation window (36 tokens) from a few hundred prompt tokens on; below it almost the whole
# prompt is gone, and 0 would keep nothing at all (a re-prefill on the decode side would do better).
MIN_BUDGET = 0.05
IMPORTANCE = ("attention", "position")  # the prompt's attention importance, or position only (the paper's baseline)
NO_VERDICT = "unknown"  # the payload header's int4_verdict when no probe verdict is cached for the model


def check_budget(budget: float) -> float:
    budget = float(budget)
    if not (MIN_BUDGET <= budget <= 1.0) or math.isnan(budget):
        raise ValueError(f"kv budget must be in [{MIN_BUDGET}, 1.0] (1.0: full precision; 0.5: half the bytes, "
                         f"INT8 for the less important tokens; lower: INT4 where the model's probe verdict allows "
                         f"it, then the least important tokens dropped), got {budget}")
    return budget


def check_importance(importance: str) -> str:
    if importance not in IMPORTANCE:
        raise ValueError(f"kv importance must be one of {', '.join(IMPORTANCE)}, got {importance!r}")
    return importance


@dataclass(frozen=True)
class KVPolicy:
    """How the prefill worker packs a prompt's KV: the budget, what ranks the tokens, the tier ladder and the
    probe verdict the payload header records."""

    budget: float = 1.0
    importance: str = "attention"  # "attention" | "position"
    ladder: tuple[Tier, ...] = LADDER_2
    int4_verdict: str = NO_VERDICT

    @property
    def wants_attention_importance(self) -> bool:
        """Whether the prefill must compute attention importance (only a budget below 1 ranks tokens)."""
        return self.budget < 1.0 and self.importance == "attention"

    @property
    def streams(self) -> bool:
        """Whether the tiers are known before the prefill's forward, so that layers can be sent as it computes them
        (attention importance needs every layer's attention first)."""
        return not self.wants_attention_importance


def kv_policy(model_dir: str | Path, budget: float, importance: str = "attention",
              cache_dir: str | Path | None = None, log=None) -> KVPolicy:
    """The handoff's policy for the model in model_dir. Below budget 1 the ladder follows the INT4 probe's verdict
    cached for the model's fingerprint (kv/probe.py; `hybridmoe eval kv-probe` writes it): FULL/INT8/INT4 when it
    allows INT4, FULL/INT8 when it refuses it or when none is cached (said once through log, default stderr)."""
    budget, importance = check_budget(budget), check_importance(importance)
    if budget >= 1.0:  # every token full: no ladder below FULL is used, no verdict needed
        return KVPolicy(budget, importance)
    fingerprint = model_fingerprint(model_dir)
    verdict = VerdictCache(cache_dir).get(fingerprint)
    if verdict is None:
        log = log or (lambda text: print(text, file=sys.stderr, flush=True))
        log(f"kv handoff: no INT4 probe verdict cached for model {fingerprint} ({model_dir}); tiers FULL/INT8, "
            f"tokens dropped below budget 0.5 (`hybridmoe eval kv-probe --model {model_dir}` caches one)")
        return KVPolicy(budget, importance, LADDER_2, NO_VERDICT)
    return KVPolicy(budget, importance, ladder_for(verdict.int4_allowed), verdict.label)


def model_identity(model_config) -> str:
    """What a payload's `model` field says: the config's fingerprint (the shapes the KV depends on)."""
    return config_fingerprint(model_config)


def slots_of(block_table: list[int], num_tokens: int, block_size: int) -> torch.Tensor:
    """Cache slots [n] of positions 0 .. num_tokens - 1 under block_table."""
    pos = torch.arange(num_tokens)
    return torch.tensor(block_table, dtype=torch.long)[pos // block_size] * block_size + pos % block_size


PROGRESS = struct.Struct("<Q")  # a segment's first bytes: the payload's layers written so far


@dataclass
class PackedKV:
    segment: str  # the shared-memory segment's name (the receiver unlinks it)
    num_tokens: int
    num_bytes: int
    budget: float
    tier_counts: tuple[int, int, int, int] = (0, 0, 0, 0)  # tokens at FULL, INT8, INT4, dropped


def choose_tiers(num_tokens: int, policy: KVPolicy, importance: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 [n] tier codes under policy: all FULL at budget 1; else ranked by importance [n] (the prompt's
    attention importance; None, or policy.importance "position": position only) over policy.ladder."""
    if policy.budget >= 1.0:
        return torch.full((num_tokens,), int(Tier.FULL), dtype=torch.uint8)
    if policy.importance == "position" or importance is None:
        importance = position_importance(num_tokens)
    elif importance.shape[0] != num_tokens:
        raise ValueError(f"importance of {importance.shape[0]} tokens for a prompt of {num_tokens}")
    return allocate(importance, policy.budget, policy.ladder)


def pack_into_segment(name: str, caches: list[torch.Tensor], layout: KVLayout, slots: torch.Tensor, *,
                      model: str, budget: float = 1.0, policy: KVPolicy | None = None,
                      importance: torch.Tensor | None = None) -> PackedKV:
    """Pack the KV at slots of every layer's cache into a new segment `name` (removed again if packing fails).
    policy: the budget, ranking and ladder (default: `budget` with position importance over FULL/INT8, the
    policy without a probe verdict); importance [n]: the prompt's attention importance, for policy.importance
    "attention"."""
    policy = policy or KVPolicy(check_budget(budget), "position")
    with single_threaded():
        writer = LayerWriter(name, layout, choose_tiers(slots.shape[0], policy, importance), model=model,
                             full_dtype=caches[0].dtype, policy=policy)
        try:
            for i, cache in enumerate(caches):
                writer.write_layer(i, cache, slots)
        except BaseException:
            writer.discard()
            raise
        return writer.close()


class LayerWriter:
    """A payload written into a new segment `name` layer by layer: the head at once, then `write_layer(i, cache,
    slots)` for i = 0, 1, ... (each raises the segment's progress word), then `close()` (or `discard()`: the
    segment is removed)."""

    def __init__(self, name: str, layout: KVLayout, tiers: torch.Tensor, *, model: str, full_dtype: torch.dtype,
                 policy: KVPolicy):
        self.layout, self.policy = layout, policy
        self.writer = PayloadWriter(layout, tiers, model=model, full_dtype=DTYPE_NAMES[full_dtype],
                                    ladder=policy.ladder, int4_verdict=policy.int4_verdict, budget=policy.budget)
        self.segment = Segment.create(name, PROGRESS.size + self.writer.total_bytes)
        head = self.writer.head()
        self.offset = PROGRESS.size + len(head)
        self.segment.buf[PROGRESS.size: self.offset] = head
        self.layers = 0

    @property
    def packed(self) -> PackedKV:
        """What the receiver is told of the payload."""
        return PackedKV(self.segment.name, int(self.writer.tiers.shape[0]), self.writer.total_bytes,
                        self.policy.budget, tuple(self.writer.header["tier_counts"]))

    def write_layer(self, layer: int, cache: torch.Tensor, slots: torch.Tensor) -> None:
        """Pack layer `layer` (the next one) of cache at slots [n] and publish it."""
        if layer != self.layers:
            raise ValueError(f"layer {layer} written after {self.layers} of {self.layout.num_layers}")
        data = self.writer.pack_layer(layer, self.layout.rows_from_cache(cache, slots).cpu())  # the cache may be on
        # the accelerator (attention placed there); the payload is packed on the host
        self.segment.buf[self.offset: self.offset + len(data)] = data
        self.offset += len(data)
        self.layers += 1
        PROGRESS.pack_into(self.segment.buf, 0, self.layers)  # after the layer's bytes (see the module docstring)

    def close(self) -> PackedKV:
        """Unmap the segment once every layer is written (the receiver unlinks it)."""
        if self.layers != self.layout.num_layers:
            raise ValueError(f"{self.layers} of {self.layout.num_layers} layers written")
        assert self.offset == PROGRESS.size + self.writer.total_bytes, (self.offset, self.writer.total_bytes)
        packed = self.packed
        self.segment.close()
        return packed

    def discard(self) -> None:
        self.segment.close()
        self.segment.unlink()


class LayerReader:
    """The receiving side of a segment: validates the payload's head at once (PayloadError for a payload of another
    model, layout or format version, or of another token count than slots), then `unpack_ready(caches)` writes the
    layers published since the last call into each layer's cache at slots; `close()` unmaps and unlinks the
    segment (whatever happened)."""

    def __init__(self, name: str, layout: KVLayout, slots: torch.Tensor, *, model: str):
        self.segment = Segment.attach(name)
        self.slots = slots
        self.done = 0
        try:
            self.view = self.segment.buf[PROGRESS.size:]
            self.reader = PayloadReader(self.view, model=model, layout=layout, capacity=len(self.view))
            if self.reader.num_tokens != slots.shape[0]:
                raise PayloadError(f"payload holds {self.reader.num_tokens} tokens, the request has {slots.shape[0]}")
            if self.reader.total_bytes != len(self.view):
                raise PayloadError(f"payload of {self.reader.total_bytes} bytes in a segment of {len(self.view)}")
        except BaseException:
            self.close()
            raise

    @property
    def complete(self) -> bool:
        return self.done == self.reader.layout.num_layers

    def unpack_ready(self, caches: list[torch.Tensor]) -> bool:
        """Unpack the layers published since the last call; True once every layer is in."""
        published = min(PROGRESS.unpack_from(self.segment.buf, 0)[0], len(caches))
        with single_threaded():
            for i in range(self.done, published):
                lo, hi = self.reader.segment_range(i)
                self.reader.layout.rows_to_cache(caches[i], self.slots,
                                                 self.reader.unpack_layer(i, self.view[lo:hi], caches[i].dtype))
                self.done = i + 1
        return self.complete

    def close(self) -> None:
        view = getattr(self, "view", None)
        if view is not None:
            try:
                view.release()
            except BufferError:  # a view of it still held elsewhere: unmapped when that goes
                pass
        self.segment.close()
        self.segment.unlink()


def unpack_from_segment(name: str, caches: list[torch.Tensor], layout: KVLayout, slots: torch.Tensor, *,
                        model: str) -> PayloadReader:
    """Write the complete payload in segment `name` into every layer's cache at slots, layer by layer; the segment
    is unlinked whatever happens. Raises PayloadError as LayerReader does, and when layers are missing."""
    reader = LayerReader(name, layout, slots, model=model)
    try:
        if not reader.unpack_ready(caches):
            raise PayloadError(f"incomplete payload: {reader.done} of {len(caches)} layers written")
        return reader.reader
    finally:
        reader.close()


def adopted_kv(reader: PayloadReader, cache_dtype: torch.dtype) -> AdoptedKV | None:
    """What an unpacked payload left in the cache, for `LLMEngine.adopt_request`: None when it is exactly the
    sender's (every token FULL in the cache's dtype), else its dropped positions and that it is not exact."""
    dropped = reader.dropped
    if bool((reader.tiers == Tier.FULL).all()) and reader.full_dtype == cache_dtype:
        return None
    return AdoptedKV(dropped=dropped if bool(dropped.any()) else None, exact=False)


def tier_summary(counts) -> str:
    """'fp16 10, int8 20, int4 0, drop 5' of a payload's tier counts."""
    return ", ".join(f"{TIER_NAMES[Tier(t)]} {c}" for t, c in enumerate(counts))


def single_threaded():
    """torch on one thread for the packing's small ops (a team of OpenMP threads costs more than it saves)."""
    return torch_threads_for_step(0)
