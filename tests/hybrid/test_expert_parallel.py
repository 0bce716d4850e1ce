"""Small expert parallelism's pieces in one process: which rank owns which experts, how a chunk is split between
the ranks, and that the ranks' partial outputs sum to the whole layer's output (the multi-process tests are in
test_expert_parallel_ranks.py)."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.accel.accelerator import Accelerator
from hybridmoe.layers.moe.backend import ExpertWeights
from hybridmoe.layers.moe.torch_backend import TorchExpertBackend
from hybridmoe.parallel.exchange import message_bytes, split_by_owner
from hybridmoe.parallel.ownership import owned_experts, owner_tables
from hybridmoe.parallel.share import ShareStreamer


def test_every_expert_has_exactly_one_owner_and_its_local_index():
    for experts, world in ((8, 2), (16, 3), (5, 5), (128, 4)):
        shares = [owned_experts(experts, world, r) for r in range(world)]
        assert sorted(e for s in shares for e in s) == list(range(experts))
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
        owner, local = owner_tables(experts, world)
        for rank, share in enumerate(shares):
            assert owner[list(share)].eq(rank).all() and local[list(share)].tolist() == list(range(len(share)))
    with pytest.raises(ValueError, match="cannot be split over 4 ranks"):
        owned_experts(3, 4, 0)


def _layer(num_experts=8, hidden=16, inter=12, seed=0) -> ExpertWeights:
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen) * 0.2  # noqa: E731
    return ExpertWeights("dense", [rand(inter, hidden) for _ in range(num_experts)],
                         [rand(inter, hidden) for _ in range(num_experts)],
                         [rand(hidden, inter) for _ in range(num_experts)])


@pytest.mark.parametrize("copy", ["all", "activated"])
@pytest.mark.parametrize("world", [2, 3])
def test_the_ranks_streamed_partial_outputs_sum_to_the_layers_output(world, copy):
    """Each rank streams its share of two layers (ShareStreamer) and computes its tokens; the sum is the layer's."""
    layers, tokens, top_k = {1: _layer(seed=1), 3: _layer(seed=3)}, 20, 3
    gen = torch.Generator().manual_seed(1)
    owner, local = owner_tables(8, world)
    shares = [ShareStreamer({l: w.subset(list(owned_experts(8, world, r))) for l, w in layers.items()},
                            Accelerator("cpu"), staging_bytes=1 << 16, name=f"ep{r}") for r in range(world)]
    for layer, weights in layers.items():  # one pass, in model order
        hidden = torch.randn(tokens, 16, generator=gen)
        ids = torch.stack([torch.randperm(8, generator=gen)[:top_k] for _ in range(tokens)])  # [T, K] distinct
        ids[0] = torch.tensor([5, 6, 7])  # token 0 only on the last rank's experts: no other worker gets it
        topk_weights = torch.rand(tokens, top_k, generator=gen)
        whole = TorchExpertBackend(weights).submit(hidden, ids, topk_weights)
        parts = split_by_owner(ids, topk_weights, owner, local, world)
        assert parts[0].rows.tolist() == list(range(tokens))  # rank 0 keeps every row
        pairs = sum(int((p.local_ids >= 0).sum()) for p in parts)
        assert pairs == tokens * top_k  # every (token, expert) pair goes to exactly one rank
        assert [0 in p.rows.tolist() for p in parts[1:]] == [r == world - 1 for r in range(1, world)]
        out = torch.zeros_like(hidden)
        for p in parts:
            assert ((p.local_ids >= 0).any(dim=1) | (p.rank == 0)).all()  # a worker gets only tokens it computes
            out.index_add_(0, p.rows, shares[p.rank].run(layer, hidden[p.rows], p.local_ids, p.weights, copy))
        torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-6)
    for rank, share in enumerate(shares):
        stats = share.stats()
        assert stats.passes == 1 and stats.layers_copied == 2
        per_expert = layers[1].expert_bytes(0)
        owned = len(owned_experts(8, world, rank))
        assert stats.bytes <= 2 * owned * per_expert and (copy == "activated" or stats.bytes == 2 * owned * per_expert)
        share.close()


def test_message_bytes_count_both_directions():
    assert message_bytes(0, 64, 2, torch.float32) == 0
    assert message_bytes(10, 64, 2, torch.float32) == 5 * 8 + 10 * (2 * 64 * 4 + 2 * 8)  # header, then data


def test_the_planners_rank0_exchange_sends_the_tokens_that_need_each_worker_both_ways():
    """parallel="rank0" (what the engine runs): GPU 0 sends each other GPU the chunk's tokens that route to it,
    (N-1) * T * (1 - (1 - 1/N)^K) hidden states, and gets as many back; twice "tokens"' volume at N=2, where each
    GPU holds only its half of the chunk."""
    from hybridmoe.placement import hardware
    from hybridmoe.placement.costmodel import CostModel
    from hybridmoe.placement.modelspec import ModelSpec, resolve_model
    from hybridmoe.placement.passes import PassBuilder, Residency

    gpu = hardware.reference_profile("rtx4090").gpu
    gpu = type(gpu)(**{**gpu.__dict__, "p2p_gbs": 10.0, "link_latency_us": 0.0})
    machine = hardware.Machine("m", hardware.reference_profile("epyc-genoa-2s").cpu, gpu, num_gpus=2)
    spec = ModelSpec(resolve_model("qwen3-30b-a3b"))
    builder = PassBuilder(CostModel(machine, spec), Residency.all_but_experts(len(spec.layers), len(spec.moe_layers)))
    chunk, k = 4096, spec.top_k
    dispatch, combine = builder._exchange_s(chunk, 2, "rank0")
    expected = chunk * (1 - 0.5**k) * spec.hidden * 2 / 10e9  # bf16 hidden states over a 10 GB/s link
    assert dispatch == pytest.approx(expected) and combine == pytest.approx(expected)
    assert dispatch == pytest.approx(2 * builder._exchange_s(chunk, 2, "tokens")[0])
    units = builder.prefill_units("slp", chunk, 0, last=False, gpus=2, parallel="rank0")
    assert {"dispatch", "combine"} <= {u.name for u in units}


def test_bench_ep_prediction_is_half_of_one_gpu_over_a_free_link_and_pays_for_a_slow_one():
    """bench costmodel's ep case predicts with the planner's rank0 schedule: each of 2 GPUs streams and computes
    half of what one GPU does, plus the exchange over the link between them."""
    from hybridmoe.bench._ep_case import predict
    from hybridmoe.bench._slp_case import SLP_LAYERS, SLP_SHAPE
    from hybridmoe.bench._slp_case import predict as one_gpu
    from hybridmoe.config import parse_config

    config = parse_config({"architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": SLP_LAYERS,
                           "max_position_embeddings": 4096, **SLP_SHAPE})
    experts, k = SLP_SHAPE["num_experts"], SLP_SHAPE["num_experts_per_tok"]
    counts = [[512 * k // experts] * experts for _ in range(SLP_LAYERS)]  # uniform: every expert active
    alone = one_gpu(config, 512, "all", counts, 1.0, 0.5, stand_in=False).total_s
    free = predict(config, counts, 1.0, 0.5, 1e9, stand_in=False)
    assert free.total_s == pytest.approx(alone / 2, rel=1e-3)
    # two stand-in ranks of 2 threads share a 2-core host: no faster than one rank, and copies no longer hide
    # behind compute (no core is free for the copy threads)
    shared = predict(config, counts, 1.0, 0.5, 1e9, stand_in=True, cores=2, threads=2)
    one_rank = one_gpu(config, 512, "all", counts, 1.0, 0.5, stand_in=True, cores=2, threads=2).total_s
    assert shared.total_s == pytest.approx(one_rank, rel=1e-3)
    assert shared.total_s > alone
    # with a core for every thread, copy threads included, the stand-in ranks are two GPUs
    spare = predict(config, counts, 1.0, 0.5, 1e9, stand_in=True, cores=4, threads=1)
    assert spare.total_s == pytest.approx(free.total_s, rel=1e-3)
    assert one_gpu(config, 512, "all", counts, 1.0, 0.5, stand_in=True, cores=2, threads=1).total_s == \
        pytest.approx(alone, rel=1e-3)
    slow = predict(config, counts, 1.0, 0.5, 0.1, stand_in=False)  # 0.1 GB/s: 512 x 1024 bf16 states each way
    exchange = sum(u.handoff_s for u in slow.units if u.name in ("dispatch", "combine"))
    assert exchange == pytest.approx(SLP_LAYERS * 2 * 512 * (1 - 0.5**k) * 1024 * 2 / 0.1e9, rel=1e-6)
    assert free.total_s < slow.total_s <= free.total_s + exchange + 1e-9
