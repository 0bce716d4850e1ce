"""The streamed chunks' JSON, written from a per-stream template, is byte for byte the JSON of the chunk as a dict
(what the server sent before); a slow client, and a server with a stream interval, give the stream's text and usage
whole; logit_bias (OpenAI's semantics) moves greedy tokens and is checked (400 naming it)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from hybridmoe.runtime.async_engine import AsyncLLMEngine
from hybridmoe.runtime.engine import EngineConfig, RequestOutput
from hybridmoe.runtime.logprobs import TokenLogprobs
from hybridmoe.runtime.tokenizer import load_tokenizer
from hybridmoe.serve.chat import _ChatStream
from hybridmoe.serve.completions import _CompletionStream
from hybridmoe.serve.generation import to_json, usage
from hybridmoe.serve.logprobs import TokenStrings, chat_logprobs, completion_logprobs, merge_completion_logprobs

from hybridmoe.cli import main

from .conftest import MODEL_NAME, running_server, tiny_engine


def _out(text: str, ids: list[int], finished: bool = False, reason: str | None = None, logprobs: bool = False):
    entries = [TokenLogprobs(t, -0.5, ((t, -0.5), (3, -1.25))) for t in ids] if logprobs else None
    return RequestOutput("r-0", [1, 2], ids, text, new_token_ids=ids, new_text=text, finished=finished,
                         finish_reason=reason, new_logprobs=entries)


OUTPUTS = [_out("Hello", [5]), _out(' "quoted"\n\\ é ☃', [6, 7]), _out("", [8], True, "length"),
           _out("end", [9], True, "stop")]


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("with_logprobs", [False, True])
def test_chat_chunks_are_the_json_of_the_dicts(model_dir, include_usage, with_logprobs):
    strings = TokenStrings(load_tokenizer(model_dir)) if with_logprobs else None
    fmt = _ChatStream("chatcmpl-x", 17, "m", 2, 3, include_usage, strings)
    base = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 17, "model": "m",
            **({"usage": None} if include_usage else {})}
    for index, raw in enumerate(OUTPUTS):
        out = _out(raw.new_text, raw.new_token_ids, raw.finished, raw.finish_reason, with_logprobs)
        logprobs = {"content": chat_logprobs(out.new_logprobs, strings)} if with_logprobs else None
        delta = {"content": out.new_text} if out.new_text or not out.finished else {}
        expected = {**base, "choices": [{"index": index % 2, "delta": delta, "logprobs": logprobs,
                                         "finish_reason": out.finish_reason if out.finished else None}]}
        assert fmt.chunk(index % 2, out) == to_json(expected)
        assert json.loads(fmt.chunk(index % 2, out)) == expected
    assert fmt.chunk(0, _out("", [4])) is None  # a token that completes no character yet


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("with_logprobs", [False, True])
def test_completion_chunks_are_the_json_of_the_dicts(model_dir, include_usage, with_logprobs):
    strings = TokenStrings(load_tokenizer(model_dir)) if with_logprobs else None
    fmt = _CompletionStream("cmpl-x", 17, "m", 1, ["", ""], 4, include_usage, strings, False)
    base = {"id": "cmpl-x", "object": "text_completion", "created": 17, "model": "m",
            **({"usage": None} if include_usage else {})}
    offsets = {}
    for index, raw in enumerate(OUTPUTS):
        out = _out(raw.new_text, raw.new_token_ids, raw.finished, raw.finish_reason, with_logprobs)
        logprobs = None
        if with_logprobs:
            logprobs = merge_completion_logprobs([completion_logprobs(out.new_logprobs, out.new_token_ids, strings,
                                                                      offsets.get(index % 2, 0))])
        offsets[index % 2] = offsets.get(index % 2, 0) + len(out.new_text)
        expected = {**base, "choices": [{"index": index % 2, "text": out.new_text, "logprobs": logprobs,
                                         "finish_reason": out.finish_reason if out.finished else None}]}
        assert fmt.chunk(index % 2, out) == to_json(expected)
    assert fmt.tail() == ([{**base, "choices": [], "usage": usage(4, 2)}] if include_usage else [])


def test_a_slow_streaming_client_gets_the_same_text(server):
    """The client reads nothing until the request has finished on the engine: whatever the grouping of tokens into
    chunks (outputs that waited for the handler come merged), the text, finish_reason and usage are whole."""
    body = {"model": MODEL_NAME, "prompt": [5, 17, 33, 8, 90], "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}
    expected = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()

    async def slow():
        async with httpx.AsyncClient(timeout=60) as client:
            async with client.stream("POST", server.url + "/v1/completions",
                                     json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
                while server.engine.num_unfinished_requests:  # the engine runs the request to its end meanwhile
                    await asyncio.sleep(0.01)
                return [line async for line in r.aiter_lines() if line.startswith("data: ")]
    lines = asyncio.run(slow())
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    text_chunks = [c for c in chunks if c["choices"]]
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == expected["choices"][0]["text"]
    assert text_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"] == expected["usage"]


def test_a_stream_interval_sends_fewer_chunks_of_the_same_text(model_dir, capsys):
    """--stream-interval 5: the first token's chunk at once, then a chunk per 5 tokens, the text and usage those of
    the response unstreamed."""
    body = {"model": MODEL_NAME, "prompt": [5, 17, 33, 8, 90], "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}
    with running_server(tiny_engine(model_dir, block_size=4)) as plain:
        expected = httpx.post(plain.url + "/v1/completions", json=body, timeout=60).json()
    with running_server(AsyncLLMEngine(model_dir, EngineConfig(dtype="float32", block_size=4),
                                       stream_interval=5)) as server:
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                          json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    text_chunks = [c for c in chunks if c["choices"]]
    assert 2 <= len(text_chunks) <= 4  # 1 + 5 + 5 + 1 tokens (fewer where the handler merged waiting ones)
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == expected["choices"][0]["text"]
    assert chunks[-1]["usage"] == expected["usage"]
    assert main(["serve", "--stream-interval", "0"]) == 2
    assert "--stream-interval must be a positive integer, got 0" in capsys.readouterr().err


def test_logit_bias_moves_greedy_tokens(server):
    url = server.url + "/v1/completions"
    body = {"model": MODEL_NAME, "prompt": [5, 17, 33], "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}
    plain = httpx.post(url, json=body, timeout=60).json()["choices"][0]["logprobs"]["tokens"]
    forced = 42
    token = httpx.post(server.url + "/detokenize", json={"tokens": [forced]}, timeout=60).json()["prompt"]
    biased = httpx.post(url, json={**body, "logit_bias": {str(forced): 100}}, timeout=60).json()
    assert biased["choices"][0]["logprobs"]["tokens"] == [token] * 4 != plain
    # -100 on every token the plain run chose: none of them comes back
    ids = httpx.post(server.url + "/tokenize", json={"prompt": "".join(plain), "add_special_tokens": False},
                     timeout=60).json()["tokens"]
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
            "logit_bias": {str(t): -100 for t in ids}, "logprobs": True}
    response = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("bias, words", [
    ({"x": 1}, "is not a token id"),
    ({"-1": 1}, "not in [0, "),
    ({"100000": 1}, "not in [0, "),
    ({"5": 100.5}, "not in [-100, 100]"),
    ({"5": -101}, "not in [-100, 100]"),
])
def test_bad_logit_bias_is_400_naming_it(server, bias, words):
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})):
        response = httpx.post(server.url + path, json={**body, "max_tokens": 2, "logit_bias": bias}, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "logit_bias" and words in error["message"], error
