"""Logprobs of sampled tokens and of prompt tokens against transformers' logits in float64 (log-softmax), also
when the prompt is prefilled in chunks, when a request is preempted, and when its prefix is cached."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridmoe import LLM, SamplingParams
from hybridmoe.runtime.logprobs import token_logprobs

PROMPTS = [[5, 17, 33, 8, 90, 41, 12, 7, 63, 2, 19], [44, 3, 81, 9, 27]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("deepseek_v3")


@pytest.fixture(scope="module")
def reference(model_dir):
    """(prompt + greedy output) -> float64 log-softmax of transformers' logits at every position."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), dim=-1)  # [n, V]
    return logprobs


def _check(result, prompt, reference):
    ref = reference(prompt + result.token_ids)  # position p scores token p + 1
    assert result.prompt_logprobs[0] is None and len(result.prompt_logprobs) == len(prompt)
    for p, entry in enumerate(result.prompt_logprobs[1:]):
        assert entry.token_id == prompt[p + 1]
        assert entry.logprob == pytest.approx(float(ref[p, prompt[p + 1]]), abs=1e-4)
        top_ids = [i for i, _ in entry.top]
        assert len(top_ids) == 2 and top_ids[0] == int(ref[p].argmax())
        assert [v for _, v in entry.top] == pytest.approx(ref[p].topk(2).values.tolist(), abs=1e-4)
    assert len(result.logprobs) == len(result.token_ids)
    for k, (entry, token) in enumerate(zip(result.logprobs, result.token_ids)):
        row = ref[len(prompt) - 1 + k]
        assert entry.token_id == token and entry.logprob == pytest.approx(float(row[token]), abs=1e-4)
        assert entry.top[0] == (token, pytest.approx(float(row.max()), abs=1e-4))  # greedy: the top token
        assert len(entry.top) == 3


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 4}], ids=["one-prefill", "chunked"])
def test_logprobs_match_transformers(model_dir, reference, options):
    llm = LLM(model_dir, dtype="float32", block_size=4, **options)
    for prompt, result in zip(PROMPTS, llm.generate(PROMPTS, PARAMS)):
        _check(result, prompt, reference)
    again = llm.generate(PROMPTS[0], PARAMS)[0]  # its prefix is cached now: the prompt is still scored in full
    _check(again, PROMPTS[0], reference)


def test_logprobs_survive_preemption(model_dir, reference):
    llm = LLM(model_dir, dtype="float32", block_size=4)
    num_blocks = 6  # the two requests (up to 17 and 11 tokens) cannot both stay resident
    llm = LLM(model_dir, dtype="float32", block_size=4,
              kv_cache_gb=llm.engine.model.kv_bytes_per_token() * 4 * num_blocks / 2**30)
    results = llm.generate(PROMPTS, PARAMS)
    assert llm.engine.stats().num_preemptions > 0
    for prompt, result in zip(PROMPTS, results):
        _check(result, prompt, reference)


def test_token_logprobs_against_float64():
    torch.manual_seed(3)
    logits = torch.randn(4, 100) * 4
    ids = [3, 50, 99, 0]
    values = token_logprobs(logits, ids, 5)
    ref = torch.log_softmax(logits.double(), dim=-1)
    for row, (value, token) in enumerate(zip(values, ids)):
        assert value.logprob == pytest.approx(float(ref[row, token]), abs=1e-5)
        assert [i for i, _ in value.top] == ref[row].topk(5).indices.tolist()
    assert token_logprobs(logits, ids, 0)[0].top == ()


def test_no_logprobs_unless_asked(model_dir):
    result = LLM(model_dir, dtype="float32").generate(PROMPTS[1], SamplingParams(max_tokens=3))[0]
    assert result.logprobs is None and result.prompt_logprobs is None
