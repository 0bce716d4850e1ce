"""`serve --pd` in process (uvicorn on a thread) over a tiny DeepSeek-V3 (MLA) model, two worker processes behind
it: the openai client gets the single-process engine's greedy tokens, streamed and not; a client that leaves
mid-stream aborts its request; killing the decode worker
mid-request fails that request only (500 in OpenAI's shape), the worker is restarted and the next request
succeeds; after shutdown no worker process and no shared-memory segment is left."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import pytest

from hybridmoe import LLM, SamplingParams
from hybridmoe.disagg.engine import PDEngine
from hybridmoe.disagg.shm import list_segments
from hybridmoe.runtime.engine import EngineConfig

from serve.conftest import MODEL_NAME, running_server

pytestmark = pytest.mark.slow
PROMPTS = [[5, 17, 33, 8, 90], [44, 3, 81], [7, 7, 7, 7, 7, 7, 7, 7, 7], [120, 60, 14, 200]]
HANG_S = 120  # a bound on waits for the workers, never a timing assertion


def _wait(condition, what: str) -> None:
    deadline = time.monotonic() + HANG_S
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {HANG_S} s"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_serve_pd_openai_client_crash_and_shutdown(tiny_model_dir):
    model_dir = tiny_model_dir("deepseek_v3")
    expected = LLM(model_dir, dtype="float32").generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    engine = PDEngine(model_dir, EngineConfig(dtype="float32", kv_cache_gb=0.05))
    with running_server(engine) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=HANG_S, max_retries=0)
        response = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=12, temperature=0,
                                             extra_body={"ignore_eos": True})
        assert [c.text for c in response.choices] == [r.text for r in expected]
        assert response.usage.completion_tokens == 48
        streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
            model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True,
            extra_body={"ignore_eos": True}) if chunk.choices)
        assert streamed == expected[0].text
        assert server.metric("kv_blocks_used") == 0

        # a client that leaves mid-stream: its request is aborted in the decode worker, its blocks freed
        leaving = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=400, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
        chunks = iter(leaving)
        next(chunks), next(chunks), next(chunks)
        leaving.close()
        _wait(lambda: engine.num_unfinished_requests == 0 and server.metric("kv_blocks_used") == 0,
              "the abort of a request whose client left")
        assert server.metric("request_success_total", finished_reason="abort") == 1

        # kill the decode worker while a long request decodes on it
        pids = engine.worker_pids()
        stream = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=400, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks), next(chunks)  # the first token (prefill worker), then one from the decode worker
        os.kill(pids["decode"], signal.SIGKILL)
        with pytest.raises(openai.APIError, match="decode worker .* died"):
            for _ in chunks:
                pass
        # a non-streamed request in flight when the worker dies: a 500 in OpenAI's shape
        result: dict = {}

        def long_request():
            try:
                client.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=400, temperature=0,
                                          extra_body={"ignore_eos": True})
            except openai.APIStatusError as error:
                result["error"] = error

        _wait(lambda: engine.worker_pids()["decode"] is not None, "the decode worker's restart")
        restarted = engine.worker_pids()["decode"]
        assert restarted != pids["decode"] and engine.worker_restarts()["decode"] == 1
        thread = threading.Thread(target=long_request)
        thread.start()
        _wait(lambda: engine.stats() is not None and engine.stats().num_running_requests > 0
              and engine.requests_in("decode") == 1, "the long request's decode")
        os.kill(restarted, signal.SIGKILL)
        thread.join(HANG_S)
        error = result["error"]
        assert error.status_code == 500 and error.body["type"] == "server_error"
        assert "decode worker" in error.body["message"] and "died" in error.body["message"]

        _wait(lambda: engine.worker_pids()["decode"] not in (None, restarted), "the second restart")
        again = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[3], max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert again.choices[0].text == expected[3].text
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        assert server.metric("request_success_total", finished_reason="error") == 2
        survivors = [p for p in engine.worker_pids().values() if p is not None]
        _wait(lambda: server.metric("kv_blocks_used") == 0, "the KV blocks' release")
    engine.shutdown()
    assert list_segments(engine.prefix) == []
    _wait(lambda: not any(_alive(pid) for pid in survivors), "the workers' exit")

