"""Stream-loading prefill on the CPU stand-in: the same greedy tokens as the plain engine (whole layers prefetched,
and only the activated experts) on tiny DeepSeek-V3 (FP8 experts), Qwen3-MoE and Mixtral models; the copy/compute
schedule read from the accelerator's trace; the device budget; bounded staging and its pageable fallback; a
streamer over a subset of the experts."""

from __future__ import annotations

import re

import pytest
import torch

from hybridmoe import LLM, SamplingParams
from hybridmoe.accel.accelerator import Accelerator, DeviceMemoryError
from hybridmoe.checkpoint.fp8 import write_fp8_checkpoint
from hybridmoe.kernels import isa
from hybridmoe.layers.moe import staging
from hybridmoe.layers.moe.backend import ExpertWeights
from hybridmoe.layers.moe.block import MoEBlock
from hybridmoe.layers.moe.stream_prefill import (DEFAULT_SLOT_BYTES, ExpertLayout, ExpertStreamer, StreamPrefill,
                                                   fitting_slot_bytes)
from hybridmoe.layers.moe.torch_backend import TorchExpertBackend
from hybridmoe.models.loader import load_model
from hybridmoe.runtime.model_runner import ModelRunner, SequenceChunk

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
MIN_TOKENS = 4  # prompts stream, decode steps (1 token each) stay on the CPU experts


@pytest.fixture(autouse=True)
def exact_cpu_kernels():
    """The plain engine's CPU kernels in float32 arithmetic (AMX and bf16 dot products round activations to bf16,
    ~3e-3, enough to flip a greedy token of a random tiny model); the streamed experts compute in float32."""
    exact = next(name for name in ("avx512", "avx2", "scalar") if name in isa.available_isas())
    with isa.use_isa(exact):
        yield


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(6, 300, (n,), generator=gen).tolist() for n in (5, 23, 11)]


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dir, tmp_path_factory):
    """model type -> directory; DeepSeek-V3 in its FP8 checkpoint format; more experts than the tiny defaults so
    that a short prompt leaves some unactivated."""
    fp8 = write_fp8_checkpoint(tiny_model_dir("deepseek_v3", n_routed_experts=16, num_hidden_layers=4),
                               tmp_path_factory.mktemp("fp8") / "deepseek_v3")
    return {"deepseek_v3": fp8, "qwen3_moe": tiny_model_dir("qwen3_moe", num_experts=16, num_hidden_layers=4),
            "mixtral": tiny_model_dir("mixtral", num_local_experts=8, num_hidden_layers=3)}


def _moe_blocks(model) -> list[MoEBlock]:
    return [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoEBlock)]


@pytest.mark.parametrize("model_type", ["deepseek_v3", "qwen3_moe", "mixtral"])
def test_same_greedy_tokens_as_the_plain_engine(model_dirs, model_type):
    plain = [r.token_ids for r in LLM(model_dirs[model_type], dtype="float32").generate(_prompts(), GREEDY)]
    for copy in ("all", "activated"):
        llm = LLM(model_dirs[model_type], dtype="float32")
        blocks = _moe_blocks(llm.engine.model)
        if model_type == "deepseek_v3":
            assert blocks[0].experts.weights.fmt == "fp8"  # streamed as the FP8 bytes the CPU kernels read
        activated: list[int] = []  # per streamed MoE layer: experts the chunk activated
        llm.engine.model.add_routing_observer(
            lambda _i, ids: activated.append(len(torch.unique(ids))) if ids.shape[0] >= MIN_TOKENS else None)
        slp = StreamPrefill(llm.engine.model, Accelerator("cpu"), min_tokens=MIN_TOKENS, copy=copy)
        streamed = [r.token_ids for r in llm.generate(_prompts(), GREEDY)]
        assert streamed == plain, copy
        stats = slp.stats()
        weights = blocks[0].experts.weights
        per_expert = weights.expert_bytes(0)
        layers = len(blocks)
        assert stats.passes >= 1 and stats.layers_copied == stats.passes * layers
        if copy == "all":
            assert stats.bytes == stats.passes * layers * weights.nbytes()
        else:
            assert stats.bytes == per_expert * sum(activated)
            if model_type != "mixtral":  # (its 8 experts may all be activated) 16 experts: some were not copied
                assert stats.bytes < stats.passes * layers * weights.nbytes()
        assert stats.copy_s > 0 and stats.copy_gbs > 0 and stats.staging == "pinned"


def _one_forward(model, prompt_len: int = 24):
    runner = ModelRunner(model, num_blocks=8, block_size=8)
    tokens = torch.randint(6, 300, (prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    return runner.forward([SequenceChunk(tokens, 0, [0, 1, 2])])


def _trace(accel: Accelerator) -> list[tuple[str, str, str]]:
    return [(e.kind, e.label, e.stream) for e in accel.events if not e.label.startswith("staging")]


def test_whole_layer_schedule_from_the_trace(model_dirs):
    model = load_model(model_dirs["qwen3_moe"], "float32")
    accel = Accelerator("cpu", trace=True)
    StreamPrefill(model, accel, min_tokens=MIN_TOKENS, copy="all")
    _one_forward(model)
    events = _trace(accel)
    layers = len(_moe_blocks(model))
    assert layers >= 3  # slot reuse is visible

    def first(kind: str, pattern: str, stream: str | None = None) -> int:
        return next(i for i, (k, label, s) in enumerate(events)
                    if k == kind and re.fullmatch(pattern, label) and (stream is None or s == stream))

    for kind, label, stream in events:
        if kind == "copy":  # layer l goes to slot l % 2
            layer, slot = map(int, re.fullmatch(r"layer (\d+) -> slot (\d+)", label).groups())
            assert slot == layer % 2 and stream == "copy"
    compute_waits = [(i, label) for i, (kind, label, stream) in enumerate(events)
                     if kind == "wait" and stream == "compute"]
    assert [label for _, label in compute_waits] == [f"layer {l} copied" for l in range(layers)]
    for l in range(layers):
        computes = first("compute", f"layer {l} experts")
        assert compute_waits[l][0] == computes - 1  # each compute waits for its own layer's copy, and only that
        if l + 1 < layers:  # the next layer's copy is issued before this layer's compute ends
            assert first("copy", f"layer {l + 1} -> slot {(l + 1) % 2}") < first("record", f"layer {l} computed")
        if l + 2 < layers:  # a slot is refilled only after the compute that last read it, waited on the copy stream
            wait = first("wait", f"layer {l} computed", "copy")
            assert first("record", f"layer {l} computed") < wait < first("copy", f"layer {l + 2} -> slot {l % 2}")
    assert all(not (kind == "wait" and stream == "copy" and not label.endswith("computed"))
               for kind, label, stream in events)


def test_activated_schedule_copies_after_the_layers_router(model_dirs):
    model = load_model(model_dirs["qwen3_moe"], "float32")
    accel = Accelerator("cpu", trace=True)
    routed: list[int] = []
    model.add_routing_observer(lambda index, ids: (routed.append(index), accel.mark_compute(f"router {index}")))
    StreamPrefill(model, accel, min_tokens=MIN_TOKENS, copy="activated")
    _one_forward(model, prompt_len=6)
    events = _trace(accel)
    index = {(kind, label): i for i, (kind, label, _) in reversed(list(enumerate(events)))}
    for l, layer_index in enumerate(routed):
        copy = index[("copy", f"layer {l} -> slot {l % 2}")]
        assert index[("compute", f"router {layer_index}")] < copy < index[("compute", f"layer {l} experts")]
        if l >= 1:  # not prefetched: issued after the previous layer computed
            assert index[("record", f"layer {l - 1} computed")] < copy


def test_device_budget_is_respected(model_dirs):
    model = load_model(model_dirs["mixtral"], "float32")
    weights = _moe_blocks(model)[0].experts.weights
    probe = Accelerator("cpu")
    ExpertStreamer([weights], probe).close()
    slots = probe.peak_bytes  # two slots, each one layer's experts (aligned)
    assert weights.nbytes() * 2 <= slots < weights.nbytes() * 2 + 2 * 256 * 3 * weights.num_experts
    with pytest.raises(DeviceMemoryError, match="slp.slot1"):
        StreamPrefill(model, Accelerator("cpu", budget_bytes=slots - 1))
    accel = Accelerator("cpu", budget_bytes=slots)
    slp = StreamPrefill(model, accel, min_tokens=MIN_TOKENS)
    _one_forward(model)
    assert slp.stats().passes == 1 and accel.peak_bytes <= slots
    slp.detach()
    assert accel.held_bytes == 0 and all(b.prefill_experts is None for b in _moe_blocks(model))


def test_small_staging_buffers_and_pageable_fallback(model_dirs, monkeypatch):
    plain = [r.token_ids for r in LLM(model_dirs["deepseek_v3"], dtype="float32").generate(_prompts(), GREEDY)]
    llm = LLM(model_dirs["deepseek_v3"], dtype="float32")
    slp = StreamPrefill(llm.engine.model, Accelerator("cpu"), MIN_TOKENS, staging_bytes=1000)  # many windows
    assert [r.token_ids for r in llm.generate(_prompts(), GREEDY)] == plain
    assert slp.stats().pinned_bytes == 2000 and slp.stats().staging == "pinned"

    monkeypatch.setattr(staging, "pin", lambda accel, buffer: (buffer, False))  # page-locking fails
    llm = LLM(model_dirs["deepseek_v3"], dtype="float32")
    accel = Accelerator("cpu", trace=True)
    with pytest.warns(RuntimeWarning, match="pageable memory"):
        slp = StreamPrefill(llm.engine.model, accel, MIN_TOKENS)
    assert [r.token_ids for r in llm.generate(_prompts(), GREEDY)] == plain
    stats = slp.stats()
    assert stats.staging == "pageable" and stats.pinned_bytes == 0 and stats.bytes > 0
    copies = [e.label for e in accel.events if e.kind == "copy"]
    assert copies and all(label.endswith("(pageable)") for label in copies)


def test_staging_packs_pieces_into_bounded_buffers():
    accel = Accelerator("cpu", trace=True)
    gen = torch.Generator().manual_seed(0)
    pieces = [staging.Piece(0, torch.randn(37, generator=gen)),  # 148 bytes
              staging.Piece(256, torch.randint(-128, 127, (300,), dtype=torch.int8, generator=gen)),
              staging.Piece(768, torch.randn(5, 3, generator=gen).to(torch.bfloat16))]
    dst = torch.zeros(1024, dtype=torch.uint8)
    host = staging.HostStaging(accel, buffer_bytes=200)
    moved = host.copy(accel.new_stream("copy"), dst, pieces, "pieces")
    for p in pieces:
        got = dst[p.offset:p.offset + p.src.nbytes].view(p.src.dtype).view(p.src.shape)
        assert torch.equal(got, p.src)
    assert moved == 768 + 30 and len([e for e in accel.events if e.kind == "copy"]) == -(-moved // 200)


def test_streamer_over_a_subset_of_experts():
    """What an expert-parallel rank does: stream only its experts (ids local to the subset)."""
    gen = torch.Generator().manual_seed(3)
    E, H, I, T, K = 6, 16, 8, 10, 2
    mat = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    full = [ExpertWeights("dense", [mat(I, H) for _ in range(E)], [mat(I, H) for _ in range(E)],
                          [mat(H, I) for _ in range(E)]) for _ in range(3)]
    owned = [1, 3, 4]
    streamer = ExpertStreamer([w.subset(owned) for w in full], Accelerator("cpu"))
    hidden = mat(T, H)
    ids = torch.randint(0, E, (T, K), generator=gen)
    weights = torch.rand(T, K, generator=gen)
    mine = torch.isin(ids, torch.tensor(owned))
    local = torch.where(mine, torch.searchsorted(torch.tensor(owned), ids), 0)
    streamer.load(0)
    streamer.load(1)
    for layer, w in enumerate(full):
        got = streamer.run(layer, hidden, local, weights * mine)
        if layer + 2 < len(full):
            streamer.load(layer + 2)
        expected = TorchExpertBackend(w).submit(hidden, ids, weights * mine)
        torch.testing.assert_close(got, expected)
    with pytest.raises(RuntimeError, match="not loaded"):
        streamer.run(0, hidden, local, weights)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (benchmarks/gpu_check.sh runs it)")
@pytest.mark.parametrize("model_type", ["deepseek_v3", "qwen3_moe", "mixtral"])
def test_cuda_same_greedy_tokens(model_dirs, model_type):
    """On a GPU: experts streamed through page-locked staging on a copy stream and copy thread, computed in float32
    on the device, give the plain engine's tokens, with whole-layer slots and with slots of 3 experts; the ledger
    stays within the budget given."""
    plain = [r.token_ids for r in LLM(model_dirs[model_type], dtype="float32").generate(_prompts(), GREEDY)]
    for copy, split in [("all", False), ("activated", False), ("all", True), ("activated", True)]:
        llm = LLM(model_dirs[model_type], dtype="float32")
        accel = Accelerator("cuda", budget_bytes=64 << 20)
        slot_bytes = _split_slot_bytes(llm.engine.model) if split else None  # splits of 3 experts, or whole layers
        slp = StreamPrefill(llm.engine.model, accel, min_tokens=MIN_TOKENS, copy=copy, slot_bytes=slot_bytes)
        assert [r.token_ids for r in llm.generate(_prompts(), GREEDY)] == plain, (copy, split)
        stats = slp.stats()
        assert stats.staging == "pinned" and stats.bytes > 0 and stats.copy_gbs > 0
        assert accel.peak_bytes <= 64 << 20
        slp.detach()


SPLIT = 3  # experts a slot holds in the split tests: far fewer than a layer's


def _split_slot_bytes(model) -> int:
    return SPLIT * ExpertLayout.of(_moe_blocks(model)[0].experts.weights).stride


@pytest.mark.parametrize("model_type", ["deepseek_v3", "qwen3_moe", "mixtral"])
def test_slots_smaller_than_a_layer_same_greedy_tokens(model_dirs, model_type):
    """Layers streamed as splits of 3 experts through two slots within a budget far below one layer: the plain
    engine's tokens, and the same bytes as whole layers / activated experts."""
    plain = [r.token_ids for r in LLM(model_dirs[model_type], dtype="float32").generate(_prompts(), GREEDY)]
    for copy in ("all", "activated"):
        llm = LLM(model_dirs[model_type], dtype="float32")
        blocks = _moe_blocks(llm.engine.model)
        weights = blocks[0].experts.weights
        slot_bytes = _split_slot_bytes(llm.engine.model)
        assert weights.num_experts > SPLIT and 2 * slot_bytes < weights.nbytes()
        activated: list[int] = []
        llm.engine.model.add_routing_observer(
            lambda _i, ids: activated.append(len(torch.unique(ids))) if ids.shape[0] >= MIN_TOKENS else None)
        accel = Accelerator("cpu", budget_bytes=2 * slot_bytes)
        slp = StreamPrefill(llm.engine.model, accel, min_tokens=MIN_TOKENS, copy=copy, slot_bytes=slot_bytes)
        assert [r.token_ids for r in llm.generate(_prompts(), GREEDY)] == plain, copy
        stats = slp.stats()
        layers = len(blocks)
        assert stats.experts_per_slot == SPLIT and stats.slot_bytes == slot_bytes
        assert accel.peak_bytes <= 2 * slot_bytes
        assert stats.passes >= 1 and stats.layers_copied == stats.passes * layers
        if copy == "all":
            assert stats.bytes == stats.passes * layers * weights.nbytes()
            assert stats.splits_copied == stats.passes * layers * -(-weights.num_experts // SPLIT)
        else:
            assert stats.bytes == weights.expert_bytes(0) * sum(activated)
            assert stats.splits_copied == sum(-(-n // SPLIT) for n in activated)
        slp.detach()
        assert accel.held_bytes == 0


@pytest.mark.parametrize("copy", ["all", "activated"])
def test_split_schedule_from_the_trace(model_dirs, copy):
    """Unit u (a split of a layer) goes to slot u % 2; each compute waits only for its own unit's copy; a slot is
    refilled only after the compute that last read it; with copy "all" the next unit's copy (the next split, or
    the next layer's first) is issued before the current unit's compute ends."""
    model = load_model(model_dirs["qwen3_moe"], "float32")
    accel = Accelerator("cpu", trace=True)
    StreamPrefill(model, accel, min_tokens=MIN_TOKENS, copy=copy, slot_bytes=_split_slot_bytes(model))
    _one_forward(model, prompt_len=24)
    events = _trace(accel)
    units = []  # (layer, split) in copy order, and their slots
    for kind, label, stream in events:
        if kind == "copy":
            layer, split, slot = map(int, re.fullmatch(r"layer (\d+) split (\d+) -> slot (\d+)", label).groups())
            assert slot == len(units) % 2 and stream == "copy"
            units.append((layer, split))
    layers = len(_moe_blocks(model))
    per_layer = [sum(1 for l, _ in units if l == layer) for layer in range(layers)]
    assert all(n >= 2 for n in per_layer)  # every layer took several splits
    if copy == "all":
        assert per_layer == [-(-16 // SPLIT)] * layers
    assert units == [(l, s) for l in range(layers) for s in range(per_layer[l])]  # the flat stream order
    names = [f"layer {l} split {s}" for l, s in units]
    at = {(kind, label): i for i, (kind, label, _) in reversed(list(enumerate(events)))}
    compute_waits = [label for kind, label, stream in events if kind == "wait" and stream == "compute"]
    assert compute_waits == [f"{name} copied" for name in names]
    for u, name in enumerate(names):
        computes = at[("compute", f"{name} experts")]
        assert events[computes - 1] == ("wait", f"{name} copied", "compute")
        if u + 1 < len(names) and (copy == "all" or units[u + 1][0] == units[u][0]):
            assert at[("copy", f"{names[u + 1]} -> slot {(u + 1) % 2}")] < at[("record", f"{name} computed")]
        if u + 2 < len(names):
            wait = next(i for i, (k, label, s) in enumerate(events)
                        if k == "wait" and s == "copy" and label == f"{name} computed")
            assert at[("record", f"{name} computed")] < wait < at[("copy", f"{names[u + 2]} -> slot {u % 2}")]
    assert all(not (kind == "wait" and stream == "copy" and not label.endswith("computed"))
               for kind, label, stream in events)


def test_split_streamer_matches_the_whole_layer():
    """A streamer over a subset of experts with slots of 2 experts, ids local to the subset: the layer's output
    equals the plain backend's, for every layer, including a layer no token routes to."""
    gen = torch.Generator().manual_seed(4)
    E, H, I, T, K = 7, 16, 8, 12, 2
    mat = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    full = [ExpertWeights("dense", [mat(I, H) for _ in range(E)], [mat(I, H) for _ in range(E)],
                          [mat(H, I) for _ in range(E)]) for _ in range(3)]
    owned = [0, 2, 3, 5, 6]
    stride = ExpertLayout.of(full[0]).stride
    accel = Accelerator("cpu")
    streamer = ExpertStreamer([w.subset(owned) for w in full], accel, slot_bytes=2 * stride + 1)
    assert streamer.capacity == 2 and accel.peak_bytes == 2 * 2 * stride
    hidden = mat(T, H)
    ids = torch.randint(0, E, (T, K), generator=gen)
    weights = torch.rand(T, K, generator=gen)
    mine = torch.isin(ids, torch.tensor(owned))
    local = torch.where(mine, torch.searchsorted(torch.tensor(owned), ids), 0)
    streamer.begin_pass()
    for layer in range(3):
        streamer.load(layer)
    for layer, w in enumerate(full):
        got = streamer.run(layer, hidden, local, weights * mine)
        torch.testing.assert_close(got, TorchExpertBackend(w).submit(hidden, ids, weights * mine))
    streamer.begin_pass()
    streamer.load(0, [1, 3, 4])  # activated: two splits
    streamer.load(1, [])  # no token routes to the layer
    picked = torch.tensor([1, 3, 4])
    sel = torch.isin(local, picked) & mine
    got = streamer.run(0, hidden, local, weights * sel)
    torch.testing.assert_close(got, TorchExpertBackend(full[0]).submit(hidden, ids, weights * sel))
    assert torch.count_nonzero(streamer.run(1, hidden[:0], local[:0], weights[:0])) == 0
    stats = streamer.stats()
    assert stats.splits_copied == 3 * 3 + 2 + 1 and stats.layers_copied == 3 + 2
    with pytest.raises(RuntimeError, match="not loaded"):
        streamer.run(2, hidden, local, weights)
    streamer.close()


def test_fitting_slot_bytes_cuts_the_slot_to_the_budget_left(model_dirs):
    """What the engine passes: the wanted slot, or half of what the budget has left; streaming then splits."""
    model = load_model(model_dirs["qwen3_moe"], "float32")
    layer = _moe_blocks(model)[0].experts.weights.nbytes()
    assert fitting_slot_bytes(Accelerator("cpu"), 12345) == 12345
    assert fitting_slot_bytes(Accelerator("cpu")) == DEFAULT_SLOT_BYTES
    accel = Accelerator("cpu", budget_bytes=layer)
    accel.empty((layer // 4,), torch.uint8, "resident")
    slot_bytes = fitting_slot_bytes(accel, 10**9)
    assert slot_bytes == (layer - layer // 4) // 2
    slp = StreamPrefill(model, accel, min_tokens=MIN_TOKENS, slot_bytes=slot_bytes)  # fits: 2 slots of < 3/8 layer
    stride = ExpertLayout.of(_moe_blocks(model)[0].experts.weights).stride
    assert 1 <= slp.stats().experts_per_slot == slot_bytes // stride < 16
    _one_forward(model)
    assert accel.peak_bytes <= layer
    slp.detach()
