"""A request's prompt KV from one engine's paged cache into a SpectrumKV payload in shared memory, and from the
payload into another engine's cache.

The payload is kv/payload.py's, unchanged: prefix and JSON header (format version, model fingerprint, KV layout,
full-precision dtype, tier ladder, token count, budget), the 2-bit tier map, one segment per layer. At budget 1.0
(the default) every token is in the full tier, in the cache's own dtype, so the receiver's cache holds exactly
what the sender's held and decoding gives the same tokens. A lower budget (`--kv-budget`) gives the least
important tokens (by position: the first tokens and the most recent stay full) INT8, and INT4 below 0.5; budgets
that would drop tokens are refused (the decode engine has no per-request mask of dropped keys).

The sender writes the head and each layer's segment straight into a segment of the payload's size; the receiver
validates the head (model, layout, version: `PayloadError` otherwise), then unpacks layer by layer into its cache.

Legend: n prompt tokens, W row width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridmoe.disagg.shm import Segment
from hybridmoe.kv.allocation import LADDER_2, LADDER_3, Tier, allocate
from hybridmoe.kv.importance import position_importance
from hybridmoe.kv.layout import KVLayout, config_fingerprint
from hybridmoe.kv.payload import FULL_DTYPES, PayloadError, PayloadReader, PayloadWriter
from hybridmoe.runtime.model_runner import torch_threads_for_step

DTYPE_NAMES = {dtype: name for name, dtype in FULL_DTYPES.items()}
MIN_BUDGET = 0.25  # INT4 for every token; below it tokens would be dropped


def check_budget(budget: float) -> float:
    budget = float(budget)
    if not MIN_BUDGET <= budget <= 1.0:
        raise ValueError(f"kv budget must be in [{MIN_BUDGET}, 1.0] (1.0: full precision; 0.5: half the bytes, "
                         f"INT8 for the less important tokens; {MIN_BUDGET}: INT4 for all), got {budget}")
    return budget


def ladder_for_budget(budget: float) -> tuple[Tier, ...]:
    """FULL and INT8 down to 0.5; INT4 as well below it."""
    return LADDER_2 if budget >= 0.5 else LADDER_3


def model_identity(model_config) -> str:
    """What a payload's `model` field says: the config's fingerprint (the shapes the KV depends on)."""
    return config_fingerprint(model_config)


def slots_of(block_table: list[int], num_tokens: int, block_size: int) -> torch.Tensor:
    """Cache slots [n] of positions 0 .. num_tokens - 1 under block_table."""
    pos = torch.arange(num_tokens)
    return torch.tensor(block_table, dtype=torch.long)[pos // block_size] * block_size + pos % block_size


@dataclass
class PackedKV:
    segment: str  # the shared-memory segment's name (the receiver unlinks it)
    num_tokens: int
    num_bytes: int
    budget: float


def pack_into_segment(name: str, caches: list[torch.Tensor], layout: KVLayout, slots: torch.Tensor, *,
                      model: str, budget: float = 1.0) -> PackedKV:
    """Pack the KV at slots of every layer's cache into a new segment `name` (removed again if packing fails)."""
    n = slots.shape[0]
    with single_threaded():
        return _pack(name, caches, layout, slots, n, model, budget)


def _pack(name: str, caches: list[torch.Tensor], layout: KVLayout, slots: torch.Tensor, n: int, model: str,
          budget: float) -> PackedKV:
    if budget >= 1.0:
        tiers = torch.full((n,), int(Tier.FULL), dtype=torch.uint8)
    else:
        tiers = allocate(position_importance(n), budget, ladder_for_budget(budget))
    if (tiers == Tier.DROP).any():  # check_budget keeps the budget where nothing is dropped
        raise ValueError(f"kv budget {budget} drops tokens")
    writer = PayloadWriter(layout, tiers, model=model, full_dtype=DTYPE_NAMES[caches[0].dtype],
                           ladder=ladder_for_budget(budget), budget=budget)
    segment = Segment.create(name, writer.total_bytes)
    try:
        head = writer.head()
        segment.buf[: len(head)] = head
        offset = len(head)
        for i, cache in enumerate(caches):  # each layer's segment, written in place
            data = writer.pack_layer(i, layout.rows_from_cache(cache, slots))
            segment.buf[offset: offset + len(data)] = data
            offset += len(data)
        assert offset == writer.total_bytes, (offset, writer.total_bytes)
    except BaseException:
        segment.close()
        segment.unlink()
        raise
    segment.close()
    return PackedKV(name, n, writer.total_bytes, budget)


def unpack_from_segment(name: str, caches: list[torch.Tensor], layout: KVLayout, slots: torch.Tensor, *,
                        model: str) -> PayloadReader:
    """Write the payload in segment `name` into every layer's cache at slots, layer by layer; the segment is
    unlinked whatever happens. Raises PayloadError for a payload of another model, layout or format version, or
    of another token count than slots."""
    segment = Segment.attach(name)
    view = segment.buf
    try:
        with single_threaded():
            reader = PayloadReader(view, model=model, layout=layout, capacity=segment.size)
            if reader.num_tokens != slots.shape[0]:
                raise PayloadError(f"payload holds {reader.num_tokens} tokens, the request has {slots.shape[0]}")
            if reader.total_bytes != segment.size:
                raise PayloadError(f"payload of {reader.total_bytes} bytes in a segment of {segment.size}")
            for i, cache in enumerate(caches):
                lo, hi = reader.segment_range(i)
                layout.rows_to_cache(cache, slots, reader.unpack_layer(i, view[lo:hi], cache.dtype))
        return reader
    finally:
        del view
        segment.close()
        segment.unlink()


def single_threaded():
    """torch on one thread for the packing's small ops (a team of OpenMP threads costs more than it saves)."""
    return torch_threads_for_step(0)
