"""Every error status of the server, in OpenAI's shape ({"error": {"message", "type", "param", "code"}}): 400 for a
client's mistakes (malformed JSON, wrong types, out-of-range values, unsupported fields, a prompt too long for the
context), 401 for a wrong or missing API key, 404 for an unknown model or route, 413 for a body too large, 429 with
Retry-After past the waiting queue's bound, 503 with Retry-After while the model loads, and 500 for a failed step,
after which the server keeps serving."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from hybridmoe.runtime.async_engine import AsyncLLMEngine
from hybridmoe.runtime.engine import EngineConfig, LLMEngine

from .conftest import MODEL_NAME, running_server, tiny_engine

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _error(response: httpx.Response, status: int, param: str | None = None) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error
    return error["message"]


@pytest.mark.parametrize("body, param, words", [
    ('{"model": "tiny", "messages": [', None, "not valid JSON"),
    ({**CHAT, "temperature": "hot"}, "temperature", "number"),
    ({**CHAT, "top_p": 1.5}, "top_p", "less than or equal to 1"),
    ({**CHAT, "n": 0}, "n", "greater than or equal to 1"),
    ({**CHAT, "max_tokens": -3}, "max_tokens", "greater than or equal to 1"),
    ({**CHAT, "messages": []}, "messages", "at least 1"),
    ({**CHAT, "messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "'system'"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "look"},
                                                         {"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[1]", "type 'image_url' are not supported"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     "messages[0].content[0]", "type 'input_audio' are not supported"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0]", "its text"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"text": "x"}]}]}, "messages[0].content", None),
    ({**CHAT, "logit_bias": {"5": 300}}, "logit_bias", "not in [-100, 100]"),
    ({**CHAT, "logit_bias": {"5": "x"}}, "logit_bias.5", "number"),
    ({**CHAT, "tools": [{"type": "function"}]}, "tools", "not supported"),
    ({**CHAT, "tool_choice": "required"}, "tool_choice", "not supported"),
    ({**CHAT, "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "not supported"),
    ({**CHAT, "response_format": {"type": "json_object"}}, "response_format", "'json_object' is not supported"),
    ({**CHAT, "response_format": {"type": "json_schema", "json_schema": {}}}, "response_format", "not supported"),
    ({**CHAT, "response_format": "json"}, "response_format", None),
    ({**CHAT, "top_logprobs": 2}, "top_logprobs", "not supported"),
    ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options", "not supported"),
    ({**CHAT, "presence_penalty": 3}, "presence_penalty", "less than or equal to 2"),
    ({**CHAT, "stream": "sometimes"}, "stream", "boolean"),
    ({**CHAT, "stop": [1]}, "stop", None),
    ({**CHAT, "max_tokens": 4000}, "max_tokens", "maximum context length"),
    ({**CHAT, "max_completion_tokens": 4000}, "max_completion_tokens", "maximum context length"),
    ([1, 2], None, "valid dictionary"),
])
def test_bad_chat_requests_are_400(server, body, param, words):
    content = body if isinstance(body, str) else json.dumps(body)
    response = httpx.post(server.url + "/v1/chat/completions", content=content,
                          headers={"Content-Type": "application/json"}, timeout=30)
    message = _error(response, 400, param)
    assert words is None or words in message


def test_what_the_refused_fields_accept_still_works(server):
    for extra in ({"tool_choice": "none"}, {"tool_choice": "auto"}, {"tools": []}, {"response_format": {"type": "text"}},
                  {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, {"logit_bias": {}}):
        response = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, **extra}, timeout=30)
        assert response.status_code == 200, (extra, response.text)


def test_bad_completion_requests_are_400(server):
    url = server.url + "/v1/completions"
    _error(httpx.post(url, json={"prompt": [1, -2], "max_tokens": 2}, timeout=30), 400, "prompt")
    assert "prompt must not be empty" in _error(httpx.post(url, json={"prompt": []}, timeout=30), 400, "prompt")
    _error(httpx.post(url, json={"prompt": "a", "suffix": "b"}, timeout=30), 400, "suffix")
    _error(httpx.post(url, json={"prompt": "a", "max_tokens": 0}, timeout=30), 400, "max_tokens")
    _error(httpx.post(url, json={"prompt": "a", "logprobs": 21}, timeout=30), 400, "logprobs")
    assert "[0, 320)" in _error(httpx.post(url, json={"prompt": [1, 100000]}, timeout=30), 400)


def test_context_overflow_names_both_numbers(server):
    prompt = list(range(10, 110))  # 100 tokens
    limit = server.engine.max_model_len
    message = _error(httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": limit},
                                timeout=30), 400, "max_tokens")
    assert f"maximum context length is {limit} tokens" in message
    assert f"{100 + limit} tokens (100 in the prompt, {limit} for the completion)" in message


def test_unknown_model_route_and_method(server):
    message = _error(httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "model": "gpt-9"}, timeout=30),
                     404, "model")
    assert "gpt-9" in message
    _error(httpx.post(server.url + "/v1/nothing", json={}, timeout=30), 404)
    _error(httpx.get(server.url + "/v1/chat/completions", timeout=30), 405)


def test_body_size_limit_is_413(model_dir):
    with running_server(tiny_engine(model_dir), max_request_bytes=2000) as server:
        big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
        _error(httpx.post(server.url + "/v1/chat/completions", json=big, timeout=30), 413)

        def chunks():  # no Content-Length: counted as it arrives
            yield json.dumps(big).encode()
        _error(httpx.post(server.url + "/v1/chat/completions", content=chunks(), timeout=30), 413)
        assert httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=30).status_code == 200


def test_api_key(model_dir):
    with running_server(tiny_engine(model_dir), api_key="s3cret") as server:
        url = server.url + "/v1/chat/completions"
        assert "API key" in _error(httpx.post(url, json=CHAT, timeout=30), 401)
        _error(httpx.post(url, json=CHAT, headers={"Authorization": "Bearer wrong"}, timeout=30), 401)
        _error(httpx.get(server.url + "/v1/models", timeout=30), 401)
        _error(httpx.post(server.url + "/tokenize", json={"prompt": "a"}, timeout=30), 401)
        ok = httpx.post(url, json=CHAT, headers={"Authorization": "Bearer s3cret"}, timeout=30)
        assert ok.status_code == 200
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200  # health and metrics stay open
        assert httpx.get(server.url + "/metrics", timeout=30).status_code == 200


def test_503_while_loading_then_200(model_dir):
    gate = threading.Event()

    def slow_load():
        gate.wait(30)
        return LLMEngine(model_dir, EngineConfig(dtype="float32"))
    engine = AsyncLLMEngine(model_dir, engine_factory=slow_load)
    with running_server(engine, wait_ready=False) as server:
        health = httpx.get(server.url + "/health", timeout=30)
        assert "loading" in _error(health, 503) and health.headers["Retry-After"] == "1"
        busy = httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=30)
        _error(busy, 503)
        assert busy.headers["Retry-After"] == "1"
        gate.set()
        for _ in range(300):
            if httpx.get(server.url + "/health", timeout=30).status_code == 200:
                break
            asyncio.run(asyncio.sleep(0.05))
        assert httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=30).status_code == 200


def test_queue_past_its_bound_is_429(model_dir):
    with running_server(tiny_engine(model_dir, max_num_seqs=1), max_waiting_requests=1) as server:
        runner = server.engine.engine.runner
        real_forward = runner.forward

        def slow_forward(chunks, all_logits=False):  # a slower model: the first request is still running below
            time.sleep(0.02)
            return real_forward(chunks, all_logits)
        runner.forward = slow_forward

        async def main():
            long = {**CHAT, "max_tokens": 400, "ignore_eos": True, "stream": True}
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                async with client.stream("POST", "/v1/chat/completions", json=long) as running:
                    await anext(running.aiter_lines())  # running now
                    waiting = asyncio.create_task(client.post("/v1/chat/completions", json={**long, "stream": False}))
                    while server.engine.num_unfinished_requests < 2:
                        await asyncio.sleep(0.01)
                    refused = await client.post("/v1/chat/completions", json=CHAT)
                    assert "busy" in _error(refused, 429) and refused.headers["Retry-After"] == "1"
                waiting.cancel()
        asyncio.run(asyncio.wait_for(main(), 60))


def test_a_failed_step_is_500_and_the_server_keeps_serving(model_dir):
    with running_server(tiny_engine(model_dir)) as server:
        runner = server.engine.engine.runner
        real_forward = runner.forward

        def fail_once(chunks, all_logits=False):
            runner.forward = real_forward
            raise RuntimeError("injected failure")
        runner.forward = fail_once
        assert "injected failure" in _error(httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=30),
                                            500)
        runner.forward = fail_once
        with httpx.stream("POST", server.url + "/v1/chat/completions", json={**CHAT, "stream": True},
                          timeout=30) as stream:
            assert stream.status_code == 200  # the failure comes after the first token: an error event
            events = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert "injected failure" in json.loads(events[-2][6:])["error"]["message"] and events[-1] == "data: [DONE]"
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        assert httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=30).status_code == 200
        assert server.metric("request_success_total", finished_reason="error") == 2
