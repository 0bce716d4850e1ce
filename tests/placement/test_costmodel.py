"""Cost-model primitives and passes: rooflines, measured tables, and the stream-loading mechanisms (next-layer
prefetch, activated-only copy, two GPUs)."""

from __future__ import annotations

import dataclasses

import pytest

from hybridmoe.placement import estimate
from hybridmoe.placement.costmodel import CostModel, interpolate
from hybridmoe.placement.format_sizes import weight_format
from hybridmoe.placement.hardware import Machine, machine
from hybridmoe.placement.modelspec import ModelSpec, resolve_model
from hybridmoe.placement.passes import PassBuilder, Residency

DEEPSEEK = ModelSpec(resolve_model("deepseek-v3"), "deepseek-v3")
QWEN = ModelSpec(resolve_model("qwen3-30b-a3b"), "qwen3-30b-a3b")


def builder(spec=DEEPSEEK, hardware="rtx5090,epyc-genoa-2s", gpus=None, fmt="fp8", residency=None, **kw):
    cost = CostModel(machine(hardware, gpus=gpus), spec, fmt, "fp8" if spec is DEEPSEEK else "bf16", **kw)
    res = residency or Residency.all_but_experts(len(spec.layers), len(spec.moe_layers))
    return PassBuilder(cost, res)


def test_interpolate_is_exact_at_points_and_log_linear_between():
    table = ((1.0, 2.0), (16.0, 32.0), (256.0, 64.0))
    assert interpolate(table, 16) == pytest.approx(32.0)
    assert interpolate(table, 4) == pytest.approx(8.0)  # y = 2x on a log-log line
    assert interpolate(table, 0.5) == pytest.approx(2.0) and interpolate(table, 1e6) == pytest.approx(64.0)


def test_cpu_gemv_is_bandwidth_bound_and_gemm_compute_bound():
    cost = builder().cost
    fmt = weight_format("fp8")
    w = 3 * 7168 * 2048
    one = cost.cpu_matmul_s(w, 1, fmt)
    assert one == pytest.approx(fmt.nbytes(w) / (756e9 * 0.8))
    big = cost.cpu_matmul_s(w, 4096, fmt)
    assert big == pytest.approx(w / (cost.cpu.decode_gweights_s["fp8"] * 1e9) + 2 * w * 4096 / (29.5e12 * 0.6))


def test_measured_tables_win_over_rooflines():
    base = machine("rtx5090,epyc-genoa-2s")
    table = ((1.0, 10.0), (64.0, 40.0))
    cpu = dataclasses.replace(base.cpu, expert_table={"fp8": table})
    cost = CostModel(Machine("m", cpu, base.gpu), DEEPSEEK, "fp8", "fp8")
    experts, dispatch = 8, cost.dispatch_s
    assert cost.cpu_experts_s(experts, experts * 1) == pytest.approx(experts * cost.expert_bytes / 10e9 + dispatch)
    # beyond the table the kernel is compute-bound: twice the tokens, twice the time
    twice = cost.cpu_experts_s(experts, experts * 256) - dispatch
    assert twice == pytest.approx(2 * (cost.cpu_experts_s(experts, experts * 128) - dispatch))


def test_decode_respects_the_cpu_bandwidth_roofline():
    b = builder()
    step = estimate.decode(b, 1, 1024).step_s
    routed = sum(b.cost.distinct_experts(l.index, 1) for l in DEEPSEEK.moe_layers) * b.cost.expert_bytes
    assert step > routed / (756e9 * 0.8)  # never faster than streaming the routed experts
    assert step < 2 * routed / (756e9 * 0.8)


def test_int4_decodes_faster_than_fp8_and_cpu_only_is_slowest():
    fp8 = estimate.decode(builder(fmt="fp8"), 1, 1024).tok_s
    int4 = estimate.decode(builder(fmt="int4"), 1, 1024).tok_s
    cpu_only = CostModel(Machine("c", machine("epyc-genoa-2s").cpu), DEEPSEEK, "fp8", "fp8")
    none = Residency.none(len(DEEPSEEK.layers), len(DEEPSEEK.moe_layers))
    slowest = estimate.decode(PassBuilder(cpu_only, none), 1, 1024).tok_s
    assert slowest < fp8 < int4


def test_hot_experts_take_work_off_the_cpu():
    spec = QWEN
    none_hot = Residency.all_but_experts(len(spec.layers), len(spec.moe_layers))
    hot = dataclasses.replace(none_hot, hot=tuple(tuple(range(64)) for _ in spec.moe_layers))
    cold = estimate.decode(builder(spec, "rtx4090,desktop-2ch", fmt="bf16", residency=none_hot), 1, 1024)
    warm = estimate.decode(builder(spec, "rtx4090,desktop-2ch", fmt="bf16", residency=hot), 1, 1024)
    assert warm.step_s < 0.8 * cold.step_s


def test_dual_batch_overlap_helps_when_gpu_and_cpu_work_are_alike():
    # Qwen3-30B, 8 sequences at 32K: reading the KV cache on the GPU takes about as long as the routed
    # experts on the CPU, so running them side by side nearly halves the step
    b = builder(QWEN, "rtx4090,epyc-turin-2s", fmt="bf16")
    plain = estimate.decode(b, 8, 32768)
    overlapped = estimate.decode(b, 8, 32768, dual_batch=True)
    assert overlapped.dual_batch and overlapped.step_s < 0.8 * plain.step_s
    # DeepSeek-V3 on a 5090: the CPU dominates and halves of a batch read more distinct experts: no gain
    b = builder()
    assert estimate.decode(b, 8, 4096, dual_batch=True).step_s > estimate.decode(b, 8, 4096).step_s


def test_next_layer_prefetch_and_activated_only_copy():
    b = builder()
    slot = 1.0 * 2**30
    with_prefetch = estimate.prefill(b, "slp", 32768, buffer_bytes=8 * slot, activated="never")
    without = estimate.prefill(b, "slp", 32768, buffer_bytes=8 * slot, activated="never", prefetch=False)
    assert with_prefetch.ttft_s < without.ttft_s
    # a short chunk activates a fraction of each layer's 256 experts: copying only those moves fewer bytes
    short_all = estimate.prefill(b, "slp", 16, buffer_bytes=8 * slot, activated="never")
    short_act = estimate.prefill(b, "slp", 16, buffer_bytes=8 * slot, activated="always")
    copied = lambda e: sum(u.copy_bytes * u.repeat for u in e.timeline.units)
    assert copied(short_act) < 0.5 * copied(short_all)
    assert short_act.ttft_s < short_all.ttft_s
    assert estimate.prefill(b, "slp", 16, buffer_bytes=8 * slot).variant == "activated-only"


def test_two_gpus_halve_each_gpus_copies_and_add_exchanges():
    one = estimate.prefill(builder(gpus=1), "slp", 8192, gpus=1, buffer_bytes=4 * 2**30, activated="never")
    two = estimate.prefill(builder(gpus=2), "slp", 8192, gpus=2, buffer_bytes=4 * 2**30, activated="never")
    copied = lambda e: sum(u.copy_bytes * u.repeat for u in e.timeline.units)
    assert copied(two) == pytest.approx(copied(one) / 2)
    assert any(u.name == "dispatch" for u in two.timeline.units)
    assert two.ttft_s < one.ttft_s


def test_copy_slowdown_is_derived_from_the_link_when_not_measured():
    cost = builder().cost
    assert cost.copy_slowdown() == pytest.approx(1 - 57.6 / 756)
    assert cost.cpu_bandwidth(copying=True) < cost.cpu_bandwidth()


def test_prefill_strategies_need_what_they_use():
    cpu_only = CostModel(Machine("c", machine("epyc-genoa-2s").cpu), QWEN, "bf16", "bf16")
    b = PassBuilder(cpu_only, Residency.none(len(QWEN.layers), len(QWEN.moe_layers)))
    assert estimate.prefill(b, "cpu", 512).ttft_s > 0
    with pytest.raises(ValueError, match="needs an accelerator"):
        estimate.prefill(b, "slp", 512)
    with pytest.raises(ValueError, match="unknown prefill strategy"):
        b.prefill_units("magic", 16, 0, True)


def test_pd_decode_slows_only_by_the_copy_traffic():
    b = builder()
    slp = estimate.prefill(b, "slp", 8192, buffer_bytes=4 * 2**30)
    pd = estimate.disaggregated(b, slp, batch=1, context=1024)
    assert 0 < pd.decode_slowdown < 0.15  # the paper's "<15% latency increase"
    assert pd.ttft_during_decode_s > slp.ttft_s
