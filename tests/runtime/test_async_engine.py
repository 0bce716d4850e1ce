"""AsyncLLMEngine (one engine thread, asyncio streams) and LLM.stream on a tiny model in float32: streams give the
tokens LLM.generate gives; a caller that stops early aborts its request and frees its KV blocks; refusals,
failures in a step, loading errors and shutdown reach the callers."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from hybridmoe import LLM, SamplingParams
from hybridmoe.runtime.async_engine import AsyncLLMEngine, EngineNotReadyError, EngineStepError, StreamBuffer
from hybridmoe.runtime.engine import EngineConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = [[5, 17, 33, 8, 90], [44, 3, 81], [7, 7, 7, 7, 7, 7, 7, 7, 7], [120, 60]]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("deepseek_v3")


def _run(coro, timeout: float = 60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def _started(model_dir, stream_interval: int = 1, **options) -> tuple[AsyncLLMEngine, list]:
    finished = []
    engine = AsyncLLMEngine(model_dir, EngineConfig(dtype="float32", block_size=4, **options),
                            on_request_finished=finished.append, stream_interval=stream_interval)
    engine.start()
    await engine.wait_ready()
    return engine, finished


def test_concurrent_streams_match_generate(model_dir):
    expected = [r.token_ids for r in LLM(model_dir, dtype="float32", block_size=4).generate(PROMPTS, GREEDY)]

    async def main():
        engine, finished = await _started(model_dir)
        try:
            async def collect(prompt):
                outs = [out async for out in engine.generate(prompt, GREEDY)]
                assert [out.finished for out in outs] == [False] * (len(outs) - 1) + [True]
                assert "".join(out.new_text for out in outs) == outs[-1].text
                return [t for out in outs for t in out.new_token_ids]
            got = await asyncio.gather(*(collect(p) for p in PROMPTS))
            assert got == expected
            assert sorted(out.finish_reason for out in finished) == ["length"] * len(PROMPTS)
        finally:
            engine.shutdown()
    _run(main())


def test_a_caller_that_leaves_aborts_its_request_and_frees_its_blocks(model_dir):
    async def main():
        engine, finished = await _started(model_dir)
        try:
            first = asyncio.Event()

            async def consume():
                async for _ in engine.generate(PROMPTS[0], SamplingParams(max_tokens=500, ignore_eos=True)):
                    first.set()
            task = asyncio.create_task(consume())
            await first.wait()
            assert engine.stats().kv_blocks_used > 0
            task.cancel()
            while not finished:
                await asyncio.sleep(0.01)
            assert finished[0].finish_reason == "abort" and len(finished[0].token_ids) < 500
            assert engine.stats().kv_blocks_used == 0 and engine.num_unfinished_requests == 0
        finally:
            engine.shutdown()
    _run(main())


def test_refusals_and_a_failed_step_reach_only_their_callers(model_dir):
    async def main():
        engine, _ = await _started(model_dir, max_model_len=32)
        try:
            with pytest.raises(ValueError, match="prompt too long: 5 tokens \\+ max_tokens 40 > max_model_len 32"):
                async for _ in engine.generate(PROMPTS[0], SamplingParams(max_tokens=40)):
                    pass
            runner = engine.engine.runner
            real_forward = runner.forward

            def failing_forward(chunks, all_logits=False):
                runner.forward = real_forward  # fails once
                raise RuntimeError("injected failure")
            runner.forward = failing_forward
            outs = [out async for out in engine.generate(PROMPTS[1], GREEDY)]
            assert outs[-1].finish_reason == "error" and "injected failure" in outs[-1].error
            outs = [out async for out in engine.generate(PROMPTS[1], GREEDY)]
            assert outs[-1].finish_reason == "length" and len(outs[-1].token_ids) == 10

            scheduler = engine.engine.scheduler
            real_schedule = scheduler.schedule

            def failing_schedule():  # a failure outside the model run: the requests in flight end, nothing else
                scheduler.schedule = real_schedule
                raise RuntimeError("scheduler bug")
            scheduler.schedule = failing_schedule
            with pytest.raises(EngineStepError, match="scheduler bug"):
                async for _ in engine.generate(PROMPTS[2], GREEDY):
                    pass
            outs = [out async for out in engine.generate(PROMPTS[2], GREEDY)]
            assert outs[-1].finish_reason == "length" and engine.stats().kv_blocks_used == 0
        finally:
            engine.shutdown()
    _run(main())


def test_loading_and_shutdown(model_dir, tmp_path):
    async def main():
        broken = AsyncLLMEngine(tmp_path / "missing", EngineConfig(dtype="float32"))
        with pytest.raises(EngineNotReadyError, match="the model is not loaded"):
            async for _ in broken.generate([1, 2], GREEDY):
                pass
        broken.start()
        with pytest.raises(EngineNotReadyError, match="failed to load"):
            await broken.wait_ready()

        engine, _ = await _started(model_dir)
        started = asyncio.Event()
        outs = []

        async def consume():
            async for out in engine.generate(PROMPTS[0], SamplingParams(max_tokens=500, ignore_eos=True)):
                outs.append(out)
                started.set()
        task = asyncio.create_task(consume())
        await started.wait()
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
        await task
        assert outs[-1].finish_reason == "abort"
        with pytest.raises(EngineNotReadyError, match="shut down"):
            async for _ in engine.generate(PROMPTS[1], GREEDY):
                pass
    _run(main())


def test_llm_stream(model_dir):
    llm = LLM(model_dir, dtype="float32")
    expected = llm.generate(PROMPTS[0], GREEDY)[0]
    outs = list(llm.stream(PROMPTS[0], GREEDY))
    assert [t for out in outs for t in out.new_token_ids] == expected.token_ids
    assert "".join(out.new_text for out in outs) == expected.text and outs[-1].finished
    for out in llm.stream(PROMPTS[1], SamplingParams(max_tokens=200, ignore_eos=True)):
        break  # leaving early aborts the request
    assert not llm.engine.has_unfinished_requests() and llm.engine.stats().kv_blocks_used == 0
    with pytest.raises(ValueError, match="the prompt is empty"):
        next(llm.stream([], GREEDY))


def test_a_slow_caller_gets_the_waiting_outputs_merged(model_dir):
    expected = LLM(model_dir, dtype="float32", block_size=4).generate([PROMPTS[0]], GREEDY)[0]

    async def main():
        engine, finished = await _started(model_dir)
        try:
            stream = engine.generate(PROMPTS[0], GREEDY)
            outs = [await anext(stream)]
            while not finished:  # the engine finishes the request while this caller reads nothing
                await asyncio.sleep(0.01)
            outs += [out async for out in stream]
            assert len(outs) == 2 and outs[-1].finished and outs[-1].finish_reason == "length"
            assert [t for out in outs for t in out.new_token_ids] == expected.token_ids == outs[-1].token_ids
            assert "".join(out.new_text for out in outs) == expected.text == outs[-1].text
            assert outs[-1].first_token_time == outs[0].first_token_time
        finally:
            engine.shutdown()
    _run(main())


def test_a_stream_interval_sends_the_first_output_then_one_per_interval_tokens(model_dir):
    """stream_interval 4: each request's first output alone, then merged outputs of 4 tokens (one a step here),
    the last whatever is left with finished (1, 4, 4, 2 tokens; a caller that falls behind merges consecutive ones,
    so every output but the last ends after 1 + 4k tokens); the tokens and text those of LLM.generate."""
    params = SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True)
    expected = LLM(model_dir, dtype="float32", block_size=4).generate(PROMPTS, params)

    async def main():
        engine, _ = await _started(model_dir, stream_interval=4)
        try:
            async def collect(prompt):
                return [out async for out in engine.generate(prompt, params)]
            for outs, want in zip(await asyncio.gather(*(collect(p) for p in PROMPTS)), expected):
                ends = list(itertools.accumulate(len(out.new_token_ids) for out in outs))
                assert len(outs) <= 4 and ends[-1] == 11 and all(end % 4 == 1 for end in ends[:-1]), ends
                assert [out.finished for out in outs] == [False] * (len(outs) - 1) + [True]
                assert [t for out in outs for t in out.new_token_ids] == want.token_ids
                assert "".join(out.new_text for out in outs) == want.text
        finally:
            engine.shutdown()
    _run(main())
    with pytest.raises(ValueError, match="stream_interval must be at least 1, got 0"):
        AsyncLLMEngine(model_dir, stream_interval=0)


def test_stream_buffer_holds_outputs_until_due():
    from hybridmoe.runtime.engine import RequestOutput

    def out(n, finished=False):
        return RequestOutput("r", [1], [], "", new_token_ids=[7] * n, finished=finished)

    one = StreamBuffer(1)
    assert all(len(one.push(o)) == 1 for o in (out(1), out(1), out(1, True)))
    buffer = StreamBuffer(3)
    first = out(1)
    assert buffer.push(first) == [first]  # the first output at once (time to first token)
    a, b, c = out(1), out(1), out(2)
    assert buffer.push(a) == [] and buffer.push(b) == []
    assert buffer.push(c) == [a, b, c]  # 4 >= 3 tokens gathered: all of them, in order
    d, last = out(1), out(0, finished=True)
    assert buffer.push(d) == [] and buffer.push(last) == [d, last]  # the last at once, with what was held


def test_merged_outputs_keep_logprobs_and_stop_at_the_finished_one():
    from hybridmoe.runtime.async_engine import _coalesce
    from hybridmoe.runtime.engine import RequestOutput

    def out(ids, finished=False, logprobs=True):
        return RequestOutput("r", [1], [], "", new_token_ids=ids, new_text="".join(map(str, ids)), finished=finished,
                             finish_reason="stop" if finished else None, first_token_time=1.0 if ids[0] == 1 else 2.0,
                             new_logprobs=[f"lp{i}" for i in ids] if logprobs else None)

    async def main():
        q = asyncio.Queue()
        for item in (out([2, 3]), out([4], finished=True), out([9])):
            q.put_nowait(item)
        merged = _coalesce(out([1]), q)
        assert merged.new_token_ids == [1, 2, 3, 4] and merged.new_text == "1234" and merged.finished
        assert merged.new_logprobs == ["lp1", "lp2", "lp3", "lp4"] and merged.first_token_time == 1.0
        assert q.qsize() == 1  # nothing is taken past the finished output
        q.put_nowait(RuntimeError("failed"))
        q.get_nowait()
        assert isinstance(_coalesce(out([1], logprobs=False), q), RuntimeError)
    _run(main())


def test_shutdown_closes_the_engine(model_dir):
    """Shutdown stops what the engine started beside the model: stream-loading prefill's device slots go back."""
    async def main():
        engine, _ = await _started(model_dir, stream_prefill="on", vram="8GB", kv_cache_gb=0.01)
        outs = [out async for out in engine.generate(PROMPTS[0], GREEDY)]
        assert outs[-1].finish_reason == "length"
        held = engine.engine.accel.ledger.held
        assert any(name.startswith("slp.slot") for name in held)
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
        assert not any(name.startswith("slp.slot") for name in held)
    _run(main())
