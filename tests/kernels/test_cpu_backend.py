"""CpuExpertBackend (the ExpertBackend on the C++ kernels) against plain torch computations of the same MoE,
grouped by expert, for each weight format; shared experts as extra experts in the same call; overlap of submit
and wait; the MoE block's blocking run where it has no shared experts."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.accel.stats import RunStats
from hybridmoe.kernels import reference
from hybridmoe.layers.moe.backend import ExpertWeights
from hybridmoe.layers.moe.block import MoEBlock
from hybridmoe.layers.moe.cpu_backend import CpuExpertBackend
from hybridmoe.layers.moe.hybrid_backend import TimedOnDevice
from hybridmoe.layers.moe.torch_backend import TorchExpertBackend
from hybridmoe.models.loader import load_model
from kernel_testing import bf16_activation_tolerance, random_experts, random_routing, seed

E, H, I, K = 8, 256, 96, 4


def _expert_weights(fmt: str, gen: torch.Generator, num_experts: int = E) -> tuple[ExpertWeights, list]:
    kwargs, exact = random_experts(fmt, num_experts, H, I, gen)
    weights = ExpertWeights(
        fmt={"f32": "dense", "bf16": "dense"}.get(fmt, fmt), gate=kwargs["gate"], up=kwargs["up"],
        down=kwargs["down"], gate_scale=kwargs.get("gate_scale"), up_scale=kwargs.get("up_scale"),
        down_scale=kwargs.get("down_scale"), block_size=kwargs["block"])
    return weights, exact


def _error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("fmt,tol", [("f32", 2e-5), ("bf16", 2e-5), ("fp8", 2e-5), ("int4", 3e-2), ("int8", 3e-2)])
def test_backend_matches_torch_grouped_by_expert(fmt, tol):
    gen = torch.Generator().manual_seed(seed(fmt))
    weights, exact = _expert_weights(fmt, gen)
    backend = CpuExpertBackend(weights)
    assert backend.repacked_bytes == 0
    for tokens in (1, 6, 24):
        hidden = torch.randn(tokens, H, generator=gen)
        ids, topk_weights = random_routing(tokens, K, E, gen)
        out = backend.wait(backend.submit(hidden, ids, topk_weights))
        error = _error(out, reference.moe_reference(hidden, ids, topk_weights, exact))
        assert error < tol + bf16_activation_tolerance(fmt)
        if fmt in ("f32", "fp8"):  # the engine's plain-torch backend, in float32
            torch_out = TorchExpertBackend(weights).submit(hidden, ids, topk_weights)
            assert _error(out, torch_out.double()) < 1e-4 + bf16_activation_tolerance(fmt)


def test_shared_experts_ride_in_the_same_call_as_extra_experts():
    """Shared experts appended to the routed ones, visited by every token with weight 1, in one bf16 call."""
    gen = torch.Generator().manual_seed(3)
    routed, exact = _expert_weights("fp8", gen)
    shared, shared_exact = _expert_weights("fp8", gen, num_experts=2)
    both = ExpertWeights(fmt="fp8", **{name: getattr(routed, name) + getattr(shared, name) for name in (
        "gate", "up", "down", "gate_scale", "up_scale", "down_scale")}, block_size=routed.block_size)
    backend = CpuExpertBackend(both)
    hidden = torch.randn(5, H, generator=gen).bfloat16()
    ids, topk_weights = random_routing(5, K, E, gen)
    shared_ids = torch.arange(E, E + 2).expand(5, -1)  # [T, 2]
    out = backend.wait(backend.submit(hidden, torch.cat([ids.long(), shared_ids], 1),
                                      torch.cat([topk_weights.float(), torch.ones(5, 2)], 1)))
    ref = reference.moe_reference(hidden, ids, topk_weights, exact)
    for gate, up, down in shared_exact:
        x = hidden.double()
        ref += (reference.silu(x @ gate.T) * (x @ up.T)) @ down.T
    assert out.dtype == torch.bfloat16 and _error(out, ref) < 1e-2


def test_python_work_runs_between_submit_and_wait():
    gen = torch.Generator().manual_seed(4)
    weights, exact = _expert_weights("bf16", gen)
    backend = CpuExpertBackend(weights)
    batches = [(torch.randn(4, H, generator=gen),) + random_routing(4, K, E, gen) for _ in range(2)]
    first = backend.submit(*batches[0])  # micro-batch 0's MoE runs on the kernel threads...
    second_hidden = batches[1][0] @ torch.eye(H)  # ...while Python computes (stand-in for attention)
    second = backend.submit(second_hidden, *batches[1][1:])
    for (hidden, ids, w), handle in zip(batches, (first, second)):
        error = _error(backend.wait(handle), reference.moe_reference(hidden, ids, w, exact))
        assert error < 2e-5 + bf16_activation_tolerance("bf16")


def test_transposed_dense_weights_are_repacked_once_and_counted():
    gen = torch.Generator().manual_seed(5)
    weights, exact = _expert_weights("f32", gen, num_experts=2)
    weights.gate = [g.T.contiguous().T for g in weights.gate]  # same values, column-major storage
    backend = CpuExpertBackend(weights)
    assert backend.repacked_bytes == 2 * I * H * 4
    hidden = torch.randn(3, H, generator=gen)
    ids, w = random_routing(3, 2, 2, gen)
    assert _error(backend.wait(backend.submit(hidden, ids, w)), reference.moe_reference(hidden, ids, w, exact)) < 2e-5


def test_unsupported_formats_are_clear_errors():
    weights, _ = _expert_weights("bf16", torch.Generator().manual_seed(6), num_experts=1)
    weights.fmt = "nf4"
    with pytest.raises(ValueError, match="unsupported expert weight format 'nf4'"):
        CpuExpertBackend(weights)


@pytest.mark.parametrize("family,blocking", [("qwen3_moe", True), ("mixtral", True), ("deepseek_v3", False)])
def test_a_moe_block_without_shared_experts_runs_its_experts_on_the_calling_thread(tiny_model_dir, family,
                                                                                     blocking):
    """MoEBlock.forward takes the backend's blocking `run` when it has no shared experts to overlap (Qwen3-MoE,
    Mixtral), submit/wait otherwise (DeepSeek-V3); either way the same output bit for bit as start/finish."""
    model = load_model(tiny_model_dir(family), "float32")
    blocks = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoEBlock)]
    gen = torch.Generator().manual_seed(7)
    for block in blocks:
        assert (block.shared is None) == blocking and isinstance(block.experts, CpuExpertBackend)
        for tokens in (1, 5):
            x = torch.randn(tokens, model.config.hidden_size, generator=gen)
            assert torch.equal(block.forward(x), block.finish(block.start(x)))


def test_a_timed_backends_blocking_run_counts_as_accelerator_time():
    """TimedOnDevice (a part the plan put on the accelerator) times a backend's blocking `run` as it times its
    submit and wait; a part without `run` has none through it."""
    gen = torch.Generator().manual_seed(8)
    weights, exact = _expert_weights("f32", gen)
    stats = RunStats()
    timed = TimedOnDevice(CpuExpertBackend(weights), stats)
    hidden = torch.randn(3, H, generator=gen)
    ids, w = random_routing(3, K, E, gen)
    stats.begin_step("decode")
    assert _error(timed.run(hidden, ids, w), reference.moe_reference(hidden, ids, w, exact)) < 2e-5
    assert stats.last.accel_s > 0
    assert getattr(TimedOnDevice(object(), stats), "run", None) is None
