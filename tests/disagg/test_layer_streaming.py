"""The prompt's KV streamed layer by layer between two engines in one process (what the PD workers do when the
tiers are known before the prefill): the prefill engine's prompt-KV observer writes each layer into the segment as
soon as its forward has computed it, and the decode engine, holding KV blocks from reserve_adoption, unpacks that
layer while the later layers are still to be computed. Same greedy tokens as one engine on all three families,
with chunked prefill too; with position importance the streamed payload is the one packed after at any budget; a
cancelled adoption gives its blocks back; caches on CUDA stream too (with a GPU); nothing is left in /dev/shm."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridmoe.disagg import handoff
from hybridmoe.disagg.shm import list_segments, owner_prefix
from hybridmoe.kv.layout import KVLayout
from hybridmoe.runtime.engine import EngineConfig, LLMEngine
from hybridmoe.runtime.sampling_params import SamplingParams

from disagg.test_handoff import run_to_end

PROMPT = [5, 17, 33, 8, 90, 12, 61, 7, 200, 31, 4, 77, 19, 150, 2, 88, 43, 9, 120, 64, 3]
FAMILIES = ["deepseek_v3", "qwen3_moe", "mixtral"]
PREFIX = owner_prefix() + "test-stream-"
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def engine(model_dir, **config) -> LLMEngine:
    return LLMEngine(model_dir, EngineConfig(dtype="float32", kv_cache_gb=0.01, block_size=4, **config),
                     show_progress=False)


def prefilled(model_dir):
    """A prefill engine that has computed PROMPT (request "a") up to its first token, a decode engine, and the
    prompt's KV layout, model identity and cache slots [n] in the prefill engine."""
    pre, dec = engine(model_dir), engine(model_dir)
    pre.add_request(PROMPT, GREEDY, req_id="a")
    while not any(o.token_ids for o in pre.step()):
        pass
    slots = handoff.slots_of(pre.scheduler.block_manager.get_block_table("a"), len(PROMPT), 4)
    return pre, dec, KVLayout.from_config(pre.model_config), handoff.model_identity(pre.model_config), slots


class Streamer:
    """The prompt-KV observer of a prefill engine, writing into a segment that a decode engine reads at once."""

    def __init__(self, pre: LLMEngine, dec: LLMEngine):
        self.pre, self.dec = pre, dec
        self.layout = KVLayout.from_config(pre.model_config)
        self.identity = handoff.model_identity(pre.model_config)
        self.writer = self.reader = None
        self.seen: list[tuple[int, int]] = []  # (layer written, layers the reader had unpacked right after)

    def __call__(self, layer: int, prompts) -> None:
        (prompt,) = prompts
        n = len(prompt.prompt_ids)
        if layer == 0:
            policy = handoff.KVPolicy(1.0)
            self.writer = handoff.LayerWriter(PREFIX + prompt.req_id, self.layout, handoff.choose_tiers(n, policy),
                                              model=self.identity, full_dtype=self.pre.runner.kv_caches[0].dtype,
                                              policy=policy)
            self.src = handoff.slots_of(prompt.block_table, n, self.pre.config.block_size)
            table = self.dec.reserve_adoption(prompt.prompt_ids, GREEDY, prompt.req_id)
            self.reader = handoff.LayerReader(self.writer.segment.name, self.layout,
                                              handoff.slots_of(table, n, self.dec.config.block_size),
                                              model=self.identity)
        self.writer.write_layer(layer, self.pre.runner.kv_caches[layer], self.src)
        self.reader.unpack_ready(self.dec.runner.kv_caches)
        self.seen.append((layer, self.reader.done))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("chunk", [None, 8], ids=["one-step", "chunked"])
def test_streamed_layers_arrive_during_the_prefill_and_decode_like_one_engine(tiny_model_dir, family, chunk):
    model_dir = tiny_model_dir(family)
    config = {"max_num_batched_tokens": chunk} if chunk else {}
    pre, dec = engine(model_dir, **config), engine(model_dir)
    pre.add_request(PROMPT, GREEDY, req_id="one")
    expected = run_to_end(pre)["one"]

    streamer = Streamer(pre, dec)
    pre.set_prompt_kv_observer(streamer)
    pre.add_request(PROMPT, GREEDY, req_id="pd")
    while True:
        outs = [o for o in pre.step() if o.req_id == "pd" and o.token_ids]
        if outs:
            break
    layers = pre.model_config.num_layers
    assert streamer.seen == [(i, i + 1) for i in range(layers)]  # each layer in the receiver's cache at once
    assert not dec.has_unfinished_requests()  # reserved only: nothing to step yet
    packed = streamer.writer.close()
    assert packed.num_tokens == len(PROMPT) and streamer.reader.complete
    adopted = handoff.adopted_kv(streamer.reader.reader, dec.runner.kv_caches[0].dtype)
    streamer.reader.close()
    dec.complete_adoption("pd", outs[0].token_ids[0], adopted)
    pre.detach_request("pd")
    assert run_to_end(dec)["pd"] == expected
    assert list_segments(PREFIX) == []
    for eng in (pre, dec):
        assert eng.stats().kv_blocks_used == 0 and not eng.has_unfinished_requests()


def test_the_observer_sees_only_steps_that_complete_a_prompt(tiny_model_dir):
    pre = engine(tiny_model_dir("qwen3_moe"), max_num_batched_tokens=8)
    calls = []
    pre.set_prompt_kv_observer(lambda layer, prompts: calls.append((layer, [p.req_id for p in prompts])))
    pre.add_request(PROMPT, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), req_id="a")
    run_to_end(pre)  # 21 tokens in chunks of 8: the third step completes the prompt, then two decode steps
    assert calls == [(i, ["a"]) for i in range(pre.model_config.num_layers)]
    pre.set_prompt_kv_observer(None)


def test_a_cancelled_adoption_gives_its_blocks_back(tiny_model_dir):
    dec = engine(tiny_model_dir("mixtral"))
    free = dec.stats().kv_blocks_free
    table = dec.reserve_adoption(PROMPT, GREEDY, "r")
    assert len(table) == -(-(len(PROMPT) + 1) // 4) and dec.stats().kv_blocks_free == free - len(table)
    assert not dec.has_unfinished_requests() and dec.step() == []
    dec.cancel_adoption("r")
    assert dec.stats().kv_blocks_free == free and not dec.has_unfinished_requests()
    dec.reserve_adoption(PROMPT, GREEDY, "r2")
    dec.abort_request("r2")  # never ran: cancelled, nothing to report
    assert dec.stats().kv_blocks_free == free and not dec.has_unfinished_requests() and dec.step() == []


def test_a_reader_sees_only_the_published_layers(tiny_model_dir):
    """The progress word: layers not yet written are not unpacked, and an incomplete payload is refused whole."""
    pre, dec, layout, identity, slots = prefilled(tiny_model_dir("deepseek_v3"))
    policy = handoff.KVPolicy(1.0)
    writer = handoff.LayerWriter(PREFIX + "partial", layout, handoff.choose_tiers(len(PROMPT), policy),
                                 model=identity, full_dtype=pre.runner.kv_caches[0].dtype, policy=policy)
    writer.write_layer(0, pre.runner.kv_caches[0], slots)
    with pytest.raises(ValueError, match="layer 2 written after 1"):
        writer.write_layer(2, pre.runner.kv_caches[2], slots)
    reader = handoff.LayerReader(PREFIX + "partial", layout, slots + 8, model=identity)
    assert not reader.unpack_ready(dec.runner.kv_caches) and reader.done == 1
    reader.close()
    with pytest.raises(ValueError, match="1 of .* layers written"):
        writer.close()
    writer.discard()
    assert list_segments(PREFIX) == []
    pre.abort_request("a")
    run_to_end(pre)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (benchmarks/gpu_check.sh runs it)")
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_layers_stream_from_and_into_caches_on_cuda(tiny_model_dir, family):
    """Where attention is placed on the accelerator the paged caches live there: a layer is packed on the host from
    a CUDA cache and unpacked into another CUDA cache, the rows equal to the CPU cache's."""
    pre, _, layout, identity, slots = prefilled(tiny_model_dir(family))
    sources = [cache.cuda() for cache in pre.runner.kv_caches]
    targets = [torch.zeros_like(cache) for cache in sources]
    policy = handoff.KVPolicy(1.0)
    writer = handoff.LayerWriter(PREFIX + "cuda", layout, handoff.choose_tiers(len(PROMPT), policy), model=identity,
                                 full_dtype=sources[0].dtype, policy=policy)
    reader = handoff.LayerReader(PREFIX + "cuda", layout, slots, model=identity)
    for i, cache in enumerate(sources):
        writer.write_layer(i, cache, slots)
        reader.unpack_ready(targets)
    writer.close()
    reader.close()
    for cpu, target in zip(pre.runner.kv_caches, targets):
        assert torch.equal(layout.rows_from_cache(cpu, slots), layout.rows_from_cache(target, slots).cpu())
    assert list_segments(PREFIX) == []
    pre.abort_request("a")
    run_to_end(pre)


@pytest.mark.parametrize("budget", [1.0, 0.5, 0.2])
def test_a_streamed_payload_is_the_payload_packed_after(tiny_model_dir, budget):
    """With position importance the tiers are known before the prefill, so the KV streams at any budget: layer by
    layer it unpacks to the same rows, tiers and dropped positions as the payload packed after the step."""
    pre, dec, layout, identity, slots = prefilled(tiny_model_dir("qwen3_moe"))
    policy = handoff.KVPolicy(budget, "position")
    assert policy.streams
    whole = handoff.pack_into_segment(PREFIX + "whole", pre.runner.kv_caches, layout, slots, model=identity,
                                      policy=policy)
    packed_after = handoff.unpack_from_segment(whole.segment, dec.runner.kv_caches, layout, slots + 32,
                                               model=identity)
    writer = handoff.LayerWriter(PREFIX + "layers", layout, handoff.choose_tiers(len(PROMPT), policy),
                                 model=identity, full_dtype=pre.runner.kv_caches[0].dtype, policy=policy)
    reader = handoff.LayerReader(PREFIX + "layers", layout, slots + 64, model=identity)
    for i, cache in enumerate(pre.runner.kv_caches):
        writer.write_layer(i, cache, slots)
        assert reader.unpack_ready(dec.runner.kv_caches) == (i + 1 == len(pre.runner.kv_caches))
    assert writer.close() == dataclasses.replace(whole, segment=PREFIX + "layers")
    assert torch.equal(reader.reader.tiers, packed_after.tiers) and bool((packed_after.tiers != 0).any()) == (budget < 1)
    reader.close()
    for cache in dec.runner.kv_caches:
        assert torch.equal(layout.rows_from_cache(cache, slots + 32), layout.rows_from_cache(cache, slots + 64))
    assert list_segments(PREFIX) == []
    pre.abort_request("a")
    run_to_end(pre)
