"""Small expert parallelism with real ranks on the CPU stand-in: the engine process (rank 0) spawns a worker rank,
two gloo processes, and prefill chunks stream and compute each rank's share of the experts. Through the engine
(num_gpus=2) the same greedy tokens as the plain engine on tiny DeepSeek-V3 (FP8 experts), Qwen3-MoE and Mixtral
models; the activated-only copy; a killed rank and a hung rank fail with a clear error within a bound (a bound on a
hang, not a speed goal); no process is left after close, nor after an engine process that exits without closing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from hybridmoe import LLM, SamplingParams
from hybridmoe.checkpoint.fp8 import write_fp8_checkpoint
from hybridmoe.kernels import isa
from hybridmoe.layers.moe.block import MoEBlock
from hybridmoe.parallel.attach import attach_expert_parallel
from hybridmoe.parallel.backend import ExpertParallelBackend
from hybridmoe.parallel.group import RankFailedError

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
MIN_TOKENS = 4  # prompts run over the ranks, decode steps (one token per sequence) stay on rank 0's CPU experts
HANG_BOUND_S = 30.0  # a failed rank must surface within this (a bound on a hang, not a speed goal)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(6, 300, (n,), generator=gen).tolist() for n in (5, 23, 11)]


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dir, tmp_path_factory):
    """model type -> directory; DeepSeek-V3 in its FP8 checkpoint format."""
    fp8 = write_fp8_checkpoint(tiny_model_dir("deepseek_v3", n_routed_experts=16, num_hidden_layers=4),
                               tmp_path_factory.mktemp("fp8") / "deepseek_v3")
    return {"deepseek_v3": fp8, "qwen3_moe": tiny_model_dir("qwen3_moe", num_experts=16, num_hidden_layers=4),
            "mixtral": tiny_model_dir("mixtral", num_hidden_layers=3)}


@pytest.fixture(autouse=True)
def float32_kernels():
    """The plain engine's CPU kernels on an ISA that keeps float32 activations: ISAs with bf16 dot products (AMX,
    avx512bf16) round a prefill's activations to bf16 on FP8 experts (~3e-3, tests/models/test_fp8_models.py),
    enough to flip a greedy token of a random tiny model; the ranks compute in float32 like the torch reference."""
    with isa.use_isa(next(name for name in ("avx512", "avx2", "scalar") if name in isa.available_isas())):
        yield


def _running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _parallel(llm: LLM) -> list[ExpertParallelBackend]:
    """The expert-parallel backends the engine attached to its MoE blocks."""
    blocks = [layer.mlp for layer in llm.engine.model.layers if isinstance(layer.mlp, MoEBlock)]
    backends = [block.prefill_experts for block in blocks]
    assert all(isinstance(b, ExpertParallelBackend) for b in backends)
    return backends


@pytest.mark.parametrize("model_type", ["deepseek_v3", "qwen3_moe", "mixtral"])
def test_two_ranks_through_the_engine_give_the_same_greedy_tokens_as_the_plain_engine(model_dirs, model_type):
    """num_gpus=2: the engine spawns the worker; each rank streams its whole half of every layer ("all")."""
    model_dir = model_dirs[model_type]
    plain = [r.token_ids for r in LLM(model_dir, dtype="float32").generate(_prompts(), GREEDY)]
    llm = LLM(model_dir, dtype="float32", num_gpus=2, stream_prefill="on")
    backends = _parallel(llm)
    group, local = backends[0].group, backends[0].local
    pids = list(group.pids.values())
    try:
        assert len(pids) == 1 and _running(pids[0]) and pids[0] != os.getpid()
        share = local.streamer.layers[0]
        assert share.num_experts == llm.engine.model.config.moe.num_experts // 2  # rank 0 streams its half
        if model_type == "deepseek_v3":
            assert share.fmt == "fp8"  # streamed as the FP8 bytes the CPU kernels read (the worker maps the same)
        results = llm.generate(_prompts(), GREEDY)
        assert [r.error for r in results] == [None] * 3
        assert [r.token_ids for r in results] == plain
        # the prompts' chunk went over both ranks: the worker got tokens, each rank streamed its whole share once
        stats = backends[0].stats
        assert stats.calls == len(backends) and stats.tokens_sent[1] > 0
        whole_share = share.nbytes() * len(backends)  # every MoE layer's half (same shapes in every layer)
        passes, nbytes, _, _ = group.worker_stream_stats(1)
        assert (passes, nbytes) == (local.stats().passes, local.stats().bytes) == (1, whole_share)
    finally:
        llm.engine.close()
    assert not any(map(_running, pids))
    results = llm.generate(_prompts()[:1], GREEDY)  # closed: the engine decodes (and prefills) alone again
    assert results[0].token_ids == plain[0]


def test_activated_copy_streams_only_the_chosen_experts_and_a_failed_step_leaves_the_ranks_in_step(
        model_dirs):
    model_dir = model_dirs["qwen3_moe"]
    plain = [r.token_ids for r in LLM(model_dir, dtype="float32").generate(_prompts(), GREEDY)]
    llm = LLM(model_dir, dtype="float32")
    ep = attach_expert_parallel(llm.engine.model, model_dir, 2, min_tokens=MIN_TOKENS, copy="activated",
                                timeout_s=60, threads=1, staging_bytes=1 << 20)
    try:
        assert [r.token_ids for r in llm.generate(_prompts(), GREEDY)] == plain
        whole_share = ep.local.streamer.layers[0].nbytes() * len(ep.backends)
        for stats in ep.stream_stats():  # 16 experts, 39 tokens at top-2: some of each rank's 8 left unchosen
            assert stats.passes == 1 and 0 < stats.bytes < whole_share
        # rank 0's own share fails once in the second MoE layer, after the worker got that layer's tokens: the
        # step fails alone, and the worker's answer to it is not read as a later layer's
        run, calls = ep.local.run, []

        def failing_once(layer, *args):
            calls.append(layer)
            if len(calls) == 2:
                raise RuntimeError("injected failure")
            return run(layer, *args)

        ep.local.run = failing_once
        assert "injected failure" in llm.generate(_prompts()[1], GREEDY)[0].error
        assert [r.token_ids for r in llm.generate(_prompts(), GREEDY)] == plain
    finally:
        ep.close()


def test_a_killed_rank_fails_the_engine_with_a_clear_error_within_a_bound(model_dirs):
    llm = LLM(model_dirs["qwen3_moe"], dtype="float32", num_gpus=2, stream_prefill="on")
    backend = _parallel(llm)[0]
    try:
        pid = backend.group.pids[1]
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        result = llm.generate(_prompts()[1], GREEDY)[0]
        assert time.monotonic() - start < HANG_BOUND_S
        assert result.finish_reason == "error"
        assert f"rank 1 (pid {pid}) was killed by SIGKILL" in result.error and "Restart the engine" in result.error
        with pytest.raises(RankFailedError, match="killed by SIGKILL"):  # every later prefill fails at once
            backend.submit(torch.zeros(4, 64), torch.zeros(4, 2, dtype=torch.long), torch.ones(4, 2))
    finally:
        llm.engine.close()
    assert not _running(pid)


def test_a_hung_rank_fails_the_exchange_after_the_timeout_and_close_kills_it(model_dirs):
    llm = LLM(model_dirs["mixtral"], dtype="float32")
    ep = attach_expert_parallel(llm.engine.model, model_dirs["mixtral"], 2, min_tokens=MIN_TOKENS, timeout_s=3,
                                threads=1)
    pid = ep.group.pids[1]
    try:
        os.kill(pid, signal.SIGSTOP)  # alive but answering nothing
        start = time.monotonic()
        result = llm.generate(_prompts()[1], GREEDY)[0]
        assert time.monotonic() - start < HANG_BOUND_S
        assert result.finish_reason == "error"
        assert f"rank 1 did not answer within 3 s (pid {pid} is still running" in result.error
    finally:
        ep.close()
    assert not _running(pid)


def test_a_rank_killed_while_rank_0_waits_for_it_fails_at_once_not_at_the_timeout(model_dirs):
    """The worker is stopped (so rank 0 is left waiting inside the exchange), then killed: the closed connection
    ends the wait with the exit status long before the 60 s receive timeout."""
    llm = LLM(model_dirs["mixtral"], dtype="float32")
    ep = attach_expert_parallel(llm.engine.model, model_dirs["mixtral"], 2, min_tokens=MIN_TOKENS, timeout_s=60,
                                threads=1)
    pid = ep.group.pids[1]
    try:
        os.kill(pid, signal.SIGSTOP)
        killer = threading.Timer(1.0, os.kill, (pid, signal.SIGKILL))
        killer.start()
        start = time.monotonic()
        result = llm.generate(_prompts()[1], GREEDY)[0]
        assert time.monotonic() - start < HANG_BOUND_S
        assert f"rank 1 (pid {pid}) was killed by SIGKILL" in result.error
        killer.join()
    finally:
        ep.close()
    assert not _running(pid)


def test_no_worker_outlives_an_engine_process_that_exits_without_closing(model_dirs):
    script = textwrap.dedent(f"""
        import os, torch
        from hybridmoe.models.loader import load_model
        from hybridmoe.parallel.attach import attach_expert_parallel
        model = load_model({str(model_dirs["mixtral"])!r}, "float32", show_progress=False)
        ep = attach_expert_parallel(model, {str(model_dirs["mixtral"])!r}, 2, threads=1)
        print(ep.group.pids[1], flush=True)
        os._exit(0)  # no close, no atexit: the worker must notice by itself
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    pid = int(out.stdout.split()[-1])
    deadline = time.monotonic() + HANG_BOUND_S
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(pid)
