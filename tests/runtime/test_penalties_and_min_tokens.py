"""Presence / frequency penalties (OpenAI's definition, over the output only) against a float64 reference, and
min_tokens holding back EOS and stop_token_ids end to end."""

from __future__ import annotations

import pytest
import torch

from hybridmoe import LLM, SamplingParams
from hybridmoe.runtime.sampler import Sampler


def _reference(logits: torch.Tensor, params, outputs) -> torch.Tensor:
    out = logits.double().clone()
    for row, (p, output) in enumerate(zip(params, outputs)):
        for token in set(output):
            out[row, token] -= output.count(token) * p.frequency_penalty + p.presence_penalty
    return out


def test_presence_and_frequency_penalties_match_reference():
    torch.manual_seed(5)
    vocab = 50
    logits = torch.randn(3, vocab) * 3
    outputs = [[int(logits[0].argmax())] * 3 + [7, 7, 9], [int(logits[1].argmax()), 4], []]
    params = [SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=1.5),
              SamplingParams(temperature=0.0, presence_penalty=2.0),
              SamplingParams(temperature=0.0, frequency_penalty=-2.0)]
    prompts = [[int(logits[2].argmax())], [], [11]]  # prompt ids are not penalised
    histories = [p + o for p, o in zip(prompts, outputs)]
    ids = Sampler().sample(logits, params, [None] * 3, histories, outputs)
    expected = _reference(logits, params, outputs).argmax(dim=-1)
    assert torch.equal(ids, expected)
    assert int(ids[0]) != int(logits[0].argmax()) and int(ids[1]) != int(logits[1].argmax())
    assert int(ids[2]) == int(logits[2].argmax())
    with pytest.raises(ValueError, match="need output_token_ids"):
        Sampler().sample(logits, params, [None] * 3, histories)


def test_penalty_ranges_are_checked():
    with pytest.raises(ValueError, match=r"presence_penalty must be in \[-2, 2\]"):
        SamplingParams(presence_penalty=2.5)
    with pytest.raises(ValueError, match=r"min_tokens must be an integer in \[0, max_tokens=4\]"):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(ValueError, match=r"logprobs must be None or an integer in \[0, 20\]"):
        SamplingParams(logprobs=21)


def test_min_tokens_holds_back_eos_and_stop_token_ids(tiny_model_dir):
    llm = LLM(tiny_model_dir("deepseek_v3"), dtype="float32")
    prompt = [5, 17, 33, 8]
    free = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0].token_ids
    k = next(k for k in range(1, 12) if free[k] not in free[:k])
    stopper = free[k]  # greedy stops at token k + 1 with this stop id
    stopped = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stopper]))[0]
    assert stopped.token_ids == free[:k + 1] and stopped.finish_reason == "stop"
    held = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stopper],
                                               min_tokens=k + 3))[0]
    assert stopper not in held.token_ids[:k + 3] and len(held.token_ids) >= k + 3
    assert held.token_ids[:k] == free[:k]
