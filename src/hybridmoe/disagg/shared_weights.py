"""One copy, for both PD workers, of the weights the loader makes at load: a named shared-memory segment.

The loader views most weights in the mapped checkpoint, which the page cache holds once for every process; what it
makes instead (models/transformed_weights.py: weights converted to the compute dtype, FP8 ones dequantised,
routers in float32), and the kernels' copies of the experts per NUMA node (ExpertWeights.shard_storage), would be
each worker's own. `SharedWeights` is the `TransformedWeights` of a worker: the first
to load writes each such weight into the segment `<front prefix>weights-<fingerprint hash>` and computes from it;
the other, and a worker restarted after a crash, map the segment read-only and compute from its tensors (zero-copy,
as from the checkpoint's) without making them again. The segment is removed with the front's other segments
(`shm.sweep`: on shutdown, and by a worker whose front died).

Layout: a header (magic, version, then the index's offset and length, both 0 until the segment is complete), the
tensors from byte 4096, each 64-byte aligned, then the index: JSON with the fingerprint (model files, compute
dtype) and key -> [dtype, shape, offset]. A segment of another fingerprint or an incomplete one (its builder died)
is rebuilt, never used; one whose load failed is removed. Opening takes an exclusive flock of the segment, held by
a builder until it is complete: the second worker waits for the first instead of building too. The builder
reserves the most the weights can take (a sparse file: 8 bytes per element of every checkpoint tensor, its float32
copy and one derived from it) and trims it when done; each tensor's pages are allocated before they are written
(no room: that tensor and the rest stay private, with a warning).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import struct
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from hybridmoe.checkpoint.safetensors_reader import CheckpointReader
from hybridmoe.disagg.shm import Segment, remove, shm_dir
from hybridmoe.models.transformed_weights import PrivateWeights

VERSION = 1
MAGIC = b"HMWEIGHT"
HEADER = struct.Struct("<8sIQQ")  # magic, version, index offset, index length
DATA_START = 4096
ALIGN = 64
DISABLE_ENV = "HYBRIDMOE_PD_SHARED_WEIGHTS"  # "0": each worker keeps its own copy (to measure the difference)


def enabled() -> bool:
    return os.environ.get(DISABLE_ENV, "1") != "0"


def fingerprint(model_dir: str | Path, dtype: torch.dtype) -> dict:
    """What the segment's tensors depend on: the checkpoint files and config (path, size, mtime) and the dtype."""
    model_dir = Path(model_dir).resolve()
    files = sorted(p for p in model_dir.iterdir() if p.suffix == ".safetensors" or p.name == "config.json")
    return {"version": VERSION, "model": str(model_dir), "dtype": str(dtype),
            "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]}


def segment_name(prefix: str, fp: dict) -> str:
    return f"{prefix}weights-{hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]}"


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class SharedWeights:
    """`with SharedWeights(prefix, model_dir, dtype) as weights: LLMEngine(..., transformed=weights)`.

    Entering maps the complete segment (`built` False) or locks it for building (`built` True); leaving after a
    load completes the segment and unlocks it (after a failed load, removes it: nobody maps an incomplete one).
    `private`: how many transformed weights this process holds in its own memory (none where there was room)."""

    def __init__(self, prefix: str, model_dir: str | Path, dtype: torch.dtype):
        self.model_dir, self.fingerprint = Path(model_dir), fingerprint(model_dir, dtype)
        self.name = segment_name(prefix, self.fingerprint)
        self.built, self.private = False, 0
        self.index: dict[str, list] = {}
        self._fd: int | None = None
        self._segment: Segment | None = None
        self._end = DATA_START
        self._full = False

    def __enter__(self) -> "SharedWeights":
        fd = os.open(shm_dir() / self.name, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # released by the kernel if this process dies
            index = self._complete_index(fd)
            if index is not None:
                self.index = index["tensors"]
                self._segment = Segment(self.name, os.dup(fd), os.fstat(fd).st_size, readonly=True)
                _unlock(fd)
                return self
            # build: a sparse file as large as the weights could be (never touched beyond what is written)
            entries = CheckpointReader(self.model_dir).entries.values()
            capacity = DATA_START + sum(8 * e.nbytes + 2 * ALIGN for e in entries)
            os.ftruncate(fd, 0)
            os.ftruncate(fd, capacity)
            self._segment = Segment(self.name, os.dup(fd), capacity)
        except BaseException:
            _unlock(fd)
            raise
        self._fd, self.built = fd, True
        return self

    def _complete_index(self, fd: int) -> dict | None:
        """The segment's index when it is complete and of this fingerprint, else None."""
        size = os.fstat(fd).st_size
        if size < DATA_START:
            return None
        magic, version, offset, length = HEADER.unpack(os.pread(fd, HEADER.size, 0))
        if magic != MAGIC or version != VERSION or offset < DATA_START or offset + length != size:
            return None
        try:
            index = json.loads(os.pread(fd, length, offset))
        except ValueError:
            return None
        return index if index.get("fingerprint") == self.fingerprint else None

    def get(self, key: str, shape: tuple[int, ...], dtype: torch.dtype,
            fill: Callable[[torch.Tensor], object]) -> torch.Tensor:
        if self.built:
            return self._put(key, shape, dtype, fill)
        entry = self.index.get(key)
        if entry is None:  # the builder had no room for it
            self.private += 1
            return PrivateWeights().get(key, shape, dtype, fill)
        if entry[0] != str(dtype) or tuple(entry[1]) != tuple(shape):
            raise ValueError(f"shared weights segment {self.name}: {key} is {entry[0]} {entry[1]}, the loader "
                             f"expects {dtype} {list(shape)}")
        return self._view(entry[2], dtype, shape)

    def _put(self, key: str, shape: tuple[int, ...], dtype: torch.dtype, fill) -> torch.Tensor:
        """The weight filled into the segment (a view of it), or into private memory when there is no room."""
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        offset = _align(self._end)
        if nbytes == 0 or self._full:
            self.private += nbytes > 0
            return PrivateWeights().get(key, shape, dtype, fill)
        try:
            if offset + nbytes > self._segment.size:
                raise OSError(errno.EFBIG, "more than the reservation")
            os.posix_fallocate(self._fd, offset, nbytes)  # no room: an error here, not SIGBUS on writing
        except OSError as error:
            if error.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                raise
            self._full = True
            print(f"hybridmoe: no room in {shm_dir()} for shared weights ({error}); the rest stay per worker",
                  file=sys.stderr)
            return self._put(key, shape, dtype, fill)
        view = self._view(offset, dtype, shape)
        fill(view)
        self.index[key] = [str(dtype), list(shape), offset]
        self._end = offset + nbytes
        return view

    def _view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        if not shape or 0 in shape:
            return torch.empty(shape, dtype=dtype)
        count = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        with warnings.catch_warnings():  # a reader's mapping is read-only; weights are never written
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(self._segment.buf, dtype=torch.uint8, count=count, offset=offset)
        return flat.view(dtype).view(shape)

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if exc_type is None:
                index = json.dumps({"fingerprint": self.fingerprint, "tensors": self.index}).encode()
                offset = _align(self._end)
                os.ftruncate(fd, offset + len(index))  # the reservation trimmed to what was written
                os.pwrite(fd, index, offset)
                os.pwrite(fd, HEADER.pack(MAGIC, VERSION, offset, len(index)), 0)  # complete from here on
            else:  # the load failed: removed (a worker waiting for it builds its own, the next a new one)
                remove(self.name)
        finally:
            _unlock(fd)


def _unlock(fd: int) -> None:
    """Release the flock and close fd. Explicitly: the mapping holds a duplicate of fd (mmap's own), and the lock
    would last as long as it does."""
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
