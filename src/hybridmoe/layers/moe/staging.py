"""Bounded pinned staging for host -> accelerator copies of weights that live in pageable memory.

Routed experts are zero-copy views of the memory-mapped checkpoint: pageable memory, which the accelerator cannot
read asynchronously, and far too large to page-lock whole (DeepSeek-V3's experts are ~650 GB). `HostStaging` holds
a few page-locked buffers of a fixed size (two by default: 2 x 64 MiB) and moves bytes through them: host memcpy
into a staging buffer, then an async copy from it to the device on the caller's stream. Before a buffer is
refilled the host waits for the device copy that last read it, so with two buffers the memcpy of one piece
overlaps the transfer of the previous one. The page-locked memory never grows past `pinned_bytes`.

A copy is described by its destination (one contiguous byte range of a device buffer) and the host tensors that
land in it at given offsets; pieces of several tensors are packed into one staging buffer, so small tensors
(block scales) do not cost a transfer each.

When page-locking fails (a locked-memory limit, a container without the privilege) the staging falls back to
copying each tensor straight from pageable memory (synchronous for the host, slower), with a warning, and reports
`mode` "pageable". On the CPU stand-in the staging buffers are ordinary host memory standing in for page-locked
memory: the same code path, the same copies.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from hybridmoe.accel.accelerator import Accelerator, Event, Stream

DEFAULT_STAGING_BYTES = 64 << 20  # per buffer


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's storage as a flat uint8 view (a contiguous copy first if it is not contiguous)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def pin(accel: Accelerator, buffer: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Page-lock a host buffer for async copies to `accel`: (buffer, True), or (buffer, False) when that fails.
    The stand-in has no page-locked memory of its own: host memory stands in for it."""
    if not accel.is_cuda:
        return buffer, True
    return accel.pinned(buffer)


@dataclass(frozen=True)
class Piece:
    offset: int  # byte offset in the destination range
    src: torch.Tensor  # host tensor (any dtype, contiguous)


class HostStaging:
    def __init__(self, accel: Accelerator, buffer_bytes: int = DEFAULT_STAGING_BYTES, buffers: int = 2):
        if buffer_bytes < 1 or buffers < 1:
            raise ValueError(f"staging needs at least one buffer of at least one byte, got {buffers} x {buffer_bytes}")
        self.accel = accel
        self.buffers: list[torch.Tensor] = []
        for _ in range(buffers):
            buffer, ok = pin(accel, torch.empty(buffer_bytes, dtype=torch.uint8))
            if not ok:
                self.buffers = []
                warnings.warn(f"page-locking {buffers} x {buffer_bytes / 2**20:.0f} MiB of staging memory failed: "
                              "streamed weights are copied from pageable memory (slower, synchronous for the host)",
                              RuntimeWarning, stacklevel=2)
                break
            self.buffers.append(buffer)
        self.buffer_bytes = buffer_bytes
        self._last_read: list[Event | None] = [None] * len(self.buffers)  # the device copy that last read each
        self._next = 0

    @property
    def mode(self) -> str:
        return "pinned" if self.buffers else "pageable"

    @property
    def pinned_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def copy(self, stream: Stream, dst: torch.Tensor, pieces: list[Piece], label: str) -> int:
        """Issue on `stream` the copy of every piece's bytes into dst (a flat uint8 device range) at its offset;
        bytes of dst between pieces are left as they are or filled with padding. Returns the bytes transferred."""
        if not self.buffers:
            for piece in pieces:
                src = as_bytes(piece.src)
                stream.copy(dst[piece.offset:piece.offset + src.numel()], src, label + " (pageable)")
            return sum(p.src.nbytes for p in pieces)
        pieces = sorted(pieces, key=lambda p: p.offset)
        end = max(p.offset + p.src.nbytes for p in pieces) if pieces else 0
        start = min(p.offset for p in pieces) if pieces else 0
        size, index, moved = self.buffer_bytes, 0, 0
        for window in range(start, end, size):  # one staging buffer per window of the destination
            stop = min(window + size, end)
            i, buffer = self._take()
            while index < len(pieces) and pieces[index].offset + pieces[index].src.nbytes <= window:
                index += 1
            for piece in pieces[index:]:
                if piece.offset >= stop:
                    break
                src = as_bytes(piece.src)
                lo, hi = max(window, piece.offset), min(stop, piece.offset + src.numel())
                buffer[lo - window:hi - window].copy_(src[lo - piece.offset:hi - piece.offset])
            stream.copy(dst[window:stop], buffer[:stop - window], label)
            self._last_read[i] = stream.record(f"staging {i} read")
            moved += stop - window
        return moved

    def _take(self) -> tuple[int, torch.Tensor]:
        """The next staging buffer, once the device copy that last read it is done (the host waits)."""
        i = self._next
        self._next = (i + 1) % len(self.buffers)
        if self._last_read[i] is not None:
            self._last_read[i].synchronize()
            self._last_read[i] = None
        return i, self.buffers[i]
