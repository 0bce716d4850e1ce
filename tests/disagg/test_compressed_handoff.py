"""The full SpectrumKV policy in the PD handoff, between two engines in one process (what the workers do, without
the processes; and once through PDEngine's two worker processes), float32: tokens dropped below the cheapest tier are masked by the decode engine's per-request mask
(positions kept), giving the tokens of a reference decoder fed the same unpacked KV and mask; garbage in the dropped
slots changes nothing; attention importance (computed by the prefill engine) changes the tier map against position
only; INT4 only where the cached probe verdict allows it; the mask stays with its request (not with the blocks, not
in the prefix cache) and a preemption, which recomputes the prompt, clears it."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.commands._kv_eval import KVHarness
from hybridmoe.disagg import handoff
from hybridmoe.disagg.shm import Segment, list_segments, owner_prefix, remove
from hybridmoe.kv.allocation import LADDER_2, LADDER_3, Tier
from hybridmoe.kv.importance import AttentionImportance
from hybridmoe.kv.layout import KVLayout
from hybridmoe.kv.payload import PayloadReader, unpack
from hybridmoe.kv.probe import ProbeVerdict, VerdictCache, model_fingerprint
from hybridmoe.runtime.engine import EngineConfig, LLMEngine
from hybridmoe.runtime.sampling_params import SamplingParams

PREFIX = owner_prefix() + "test-compressed-"
MODEL = "qwen3_moe"
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def prompt(n: int = 96, seed: int = 3) -> list[int]:
    return torch.randint(5, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine(model_dir, **overrides) -> LLMEngine:
    config = dict(dtype="float32", kv_cache_gb=0.01, block_size=4)
    config.update(overrides)
    return LLMEngine(model_dir, EngineConfig(**config), show_progress=False)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir(MODEL)


@pytest.fixture(scope="module")
def pre(model_dir):
    eng = engine(model_dir, enable_prefix_caching=False)
    eng.set_prompt_importance(True)
    return eng


@pytest.fixture(scope="module")
def harness(model_dir):
    return KVHarness(model_dir, "float32")


def prefill(pre: LLMEngine, ids: list[int], req_id: str, params: SamplingParams = GREEDY):
    """Prefill until the first token -> (first token, slots of the prompt in pre's cache)."""
    pre.add_request(ids, params, req_id=req_id)
    while True:
        outs = [o for o in pre.step() if o.req_id == req_id]
        if outs and outs[0].token_ids:
            break
    table = pre.scheduler.block_manager.get_block_table(req_id)
    return outs[0].token_ids[0], handoff.slots_of(table, len(ids), pre.config.block_size)


def pack(pre: LLMEngine, req_id: str, slots, policy: handoff.KVPolicy, name: str):
    return handoff.pack_into_segment(PREFIX + name, pre.runner.kv_caches, KVLayout.from_config(pre.model_config),
                                     slots, model=handoff.model_identity(pre.model_config), policy=policy,
                                     importance=pre.prompt_importance(req_id))


def payload_bytes(kv: handoff.PackedKV) -> bytes:
    """The payload in kv's segment (after its progress word)."""
    segment = Segment.attach(kv.segment)
    try:
        return bytes(segment.buf[handoff.PROGRESS.size:])
    finally:
        segment.close()


def adopt(dec: LLMEngine, ids, req_id, first, kv, params: SamplingParams = GREEDY) -> None:
    layout = KVLayout.from_config(dec.model_config)

    def write_kv(table):
        slots = handoff.slots_of(table, len(ids), dec.config.block_size)
        reader = handoff.unpack_from_segment(kv.segment, dec.runner.kv_caches, layout, slots,
                                             model=handoff.model_identity(dec.model_config))
        return handoff.adopted_kv(reader, dec.runner.kv_caches[0].dtype)

    dec.adopt_request(ids, params, req_id, first, write_kv)


def run_to_end(eng: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                tokens[out.req_id] = out.token_ids
    return tokens


def reference_decode(harness: KVHarness, data: bytes, first: int, steps: int, garbage: bool = False):
    """The same payload unpacked by kv/payload into a fresh cache (identity block table), decoded greedily by the
    model's own forward with the payload's mask of dropped keys: first, then `steps` tokens at positions n, n+1..
    -> (tokens, the mask)."""
    reader, rows = unpack(data, layout=harness.layout)
    n = reader.num_tokens
    caches = harness.new_caches(n + steps + 1)
    slots = torch.arange(n)
    for cache, layer_rows in zip(caches, rows):
        harness.layout.rows_to_cache(cache, slots, layer_rows)
    dropped = reader.dropped
    tokens = [first]
    for step in range(steps):
        logits = harness.forward([tokens[-1]], n + step, caches, dropped)
        tokens.append(int(logits[-1].argmax()))
    return tokens, dropped


def garbage_into(eng: LLMEngine, req_id: str, positions: torch.Tensor) -> None:
    layout = KVLayout.from_config(eng.model_config)
    slots = handoff.slots_of(eng.scheduler.block_manager.get_block_table(req_id), int(positions.max()) + 1,
                             eng.config.block_size)[positions]
    for cache in eng.runner.kv_caches:
        layout.rows_to_cache(cache, slots, torch.full((slots.shape[0], layout.row_width), 1e3))


@pytest.mark.parametrize("budget, ladder", [(0.2, LADDER_2), (0.15, LADDER_3)], ids=["int8+drop", "int4+drop"])
def test_dropped_tokens_are_masked_in_place_and_decode_like_the_reference(model_dir, pre, harness, budget, ladder):
    ids, n = prompt(), 96
    first, slots = prefill(pre, ids, f"drop-{budget}")
    policy = handoff.KVPolicy(budget, "attention", ladder, "test")
    kv = pack(pre, f"drop-{budget}", slots, policy, f"a-{budget}")
    again = pack(pre, f"drop-{budget}", slots, policy, f"b-{budget}")  # the same payload, for the reference
    pre.detach_request(f"drop-{budget}")
    data = payload_bytes(again)
    remove(again.segment)
    assert kv.tier_counts[Tier.DROP] > 0 and kv.tier_counts == again.tier_counts
    expected, dropped = reference_decode(harness, data, first, GREEDY.max_tokens - 1)

    dec = engine(model_dir)
    seen = []  # (positions, the attention metadata's mask) of each decode step

    def recording(forward):
        def wrapped(input_ids, positions, meta, *args, **kwargs):
            seen.append((positions.tolist(), meta.dropped))
            return forward(input_ids, positions, meta, *args, **kwargs)
        return wrapped

    dec.model.forward = recording(dec.model.forward)
    adopt(dec, ids, "d", first, kv)
    request = dec.scheduler.running[0]
    assert torch.equal(request.kv_dropped, dropped) and not request.kv_exact
    garbage_into(dec, "d", torch.nonzero(dropped).flatten())  # whatever the dropped slots hold is never attended
    got = run_to_end(dec)["d"]
    assert got == expected
    assert [positions for positions, _ in seen] == [[n + i] for i in range(GREEDY.max_tokens - 1)]  # not n - drops
    for step, (_, masks) in enumerate(seen):
        assert len(masks) == 1 and masks[0].shape[0] == n + step + 1
        assert torch.equal(masks[0][:n], dropped) and not masks[0][n:].any()
    # the garbage matters where it is not masked: the reference without the mask decodes otherwise
    reader, rows = unpack(data, layout=harness.layout)
    caches = harness.new_caches(n + 1)
    for cache, layer_rows in zip(caches, rows):
        layer_rows[dropped] = 1e3
        harness.layout.rows_to_cache(cache, torch.arange(n), layer_rows)
    masked = harness.forward([first], n, caches, dropped)
    assert not torch.allclose(harness.forward([first], n, caches, None), masked, atol=1e-3)
    assert dec.stats().kv_blocks_used == 0 and dec.stats().kv_blocks_cached == 0  # never offered to the cache
    assert list_segments(PREFIX) == []


def test_engine_importance_is_the_observers_over_a_chunked_prefill(model_dir, harness):
    """The prefill engine scores the prompt in the step that computes its last token, chunked or not."""
    ids = prompt(50, seed=5)
    chunked = engine(model_dir, max_num_batched_tokens=20)  # chunks of 20, 20, 10 tokens
    chunked.set_prompt_importance(True, window=8)
    prefill(chunked, ids, "c")
    caches = harness.new_caches(len(ids))
    observer = AttentionImportance(len(ids), 8)
    remove = harness.model.add_attention_observer(observer)
    try:
        harness.forward(ids, 0, caches)
    finally:
        remove()
    torch.testing.assert_close(chunked.prompt_importance("c"), observer.scores(), rtol=1e-4, atol=1e-6)
    chunked.abort_request("c")
    run_to_end(chunked)
    prefill(chunked, ids, "again")  # found in the prefix cache: its last 8 tokens are computed all the same
    assert chunked.stats().prefix_cache_hits > 0
    torch.testing.assert_close(chunked.prompt_importance("again"), observer.scores(), rtol=1e-4, atol=1e-6)
    chunked.abort_request("again")
    run_to_end(chunked)
    plain = engine(model_dir)  # off by default: nothing scored, no observer
    prefill(plain, ids, "p")
    assert plain.prompt_importance("p") is None


def test_attention_importance_changes_the_tier_map(pre):
    ids = prompt(seed=11)
    _, slots = prefill(pre, ids, "imp")
    maps = {}
    for importance in ("attention", "position"):
        policy = handoff.KVPolicy(0.3, importance, LADDER_2)
        kv = pack(pre, "imp", slots, policy, f"imp-{importance}")
        reader = PayloadReader(payload_bytes(kv))
        remove(kv.segment)
        maps[importance] = reader.tiers
        assert reader.header["int4_verdict"] == "unknown" and reader.header["ladder"] == ["fp16", "int8"]
    pre.detach_request("imp")
    position = maps["position"]
    assert torch.equal(position, handoff.choose_tiers(len(ids), handoff.KVPolicy(0.3, "position", LADDER_2)))
    assert not torch.equal(maps["attention"], position)
    assert [int((maps["attention"] == t).sum()) for t in Tier] == [int((position == t).sum()) for t in Tier]
    assert (position[-20:] != Tier.DROP).all()  # position keeps the most recent; attention chooses otherwise
    assert list_segments(PREFIX) == []


def test_int4_only_when_the_cached_verdict_allows_it(model_dir, pre, tmp_path):
    said = []
    cache = VerdictCache(tmp_path)
    policy = handoff.kv_policy(model_dir, 0.3, cache_dir=tmp_path, log=said.append)
    assert policy.ladder == LADDER_2 and policy.int4_verdict == "unknown"
    assert len(said) == 1 and "no INT4 probe verdict" in said[0]
    assert handoff.kv_policy(model_dir, 1.0, cache_dir=tmp_path, log=said.append).ladder == LADDER_2
    assert len(said) == 1  # budget 1 consults nothing
    fingerprint = model_fingerprint(model_dir)
    ids = prompt(seed=13)
    _, slots = prefill(pre, ids, "v")
    for allowed in (False, True, None):
        if allowed is not None:
            cache.put(ProbeVerdict(fingerprint, allowed, [allowed] * 3))
        else:
            cache.path(fingerprint).unlink()
        policy = handoff.kv_policy(model_dir, 0.3, cache_dir=tmp_path, log=said.append)
        kv = pack(pre, "v", slots, policy, f"v-{allowed}")
        header = PayloadReader(payload_bytes(kv)).header
        remove(kv.segment)
        counts = header["tier_counts"]
        if allowed:
            assert header["ladder"] == ["fp16", "int8", "int4"] and header["int4_verdict"] == "int4-allowed"
            assert counts[Tier.INT4] > 0 and counts[Tier.DROP] == 0  # b 0.3 >= 0.25: nothing dropped
        else:
            assert header["ladder"] == ["fp16", "int8"] and counts[Tier.INT4] == 0 and counts[Tier.DROP] > 0
            assert header["int4_verdict"] == ("int4-refused" if allowed is False else "unknown")
    pre.detach_request("v")
    assert len(said) == 2


def test_the_mask_stays_with_its_request(model_dir, pre):
    """A plain request decoding beside the compressed one, and another that later reuses its blocks, decode as
    in an engine that never saw it; none of its blocks enters the prefix cache."""
    ids = prompt(seed=17)
    reference = engine(model_dir)
    reference.add_request(ids, GREEDY, req_id="ref")
    expected = run_to_end(reference)["ref"]
    bytes_per_block = reference.model.kv_bytes_per_token() * 4
    dec = engine(model_dir, kv_cache_gb=30 * bytes_per_block / 2**30)  # 30 blocks: a request takes 26
    assert dec.scheduler.block_manager.num_blocks == 30

    first, slots = prefill(pre, ids, "m")
    kv = pack(pre, "m", slots, handoff.KVPolicy(0.2, "attention", LADDER_2), "m")
    pre.detach_request("m")
    adopt(dec, ids, "m", first, kv)
    dropped_blocks = set(dec.scheduler.block_manager.get_block_table("m"))
    assert dec.stats().kv_blocks_cached == 0
    dec.add_request(ids, GREEDY, req_id="beside")  # waits for blocks while "m" runs, then reuses them
    tokens, table = {}, []
    while dec.has_unfinished_requests():
        tokens.update((out.req_id, out.token_ids) for out in dec.step() if out.finished)
        table = table or dec.scheduler.block_manager.get_block_table("beside")
    assert dropped_blocks & set(table)
    assert tokens["beside"] == expected
    assert dec.stats().prefix_cache_hits == 0  # nothing of "m" was offered
    dec.add_request(ids, GREEDY, req_id="after")
    assert run_to_end(dec)["after"] == expected
    assert dec.stats().prefix_cache_hits > 0  # "beside"'s own blocks, computed in full

    both = engine(model_dir)  # the two side by side in one batch
    first, slots = prefill(pre, ids, "m2")
    kv = pack(pre, "m2", slots, handoff.KVPolicy(0.2, "attention", LADDER_2), "m2")
    pre.detach_request("m2")
    both.add_request(ids, GREEDY, req_id="plain")
    both.step()  # its prefill
    adopt(both, ids, "m2", first, kv)
    assert run_to_end(both)["plain"] == expected
    assert list_segments(PREFIX) == []


def test_preemption_clears_the_mask(model_dir, pre):
    ids = prompt(40, seed=19)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    probe = engine(model_dir)
    bytes_per_block = probe.model.kv_bytes_per_token() * 4
    dec = engine(model_dir, kv_cache_gb=28 * bytes_per_block / 2**30)  # 28 blocks: 70 tokens each need 18 + 18
    first, slots = prefill(pre, ids, "p", params)
    kv = pack(pre, "p", slots, handoff.KVPolicy(0.2, "attention", LADDER_2), "p")
    pre.detach_request("p")
    dec.add_request(prompt(40, seed=23), params, req_id="older")
    dec.step()
    adopt(dec, ids, "p", first, kv, params)  # the newest running request: the one preempted
    request = next(r for r in dec.scheduler.running if r.req_id == "p")
    assert request.kv_dropped is not None and not request.kv_exact
    masks_after = []
    preempted = False
    forward = dec.model.forward

    def recording(input_ids, positions, meta, *args, **kwargs):
        if preempted:
            masks_after.append(meta.dropped)
        return forward(input_ids, positions, meta, *args, **kwargs)

    dec.model.forward = recording
    while dec.has_unfinished_requests():
        dec.step()
        if not preempted and request.num_computed_tokens == 0:
            preempted = True
            assert request.kv_dropped is None and request.kv_exact
    assert preempted and dec.stats().num_preemptions >= 1
    assert masks_after and all(masks is None for masks in masks_after)  # recomputed in full: no mask
    assert request.num_output_tokens == params.max_tokens
    assert list_segments(PREFIX) == []


def test_pd_workers_drop_and_mask_like_the_in_process_handoff(model_dir, pre, harness, monkeypatch, tmp_path,
                                                               capfd):
    """`serve --pd --kv-budget 0.2` through the two worker processes: no verdict cached (said once, by the prefill
    worker), FULL/INT8 with drops, attention importance; the same greedy tokens as the in-process handoff."""
    import asyncio

    from hybridmoe.disagg.engine import PDEngine

    monkeypatch.setenv("HYBRIDMOE_CACHE", str(tmp_path))  # an empty verdict cache for the workers
    ids = prompt(seed=29)
    policy = handoff.kv_policy(model_dir, 0.2, "attention", cache_dir=tmp_path / "kv-probe", log=lambda _: None)
    first, slots = prefill(pre, ids, "e2e")
    kv = pack(pre, "e2e", slots, policy, "e2e")
    pre.detach_request("e2e")
    assert kv.tier_counts[Tier.DROP] > 0 and kv.tier_counts[Tier.INT4] == 0
    expected, _ = reference_decode(harness, payload_bytes(kv), first, GREEDY.max_tokens - 1)
    remove(kv.segment)

    engine = PDEngine(model_dir, EngineConfig(dtype="float32", kv_cache_gb=0.05), kv_budget=0.2)
    engine.start()

    async def run():
        tokens = []
        async for out in engine.generate(ids, GREEDY):
            tokens += out.new_token_ids
        return tokens

    try:
        engine.wait_ready_sync(180)
        assert asyncio.run(run()) == expected
        assert engine.stats().kv_blocks_used == 0
    finally:
        engine.shutdown()
    assert capfd.readouterr().err.count("no INT4 probe verdict cached") == 1
