"""The KV handoff between two engines in one process (what the PD workers do, without the processes): prefill
in one LLMEngine, pack the prompt's KV into a shared-memory payload, adopt it in another, decode there. Same
greedy (and seeded) tokens as one engine on all three families; the payload is refused for another model or
format version; nothing is left in /dev/shm or in the KV blocks."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.disagg import handoff
from hybridmoe.disagg.shm import list_segments, owner_prefix, shm_dir
from hybridmoe.kv.layout import KVLayout
from hybridmoe.kv.payload import PayloadError
from hybridmoe.runtime.engine import EngineConfig, LLMEngine
from hybridmoe.runtime.sampling_params import SamplingParams

PROMPTS = [[5, 17, 33, 8, 90, 12, 61, 7, 200, 31, 4, 77, 19, 150, 2, 88, 43, 9, 120, 64, 3],
           [44, 3, 81, 9, 27, 11, 230, 5]]
FAMILIES = ["deepseek_v3", "qwen3_moe", "mixtral"]
PREFIX = owner_prefix() + "test-"


def engine(model_dir) -> LLMEngine:
    return LLMEngine(model_dir, EngineConfig(dtype="float32", kv_cache_gb=0.01, block_size=4),
                     show_progress=False)


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tiny_model_dir):
    model_dir = tiny_model_dir(request.param)
    return model_dir, engine(model_dir), engine(model_dir)


def prefill_and_pack(pre: LLMEngine, prompt: list[int], params: SamplingParams, req_id: str, budget: float = 1.0):
    """Prefill until the first token, pack the KV into a segment, detach. -> (first token, PackedKV, generator)"""
    pre.add_request(prompt, params, req_id=req_id)
    while True:
        outs = [o for o in pre.step() if o.req_id == req_id]
        if outs and outs[0].token_ids:
            break
    assert not outs[0].finished
    slots = handoff.slots_of(pre.scheduler.block_manager.get_block_table(req_id), len(prompt), pre.config.block_size)
    kv = handoff.pack_into_segment(PREFIX + req_id, pre.runner.kv_caches, KVLayout.from_config(pre.model_config),
                                   slots, model=handoff.model_identity(pre.model_config), budget=budget)
    return outs[0].token_ids[0], kv, pre.detach_request(req_id)


def adopt(dec: LLMEngine, prompt, params, req_id, first, kv, generator, model=None):
    layout = KVLayout.from_config(dec.model_config)

    def write_kv(table):
        slots = handoff.slots_of(table, len(prompt), dec.config.block_size)
        handoff.unpack_from_segment(kv.segment, dec.runner.kv_caches, layout, slots,
                                    model=model or handoff.model_identity(dec.model_config))

    dec.adopt_request(prompt, params, req_id, first, write_kv,
                      generator.get_state() if generator is not None else None)


def run_to_end(eng: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                tokens[out.req_id] = out.token_ids
    return tokens


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
                                    SamplingParams(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_handoff_gives_the_same_tokens_as_one_engine(pair, params):
    model_dir, pre, dec = pair
    expected = {}
    for i, prompt in enumerate(PROMPTS):
        pre.add_request(prompt, params, req_id=f"one-{i}")
    expected = run_to_end(pre)
    for i, prompt in enumerate(PROMPTS):
        first, kv, generator = prefill_and_pack(pre, prompt, params, f"pd-{i}")
        adopt(dec, prompt, params, f"pd-{i}", first, kv, generator)
    got = run_to_end(dec)
    assert [got[f"pd-{i}"] for i in range(len(PROMPTS))] == [expected[f"one-{i}"] for i in range(len(PROMPTS))]
    assert len(set(got["pd-0"])) > 1  # not a degenerate model that repeats one token whatever its KV
    assert list_segments(PREFIX) == []
    for eng in (pre, dec):
        assert eng.stats().kv_blocks_used == 0 and not eng.has_unfinished_requests()


def test_budget_one_copies_the_cache_exactly_and_a_lower_budget_packs_fewer_bytes(tiny_model_dir):
    pre, dec = engine(tiny_model_dir("qwen3_moe")), engine(tiny_model_dir("qwen3_moe"))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = PROMPTS[0]
    pre.add_request(prompt, params, req_id="a")
    while not any(o.token_ids for o in pre.step()):
        pass
    layout = KVLayout.from_config(pre.model_config)
    src = handoff.slots_of(pre.scheduler.block_manager.get_block_table("a"), len(prompt), 4)
    identity = handoff.model_identity(pre.model_config)
    full = handoff.pack_into_segment(PREFIX + "full", pre.runner.kv_caches, layout, src, model=identity)
    half = handoff.pack_into_segment(PREFIX + "half", pre.runner.kv_caches, layout, src, model=identity, budget=0.5)
    assert half.num_bytes < 0.6 * full.num_bytes
    dst = torch.arange(len(prompt)) + 8  # other slots of the receiver
    handoff.unpack_from_segment(full.segment, dec.runner.kv_caches, layout, dst, model=identity)
    for a, b in zip(pre.runner.kv_caches, dec.runner.kv_caches):
        assert torch.equal(layout.rows_from_cache(a, src), layout.rows_from_cache(b, dst))
    handoff.unpack_from_segment(half.segment, dec.runner.kv_caches, layout, dst, model=identity)
    rows_a = layout.rows_from_cache(pre.runner.kv_caches[0], src)
    rows_b = layout.rows_from_cache(dec.runner.kv_caches[0], dst)
    assert not torch.equal(rows_a, rows_b) and torch.allclose(rows_a, rows_b, atol=0.05 * rows_a.abs().max())
    assert list_segments(PREFIX) == []
    pre.abort_request("a")
    run_to_end(pre)


def test_kv_budget_one_gives_the_single_engine_greedy_tokens(tiny_model_dir):
    """--kv-budget 1.0 is the SpectrumKV payload at full precision: same greedy tokens as one engine."""
    pre, dec = engine(tiny_model_dir("mixtral")), engine(tiny_model_dir("mixtral"))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    pre.add_request(PROMPTS[0], params, req_id="one")
    expected = run_to_end(pre)["one"]
    first, kv, gen = prefill_and_pack(pre, PROMPTS[0], params, "b1", budget=1.0)
    assert kv.budget == 1.0
    adopt(dec, PROMPTS[0], params, "b1", first, kv, gen)
    assert run_to_end(dec)["b1"] == expected


@pytest.mark.parametrize("budget", [0.0, 0.04, 1.5, float("nan")])
def test_a_budget_out_of_range_is_refused(budget):
    """Down to 0.05 (tokens dropped below the cheapest tier, masked by the decode engine); 0 would keep nothing."""
    with pytest.raises(ValueError, match="kv budget must be in"):
        handoff.check_budget(budget)
    assert handoff.check_budget(0.05) == 0.05


def test_payload_of_another_model_or_version_is_refused_and_removed(tiny_model_dir):
    pre, dec = engine(tiny_model_dir("qwen3_moe")), engine(tiny_model_dir("qwen3_moe"))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first, kv, gen = prefill_and_pack(pre, PROMPTS[1], params, "m")
    with pytest.raises(PayloadError, match="payload is for model"):
        adopt(dec, PROMPTS[1], params, "m", first, kv, gen, model="another-model")
    assert list_segments(PREFIX) == []
    assert dec.stats().kv_blocks_used == 0 and not dec.has_unfinished_requests()

    first, kv, gen = prefill_and_pack(pre, PROMPTS[1], params, "v")
    with open(shm_dir() / kv.segment, "r+b") as f:  # after the progress word, the prefix: magic, u16 version
        f.seek(handoff.PROGRESS.size + 4)
        f.write((99).to_bytes(2, "little"))
    with pytest.raises(PayloadError, match="format version 99"):
        adopt(dec, PROMPTS[1], params, "v", first, kv, gen)
    assert list_segments(PREFIX) == []
    assert dec.stats().kv_blocks_used == 0 and not dec.has_unfinished_requests()

    other = engine(tiny_model_dir("mixtral"))  # another family's layout and fingerprint
    first, kv, gen = prefill_and_pack(pre, PROMPTS[1], params, "o")
    with pytest.raises(PayloadError, match="payload is for model"):
        adopt(other, PROMPTS[1], params, "o", first, kv, gen)
    assert list_segments(PREFIX) == []
