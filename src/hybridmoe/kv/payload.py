"""The SpectrumKV payload: a prompt's KV cache, every token at its own precision tier, packed into bytes.

Layout (little-endian; every region starts at a multiple of 64 bytes):
  prefix   16 bytes: magic b"HMKV", u16 format version, u16 0, u32 header length, u32 crc32 of the header
  header   JSON: format version, model fingerprint, layout (kind, layers, group widths), full-precision dtype,
           tier ladder, INT4 probe verdict, token count, budget, tier counts, segment bytes, total bytes,
           crc32 of the tier map
  tier map 2 bits per token (token i in bits 2(i%4) of byte i//4): 0 full, 1 INT8, 2 INT4, 3 dropped
  segments one per layer, all of one size: u32 layer index, u32 crc32 of the body, then the body: the full
           tier's values [n_full, W] in the full dtype, INT8 codes [n8, W] and float16 scales [n8, G], INT4
           codes [n4, W/2] and scales [n4, G] (tokens in prompt order within a tier; each array 8-aligned)
The header and the tier map exist once the tiers are chosen, so the first layer's segment can go out while
later layers are still being packed (or, with position importance, still being prefilled). The reader checks
the prefix, version, crc32s, the model and the layout, and refuses a payload larger than its preallocated
capacity; it unpacks layer by layer into rows [n, W] (dropped rows zero, their positions kept: `dropped`).

Legend: n tokens, W row width, G groups per row (hybridmoe.kv.layout).
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass

import torch

from hybridmoe.kv import quant
from hybridmoe.kv.allocation import TIER_NAMES, Tier, paper_budget
from hybridmoe.kv.layout import KVLayout

MAGIC = b"HMKV"
FORMAT_VERSION = 1
ALIGN = 64
PREFIX = struct.Struct("<4sHHII")
SEGMENT_PREFIX = struct.Struct("<II")
MAX_HEADER_BYTES = 1 << 16
FULL_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
NAME_TO_TIER = {name: tier for tier, name in TIER_NAMES.items()}


class PayloadError(ValueError):
    """A payload this receiver cannot take: another model or format, truncated, corrupted, too large."""


def _align(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def pack_tier_map(tiers: torch.Tensor) -> bytes:
    t = tiers.to(torch.uint8)
    padded = torch.full((_align(t.shape[0], 4),), int(Tier.DROP), dtype=torch.uint8)
    padded[: t.shape[0]] = t
    q = padded.view(-1, 4)
    return bytes((q[:, 0] | (q[:, 1] << 2) | (q[:, 2] << 4) | (q[:, 3] << 6)).numpy().tobytes())


def unpack_tier_map(data: bytes, num_tokens: int) -> torch.Tensor:
    b = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return torch.stack([(b >> s) & 3 for s in (0, 2, 4, 6)], dim=1).flatten()[:num_tokens].contiguous()


@dataclass(frozen=True)
class SegmentLayout:
    """Byte offsets of the arrays in one layer's segment body."""

    counts: tuple[int, int, int]  # full, INT8, INT4 tokens
    width: int
    groups: int
    full_bytes: int  # bytes per full-tier value

    def arrays(self) -> list[tuple[str, int, int]]:
        """(name, offset in body, bytes) of each array."""
        n16, n8, n4 = self.counts
        sizes = [("full", n16 * self.width * self.full_bytes), ("int8", n8 * self.width), ("int8_scales", n8 * self.groups * 2),
                 ("int4", n4 * self.width // 2), ("int4_scales", n4 * self.groups * 2)]
        out, offset = [], 0
        for name, size in sizes:
            out.append((name, offset, size))
            offset = _align(offset + size, 8)
        return out

    @property
    def body_bytes(self) -> int:
        name, offset, size = self.arrays()[-1]
        return offset + size

    @property
    def segment_bytes(self) -> int:
        return _align(SEGMENT_PREFIX.size + self.body_bytes)


def _header_region(header: dict) -> bytes:
    text = json.dumps(header, sort_keys=True).encode()
    prefix = PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(text), zlib.crc32(text))
    raw = prefix + text
    return raw + b"\0" * (_align(len(raw)) - len(raw))


class PayloadWriter:
    """Packs one prompt's KV: `head()` (prefix, header, tier map), then `pack_layer(i, rows)` per layer."""

    def __init__(self, layout: KVLayout, tiers: torch.Tensor, *, model: str, full_dtype: str = "bfloat16",
                 ladder: tuple[Tier, ...] = (Tier.FULL, Tier.INT8, Tier.INT4), int4_verdict: str = "unknown",
                 budget: float | None = None):
        if full_dtype not in FULL_DTYPES:
            raise ValueError(f"full-precision dtype must be one of {sorted(FULL_DTYPES)}, got {full_dtype!r}")
        if Tier.INT4 in ladder and layout.row_width % 2:
            raise ValueError("INT4 needs an even row width")
        self.layout, self.tiers = layout, tiers.to(torch.uint8)
        self.full_dtype = FULL_DTYPES[full_dtype]
        n = self.tiers.shape[0]
        counts = [int((self.tiers == t).sum()) for t in Tier]
        used = {Tier(t) for t in Tier if counts[t] and t != Tier.DROP}
        if not used <= set(ladder):
            raise ValueError(f"tier map uses {sorted(TIER_NAMES[t] for t in used)} outside the ladder "
                             f"{[TIER_NAMES[t] for t in ladder]}")
        self.index = {t: torch.nonzero(self.tiers == t).flatten() for t in (Tier.FULL, Tier.INT8, Tier.INT4)}
        self.segment = SegmentLayout((counts[0], counts[1], counts[2]), layout.row_width, layout.num_groups,
                                     self.full_dtype.itemsize)
        tier_map = pack_tier_map(self.tiers)
        header = {
            "format": "hybridmoe-spectrumkv", "version": FORMAT_VERSION, "model": model, "layout": layout.to_json(),
            "full_dtype": full_dtype, "ladder": [TIER_NAMES[t] for t in ladder], "int4_verdict": int4_verdict,
            "num_tokens": n, "budget": paper_budget(self.tiers) if budget is None else budget,
            "tier_counts": counts, "segment_bytes": self.segment.segment_bytes, "tier_map_crc": zlib.crc32(tier_map),
        }
        rest = _align(len(tier_map)) + layout.num_layers * self.segment.segment_bytes
        header["total_bytes"] = 0
        while True:  # the total counts the header, whose length counts the total's digits
            head = _header_region(header)
            if header["total_bytes"] == len(head) + rest:
                break
            header["total_bytes"] = len(head) + rest
        self._head = head + tier_map + b"\0" * (_align(len(tier_map)) - len(tier_map))
        self.header = header

    @property
    def total_bytes(self) -> int:
        return self.header["total_bytes"]

    def head(self) -> bytes:
        return self._head

    def pack_layer(self, layer: int, rows: torch.Tensor) -> bytes:
        """rows [n, W] of layer `layer` (any float dtype) -> its segment."""
        lay, seg = self.layout, self.segment
        if rows.shape != (self.tiers.shape[0], lay.row_width):
            raise ValueError(f"layer {layer}: rows {tuple(rows.shape)}, expected {(self.tiers.shape[0], lay.row_width)}")
        out = torch.zeros(seg.segment_bytes, dtype=torch.uint8)
        body = out[SEGMENT_PREFIX.size: SEGMENT_PREFIX.size + seg.body_bytes]
        arrays = {name: body[offset: offset + size] for name, offset, size in seg.arrays()}
        n16, n8, n4 = seg.counts
        width, groups = lay.row_width, lay.num_groups
        if n16:
            arrays["full"].view(self.full_dtype).view(n16, width).copy_(self._gather(rows, Tier.FULL))
        for tier, bits, name, count, code_width in ((Tier.INT8, 8, "int8", n8, width),
                                                    (Tier.INT4, 4, "int4", n4, width // 2)):
            if count:
                codes = arrays[name].view(count, code_width)
                quant.quantize(self._gather(rows, tier), lay.group_widths, bits,
                               codes.view(torch.int8) if bits == 8 else codes,
                               arrays[name + "_scales"].view(torch.float16).view(count, groups))
        array = out.numpy()
        SEGMENT_PREFIX.pack_into(array, 0, layer, zlib.crc32(array[SEGMENT_PREFIX.size: SEGMENT_PREFIX.size + seg.body_bytes]))
        return array.tobytes()


    def _gather(self, rows: torch.Tensor, tier: Tier) -> torch.Tensor:
        """The rows of one tier's tokens, in a reused buffer."""
        index = self.index[tier]
        out = quant.scratch("gather", (index.shape[0], rows.shape[1]), rows.dtype)
        return torch.index_select(rows, 0, index, out=out)


def pack(writer: PayloadWriter, layers: list[torch.Tensor]) -> bytes:
    """The whole payload of rows [n, W] per layer."""
    return writer.head() + b"".join(writer.pack_layer(i, rows) for i, rows in enumerate(layers))


def payload_capacity(layout: KVLayout, num_tokens: int, budget: float, full_dtype: str = "bfloat16") -> int:
    """An upper bound on the payload bytes of num_tokens tokens at budget b (paper costs), for any ladder:
    what a receiver preallocates before the header arrives."""
    values = budget * num_tokens * layout.row_width * 2 * FULL_DTYPES[full_dtype].itemsize / 2
    scales = num_tokens * layout.num_groups * 2
    per_layer = _align(SEGMENT_PREFIX.size + int(values) + scales + 5 * 8)
    return MAX_HEADER_BYTES + _align(-(-num_tokens // 4)) + layout.num_layers * per_layer


class PayloadReader:
    """The receiving side: `PayloadReader(head_bytes, ...)` validates the prefix, header and tier map, then
    `unpack_layer(i, segment)` gives each layer's rows."""

    def __init__(self, data: bytes | bytearray | memoryview, *, model: str | None = None,
                 layout: KVLayout | None = None, capacity: int | None = None):
        data = memoryview(data)
        if len(data) < PREFIX.size:
            raise PayloadError(f"truncated payload: {len(data)} bytes, not even the {PREFIX.size}-byte prefix")
        magic, version, _, header_len, header_crc = PREFIX.unpack(data[: PREFIX.size])
        if magic != MAGIC:
            raise PayloadError(f"not a SpectrumKV payload (magic {bytes(magic)!r}, expected {MAGIC!r})")
        if version != FORMAT_VERSION:
            raise PayloadError(f"payload format version {version}; this reader takes version {FORMAT_VERSION}")
        if header_len > MAX_HEADER_BYTES or len(data) < PREFIX.size + header_len:
            raise PayloadError(f"truncated payload: the header needs {PREFIX.size + header_len} bytes, got {len(data)}")
        text = bytes(data[PREFIX.size: PREFIX.size + header_len])
        if zlib.crc32(text) != header_crc:
            raise PayloadError("corrupted payload: header checksum mismatch")
        try:
            h = json.loads(text)
            self._check_header(h)
        except (ValueError, KeyError, TypeError) as error:
            if isinstance(error, PayloadError):
                raise
            raise PayloadError(f"malformed payload header: {error!r}") from error
        self.header = h
        if model is not None and h["model"] != model:
            raise PayloadError(f"payload is for model {h['model']}, this receiver serves {model}")
        self.layout = KVLayout.from_json(h["layout"])
        if layout is not None and self.layout != layout:
            raise PayloadError(f"payload KV layout {self.layout} does not match this model's {layout}")
        if capacity is not None and h["total_bytes"] > capacity:
            raise PayloadError(f"payload of {h['total_bytes']} bytes exceeds the preallocated {capacity}")
        self.num_tokens = n = int(h["num_tokens"])
        self.full_dtype = FULL_DTYPES[h["full_dtype"]]
        map_bytes = -(-n // 4)
        self.map_offset = _align(PREFIX.size + header_len)
        if len(data) < self.map_offset + map_bytes:
            raise PayloadError(f"truncated payload: the tier map ends at byte {self.map_offset + map_bytes}, got {len(data)}")
        tier_map = bytes(data[self.map_offset: self.map_offset + map_bytes])
        if zlib.crc32(tier_map) != h["tier_map_crc"]:
            raise PayloadError("corrupted payload: tier map checksum mismatch")
        self.tiers = unpack_tier_map(tier_map, n)
        counts = [int((self.tiers == t).sum()) for t in Tier]
        if counts != h["tier_counts"]:
            raise PayloadError(f"corrupted payload: tier map counts {counts}, header says {h['tier_counts']}")
        self.index = {t: torch.nonzero(self.tiers == t).flatten() for t in (Tier.FULL, Tier.INT8, Tier.INT4)}
        self.segment = SegmentLayout(tuple(counts[:3]), self.layout.row_width, self.layout.num_groups,
                                     self.full_dtype.itemsize)
        if self.segment.segment_bytes != h["segment_bytes"]:
            raise PayloadError("corrupted payload: segment size does not follow from the tier counts")
        self.segments_offset = self.map_offset + _align(map_bytes)
        if self.segments_offset + self.layout.num_layers * self.segment.segment_bytes != h["total_bytes"]:
            raise PayloadError("corrupted payload: total size does not follow from the header")

    @staticmethod
    def _check_header(h: dict) -> None:
        if h.get("format") != "hybridmoe-spectrumkv" or h.get("version") != FORMAT_VERSION:
            raise PayloadError(f"header names format {h.get('format')!r} version {h.get('version')!r}")
        for key in ("model", "layout", "full_dtype", "num_tokens", "tier_counts", "segment_bytes", "total_bytes",
                    "tier_map_crc"):
            if key not in h:
                raise PayloadError(f"malformed payload header: no {key!r}")
        if h["full_dtype"] not in FULL_DTYPES:
            raise PayloadError(f"payload's full-precision dtype {h['full_dtype']!r} is not one of {sorted(FULL_DTYPES)}")

    @property
    def total_bytes(self) -> int:
        return self.header["total_bytes"]

    @property
    def dropped(self) -> torch.Tensor:
        """bool [n]: tokens whose KV was dropped (attention masks them; their positions stay)."""
        return self.tiers == Tier.DROP

    def segment_range(self, layer: int) -> tuple[int, int]:
        start = self.segments_offset + layer * self.segment.segment_bytes
        return start, start + self.segment.segment_bytes

    def unpack_layer(self, layer: int, segment: bytes | bytearray | memoryview,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """One layer's segment -> rows [n, W] in dtype, dropped rows zero."""
        seg, lay = self.segment, self.layout
        segment = memoryview(segment)
        if len(segment) < seg.segment_bytes:
            raise PayloadError(f"truncated payload: layer {layer}'s segment has {len(segment)} of "
                               f"{seg.segment_bytes} bytes")
        index, crc = SEGMENT_PREFIX.unpack(segment[: SEGMENT_PREFIX.size])
        body = segment[SEGMENT_PREFIX.size: SEGMENT_PREFIX.size + seg.body_bytes]
        if index != layer:
            raise PayloadError(f"corrupted payload: segment of layer {index} where layer {layer} was expected")
        if zlib.crc32(body) != crc:
            raise PayloadError(f"corrupted payload: layer {layer}'s segment checksum mismatch")
        raw = torch.frombuffer(bytearray(body), dtype=torch.uint8) if seg.body_bytes else torch.empty(0, dtype=torch.uint8)
        arrays = {name: raw[offset: offset + size] for name, offset, size in seg.arrays()}
        n16, n8, n4 = seg.counts
        width, groups = lay.row_width, lay.num_groups
        rows = torch.zeros(self.num_tokens, width, dtype=dtype)
        if n16:
            rows[self.index[Tier.FULL]] = arrays["full"].view(self.full_dtype).view(n16, width).to(dtype)
        if n8:
            rows[self.index[Tier.INT8]] = quant.dequantize(
                arrays["int8"].view(torch.int8).view(n8, width), arrays["int8_scales"].view(torch.float16).view(n8, groups),
                lay.group_widths, 8, dtype)
        if n4:
            rows[self.index[Tier.INT4]] = quant.dequantize(
                arrays["int4"].view(n4, width // 2), arrays["int4_scales"].view(torch.float16).view(n4, groups),
                lay.group_widths, 4, dtype)
        return rows


def unpack(data: bytes | bytearray | memoryview, *, model: str | None = None, layout: KVLayout | None = None,
           dtype: torch.dtype = torch.float32) -> tuple[PayloadReader, list[torch.Tensor]]:
    """A whole payload -> (its reader, rows [n, W] per layer)."""
    reader = PayloadReader(data, model=model, layout=layout)
    if len(data) < reader.total_bytes:
        raise PayloadError(f"truncated payload: {len(data)} of {reader.total_bytes} bytes")
    if len(data) > reader.total_bytes:
        raise PayloadError(f"payload has {len(data) - reader.total_bytes} bytes past its end")
    view = memoryview(data)
    layers = []
    for i in range(reader.layout.num_layers):
        start, end = reader.segment_range(i)
        layers.append(reader.unpack_layer(i, view[start:end], dtype))
    return reader, layers
