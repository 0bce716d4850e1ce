"""SharedWeights in one process (the PD workers' use of it: test_pd_memory.py): the first load writes what the loader
makes (a bf16 checkpoint computed in float32, FP8 weights dequantised) into the segment, a second load maps it
without making anything, every weight of that model is a view of the checkpoint or of the segment, and its logits
are the private load's bit for bit; a segment of another model, dtype or an incomplete one is never used."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from hybridmoe.checkpoint.fp8 import write_fp8_checkpoint
from hybridmoe.disagg.shared_weights import HEADER, SharedWeights, fingerprint, segment_name
from hybridmoe.disagg.shm import list_segments, owner_prefix, shm_dir, sweep
from hybridmoe.layers.rope import RotaryEmbedding
from hybridmoe.models.loader import load_model
from hybridmoe.runtime.model_runner import ModelRunner, SequenceChunk


@pytest.fixture
def prefix():
    prefix = owner_prefix() + "test-weights-"
    yield prefix
    sweep(prefix)


def mapped_files() -> list[tuple[int, int, str]]:
    """(start, end, path) of this process's file mappings."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6:
                start, end = (int(x, 16) for x in parts[0].split("-"))
                out.append((start, end, parts[5].strip()))
    return out


def weight_tensors(obj, seen=None) -> list[torch.Tensor]:
    """Every tensor reachable from the model's objects (but the rotary embedding's computed frequencies)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, (RotaryEmbedding, str, int, float, bool, type(None))):
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        children = list(obj)
    elif dataclasses.is_dataclass(obj) or hasattr(obj, "__dict__"):
        children = list(vars(obj).values()) if hasattr(obj, "__dict__") else []
    else:
        return []
    return [t for child in children for t in weight_tensors(child, seen)]


def where(tensors: list[torch.Tensor]) -> dict[str, int]:
    """Bytes of the tensors by the file mapping holding them ("private" when none)."""
    maps, out = mapped_files(), {}
    for t in tensors:
        ptr = t.data_ptr()
        path = next((p for start, end, p in maps if start <= ptr < end), "private") if t.numel() else "empty"
        path = ("checkpoint" if path.endswith(".safetensors") else  # anonymous memory, the heap: "private"
                "private" if not path.startswith("/") else os.path.basename(path))
        out[path] = out.get(path, 0) + t.numel() * t.element_size()
    return out


def logits(model) -> torch.Tensor:
    runner = ModelRunner(model, num_blocks=8, block_size=8)
    return runner.forward([SequenceChunk([5, 17, 33, 8, 90, 12, 61], 0, [0]), SequenceChunk([44, 3], 0, [1])],
                          all_logits=True)


@pytest.mark.parametrize("case", ["bf16-as-float32", "fp8-as-bfloat16"])
def test_second_load_maps_what_the_first_made(tiny_model_dir, tmp_path, prefix, case):
    if case == "bf16-as-float32":
        model_dir, dtype = tiny_model_dir("qwen3_moe", dtype=torch.bfloat16), torch.float32
    else:  # dense weights dequantised from FP8 into bf16, routers into float32
        model_dir = write_fp8_checkpoint(tiny_model_dir("deepseek_v3"), tmp_path / "fp8")
        dtype = torch.bfloat16
    private = load_model(model_dir, dtype)
    made = where(weight_tensors(private))["private"]
    assert made > 0  # this model has weights the loader makes

    with SharedWeights(prefix, model_dir, dtype) as first:
        built = load_model(model_dir, dtype, transformed=first)
    assert first.built and first.private == 0
    with SharedWeights(prefix, model_dir, dtype) as second:
        second_model = load_model(model_dir, dtype, transformed=second)
    assert not second.built and second.private == 0 and second.index.keys() == first.index.keys()
    assert list_segments(prefix) == [shm_dir() / first.name]

    for model in (built, second_model):  # nothing of its own: the checkpoint's pages or the segment's
        placed = where(weight_tensors(model))
        assert set(placed) == {"checkpoint", first.name}, placed
        assert placed[first.name] == made
    assert torch.equal(logits(second_model), logits(private))
    assert torch.equal(logits(built), logits(private))


def test_a_segment_of_another_model_or_dtype_is_not_used(tiny_model_dir, prefix):
    model_dir = tiny_model_dir("qwen3_moe", dtype=torch.bfloat16)
    other_dir = tiny_model_dir("qwen3_moe", dtype=torch.bfloat16, seed=1)
    # other dtype, other model: other names
    names = {segment_name(prefix, fingerprint(d, t)) for d in (model_dir, other_dir)
             for t in (torch.float32, torch.float16)}
    assert len(names) == 4
    with SharedWeights(prefix, other_dir, torch.float16) as other:
        load_model(other_dir, torch.float16, transformed=other)
    # another model's complete segment under this one's name (as a stale one would be): rebuilt, not used
    mine = segment_name(prefix, fingerprint(model_dir, torch.float16))
    os.rename(shm_dir() / other.name, shm_dir() / mine)
    with SharedWeights(prefix, model_dir, torch.float16) as weights:
        model = load_model(model_dir, torch.float16, transformed=weights)
    assert weights.built
    assert torch.equal(logits(model), logits(load_model(model_dir, torch.float16)))
    # an incomplete segment (its builder died before the index): rebuilt
    with open(shm_dir() / mine, "r+b") as f:
        f.write(HEADER.pack(b"HMWEIGHT", 1, 0, 0))
    with SharedWeights(prefix, model_dir, torch.float16) as again:
        load_model(model_dir, torch.float16, transformed=again)
    assert again.built
    with SharedWeights(prefix, model_dir, torch.float16) as mapped:
        load_model(model_dir, torch.float16, transformed=mapped)
    assert not mapped.built


def test_a_failed_load_removes_it_and_the_next_builds_it(tiny_model_dir, prefix):
    model_dir = tiny_model_dir("qwen3_moe", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="boom"):
        with SharedWeights(prefix, model_dir, torch.float32) as weights:
            load_model(model_dir, torch.float32, transformed=weights)
            raise RuntimeError("boom")
    assert list_segments(prefix) == []
    with SharedWeights(prefix, model_dir, torch.float32) as again:
        load_model(model_dir, torch.float32, transformed=again)
    assert again.built and again.private == 0


def test_what_does_not_fit_stays_private_in_both(tiny_model_dir, prefix):
    model_dir = tiny_model_dir("qwen3_moe", dtype=torch.bfloat16)
    big = (1 << 20, 64)  # 256 MB of float32: more than the reservation for this checkpoint (8 bytes an element)
    ones = lambda out: out.fill_(1)  # noqa: E731
    with SharedWeights(prefix, model_dir, torch.float32) as first:
        small = first.get("small", (4, 4), torch.float32, ones)
        large = first.get("large", big, torch.float32, lambda out: out[:2].fill_(2))
        after = first.get("after", (4,), torch.float32, ones)  # once full, the rest stays private too
    assert first.private == 2 and list(first.index) == ["small"]
    assert where([small]) == {first.name: 64} and where([large, after])["private"] == large.nbytes + 16
    with SharedWeights(prefix, model_dir, torch.float32) as second:
        assert torch.equal(second.get("small", (4, 4), torch.float32, None), small)
        made = second.get("after", (4,), torch.float32, ones)
    assert second.private == 1 and torch.equal(made, after)
