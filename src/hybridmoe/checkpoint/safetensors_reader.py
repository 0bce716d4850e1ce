"""Memory-mapped, zero-copy reading of (sharded) safetensors checkpoints.

`CheckpointReader(model_dir)` parses every shard's header up front (validating offsets against the file size,
so a truncated download is reported before anything runs) and hands out tensors that are views of the
mmap'd file: nothing is read into RAM until a page is touched, so a 650 GB checkpoint "loads" instantly and
only the tensors that are used cost memory.

Each file's mapping is advised for transparent huge pages (MADV_HUGEPAGE): where the filesystem keeps large
folios in the page cache (ext4 on recent Linux), a page fault then reads the file in 2 MB folios mapped by one
page-table entry each, so the CPU expert kernels stream weights through far fewer TLB entries. Without the advice
the kernel reads around a fault in small folios wherever first touches are scattered, as the kernels' load-time
scan of fp8 rows and the routed experts' reads are, and the experts then stream up to a tenth slower than from
huge pages. With it, fault-time reads come in 2 MB units (what is read stays in the page cache for the tensors
around it). Pages already in the page cache keep the size they were cached with (docs/benchmarks.md, "The page
cache's pages": 16.8 MB projections read a third slower from 4 KB pages than from 2 MB ones on an AMX Xeon VM).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

INDEX_FILE = "model.safetensors.index.json"

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and the tensor."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class CheckpointReader:
    """All tensors of a model directory, by name, as zero-copy views of the memory-mapped shards."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self.entries: dict[str, TensorEntry] = {}
        self._maps: dict[Path, mmap.mmap] = {}
        for file in self._shard_files():
            for entry in _read_header(file):
                if entry.name in self.entries:
                    raise CheckpointError(f"{file}: tensor {entry.name!r} also appears in {self.entries[entry.name].file}")
                self.entries[entry.name] = entry
        self._check_index()

    def _shard_files(self) -> list[Path]:
        index = self.model_dir / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({e!r})") from None
            self._weight_map = weight_map
            files = sorted({self.model_dir / f for f in weight_map.values()})
            for f in files:
                if not f.is_file():
                    raise CheckpointError(f"{index}: shard {f.name} is listed but missing from {self.model_dir}")
            return files
        self._weight_map = None
        files = sorted(self.model_dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.model_dir}: no *.safetensors files (and no {INDEX_FILE})")
        return files

    def _check_index(self) -> None:
        if self._weight_map is None:
            return
        for name, shard in self._weight_map.items():
            entry = self.entries.get(name)
            if entry is None or entry.file.name != shard:
                raise CheckpointError(
                    f"{self.model_dir / INDEX_FILE}: tensor {name!r} is listed in {shard} but that shard does not hold it"
                )

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def names(self) -> list[str]:
        return list(self.entries)

    def entry(self, name: str) -> TensorEntry:
        if name not in self.entries:
            raise CheckpointError(f"{self.model_dir}: missing tensor {name!r}")
        return self.entries[name]

    def get(self, name: str) -> torch.Tensor:
        """The tensor `name` as a read-only view of the mapped file (no copy)."""
        entry = self.entry(name)
        mapped = self._maps.get(entry.file)
        if mapped is None:
            with open(entry.file, "rb") as fh:
                mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux: see the module's docstring
                with contextlib.suppress(OSError):  # a kernel without transparent huge pages: small pages
                    mapped.madvise(mmap.MADV_HUGEPAGE)
            self._maps[entry.file] = mapped
        if entry.nbytes == 0:
            return torch.empty(entry.shape, dtype=entry.dtype)
        with warnings.catch_warnings():  # the buffer is read-only; we never write to weights
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(mapped, dtype=torch.uint8, count=entry.nbytes, offset=entry.begin)
        return flat.view(entry.dtype).view(entry.shape)

    def get_checked(self, name: str, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...] | None = None) -> torch.Tensor:
        """`get(name)` after checking its shape (and dtype, when given) against what the model expects."""
        entry = self.entry(name)
        if entry.shape != tuple(shape):
            raise CheckpointError(f"{entry.file}: tensor {name!r} has shape {list(entry.shape)}, expected {list(shape)}")
        if dtypes is not None and entry.dtype not in dtypes:
            raise CheckpointError(f"{entry.file}: tensor {name!r} has dtype {entry.dtype}, expected one of {list(dtypes)}")
        return self.get(name)


def _read_header(file: Path) -> list[TensorEntry]:
    size = file.stat().st_size
    with open(file, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{file}: truncated safetensors file ({size} bytes, no header)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8:
            raise CheckpointError(f"{file}: truncated safetensors file (header of {header_len} bytes, file {size})")
        try:
            header = json.loads(fh.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{file}: corrupt safetensors header ({e})") from None
    data_start = 8 + header_len
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except KeyError as e:
            raise CheckpointError(f"{file}: tensor {name!r} has an unsupported or missing header field {e}") from None
        expected = dtype.itemsize * _numel(shape)
        if end - begin != expected:
            raise CheckpointError(f"{file}: tensor {name!r} spans {end - begin} bytes, its shape needs {expected}")
        if data_start + end > size:
            raise CheckpointError(
                f"{file}: truncated: tensor {name!r} ends at byte {data_start + end} but the file has {size} bytes"
            )
        entries.append(TensorEntry(name, file, dtype, shape, data_start + begin, data_start + end))
    return entries


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
