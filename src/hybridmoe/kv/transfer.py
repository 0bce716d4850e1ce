"""A SpectrumKV payload between processes over torch.distributed (gloo: TCP, loopback or another machine).

The sender sends the head (prefix, header, tier map) as soon as the tiers are chosen, then each layer's segment
as it is packed; the receiver validates the head, preallocates the payload from it (refusing one larger than
its capacity: `payload_capacity`), receives each segment into its place and unpacks it layer by layer, e.g.
straight into its paged cache. Messages: a 1-element int64 tensor with the head's length, the head, then one
uint8 tensor per layer. Both sides time themselves and count the bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridmoe.kv.layout import KVLayout
from hybridmoe.kv.payload import PayloadError, PayloadReader


@dataclass
class TransferStats:
    bytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def send_payload(head: bytes, segments: Iterable[bytes], dst: int, group=None) -> TransferStats:
    """Send the head, then each segment as it comes (a generator may pack layers meanwhile)."""
    start = time.perf_counter()
    dist.send(torch.tensor([len(head)], dtype=torch.int64), dst, group=group)
    dist.send(torch.frombuffer(bytearray(head), dtype=torch.uint8), dst, group=group)
    sent = len(head)
    for segment in segments:
        dist.send(torch.frombuffer(bytearray(segment), dtype=torch.uint8), dst, group=group)
        sent += len(segment)
    return TransferStats(sent, time.perf_counter() - start)


def receive_payload(src: int, *, capacity: int, model: str | None = None, layout: KVLayout | None = None,
                    on_layer: Callable[[int, torch.Tensor], None] | None = None, dtype: torch.dtype = torch.float32,
                    group=None) -> tuple[PayloadReader, bytearray, TransferStats]:
    """Receive one payload into a buffer preallocated for `capacity` bytes; on_layer(i, rows [n, W]) is called
    as each layer arrives. -> (reader, the payload bytes, stats)."""
    buffer = bytearray(capacity)
    start = time.perf_counter()
    length = torch.zeros(1, dtype=torch.int64)
    dist.recv(length, src, group=group)
    head_len = int(length)
    if head_len > capacity:
        raise PayloadError(f"payload head of {head_len} bytes exceeds the preallocated {capacity}")
    view = torch.frombuffer(buffer, dtype=torch.uint8)
    dist.recv(view[:head_len], src, group=group)
    reader = PayloadReader(memoryview(buffer)[:head_len], model=model, layout=layout, capacity=capacity)
    for i in range(reader.layout.num_layers):
        lo, hi = reader.segment_range(i)
        dist.recv(view[lo:hi], src, group=group)
        if on_layer is not None:
            on_layer(i, reader.unpack_layer(i, memoryview(buffer)[lo:hi], dtype))
    stats = TransferStats(reader.total_bytes, time.perf_counter() - start)
    return reader, buffer[: reader.total_bytes], stats
