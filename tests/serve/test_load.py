"""The server under load: 48 concurrent streaming clients of which a third disconnect after their first chunk (the
others complete, the server answers afterwards, KV blocks in use return to zero, read from /metrics), and a KV cache
far too small for the requests (they queue or are preempted and all complete, with the tokens LLM.generate gives)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from hybridmoe import LLM, SamplingParams
from hybridmoe.runtime.engine import LLMEngine, EngineConfig

from .conftest import MODEL_NAME, running_server, tiny_engine


def _prompt(i: int, length: int) -> list[int]:
    return [(7 * i + 13 * k) % 300 + 6 for k in range(length)]


async def _stream(client: httpx.AsyncClient, body: dict, leave_after_first: bool) -> list[dict]:
    """Stream one completion; the data events, or only the first when leaving after it."""
    events = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            events.append(json.loads(line[6:]))
            if leave_after_first:
                break  # closing the response closes the connection: the server sees the client leave
    return events


def test_48_streams_a_third_disconnecting(model_dir):
    with running_server(tiny_engine(model_dir)) as server:
        async def main():
            limits = httpx.Limits(max_connections=64)
            async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as client:
                # the leaving third asks for many tokens: they cannot finish before the server sees them leave
                bodies = [{"model": MODEL_NAME, "prompt": _prompt(i, 5 + i % 20),
                           "max_tokens": 200 if i % 3 == 0 else 8, "temperature": 0.0, "ignore_eos": True,
                           "stream": True} for i in range(48)]
                results = await asyncio.gather(*(_stream(client, body, i % 3 == 0) for i, body in enumerate(bodies)))
                for i, events in enumerate(results):
                    if i % 3:
                        assert events[-1]["choices"][0]["finish_reason"] == "length"
                        text = "".join(e["choices"][0]["text"] for e in events)
                        assert len(text) > 0
                    else:
                        assert len(events) == 1
                after = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})
                assert after.status_code == 200
        asyncio.run(asyncio.wait_for(main(), 120))
        deadline = time.monotonic() + 30
        while server.metric("kv_blocks_used") != 0:
            assert time.monotonic() < deadline, "KV blocks still in use 30 s after the burst"
            time.sleep(0.05)
        assert server.metric("request_success_total", finished_reason="abort") == 16
        assert server.metric("request_success_total", finished_reason="length") == 33
        assert server.metric("num_requests_running") == 0 and server.metric("num_requests_waiting") == 0


@pytest.mark.slow
def test_kv_exhaustion_queues_and_preempts_and_loses_nothing(model_dir):
    block_size, num_blocks = 16, 12  # 192 token slots for 16 requests of 120 to 180 tokens each
    per_token = LLMEngine(model_dir, EngineConfig(dtype="float32")).model.kv_bytes_per_token()
    kv_cache_gb = per_token * block_size * num_blocks / 2**30
    prompts = [_prompt(i, 40 + 4 * i) for i in range(16)]
    expected = LLM(model_dir, dtype="float32").generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True))
    with running_server(tiny_engine(model_dir, kv_cache_gb=kv_cache_gb, block_size=block_size)) as server:
        assert server.metric("kv_blocks_total") == num_blocks

        async def main():
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
                responses = await asyncio.gather(*(client.post("/v1/completions", json={
                    "prompt": p, "max_tokens": 80, "temperature": 0.0, "ignore_eos": True}) for p in prompts))
            return [r.json() for r in responses]
        results = asyncio.run(asyncio.wait_for(main(), 180))
        assert [r["choices"][0]["text"] for r in results] == [e.text for e in expected]
        assert all(r["usage"]["completion_tokens"] == 80 for r in results)
        assert server.metric("num_preemptions_total") > 0
        assert server.metric("kv_blocks_used") == 0
        assert server.metric("request_success_total", finished_reason="length") == 16
