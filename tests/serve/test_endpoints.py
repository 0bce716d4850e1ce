"""GET /health, /v1/models and /metrics (Prometheus text with vLLM's names: latency histograms, token counters,
request outcomes, scheduler gauges, the prefix cache's hit rate), POST /tokenize and /detokenize (vLLM's shape)."""

from __future__ import annotations

import gc
import weakref

import httpx

from .conftest import MODEL_NAME, running_server, tiny_engine


def test_health_and_models(server):
    health = httpx.get(server.url + "/health", timeout=30)
    assert health.status_code == 200 and health.content == b""
    models = httpx.get(server.url + "/v1/models", timeout=30).json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == MODEL_NAME and models["data"][0]["max_model_len"] == server.engine.max_model_len


def test_metrics_count_requests_tokens_and_prefix_hits(server):
    prompt = list(range(10, 74))  # 64 tokens: four full blocks of 16, cached after the first request
    before = {name: server.metric(name) for name in ("prompt_tokens_total", "generation_tokens_total",
                                                     "prefix_cache_hits_total", "time_to_first_token_seconds_count")}
    stops = server.metric("request_success_total", finished_reason="length")
    for _ in range(2):
        response = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 5,
                                                                    "ignore_eos": True}, timeout=30)
        assert response.status_code == 200
    assert server.metric("prompt_tokens_total") - before["prompt_tokens_total"] == 128
    assert server.metric("generation_tokens_total") - before["generation_tokens_total"] == 10
    assert server.metric("request_success_total", finished_reason="length") - stops == 2
    assert server.metric("time_to_first_token_seconds_count") - before["time_to_first_token_seconds_count"] == 2
    assert server.metric("e2e_request_latency_seconds_count") >= 2
    assert server.metric("time_per_output_token_seconds_count") >= 2
    assert server.metric("prefix_cache_hits_total") - before["prefix_cache_hits_total"] == 48  # 3 blocks reused
    assert 0 < server.metric("prefix_cache_hit_rate") < 1
    stats = server.engine.stats()
    assert server.metric("kv_blocks_total") == stats.kv_blocks_total
    assert server.metric("kv_blocks_used") == 0 and server.metric("kv_blocks_free") == stats.kv_blocks_total
    assert server.metric("kv_cache_usage_perc") == 0
    assert server.metric("num_preemptions_total") == 0
    assert server.metric("num_requests_running") == 0 and server.metric("num_requests_waiting") == 0
    text = httpx.get(server.url + "/metrics", timeout=30).text
    assert "# TYPE hybridmoe:time_to_first_token_seconds histogram" in text


def test_tokenize_and_detokenize(server):
    tokenizer = server.engine.tokenizer
    result = httpx.post(server.url + "/tokenize", json={"prompt": "The quick brown fox", "return_token_strs": True},
                        timeout=30).json()
    assert result["tokens"] == tokenizer.encode("The quick brown fox")
    assert result["count"] == len(result["tokens"]) and result["max_model_len"] == server.engine.max_model_len
    assert "".join(result["token_strs"]) == tokenizer.decode(result["tokens"], skip_special_tokens=False)
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]
    chat = httpx.post(server.url + "/tokenize", json={"messages": messages}, timeout=30).json()
    assert chat["tokens"] == tokenizer.apply_chat_template([{"role": "user", "content": "hi\nthere"}])
    back = httpx.post(server.url + "/detokenize", json={"tokens": result["tokens"]}, timeout=30).json()
    assert back == {"prompt": "The quick brown fox"}
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [10**6]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = httpx.post(server.url + "/tokenize", json={"prompt": "a", "messages": messages}, timeout=30)
    assert both.status_code == 400


def test_a_stopped_server_frees_its_engine(model_dir):
    # FastAPI keeps route functions in process-wide caches: an app whose routes held the engine kept its KV cache
    # (a GB by default) alive after shutdown, one more for every app built in the process.
    engine = tiny_engine(model_dir)
    with running_server(engine) as running:
        assert httpx.get(running.url + "/v1/models", timeout=10).status_code == 200
        model_engine = weakref.ref(engine.engine)
    assert model_engine() is None  # at shutdown, even while the app and its state still exist
    front = weakref.ref(engine)
    del engine, running
    gc.collect()
    assert front() is None
