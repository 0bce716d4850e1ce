"""The C++ MoE routing (kernels/router.py) against a float64 reference of each family's rule and against the torch
path of layers/moe/router.py, on fresh random logits: softmax top-k with and without renormalisation (Qwen3-MoE,
Mixtral), DeepSeek-V3's sigmoid scores with the correction bias, group-limited choice and scaling; the order of the
ids (descending, ties to the lower id); clear errors for bad arguments."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.config import MoEConfig
from hybridmoe.kernels import router as kernel
from hybridmoe.layers.moe.router import Router


def _float64_route(logits, k, sigmoid, bias, groups, topk_groups, normalize, scale):
    """ids [T, K] (as sets per token) and weights [T, E] (0 where not chosen), in float64."""
    x = logits.double()
    scores = x.sigmoid() if sigmoid else x.softmax(dim=-1)
    choice = scores + bias.double() if bias is not None else scores.clone()
    if groups > 1:
        grouped = choice.view(x.shape[0], groups, -1)
        best = grouped.topk(2, dim=-1).values.sum(-1).topk(topk_groups, dim=-1).indices  # [T, topk_groups]
        mask = torch.ones(x.shape[0], groups, dtype=torch.bool).scatter_(1, best, False)
        choice = grouped.masked_fill(mask[..., None], float("-inf")).view_as(choice)
    ids = choice.topk(k, dim=-1).indices
    w = scores.gather(1, ids)
    if normalize:
        w = w / w.sum(-1, keepdim=True)
    return ids, torch.zeros_like(x).scatter_(1, ids, w * scale), choice


CASES = {  # name: (experts, k, sigmoid, bias, groups, topk_groups, normalize, scale)
    "qwen3-softmax-renormalised": (128, 8, False, False, 1, 1, True, 1.0),
    "mixtral-softmax": (8, 2, False, False, 1, 1, True, 1.0),
    "softmax-not-renormalised": (64, 6, False, False, 1, 1, False, 1.0),
    "deepseek-v3-grouped": (256, 8, True, True, 8, 4, True, 2.5),
    "sigmoid-bias-ungrouped": (64, 4, True, True, 1, 1, True, 1.0),
    "sigmoid-not-renormalised": (32, 4, True, False, 1, 1, False, 16.0),
}


@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("name", list(CASES))
def test_against_float64(name, tokens):
    experts, k, sigmoid, has_bias, groups, topk_groups, normalize, scale = CASES[name]
    gen = torch.Generator().manual_seed(experts + tokens)
    logits = torch.randn(tokens, experts, generator=gen) * 3
    bias = torch.randn(experts, generator=gen) * 0.5 if has_bias else None
    ids, weights = kernel.route(logits, k, sigmoid=sigmoid, bias=bias, groups=groups, topk_groups=topk_groups,
                                normalize=normalize, norm_eps=0.0, scale=scale)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32 and ids.shape == weights.shape == (tokens, k)
    want_ids, want_weights, choice = _float64_route(logits, k, sigmoid, bias, groups, topk_groups, normalize, scale)
    for t in range(tokens):
        assert sorted(ids[t].tolist()) == sorted(want_ids[t].tolist())
        picked = choice[t, ids[t]]
        assert bool((picked[:-1] >= picked[1:]).all()), "ids in descending order of the choice"
    got = torch.zeros(tokens, experts, dtype=torch.float64).scatter_(1, ids, weights.double())
    torch.testing.assert_close(got, want_weights, rtol=2e-6, atol=1e-7)


def test_ties_go_to_the_lower_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0, 2.0]])
    ids, _ = kernel.route(logits, 3, sigmoid=False, normalize=True)
    assert ids.tolist() == [[1, 2, 4]]


@pytest.mark.parametrize("config", [
    MoEConfig(num_experts=16, num_experts_per_tok=4, intermediate_size=8, norm_topk_prob=True),
    MoEConfig(num_experts=32, num_experts_per_tok=4, intermediate_size=8, scoring_func="sigmoid",
              topk_method="noaux_tc", n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5),
])
def test_the_router_layer_gives_its_torch_choice(config, monkeypatch):
    gen = torch.Generator().manual_seed(4)
    hidden = 24
    bias = torch.randn(config.num_experts, generator=gen) * 0.1 if config.topk_method == "noaux_tc" else None
    router = Router(config, torch.randn(config.num_experts, hidden, generator=gen), bias)
    x = torch.randn(9, hidden, generator=gen)
    ids, weights = router.route(x)
    monkeypatch.setattr(kernel, "applies", lambda logits: False)
    want_ids, want_weights = router.route(x)
    for t in range(x.shape[0]):
        assert sorted(ids[t].tolist()) == sorted(want_ids[t].tolist())
        mine = dict(zip(ids[t].tolist(), weights[t].tolist()))
        theirs = dict(zip(want_ids[t].tolist(), want_weights[t].tolist()))
        assert mine == pytest.approx(theirs, rel=1e-6, abs=1e-7)  # the same weight for each id, in any order


@pytest.mark.parametrize("kwargs,message", [
    (dict(k=9), r"k: must be in \[1, 8\], got 9"),
    (dict(k=2, groups=3), "groups: 3 does not divide 8 experts"),
    (dict(k=6, groups=4, topk_groups=2), "topk_groups: 2 groups of 4 cannot hold 6 experts"),
    (dict(k=2, bias=torch.zeros(7)), "bias: shape"),
])
def test_bad_arguments_are_refused(kwargs, message):
    args = dict(sigmoid=False, normalize=True) | kwargs
    k = args.pop("k")
    with pytest.raises(ValueError, match=message):
        kernel.route(torch.randn(2, 8), k, **args)
