"""One copy of the weights: the two workers of `PDEngine` map the same checkpoint pages, so the machine counts the
weights once. Measured from /proc/<pid>/smaps: each worker's mapping of model.safetensors (resident pages, and
their proportional share: a page mapped by both workers counts half in each). A worker holding its own copy
would show no shared pages and each worker's PSS equal to its RSS, their sum twice the weights.
What the loader makes at load (a bf16 checkpoint computed in float32) is in one shared-memory segment that both
workers map (disagg/shared_weights.py): measured the same way, against workers that each make their own
(HYBRIDMOE_PD_SHARED_WEIGHTS=0); a restarted worker maps the segment again, shutdown removes it.
Also greedy tokens through the two worker processes, each pinned to a CPU, equal the single-process engine's
(Mixtral, GQA), and a killed prefill worker is restarted (pinned again), a request sent meanwhile waiting for it."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch

from hybridmoe import LLM, SamplingParams
from hybridmoe.disagg.engine import PDEngine
from hybridmoe.disagg.shm import list_segments, shm_dir
from hybridmoe.runtime.engine import EngineConfig

pytestmark = pytest.mark.slow
HANG_S = 180


def mapping_kb(pid: int, path_suffix: str) -> dict[str, int]:
    """Rss, Pss, Shared_Clean, Private_* (kB) of pid's mappings of a file whose path ends with path_suffix."""
    totals: dict[str, int] = {}
    inside = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            first = line.split()[0]
            if not first.endswith(":"):  # a mapping's header line: address range, perms, ..., path
                inside = line.rstrip().endswith(path_suffix)
            elif inside and line.split()[-1] == "kB":
                totals[first[:-1]] = totals.get(first[:-1], 0) + int(line.split()[1])
    return totals


async def _run(engine: PDEngine, prompts, params):
    async def one(prompt):
        tokens = []
        async for out in engine.generate(prompt, params):
            tokens += out.new_token_ids
        return tokens
    return await asyncio.gather(*(one(p) for p in prompts))


def rollup_kb(pid: int) -> dict[str, int]:
    """pid's /proc/<pid>/smaps_rollup (kB): Rss, Pss, Private_Clean, ..."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return {line.split()[0][:-1]: int(line.split()[1]) for line in f if line.rstrip().endswith("kB")}


def private_kb(pid: int) -> int:
    """Memory only pid holds (kB): Private_Clean + Private_Dirty of /proc/<pid>/smaps_rollup."""
    fields = rollup_kb(pid)
    return fields["Private_Clean"] + fields["Private_Dirty"]


def weights_segments(prefix: str) -> list:
    return [path for path in list_segments(prefix) if path.name.startswith(prefix + "weights-")]


def serve_and_measure(model_dir) -> dict[str, tuple[dict[str, int], int]]:
    """Run a few requests through PDEngine; -> per worker role: (its checkpoint mapping's kB, its private kB)."""
    engine = PDEngine(model_dir, EngineConfig(dtype="float32", kv_cache_gb=0.05))
    engine.start()
    try:
        engine.wait_ready_sync(HANG_S)
        prompts = [[(i * 37 + j * 11) % 300 + 1 for j in range(48)] for i in range(4)]
        asyncio.run(_run(engine, prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)))
        return {role: (mapping_kb(pid, "model.safetensors"), private_kb(pid))
                for role, pid in engine.worker_pids().items()}
    finally:
        engine.shutdown()


def test_workers_share_the_weights_pages(tiny_model_dir):
    # float32 experts, ~100 MB in all: 2 layers x 8 experts x 3 x 512 x 1024 x 4 bytes
    big = tiny_model_dir("qwen3_moe", hidden_size=512, moe_intermediate_size=1024, num_hidden_layers=2,
                         num_experts=8, num_experts_per_tok=4, num_attention_heads=8, num_key_value_heads=2,
                         head_dim=64)
    weights_kb = (big / "model.safetensors").stat().st_size // 1024
    measured = serve_and_measure(big)
    baseline = serve_and_measure(tiny_model_dir("qwen3_moe"))  # the same workers over a model of ~0.5 MB
    (prefill, prefill_private), (decode, decode_private) = measured["prefill"], measured["decode"]
    print(f"weights {weights_kb} kB; prefill worker {prefill}, private {prefill_private} kB; decode worker "
          f"{decode}, private {decode_private} kB; tiny model's workers' private: "
          f"{baseline['prefill'][1]}, {baseline['decode'][1]} kB")
    for worker in (prefill, decode):  # both compute from the mapped checkpoint (most expert pages touched) ...
        assert worker["Rss"] > 0.5 * weights_kb
        assert worker["Private_Clean"] + worker["Private_Dirty"] == 0  # ... not a page of its own
    # ... the same pages: the machine counts them once, not once per worker
    # (shared pages count as "dirty" where the checkpoint lies on tmpfs)
    assert decode["Shared_Clean"] + decode["Shared_Dirty"] > 0.5 * weights_kb
    assert prefill["Pss"] + decode["Pss"] <= weights_kb * 1.02
    assert prefill["Rss"] + decode["Rss"] > 1.2 * weights_kb  # what two copies would have cost
    # and no worker made a copy of its own elsewhere: its private memory grows by far less than the weights
    for role, (_, private) in measured.items():
        assert private - baseline[role][1] < 0.25 * weights_kb, role


def test_pd_workers_give_the_single_engine_greedy_tokens_mixtral(tiny_model_dir):
    model_dir = tiny_model_dir("mixtral")
    prompts = [[5, 17, 33, 8, 90, 12, 61, 7, 200, 31, 4, 77], [44, 3, 81], [9] * 30]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    expected = [r.token_ids for r in LLM(model_dir, dtype="float32").generate(prompts, params)]
    cpus = sorted(os.sched_getaffinity(0))  # each worker on a CPU of its own where there are two
    engine = PDEngine(model_dir, EngineConfig(dtype="float32", kv_cache_gb=0.05), prefill_cpus=cpus[:1],
                      decode_cpus=cpus[-1:])
    engine.start()
    try:
        engine.wait_ready_sync(HANG_S)
        assert asyncio.run(_run(engine, prompts, params)) == expected
        pids = engine.worker_pids()
        assert os.sched_getaffinity(pids["prefill"]) == {cpus[0]}
        assert os.sched_getaffinity(pids["decode"]) == {cpus[-1]}
        stats = engine.stats()
        assert stats.kv_blocks_used == 0 and stats.num_running_requests == 0
        # the prefill worker dies: it is restarted, and a request sent meanwhile waits for it and succeeds
        dead = engine.worker_pids()["prefill"]
        os.kill(dead, signal.SIGKILL)
        deadline = time.monotonic() + HANG_S
        while engine.worker_restarts()["prefill"] == 0:
            assert time.monotonic() < deadline, "the prefill worker was not restarted"
            time.sleep(0.02)
        assert asyncio.run(_run(engine, prompts[:1], params)) == expected[:1]
        assert engine.worker_pids()["prefill"] not in (None, dead)
        assert os.sched_getaffinity(engine.worker_pids()["prefill"]) == {cpus[0]}
    finally:
        engine.shutdown()


MEMORY_PROMPTS = [[(i * 37 + j * 11) % 300 + 1 for j in range(48)] for i in range(4)]
MEMORY_PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _transformed_memory(model_dir, shared: bool, monkeypatch) -> tuple[int, dict[str, dict[str, int]], list]:
    """Serve MEMORY_PROMPTS through PDEngine in float32; -> (the shared segment's kB, 0 without it; per worker
    role: its Pss and private kB, and its mapping of the segment's kB; the greedy tokens)."""
    monkeypatch.setenv("HYBRIDMOE_PD_SHARED_WEIGHTS", "1" if shared else "0")  # the workers inherit it
    engine = PDEngine(model_dir, EngineConfig(dtype="float32", kv_cache_gb=0.05))
    engine.start()
    try:
        engine.wait_ready_sync(HANG_S)
        tokens = asyncio.run(_run(engine, MEMORY_PROMPTS, MEMORY_PARAMS))
        segments = weights_segments(engine.prefix)
        assert len(segments) == shared
        segment_kb = segments[0].stat().st_size // 1024 if shared else 0
        measured = {}
        for role, pid in engine.worker_pids().items():
            rollup = rollup_kb(pid)
            mapped = mapping_kb(pid, segments[0].name) if shared else {}
            checkpoint = mapping_kb(pid, "model.safetensors")
            measured[role] = {"pss": rollup["Pss"], "private": rollup["Private_Clean"] + rollup["Private_Dirty"],
                              "segment_rss": mapped.get("Rss", 0), "segment_pss": mapped.get("Pss", 0),
                              "segment_private": mapped.get("Private_Clean", 0) + mapped.get("Private_Dirty", 0),
                              "checkpoint_private": checkpoint["Private_Clean"] + checkpoint["Private_Dirty"]}
        return segment_kb, measured, tokens
    finally:
        engine.shutdown()


def test_transformed_weights_are_held_once(tiny_model_dir, monkeypatch):
    # a bf16 checkpoint computed in float32: the embedding is converted at load, 64 MB of float32 (16384 x 1024),
    # and tied, so it is the LM head too, which both workers read whole; the projections and experts stay bf16 views
    model_dir = tiny_model_dir("qwen3_moe", dtype=torch.bfloat16, vocab_size=16384, hidden_size=1024,
                               tie_word_embeddings=True, num_hidden_layers=2, num_attention_heads=8,
                               num_key_value_heads=2, head_dim=128, moe_intermediate_size=64, num_experts=4,
                               num_experts_per_tok=2)
    segment_kb, shared, _ = _transformed_memory(model_dir, True, monkeypatch)
    _, separate, _ = _transformed_memory(model_dir, False, monkeypatch)
    print(f"\nsegment {segment_kb} kB; with it: {shared}; each worker its own: {separate}")
    assert segment_kb > 60_000
    # both workers compute from the segment's pages (the tied LM head reads it whole) ...
    for role in ("prefill", "decode"):
        assert shared[role]["segment_rss"] > 0.5 * segment_kb, role
    # ... which the machine counts once
    assert shared["prefill"]["segment_pss"] + shared["decode"]["segment_pss"] <= 1.02 * segment_kb
    # against workers that make their own: each holds the weights privately, and the two together twice. (Private
    # memory here leaves out mapped files: the checkpoint's bf16 pages that only the builder reads, to convert them,
    # and the segment's that one worker alone has touched, count as its private pages, but are not copies.)
    for role in ("prefill", "decode"):
        ours = shared[role]["private"] - shared[role]["segment_private"] - shared[role]["checkpoint_private"]
        own = separate[role]["private"] - separate[role]["checkpoint_private"]
        assert own - ours > 0.75 * segment_kb, role
    saved = sum(w["pss"] for w in separate.values()) - sum(w["pss"] for w in shared.values())
    assert saved > 0.75 * segment_kb


def test_numa_shard_copies_of_the_experts_are_held_once(tiny_model_dir, monkeypatch):
    # HYBRIDMOE_COPY_EXPERTS=1: the kernels copy each NUMA node's shard of the experts at load (what several real
    # nodes do), here the one node's experts whole: 2 layers x 8 x 3 x 512 x 512 float32, 48 MB, which the first
    # worker writes into the segment and the other maps
    model_dir = tiny_model_dir("qwen3_moe", hidden_size=512, moe_intermediate_size=512, num_hidden_layers=2,
                               num_experts=8, num_experts_per_tok=4, num_attention_heads=8, num_key_value_heads=2,
                               head_dim=64)
    expert_kb = 2 * 8 * 3 * 512 * 512 * 4 // 1024
    expected = [r.token_ids for r in LLM(model_dir, dtype="float32").generate(MEMORY_PROMPTS, MEMORY_PARAMS)]
    monkeypatch.setenv("HYBRIDMOE_COPY_EXPERTS", "1")  # the workers inherit it
    segment_kb, shared, tokens = _transformed_memory(model_dir, True, monkeypatch)
    _, separate, separate_tokens = _transformed_memory(model_dir, False, monkeypatch)
    print(f"\nexperts {expert_kb} kB, segment {segment_kb} kB; with it: {shared}; each worker its own: {separate}")
    assert tokens == separate_tokens == expected
    assert expert_kb <= segment_kb < 1.1 * expert_kb  # the copies, nothing else is made at load here
    for role in ("prefill", "decode"):  # both compute from the copies in the segment ...
        assert shared[role]["segment_rss"] > 0.5 * segment_kb, role
    # ... which the machine counts once; workers with copies of their own hold twice the experts
    assert shared["prefill"]["segment_pss"] + shared["decode"]["segment_pss"] <= 1.02 * segment_kb
    saved = sum(w["pss"] for w in separate.values()) - sum(w["pss"] for w in shared.values())
    assert saved > 0.75 * expert_kb


def test_restarted_worker_maps_the_shared_weights_again(tiny_model_dir):
    model_dir = tiny_model_dir("qwen3_moe", dtype=torch.bfloat16)  # computed in float32: converted at load
    prompts = [[5, 17, 33, 8, 90, 12, 61, 7, 200, 31, 4, 77], [44, 3, 81], [9] * 30]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    expected = [r.token_ids for r in LLM(model_dir, dtype="float32").generate(prompts, params)]
    engine = PDEngine(model_dir, EngineConfig(dtype="float32", kv_cache_gb=0.05))
    engine.start()
    try:
        engine.wait_ready_sync(HANG_S)
        assert asyncio.run(_run(engine, prompts, params)) == expected
        [segment] = weights_segments(engine.prefix)
        built = segment.stat()
        for pid in engine.worker_pids().values():  # both compute from it
            assert mapping_kb(pid, segment.name)["Rss"] > 0
        dead = engine.worker_pids()["decode"]
        os.kill(dead, signal.SIGKILL)
        deadline = time.monotonic() + HANG_S
        while engine.worker_pids()["decode"] in (None, dead):
            assert time.monotonic() < deadline, "the decode worker was not restarted"
            time.sleep(0.02)
        assert asyncio.run(_run(engine, prompts, params)) == expected
        # the same segment, not written again (a rebuild would truncate and rewrite it), mapped by the new worker
        assert weights_segments(engine.prefix) == [segment]
        after = segment.stat()
        assert (after.st_ino, after.st_mtime_ns, after.st_size) == (built.st_ino, built.st_mtime_ns, built.st_size)
        assert mapping_kb(engine.worker_pids()["decode"], segment.name)["Rss"] > 0
    finally:
        engine.shutdown()
    assert not (shm_dir() / segment.name).exists()
