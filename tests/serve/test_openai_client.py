"""The official openai client against the server: chat and completions, streamed and not, n > 1, logprobs, usage;
greedy tokens through the server equal LLM.generate's, and logprobs equal the engine's."""

from __future__ import annotations

import openai
import pytest

from hybridmoe import LLM, SamplingParams

from .conftest import MODEL_NAME

PROMPTS = [[5, 17, 33, 8, 90], [44, 3, 81], [7, 7, 7, 7, 7, 7, 7, 7, 7], [120, 60, 14, 200]]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, dtype="float32")


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]


def test_greedy_completions_equal_llm_generate(client, llm):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    expected = llm.generate(PROMPTS, params)
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=12, temperature=0,
                                         logprobs=2, extra_body={"ignore_eos": True})
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    for choice, result in zip(response.choices, expected):
        assert choice.text == result.text and choice.finish_reason == "length"
        assert choice.logprobs.token_logprobs == pytest.approx([e.logprob for e in result.logprobs], abs=1e-6)
        assert choice.logprobs.tokens == [llm.tokenizer.decode([t], skip_special_tokens=False)
                                          for t in result.token_ids]
    assert response.usage.prompt_tokens == sum(map(len, PROMPTS))
    assert response.usage.completion_tokens == 48 and response.usage.total_tokens == 48 + sum(map(len, PROMPTS))


def test_chat_streamed_and_not(client, llm):
    expected = llm.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3))[0]
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=10,
                                              temperature=0, logprobs=True, top_logprobs=3,
                                              extra_body={"ignore_eos": True})
    choice = response.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == expected.text
    assert choice.finish_reason == "length"
    assert [e.logprob for e in choice.logprobs.content] == pytest.approx([e.logprob for e in expected.logprobs],
                                                                         abs=1e-6)
    assert all(len(e.top_logprobs) == 3 for e in choice.logprobs.content)
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids) and response.usage.completion_tokens == 10

    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_n_choices_with_a_seed_are_reproducible(client):
    def ask():
        return client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=1.0,
                                              n=3, seed=11, extra_body={"ignore_eos": True})
    first, second = ask(), ask()
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in second.choices]
    assert len(set(texts)) > 1  # each choice has a seed of its own
    assert first.usage.completion_tokens == 24

    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=1.0,
                                                 n=3, seed=11, stream=True, extra_body={"ignore_eos": True}))
    streamed = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i)
                for i in range(3)]
    assert streamed == texts


def test_completions_prompt_forms_echo_and_streaming(client, llm):
    text_prompt = "The quick brown fox"
    expected = llm.generate(text_prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    response = client.completions.create(model=MODEL_NAME, prompt=[text_prompt, text_prompt], max_tokens=6,
                                         temperature=0, echo=True, extra_body={"ignore_eos": True})
    assert [c.text for c in response.choices] == [text_prompt + expected.text] * 2
    streamed = list(client.completions.create(model=MODEL_NAME, prompt=text_prompt, max_tokens=6, temperature=0,
                                              stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed) == expected.text
    assert streamed[-1].choices[0].finish_reason == "length"
    single_ids = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=3, temperature=0)
    assert single_ids.usage.prompt_tokens == len(PROMPTS[0])


def test_echo_scores_the_prompt_like_an_evaluation_harness(client, llm):
    """lm-evaluation-harness's local-completions: token-id prompts, echo, logprobs=1, max_tokens 1 (or 0)."""
    prompt = PROMPTS[0] + PROMPTS[1]
    expected = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, logprobs=1))[0]
    for max_tokens in (1, 0):
        response = client.completions.create(model=MODEL_NAME, prompt=[prompt], max_tokens=max_tokens,
                                             temperature=0, echo=True, logprobs=1)
        logprobs = response.choices[0].logprobs
        assert len(logprobs.tokens) == len(prompt) + max_tokens
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        assert logprobs.token_logprobs[1:len(prompt)] == pytest.approx(
            [e.logprob for e in expected.prompt_logprobs[1:]], abs=1e-6)
        for entry, scored in zip(logprobs.top_logprobs[1:], expected.prompt_logprobs[1:]):
            assert max(entry.values()) == pytest.approx(scored.top[0][1], abs=1e-6)
        assert response.usage.completion_tokens == max_tokens
    streamed = list(client.completions.create(model=MODEL_NAME, prompt=[prompt], max_tokens=1, temperature=0,
                                              echo=True, logprobs=1, stream=True))
    tokens = [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    assert tokens == logprobs.token_logprobs[:len(prompt)] + [pytest.approx(expected.logprobs[0].logprob, abs=1e-6)]
