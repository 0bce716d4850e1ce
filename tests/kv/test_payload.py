"""The packed payload: round trip, size within the budget, refusals (another model, version or layout,
truncated, corrupted, too large), and the layer-by-layer reader."""

from __future__ import annotations

import struct
import zlib

import pytest
import torch

from hybridmoe.kv import payload as P
from hybridmoe.kv.allocation import LADDER_3, Tier, allocate
from hybridmoe.kv.importance import position_importance
from hybridmoe.kv.layout import KVLayout

LAYOUT = KVLayout("mla", 3, (64, 16))


def _payload(budget=0.3, n=203, full_dtype="float32", layout=LAYOUT):
    g = torch.Generator().manual_seed(3)
    layers = [torch.randn(n, layout.row_width, generator=g) for _ in range(layout.num_layers)]
    tiers = allocate(torch.rand(n, generator=g), budget, LADDER_3)
    writer = P.PayloadWriter(layout, tiers, model="m1", full_dtype=full_dtype, int4_verdict="int4-allowed")
    return writer, layers, P.pack(writer, layers)


@pytest.mark.parametrize("budget", [0.2, 0.3, 0.5, 0.75, 1.0])
def test_round_trip_and_size(budget):
    writer, layers, data = _payload(budget, full_dtype="bfloat16")
    assert len(data) == writer.total_bytes <= P.payload_capacity(LAYOUT, 203, budget, "bfloat16")
    values = 203 * LAYOUT.row_width * 2 * LAYOUT.num_layers * budget
    scales = 203 * LAYOUT.num_groups * 2 * LAYOUT.num_layers
    assert len(data) <= values + scales + 4096  # the header, tier map and alignment: a few KB
    reader, back = P.unpack(data, model="m1", layout=LAYOUT)
    assert reader.header["int4_verdict"] == "int4-allowed" and reader.header["ladder"] == ["fp16", "int8", "int4"]
    assert torch.equal(reader.tiers, writer.tiers)
    for rows, out in zip(layers, back):
        for tier, tol in ((Tier.FULL, 2**-7), (Tier.INT8, 1 / 127), (Tier.INT4, 1 / 7)):
            sel = reader.tiers == tier
            if sel.any():
                err = (rows[sel] - out[sel]).abs().amax(1) / rows[sel].abs().amax(1)
                assert (err <= tol).all()
        assert (out[reader.dropped] == 0).all()
    assert (reader.dropped == (writer.tiers == Tier.DROP)).all()


def test_full_float32_tier_is_exact():
    writer, layers, data = _payload(1.0)
    _, back = P.unpack(data)
    assert all(torch.equal(a, b) for a, b in zip(layers, back))


def test_segments_are_aligned_and_read_one_by_one():
    writer, layers, data = _payload(0.4)
    head = writer.head()
    assert len(head) % P.ALIGN == 0
    reader = P.PayloadReader(head)  # the head alone is enough to start
    for i, rows in enumerate(layers):
        lo, hi = reader.segment_range(i)
        assert lo % P.ALIGN == 0
        segment = writer.pack_layer(i, rows)
        assert segment == data[lo:hi]
        torch.testing.assert_close(reader.unpack_layer(i, segment), P.unpack(data)[1][i])


def _refused(data, match, **kw):
    with pytest.raises(P.PayloadError, match=match):
        P.unpack(data, **kw)


def test_refuses_other_model_version_layout_and_capacity():
    writer, _, data = _payload()
    _refused(data, "is for model m1", model="m2")
    _refused(data, "layout", layout=KVLayout("mla", 3, (64, 32)))
    bumped = bytearray(data)
    struct.pack_into("<H", bumped, 4, P.FORMAT_VERSION + 1)
    _refused(bytes(bumped), "format version")
    _refused(b"GGUF" + data[4:], "not a SpectrumKV payload")
    text = b'{"format": "hybridmoe-spectrumkv", "version": 1}'
    _refused(P.PREFIX.pack(P.MAGIC, P.FORMAT_VERSION, 0, len(text), zlib.crc32(text)) + text, "no 'model'")
    with pytest.raises(P.PayloadError, match="exceeds the preallocated"):
        P.PayloadReader(data, capacity=len(data) - 1)


def test_refuses_truncated_and_corrupted_payloads():
    writer, _, data = _payload()
    for cut in (3, 40, len(writer.head()) - 1, len(data) - 1):
        _refused(data[:cut], "truncated")
    _refused(data + b"\0", "past its end")
    reader = P.PayloadReader(data)
    for offset, what in ((P.PREFIX.size + 5, "header checksum"), (reader.map_offset, "tier map"),
                         (reader.segment_range(1)[0] + 20, "layer 1's segment checksum")):
        bad = bytearray(data)
        bad[offset] ^= 0x10
        _refused(bytes(bad), what)
    lo0, hi0 = reader.segment_range(0)
    lo1, hi1 = reader.segment_range(1)
    swapped = data[:lo0] + data[lo1:hi1] + data[hi0:]
    _refused(swapped, "segment of layer 1 where layer 0")


def test_tier_map_two_bits_per_token():
    tiers = torch.tensor([0, 1, 2, 3, 3, 2, 1], dtype=torch.uint8)
    packed = P.pack_tier_map(tiers)
    assert len(packed) == 2 and packed[0] == 0b11100100
    assert torch.equal(P.unpack_tier_map(packed, 7), tiers)


def test_writer_refuses_tiers_outside_its_ladder():
    tiers = allocate(position_importance(50), 0.3, LADDER_3)
    with pytest.raises(ValueError, match="outside the ladder"):
        P.PayloadWriter(LAYOUT, tiers, model="m", ladder=(Tier.FULL, Tier.INT8))
