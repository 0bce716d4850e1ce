"""The memory-mapped safetensors reader: zero-copy views, shards with an index, and clear errors for truncated
files, missing tensors and wrong shapes."""

from __future__ import annotations

import json
import mmap as mmap_module
import os

import pytest
import torch
from safetensors.torch import save_file

from hybridmoe.checkpoint.safetensors_reader import CheckpointError, CheckpointReader


def _write_sharded(tmp_path):
    a = {"x.weight": torch.randn(4, 3), "y.bias": torch.arange(5, dtype=torch.int32)}
    b = {"z.weight": torch.randn(2, 2).to(torch.bfloat16), "w.fp8": torch.randn(3, 4).to(torch.float8_e4m3fn)}
    save_file(a, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(b, str(tmp_path / "model-00002-of-00002.safetensors"))
    weight_map = {**{k: "model-00001-of-00002.safetensors" for k in a}, **{k: "model-00002-of-00002.safetensors" for k in b}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return {**a, **b}


def test_sharded_checkpoint_round_trips_and_is_zero_copy(tmp_path):
    tensors = _write_sharded(tmp_path)
    reader = CheckpointReader(tmp_path)
    assert sorted(reader.names()) == sorted(tensors)
    for name, ref in tensors.items():
        got = reader.get(name)
        assert got.dtype == ref.dtype and got.shape == ref.shape
        assert torch.equal(got.view(torch.uint8), ref.contiguous().view(torch.uint8))
    a, b = reader.get("x.weight"), reader.get("x.weight")
    assert a.data_ptr() == b.data_ptr()  # both are views of the same mapped pages, not copies


def _vm_flags(path) -> list[list[str]]:
    """The VmFlags of each of this process's mappings of `path` (/proc/self/smaps)."""
    flags, current = [], None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if line[0] in "0123456789abcdef" and "-" in fields[0]:
                current = fields[-1] if len(fields) >= 6 else None
            elif line.startswith("VmFlags:") and current == str(path):
                flags.append(fields[1:])
    return flags


@pytest.mark.skipif(not (hasattr(mmap_module, "MADV_HUGEPAGE") and os.path.exists("/proc/self/smaps")
                         and os.path.exists("/sys/kernel/mm/transparent_hugepage")),
                    reason="needs Linux with transparent huge pages and /proc/self/smaps")
def test_mapped_files_are_advised_for_huge_pages(tmp_path):
    save_file({"w": torch.randn(256, 256)}, str(tmp_path / "model.safetensors"))
    reader = CheckpointReader(tmp_path)
    assert _vm_flags(tmp_path / "model.safetensors") == []  # mapped on first use only
    reader.get("w")
    flags = _vm_flags(tmp_path / "model.safetensors")
    assert len(flags) == 1 and "hg" in flags[0]  # VM_HUGEPAGE


def test_truncated_file_names_the_file_and_tensor(tmp_path):
    save_file({"a": torch.randn(64, 64), "b": torch.randn(64, 64)}, str(tmp_path / "model.safetensors"))
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated: tensor '[ab]'"):
        CheckpointReader(tmp_path)
    path.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match="truncated safetensors file"):
        CheckpointReader(tmp_path)


def test_missing_tensor_wrong_shape_and_wrong_dtype(tmp_path):
    save_file({"a": torch.randn(2, 3)}, str(tmp_path / "model.safetensors"))
    reader = CheckpointReader(tmp_path)
    with pytest.raises(CheckpointError, match="missing tensor 'b'"):
        reader.get("b")
    with pytest.raises(CheckpointError, match=r"tensor 'a' has shape \[2, 3\], expected \[3, 2\]"):
        reader.get_checked("a", (3, 2))
    with pytest.raises(CheckpointError, match="has dtype torch.float32"):
        reader.get_checked("a", (2, 3), (torch.bfloat16,))


def test_index_listing_a_missing_shard_or_tensor(tmp_path):
    _write_sharded(tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["ghost.weight"] = "model-00001-of-00002.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="'ghost.weight' is listed in model-00001"):
        CheckpointReader(tmp_path)
    data["weight_map"]["ghost.weight"] = "model-00009-of-00009.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="shard model-00009-of-00009.safetensors is listed but missing"):
        CheckpointReader(tmp_path)


def test_empty_directory(tmp_path):
    with pytest.raises(CheckpointError, match="no \\*.safetensors files"):
        CheckpointReader(tmp_path)
