"""`hybridmoe bench kernels` end to end on tiny shapes: the JSON it writes has the fields the issue names."""

from __future__ import annotations

import argparse
import json
import types

import pytest

import torch

from hybridmoe.bench import kernels as bench
from hybridmoe.kernels import isa, numa


@pytest.mark.slow
def test_bench_writes_the_report(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "SHAPES", {"tiny": (256, 96, 16, 4)})
    monkeypatch.setattr(bench, "QUICK_TOKENS", {"tiny": (1, 9)})
    monkeypatch.setattr(bench, "POOL_BYTES", {True: 4 << 20, False: 4 << 20})  # 4 MiB: 2 or 3 layers of 16
    monkeypatch.setattr(bench, "CACHE_MULTIPLE", 0)
    out = tmp_path / "kernels.json"
    assert bench.run(argparse.Namespace(quick=True, json=str(out), formats="fp8,int4,bf16")) == 0
    printed = capsys.readouterr()
    assert sum("tiny" in line for line in printed.out.splitlines()) == 6  # each case once, in the table
    assert "tiny" not in printed.err  # stderr is no terminal here: no progress line
    report = json.loads(out.read_text())
    assert report["memory_bandwidth_gbs"] > 0 and report["threads"] >= 1 and report["isa"]
    assert report["idle_spin_us"] == isa.idle_spin_us()
    assert report["short_row_prefetch"] == isa.short_row_prefetch()
    assert report["long_row_prefetch"] == isa.long_row_prefetch()
    assert report["expert_memory"] == bench.EXPERT_MEMORY[numa.topology()["copy_shards"]]
    assert [(r["format"], r["tokens"]) for r in report["results"]] == [
        (f, t) for f in ("fp8", "int4", "bf16") for t in (1, 9)]
    for row in report["results"]:
        for key in ("shape", "weight_gbs", "bandwidth_fraction", "speedup_vs_bf16_torch", "speedup_vs_dequant_torch"):
            assert key in row
        assert row["weight_gbs"] > 0 and row["speedup_vs_bf16_torch"] > 0
        assert row["layers"] == -(-row["distinct_experts"] // 16) >= 2
        # fractions are of the case's own probes (taken beside it), which the run's best probe bounds
        assert row["bandwidth_fraction"] == pytest.approx(row["weight_gbs"] / row["probe_gbs"])
        assert row["flops_fraction"] == pytest.approx(row["gflops"] / row["probe_gflops"])
        assert 0 < row["probe_gbs"] <= report["memory_bandwidth_gbs"]
        assert row["bandwidth_fraction_of_best"] == pytest.approx(row["weight_gbs"] / report["memory_bandwidth_gbs"])
    # the opening and closing probes, and per format one before its first case and one after each case
    assert len(report["memory_bandwidth_gbs_probes"]) == 2 + 3 * (1 + 2)
    assert report["memory_bandwidth_gbs"] == max(report["memory_bandwidth_gbs_probes"])


def _fake_clock(monkeypatch, calls: list, spinning_sleeps: int = 0):
    """bench's time module on a fake clock that each call (and sleep) advances; the first `spinning_sleeps` sleeps
    see another thread of the process spin (process time advancing as fast as the clock)."""
    clock = types.SimpleNamespace(now=0.0, cpu=0.0, sleeps=0)

    def sleep(seconds):
        calls.append(("sleep", seconds))
        clock.now += seconds
        clock.sleeps += 1
        if clock.sleeps <= spinning_sleeps:
            clock.cpu += seconds

    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: clock.now, sleep=sleep,
                                                             process_time=lambda: clock.cpu))
    return clock


def test_the_wait_for_quiet_cpus_sleeps_until_no_thread_spins(monkeypatch):
    calls = []
    _fake_clock(monkeypatch, calls, spinning_sleeps=3)
    bench._wait_until_quiet()
    assert calls == [("sleep", bench.QUIET_STEP_SECONDS)] * 4
    calls.clear()
    _fake_clock(monkeypatch, calls, spinning_sleeps=10**6)  # spins for ever: waits QUIET_MAX_SECONDS, no more
    bench._wait_until_quiet()
    assert len(calls) == pytest.approx(bench.QUIET_MAX_SECONDS / bench.QUIET_STEP_SECONDS, abs=1)


def test_the_kernels_then_torch_are_timed_once_quiet_after_warming_up(monkeypatch):
    """_case_times waits for quiet CPUs, then times the kernels: on the first routing (layer 0) until
    WARMUP_SECONDS have passed, then per routing i on layer 0 for SETTLE_SECONDS, untimed, and on layer i; then
    torch likewise. It returns the medians of the timed calls."""
    calls = []
    clock = _fake_clock(monkeypatch, calls, spinning_sleeps=1)
    ms = 2.0 ** -10  # about a millisecond, exact in binary, so that the clock's sums are too
    monkeypatch.setattr(bench, "WARMUP_SECONDS", 40 * ms)
    monkeypatch.setattr(bench, "SETTLE_SECONDS", 16 * ms)
    monkeypatch.setattr(bench, "QUIET_STEP_SECONDS", 10 * ms)
    kernel_s = {0: 8 * ms, 1: 1 * ms, 2: 3 * ms, 3: 2 * ms}
    torch_s = {0: 1000 * ms, 1: 4 * ms, 2: 9 * ms, 3: 10 * ms}

    def call(name, durations):
        def run(layer, hidden, ids, weights):
            calls.append((name, layer, ids))
            clock.now += durations[layer]
        return run

    routings = [(f"ids{i}", f"w{i}") for i in range(4)]
    kernel_seconds, torch_seconds = bench._case_times(call("kernel", kernel_s), call("torch", torch_s), routings, None)
    kernel_settle = [("kernel", 0, "ids0")] * 2  # 2 x 8 ms reach 16 ms
    torch_settle = [("torch", 0, "ids0")]  # one call at least
    assert calls == ([("sleep", 10 * ms)] * 2  # a thread spun in the first
                     + [("kernel", 0, "ids0")] * 5  # 5 x 8 ms reach 40 ms
                     + kernel_settle + [("kernel", 1, "ids1")] + kernel_settle + [("kernel", 2, "ids2")]
                     + kernel_settle + [("kernel", 3, "ids3")]
                     + [("torch", 0, "ids0")]  # its warm-up: one call at least
                     + torch_settle + [("torch", 1, "ids1")] + torch_settle + [("torch", 2, "ids2")]
                     + torch_settle + [("torch", 3, "ids3")])
    assert (kernel_seconds, torch_seconds) == (2 * ms, 9 * ms)


def test_unknown_formats_are_refused():
    with pytest.raises(SystemExit, match="unknown format"):
        bench.run(argparse.Namespace(quick=True, json=None, formats="fp4"))


def test_a_pool_larger_than_a_layer_is_called_as_consecutive_layers():
    """D = 6 distinct experts of E = 4 per layer: 2 layers, layer 1's experts are pool[4], pool[5], pool[0],
    pool[1]; each layer's kernel output matches torch on that layer's experts."""
    source = bench._Bytes()
    one = bench.ExpertPool("fp8", 128, 32, 4, 1, source).expert_bytes
    pool = bench.ExpertPool("fp8", 128, 32, 4, 6 * one, source)
    assert (pool.distinct, pool.num_layers) == (6, 2)
    assert [pool.expert(1, e) is pool.experts[i] for e, i in enumerate((4, 5, 0, 1))] == [True] * 4
    assert pool.expert(3, 0) is pool.expert(1, 0)  # layers repeat in turn
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 128, generator=gen).bfloat16()
    ids, weights = bench._routings(5, 4, 2, 1)[0]
    outs = []
    for layer in (0, 1):
        out = pool.moe(layer, hidden, ids, weights).double()
        expected = torch.zeros(5, 128, dtype=torch.float64)
        for t in range(5):
            for e, w in zip(ids[t].tolist(), weights[t].tolist()):
                gate, up, down = (m.double() for m in pool.dequantized(layer, e))
                x = hidden[t].double()
                expected[t] += w * down @ (torch.nn.functional.silu(gate @ x) * (up @ x))
        assert ((out - expected).abs().max() / expected.abs().max()).item() < 3e-2
        outs.append(out)
    assert not torch.allclose(outs[0], outs[1])


def test_pool_bytes_are_their_own_memory():
    """Each matrix of a pool holds just its bytes: a slice of the 16 MiB source block would keep all of it alive
    (at Qwen3 shapes, 10x the pool's memory)."""
    source = bench._Bytes()
    small, large = source.take(1000), source.take(2 * source.block.numel() + 5)
    assert small.untyped_storage().nbytes() == 1000
    assert large.untyped_storage().nbytes() == large.numel() == 2 * source.block.numel() + 5
    assert torch.equal(large[source.block.numel():][:1000], small)


def test_pool_tensors_lie_in_one_arena_aligned_and_equal_to_their_source():
    arena = bench._HugePageArena(4096)
    gen = torch.Generator().manual_seed(0)
    src = [torch.randn(3, 5, generator=gen).bfloat16(), torch.randint(0, 255, (7,), dtype=torch.uint8),
           torch.randn(2, 9, generator=gen)]
    placed = [arena.place(t) for t in src]
    base, end = arena.buffer.data_ptr(), arena.buffer.data_ptr() + arena.buffer.numel()
    for s, p in zip(src, placed):
        assert p.dtype == s.dtype and p.shape == s.shape and torch.equal(p, s)
        assert p.data_ptr() % bench._HugePageArena.ALIGN == 0 and base <= p.data_ptr() < end
    with pytest.raises(ValueError, match="arena of 4096 bytes is full"):
        arena.place(torch.zeros(4096, dtype=torch.uint8))
    pool = bench.ExpertPool("int4", 128, 64, 4, 1, bench._Bytes())
    for m in pool.experts[0]:
        for t in m:
            start = t.data_ptr() - pool.arena.buffer.data_ptr()
            assert 0 <= start and start + t.numel() * t.element_size() <= pool.arena.buffer.numel()
