"""hybridmoe's engine computes each shipped model as transformers does: the same greedy tokens in float32."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.slow
@pytest.mark.parametrize("model", ["demo", "gqa"])
def test_engine_generates_the_same_greedy_tokens_as_transformers(request, model):
    from transformers import AutoTokenizer

    from hybridmoe import LLM, SamplingParams

    model_dir, reference = request.getfixturevalue(f"{model}_dir"), request.getfixturevalue(f"{model}_model_fp32")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer("A man was reading")["input_ids"]
    expected = reference.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    result = LLM(model_dir, dtype="float32").generate([ids], SamplingParams(temperature=0.0, max_tokens=24))[0]
    assert result.token_ids == expected[0, len(ids):].tolist()
