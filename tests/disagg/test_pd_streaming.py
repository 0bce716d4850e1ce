"""`PDEngine`'s workers stream each prompt's KV layer by layer during its prefill (budget 1, the default): the
single engine's greedy tokens on GQA and MLA models, every request's KV streamed; a request that ends with its
first token, and one aborted during its prefill, leave no segment and no KV block in the decode worker. The
benchmark runs a PD engine with kv_streaming=False beside one with it (the KV packed after the prefill: also
tests/disagg/test_compressed_handoff.py's PD test, attention importance) and checks the setting took."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridmoe import LLM, SamplingParams
from hybridmoe.disagg.engine import PDEngine
from hybridmoe.disagg.shm import list_segments
from hybridmoe.runtime.engine import EngineConfig

pytestmark = pytest.mark.slow
PROMPTS = [[5, 17, 33, 8, 90, 12, 61, 7, 200, 31, 4, 77], [44, 3, 81], [9] * 40]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
HANG_S = 120  # a bound on waits for the workers, never a timing assertion


async def _tokens(engine: PDEngine, prompt, params) -> list[int]:
    tokens = []
    async for out in engine.generate(prompt, params):
        tokens += out.new_token_ids
    return tokens


async def _outputs(engine: PDEngine, prompt, params) -> list:
    return [out async for out in engine.generate(prompt, params)]


async def _run(engine: PDEngine, prompts, params) -> list[list[int]]:
    return await asyncio.gather(*(_tokens(engine, p, params) for p in prompts))


async def _abort_during_prefill(engine: PDEngine) -> None:
    gen = engine.generate([3] * 200, GREEDY)  # chunks of 64 tokens: several prefill steps
    task = asyncio.ensure_future(gen.__anext__())
    await asyncio.sleep(0.05)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await gen.aclose()


def _kv_segments(engine: PDEngine) -> list:
    return [p for p in list_segments(engine.prefix) if not p.name.startswith(engine.prefix + "weights-")]


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_pd_streams_the_kv_and_gives_the_single_engine_tokens(tiny_model_dir, family):
    model_dir = tiny_model_dir(family)
    expected = [r.token_ids for r in LLM(model_dir, dtype="float32").generate(PROMPTS, GREEDY)]
    # an event per 3 tokens (stream_interval): the first at once, then 3 at a time, the same tokens
    engine = PDEngine(model_dir, EngineConfig(dtype="float32", kv_cache_gb=0.05, max_num_batched_tokens=64),
                      stream_interval=3)
    engine.start()
    try:
        engine.wait_ready_sync(HANG_S)
        assert asyncio.run(_run(engine, PROMPTS, GREEDY)) == expected
        assert engine.kv_streams == len(PROMPTS)
        outs = asyncio.run(_outputs(engine, PROMPTS[0], GREEDY))
        ends = list(itertools.accumulate(len(out.new_token_ids) for out in outs))
        assert len(outs) <= 4 and ends[-1] == 8 and all(end % 3 == 1 for end in ends[:-1]), ends
        # ends with its first token in the prefill worker: the decode worker gives up the KV streamed to it
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        assert asyncio.run(_tokens(engine, PROMPTS[0], one)) == expected[0][:1]
        assert engine.kv_streams == len(PROMPTS) + 2
        asyncio.run(_abort_during_prefill(engine))
        deadline = time.monotonic() + HANG_S
        while engine.num_unfinished_requests or engine.stats().kv_blocks_used or _kv_segments(engine):
            assert time.monotonic() < deadline, "a request or its KV was left behind"
            time.sleep(0.05)
        assert asyncio.run(_run(engine, PROMPTS[:1], GREEDY)) == expected[:1]  # and the workers carry on
    finally:
        engine.shutdown()
    assert list_segments(engine.prefix) == []


def test_the_streaming_benchmark_runs_both_engines(tmp_path):
    """benchmarks/pd_kv_streaming.py, shortened: both PD engines answer, the setting took (it checks each engine's
    count of streamed handoffs), and the JSON has both medians."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "pd_kv_streaming.py"
    out = tmp_path / "streaming.json"
    result = subprocess.run([sys.executable, str(script), "--long-tokens", "48", "--rounds", "2", "--json", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads(out.read_text())["summary"]
    assert set(summary) == {"streamed", "packed after"}
    assert all(s["ttft_ms"] > 0 and s["gap_ms"] > 0 for s in summary.values())
    assert "first-to-second token" in result.stdout
