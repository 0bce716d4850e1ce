"""The fused routed-expert MoE on the C++ kernels against a float64 torch computation grouped by expert, for
every weight format and ISA path here; async submit/wait; thread counts and the idle spin; input errors."""

from __future__ import annotations

import time

import pytest
import torch

from hybridmoe.kernels import isa, reference
from hybridmoe.kernels.moe import FusedMoE
from kernel_testing import bf16_activation_tolerance, random_experts, random_routing, seed

FORMATS = ["f32", "bf16", "f16", "fp8", "int4", "int8"]
E, H, I, K = 6, 200, 72, 3  # odd sizes: partial fp8 blocks, padded int groups


def _error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


def _tolerance(fmt: str, dtype: torch.dtype) -> float:
    # int: hidden and intermediate activations quantised to int8 per group against a float64 reference that
    # quantises nothing; over 120 random cases (these shapes) the max error reached 0.031 (p95 0.023, median
    # 0.015). The int kernels themselves are checked to 1e-5 against a quantisation-aware reference
    # (test_matmul_int).
    base = 5e-2 if fmt in ("int4", "int8") else 2e-5
    return base + max(1e-2 if dtype == torch.bfloat16 else 0.0, bf16_activation_tolerance(fmt))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_matches_float64(each_isa, fmt, dtype):
    gen = torch.Generator().manual_seed(seed(fmt, str(dtype), each_isa))
    kwargs, exact = random_experts(fmt, E, H, I, gen)
    moe = FusedMoE(**kwargs)
    # 40 tokens x 3 of 6 experts: the GEMM path for fp8 (from 13 tokens an expert); 420: for every format
    for tokens in (1, 2, 5, 9, 40, 420):
        hidden = torch.randn(tokens, H, generator=gen).to(dtype)
        ids, weights = random_routing(tokens, K, E, gen)
        out = moe(hidden, ids, weights)
        assert out.dtype == dtype and out.shape == (tokens, H)
        ref = reference.moe_reference(hidden, ids, weights, exact)
        assert _error(out, ref) < _tolerance(fmt, dtype), f"T={tokens}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_short_row_prefetch_level_moves_no_result(each_isa, fmt):
    """Where the GEMV's far prefetch puts short rows (isa.short_row_prefetch: L1 or L2, by CPU) changes which
    prefetch hints the tiles issue (at L2 two a line) and nothing else: at one and two tokens, with rows under 3 KB
    and more rows than the prefetch reaches ahead, both levels give the same output bit for bit, matching float64."""
    gen = torch.Generator().manual_seed(seed(fmt, each_isa, "prefetch"))
    kwargs, exact = random_experts(fmt, 4, 512, 384, gen)
    moe = FusedMoE(**kwargs)
    for tokens in (1, 2):
        hidden = torch.randn(tokens, 512, generator=gen)
        ids, weights = random_routing(tokens, 2, 4, gen)
        outs = {}
        for level in ("l1", "l2"):
            with isa.use_short_row_prefetch(level):
                outs[level] = moe(hidden, ids, weights)
        assert torch.equal(outs["l1"], outs["l2"]), f"T={tokens}"
        ref = reference.moe_reference(hidden, ids, weights, exact)
        assert _error(outs["l1"], ref) < _tolerance(fmt, torch.float32), f"T={tokens}"


@pytest.mark.parametrize("path", ["gemv", "gemm"])
def test_uneven_expert_loads_and_forced_paths(each_isa, path):
    gen = torch.Generator().manual_seed(21)
    kwargs, exact = random_experts("fp8", E, H, I, gen)
    moe = FusedMoE(**kwargs)
    ids, weights = random_routing(30, K, E, gen)
    ids[:, 0] = 4  # every token visits expert 4; expert 5 maybe none
    hidden = torch.randn(30, H, generator=gen)
    error = _error(moe(hidden, ids, weights, path=path), reference.moe_reference(hidden, ids, weights, exact))
    assert error < 2e-5 + bf16_activation_tolerance("fp8", path)


def test_submit_returns_before_wait_and_handles_complete_in_any_order():
    gen = torch.Generator().manual_seed(5)
    kwargs, exact = random_experts("bf16", E, H, I, gen)
    moe = FusedMoE(**kwargs)
    batches = [(torch.randn(t, H, generator=gen),) + random_routing(t, K, E, gen) for t in (3, 1, 8)]
    handles = [moe.submit(*batch) for batch in batches]
    for batch, handle in reversed(list(zip(batches, handles))):
        out = moe.wait(handle)
        assert handle.done()
        assert _error(out, reference.moe_reference(*batch, exact)) < 2e-5 + bf16_activation_tolerance("bf16")
    abandoned = moe.submit(*batches[0])
    del abandoned  # dropped unfinished: waits for the kernels before its arrays go


def test_queued_submissions_keep_their_temporary_inputs_alive():
    """Inputs made inside submit (fp16 -> fp32 hidden, int32 -> int64 ids, weights -> fp32) and dropped by Python
    at once must live until their job has run: jobs queue behind each other, memory is churned meanwhile, and
    every result must still match."""
    gen = torch.Generator().manual_seed(8)
    kwargs, exact = random_experts("f32", E, H, I, gen)
    moe = FusedMoE(**kwargs)
    batches = [(torch.randn(64, H, generator=gen).half(),) + random_routing(64, K, E, gen) for _ in range(6)]
    handles = [moe.submit(h, ids.int(), w.double()) for h, ids, w in batches]
    churn = [torch.full((64, H), float("nan")) for _ in range(64)]  # reuses freed memory, if any
    for (h, ids, w), handle in zip(batches, handles):
        assert _error(moe.wait(handle), reference.moe_reference(h, ids, w, exact)) < 2e-3
    del churn


@pytest.mark.parametrize("threads", [1, 4])
def test_blocking_calls_from_several_threads_beside_submissions(threads):
    """A blocking call runs on its own thread when no submitted job is pending, else queues behind them; the
    pool is shared one job at a time either way. Python threads calling at once, with async submissions in
    flight and more pool threads than cores (so that workers wake late), must all get their own results."""
    import threading

    gen = torch.Generator().manual_seed(9)
    kwargs, exact = random_experts("bf16", E, H, I, gen)
    moe = FusedMoE(**kwargs)
    batches = [(torch.randn(t, H, generator=gen),) + random_routing(t, K, E, gen) for t in (1, 3, 17, 40)]
    refs = [reference.moe_reference(*batch, exact) for batch in batches]
    tolerance = 2e-5 + bf16_activation_tolerance("bf16")
    errors: list[str] = []

    def caller(offset: int) -> None:
        for step in range(12):
            i = (offset + step) % len(batches)
            if step % 3 == 0:
                out = moe.wait(moe.submit(*batches[i]))
            else:
                out = moe(*batches[i])
            if _error(out, refs[i]) >= tolerance:
                errors.append(f"caller {offset}, step {step}, batch {i}")

    default = isa.num_threads()
    try:
        isa.configure_threads(threads)
        pending = [moe.submit(*batch) for batch in batches]  # queued before the callers start
        callers = [threading.Thread(target=caller, args=(k,)) for k in range(3)]
        for t in callers:
            t.start()
        for t in callers:
            t.join()
        for handle, ref in zip(pending, refs):
            assert _error(moe.wait(handle), ref) < tolerance
    finally:
        isa.configure_threads(default)
    assert not errors, errors


def test_fp16_hidden_and_empty_batches():
    gen = torch.Generator().manual_seed(6)
    kwargs, exact = random_experts("f32", E, H, I, gen)
    moe = FusedMoE(**kwargs)
    hidden = torch.randn(4, H, generator=gen).half()
    ids, weights = random_routing(4, K, E, gen)
    out = moe(hidden, ids.int(), weights.double())
    assert out.dtype == torch.float16
    assert _error(out, reference.moe_reference(hidden, ids, weights, exact)) < 2e-3
    assert moe(torch.empty(0, H), torch.empty(0, K, dtype=torch.int64), torch.empty(0, K)).shape == (0, H)


@pytest.mark.parametrize("threads,cpus", [(1, None), (3, None), (2, [0])])
def test_thread_counts_and_pinning_give_the_same_result(threads, cpus):
    gen = torch.Generator().manual_seed(8)
    kwargs, exact = random_experts("int4", E, H, I, gen)
    moe = FusedMoE(**kwargs)
    hidden = torch.randn(7, H, generator=gen)
    ids, weights = random_routing(7, K, E, gen)
    before = moe(hidden, ids, weights)
    default = isa.num_threads()
    try:
        isa.configure_threads(threads, cpus)
        assert isa.num_threads() == threads and isa.thread_cpus() == (cpus or [])
        assert torch.allclose(moe(hidden, ids, weights), before, rtol=1e-5, atol=1e-6)
    finally:
        isa.configure_threads(default)


def test_bad_inputs_are_clear_errors():
    gen = torch.Generator().manual_seed(9)
    kwargs, _ = random_experts("bf16", 2, 64, 32, gen)
    moe = FusedMoE(**kwargs)
    hidden = torch.randn(2, 64)
    ids, weights = random_routing(2, 2, 2, gen)
    with pytest.raises(ValueError, match=r"expert id 7 at \[1, 0\] is out of range \[0, 2\)"):
        moe(hidden, torch.tensor([[0, 1], [7, 1]]), weights)
    with pytest.raises(ValueError, match=r"hidden must be \[T, 64\]"):
        moe(torch.randn(2, 65), ids, weights)
    with pytest.raises(ValueError, match="must both be"):
        moe(hidden, ids[:, :1], weights)
    with pytest.raises(ValueError, match="integer"):
        moe(hidden, ids.float(), weights)
    bad = dict(kwargs, down=[t.float() for t in kwargs["down"]])
    with pytest.raises(ValueError, match="expert 0 down: dtype must be bfloat16"):
        FusedMoE(**bad)
    with pytest.raises(ValueError, match=r"expert 1: gate/up must be \[I, H\]"):
        FusedMoE(**dict(kwargs, gate=[kwargs["gate"][0], kwargs["gate"][1][:16]]))


def test_idle_workers_spin_as_long_as_set_then_sleep():
    """idle_spin_us: workers spinning for the next call need no wake-up. With no spin they sleep at once after a
    call; with a spin far longer than the pause between two calls none sleeps; setting it back ends the spin of
    workers spinning now."""
    gen = torch.Generator().manual_seed(12)
    kwargs, _ = random_experts("bf16", E, H, I, gen)
    moe = FusedMoE(**kwargs)
    hidden = torch.randn(3, H, generator=gen)
    ids, weights = random_routing(3, K, E, gen)
    default_threads, default_spin = isa.num_threads(), isa.idle_spin_us()
    try:
        isa.configure_threads(3)
        isa.set_idle_spin_us(0)
        before = isa.pool_sleeps()
        moe(hidden, ids, weights)
        time.sleep(0.05)
        assert isa.pool_sleeps() >= before + 2  # both workers slept
        isa.set_idle_spin_us(5_000_000)
        moe(hidden, ids, weights)  # wakes them; from here they spin
        spinning = isa.pool_sleeps()
        for _ in range(3):
            time.sleep(0.02)
            moe(hidden, ids, weights)
        assert isa.pool_sleeps() == spinning
        isa.set_idle_spin_us(0)
        time.sleep(0.05)
        assert isa.pool_sleeps() >= spinning + 2
    finally:
        isa.set_idle_spin_us(default_spin)
        isa.configure_threads(default_threads)
