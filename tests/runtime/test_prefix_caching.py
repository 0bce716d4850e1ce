"""Prefix caching end to end on tiny models (float32): requests sharing a prefix reuse its KV, compute only the
tokens past it (read from the engine's counters) and give the same greedy tokens as with caching off, also
when the whole prompt is cached, when a small cache evicts, and under preemption."""

from __future__ import annotations

import pytest
import torch

from hybridmoe import LLM, SamplingParams
from hybridmoe.runtime.engine import EngineConfig, LLMEngine

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BLOCK = 4


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(6, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SYSTEM = _tokens(1, 41)  # a "system prompt": 10 full blocks and one token
# Shared prefix alone, with short and long tails, block aligned or not, and one that diverges inside the prefix.
PROMPTS = [SYSTEM, SYSTEM + _tokens(2, 3), SYSTEM[:40], SYSTEM + _tokens(3, 12), SYSTEM[:30] + _tokens(4, 9)]


def _llm(model_dir, **options) -> LLM:
    return LLM(model_dir, dtype="float32", block_size=BLOCK, **options)


def _one_by_one(llm: LLM, prompts) -> list[list[int]]:
    return [llm.generate([p], GREEDY)[0].token_ids for p in prompts]


def _run(engine: LLMEngine, prompt: list[int]) -> list[int]:
    """One request alone, to the end: its output tokens."""
    req_id = engine.add_request(prompt, GREEDY)
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.req_id == req_id and out.finished:
                tokens = out.token_ids
    return tokens


def _kv_cache_gb(model_dir, num_blocks: int) -> float:
    per_token = LLMEngine(model_dir, EngineConfig(dtype="float32")).model.kv_bytes_per_token()
    return per_token * BLOCK * num_blocks / 2**30


@pytest.fixture(scope="module", params=[("deepseek_v3", {}), ("qwen3_moe", {}), ("mixtral", {"sliding_window": 12})],
                ids=["deepseek_v3-mla", "qwen3_moe", "mixtral-sliding_window"])
def model_dir(request, tiny_model_dir):
    model_type, overrides = request.param
    return tiny_model_dir(model_type, **overrides)


@pytest.fixture(scope="module")
def uncached(model_dir):
    """Each prompt's tokens with prefix caching off."""
    return _one_by_one(_llm(model_dir, enable_prefix_caching=False), PROMPTS)


def test_same_greedy_tokens_with_prefix_caching_on_and_off(model_dir, uncached):
    one_by_one = _llm(model_dir)
    assert _one_by_one(one_by_one, PROMPTS) == uncached
    stats = one_by_one.engine.stats()
    # SYSTEM's 10 full blocks; 9 of SYSTEM[:40]'s 10 (its last token is computed); 10; the 7 blocks of SYSTEM[:30]
    assert stats.prefix_cache_hits == 40 + 36 + 40 + 28
    # Batched and in small chunks: later requests share the blocks an earlier one computed a step before.
    chunked = _llm(model_dir, max_num_batched_tokens=6)
    assert [r.token_ids for r in chunked.generate(PROMPTS, GREEDY)] == uncached
    assert chunked.engine.stats().prefix_cache_hits > 0


def test_a_second_request_computes_only_the_tokens_past_the_shared_prefix(model_dir, uncached):
    engine = _llm(model_dir).engine
    _run(engine, PROMPTS[0])
    before = engine.stats()
    tokens = _run(engine, PROMPTS[3])  # SYSTEM + 12 tokens: SYSTEM's 10 full blocks are cached
    after = engine.stats()
    assert tokens == uncached[3]
    assert after.prefix_cache_hits - before.prefix_cache_hits == 10 * BLOCK
    assert after.prefix_cache_queries - before.prefix_cache_queries == len(PROMPTS[3])
    # the prompt's 13 tokens past the cached blocks, then one per decode step after the first token
    assert after.computed_tokens - before.computed_tokens == (len(PROMPTS[3]) - 40) + (GREEDY.max_tokens - 1)


def test_a_request_whose_whole_prompt_is_cached(model_dir):
    engine = _llm(model_dir).engine
    first = _run(engine, SYSTEM[:40])
    before = engine.stats()
    assert _run(engine, SYSTEM[:40]) == first
    after = engine.stats()
    # its last block is computed again, for the logits of the last token
    assert after.prefix_cache_hits - before.prefix_cache_hits == 9 * BLOCK
    assert after.computed_tokens - before.computed_tokens == BLOCK + GREEDY.max_tokens - 1


def test_a_multi_turn_chat_reuses_the_previous_answer(model_dir):
    cached, uncached = _llm(model_dir).engine, _llm(model_dir, enable_prefix_caching=False).engine
    turn1 = SYSTEM + _tokens(5, 6)
    answer = _run(cached, turn1)
    assert answer == _run(uncached, turn1)
    turn2 = turn1 + answer + _tokens(6, 5)
    before = cached.stats()
    assert _run(cached, turn2) == _run(uncached, turn2)
    # turn 1's computed tokens (prompt + all but the last answer token) fill 13 blocks
    assert cached.stats().prefix_cache_hits - before.prefix_cache_hits == (len(turn1) + len(answer) - 1) // BLOCK * BLOCK


def test_eviction_in_a_small_cache_keeps_exact_tokens(model_dir):
    """14 blocks of 4 tokens: each prompt (about 6 blocks with its output) evicts what earlier ones left; the
    first prompt comes back after its blocks were reused, then once more while they are still cached."""
    prompts = [_tokens(10 + i, 17) for i in range(4)]
    order = [0, 1, 2, 3, 0, 0, 2]
    small = _llm(model_dir, kv_cache_gb=_kv_cache_gb(model_dir, 14))
    assert small.engine.runner.num_blocks == 14
    reference = _one_by_one(_llm(model_dir, enable_prefix_caching=False), prompts)
    hits = []
    for i in order:
        before = small.engine.stats().prefix_cache_hits
        assert small.generate([prompts[i]], GREEDY)[0].token_ids == reference[i]
        hits.append(small.engine.stats().prefix_cache_hits - before)
    assert hits[4] < 16 and hits[5] == 16  # evicted (at least partly), then found whole
    stats = small.engine.stats()
    assert stats.kv_blocks_used == 0 and stats.kv_blocks_free == 14 and 0 < stats.kv_blocks_cached <= 14


def test_preemption_with_prefix_caching_keeps_exact_tokens(model_dir, uncached):
    # 16 blocks of 4 tokens: the five requests (up to 60 tokens each) cannot all stay resident
    tight = _llm(model_dir, kv_cache_gb=_kv_cache_gb(model_dir, 16))
    assert [r.token_ids for r in tight.generate(PROMPTS, GREEDY)] == uncached
    stats = tight.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


def test_the_option_must_be_a_bool():
    with pytest.raises(ValueError, match="enable_prefix_caching must be True or False, got 'no'"):
        EngineConfig(enable_prefix_caching="no")
