"""The engine end to end on a tiny DeepSeek-V3 model: paged-KV batching, chunked prefill and preemption give
the same tokens as running each prompt alone; bad requests fail alone with clear errors."""

from __future__ import annotations

import pytest
import torch

from hybridmoe import LLM, SamplingParams
from hybridmoe.runtime.engine import EngineConfig, LLMEngine

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _prompts(n: int = 4) -> list[list[int]]:
    gen = torch.Generator().manual_seed(99)
    return [torch.randint(6, 300, (length,), generator=gen).tolist() for length in (3, 17, 9, 30)[:n]]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("deepseek_v3")


@pytest.fixture(scope="module")
def alone(model_dir):
    llm = LLM(model_dir, dtype="float32", block_size=4)
    return [llm.generate([p], GREEDY)[0].token_ids for p in _prompts()]


def test_batched_paged_decode_matches_each_prompt_alone(model_dir, alone):
    results = LLM(model_dir, dtype="float32", block_size=4).generate(_prompts(), GREEDY)
    assert [r.token_ids for r in results] == alone
    assert all(len(r.token_ids) == 12 and r.finish_reason == "length" for r in results)


def test_chunked_prefill_matches(model_dir, alone):
    llm = LLM(model_dir, dtype="float32", block_size=4, max_num_batched_tokens=7)
    assert [r.token_ids for r in llm.generate(_prompts(), GREEDY)] == alone


def test_preemption_under_kv_pressure_matches(model_dir, alone):
    # 12 blocks of 4 tokens: the four requests (up to 42 tokens each) cannot all stay resident
    kv_bytes = LLMEngine(model_dir, EngineConfig(dtype="float32")).model.kv_bytes_per_token() * 4 * 12
    llm = LLM(model_dir, dtype="float32", block_size=4, kv_cache_gb=kv_bytes / 2**30)
    assert llm.engine.runner.num_blocks == 12
    assert [r.token_ids for r in llm.generate(_prompts(), GREEDY)] == alone


def test_seeded_sampling_is_reproducible_whatever_the_batch(model_dir):
    llm = LLM(model_dir, dtype="float32")
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True)
    alone = llm.generate([_prompts()[1]], params)[0].token_ids
    batched = llm.generate(_prompts(), [GREEDY, params, GREEDY, GREEDY])[1].token_ids
    assert alone == batched


def test_text_prompts_chat_and_stop_strings(model_dir):
    llm = LLM(model_dir, dtype="float32")
    free = llm.generate("The quick brown fox", SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0]
    assert free.text == llm.tokenizer.decode(free.token_ids, skip_special_tokens=True)
    stop = free.text[5:8]
    assert len(stop) == 3
    stopped = llm.generate("The quick brown fox", SamplingParams(temperature=0.0, max_tokens=20, stop=[stop],
                                                                 ignore_eos=True))[0]
    assert stopped.finish_reason == "stop" and stop not in stopped.text
    assert free.text.startswith(stopped.text)
    reply = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(temperature=0.0, max_tokens=5))[0]
    expected = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True)
    assert reply.prompt_token_ids == expected


def test_bad_requests_fail_alone_with_clear_errors(model_dir):
    engine = LLMEngine(model_dir, EngineConfig(dtype="float32", max_model_len=64))
    good = engine.add_request(_prompts()[0], GREEDY)
    with pytest.raises(ValueError, match=r"too long: 60 tokens \+ max_tokens 12 > max_model_len 64 \(set by "
                                         r"EngineConfig.max_model_len\)"):
        engine.add_request(list(range(6, 66)), GREEDY)
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 320\)"):
        engine.add_request([1, 2, 100000], GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    finished = [o for o in outputs if o.finished]
    assert [o.req_id for o in finished] == [good] and len(finished[0].token_ids) == 12


def test_a_too_long_prompt_is_told_what_limits_it(model_dir):
    kv_bytes = LLMEngine(model_dir, EngineConfig(dtype="float32")).model.kv_bytes_per_token() * 4 * 5
    small_cache = LLMEngine(model_dir, EngineConfig(dtype="float32", block_size=4, kv_cache_gb=kv_bytes / 2**30))
    assert small_cache.max_model_len == 20
    with pytest.raises(ValueError, match=r"> max_model_len 20 \(set by the KV cache: kv_cache_gb=.* holds 20 tokens\)"):
        small_cache.add_request(list(range(6, 16)), GREEDY)
    default = LLMEngine(model_dir, EngineConfig(dtype="float32"))
    limit = default.model_config.max_position_embeddings
    assert default.max_model_len == limit
    with pytest.raises(ValueError, match=rf"> max_model_len {limit} \(the model's max_position_embeddings\)"):
        default.add_request([6] * limit, GREEDY)


def test_a_failing_step_ends_its_requests_and_the_engine_keeps_serving(model_dir, monkeypatch):
    engine = LLMEngine(model_dir, EngineConfig(dtype="float32"))
    doomed = engine.add_request(_prompts()[1], GREEDY)
    real_forward = engine.runner.forward

    def broken_forward(chunks, all_logits=False):
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(engine.runner, "forward", broken_forward)
    outputs = engine.step()
    assert [(o.req_id, o.finished, o.finish_reason) for o in outputs] == [(doomed, True, "error")]
    assert "simulated kernel failure" in outputs[0].error
    monkeypatch.setattr(engine.runner, "forward", real_forward)
    survivor = engine.add_request(_prompts()[0], GREEDY)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [(o.req_id, o.finish_reason, len(o.token_ids)) for o in finished] == [(survivor, "length", 12)]


def test_abort_ends_a_running_request(model_dir):
    engine = LLMEngine(model_dir, EngineConfig(dtype="float32"))
    a = engine.add_request(_prompts()[0], GREEDY)
    b = engine.add_request(_prompts()[2], GREEDY)
    engine.step()
    engine.abort_request(a)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert {(o.req_id, o.finish_reason) for o in finished} == {(a, "abort"), (b, "length")}


def test_a_small_step_leaves_the_callers_torch_threads_as_they_were(model_dir):
    """Steps of few tokens run torch on one thread; the caller's thread count is restored afterwards (a later
    large step, or another runner, uses it)."""
    llm = LLM(model_dir)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llm.generate([_prompts(1)[0]], SamplingParams(max_tokens=3))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_prompt_that_cannot_be_served_fails_alone_in_generate(model_dir, alone):
    """LLM(model=...) as vLLM names it; a refused prompt gets an error result and the others run, and nothing of
    it is left in the engine."""
    llm = LLM(model=model_dir, dtype="float32", block_size=4, max_model_len=64)
    too_long = list(range(6, 66))  # 60 tokens + max_tokens 12 > 64
    results = llm.generate([_prompts()[0], too_long, _prompts()[1], "", [], [1, 2, 100000]], GREEDY)
    assert [r.finish_reason for r in results] == ["length", "error", "length", "error", "error", "error"]
    assert [results[0].token_ids, results[2].token_ids] == alone[:2]
    assert "prompt too long: 60 tokens + max_tokens 12 > max_model_len 64" in results[1].error
    assert results[1].prompt_token_ids == too_long and results[1].token_ids == [] and results[1].text == ""
    assert results[3].error == results[4].error == "the prompt is empty"
    assert "token ids must be integers in [0, 320)" in results[5].error
    assert results[0].error is None
    assert not llm.engine.has_unfinished_requests() and llm.engine.step() == []


def test_an_aborted_request_is_reported_once_by_the_next_step(model_dir):
    engine = LLMEngine(model_dir, EngineConfig(dtype="float32"))
    aborted = engine.add_request(_prompts()[0], GREEDY)
    engine.abort_request(aborted)
    assert engine.has_unfinished_requests()  # until its end is reported
    assert [(o.req_id, o.finished, o.finish_reason) for o in engine.step()] == [(aborted, True, "abort")]
    assert not engine.has_unfinished_requests() and engine.step() == []
    survivor = engine.add_request(_prompts()[2], GREEDY)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.req_id for o in engine.step() if o.finished]
    assert finished == [survivor]


@pytest.mark.parametrize("option,value,message", [
    ("kv_cache_gb", 0, "kv_cache_gb must be a number > 0"), ("kv_cache_gb", -1, "kv_cache_gb must be a number > 0"),
    ("kv_cache_gb", float("nan"), "kv_cache_gb must be a number > 0"), ("kv_cache_gb", "1", "kv_cache_gb must be"),
    ("block_size", 0, "block_size must be an integer >= 1, got 0"),
    ("max_num_seqs", 2.5, "max_num_seqs must be an integer >= 1, got 2.5"),
    ("max_num_batched_tokens", -8, "max_num_batched_tokens must be an integer >= 1"),
    ("max_model_len", 0, "max_model_len must be an integer >= 1"),
    ("kv_cache_dtype", "int8", r"kv_cache_dtype must be one of \['auto', 'float32', 'bfloat16', 'float16'\], got 'int8'"),
])
def test_engine_options_are_checked_when_given(option, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**{option: value})


def test_a_kv_cache_larger_than_the_machine_is_refused_before_the_model_loads(tmp_path):
    with pytest.raises(ValueError, match=r"kv_cache_gb=1e\+09 is more than this machine can hold: [\d.]+ GB of "
                                         r"memory available \([\d.]+ GB in all"):
        LLMEngine(tmp_path / "no-model-here", EngineConfig(kv_cache_gb=1e9))


def test_a_kv_cache_smaller_than_one_block_is_refused(model_dir):
    block_bytes = LLMEngine(model_dir, EngineConfig(dtype="float32")).model.kv_bytes_per_token() * 16
    with pytest.raises(ValueError, match=rf"holds no KV block: one block of 16 tokens of this model takes "
                                         rf"{block_bytes} bytes"):
        LLMEngine(model_dir, EngineConfig(dtype="float32", kv_cache_gb=(block_bytes - 1) / 2**30))
    one_block = LLMEngine(model_dir, EngineConfig(dtype="float32", kv_cache_gb=block_bytes / 2**30))
    assert one_block.runner.num_blocks == 1 and one_block.max_model_len == 16
