"""The handoff on real models: prefill, pack into a payload, unpack into a fresh paged cache, decode.
MLA (the demo model) and GQA (a tiny random Qwen3-MoE), float32 compute."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.checkpoint.default_model import default_model_dir
from hybridmoe.commands._kv_eval import KVHarness, passkey_prompt
from hybridmoe.kv.allocation import LADDER_3, Tier, allocate
from hybridmoe.kv.importance import position_importance
from hybridmoe.layers.paged_attention import attend


@pytest.fixture(scope="module")
def demo():
    return KVHarness(default_model_dir())


@pytest.fixture(scope="module")
def qwen(tiny_model_dir):
    return KVHarness(tiny_model_dir("qwen3_moe"))


def _prompt(h: KVHarness, tokens: int = 200) -> list[int]:
    return h.encode(passkey_prompt("52817", 0.4, tokens, h.count_tokens))


@pytest.mark.parametrize("which", ["demo", "qwen"])
def test_budget_one_gives_the_same_greedy_tokens(which, request):
    h = request.getfixturevalue(which)
    ids = _prompt(h, 120)
    n = len(ids)
    caches, _, observer = h.prefill(ids, n + 16)
    reference = h.greedy(ids, caches, None, 6)
    tiers = allocate(observer.scores(), 1.0, LADDER_3)
    assert (tiers == Tier.FULL).all()
    exact = h.handoff(caches, n, tiers, full_dtype="float32", capacity=n + 16)
    slots = torch.arange(n)
    for a, b in zip(caches, exact.caches):
        assert torch.equal(h.layout.rows_from_cache(a, slots), h.layout.rows_from_cache(b, slots))
    assert h.greedy(ids, exact.caches, exact.dropped, 6) == reference
    half = h.handoff(caches, n, tiers, capacity=n + 16, full_dtype="bfloat16").payload_bytes
    assert half < exact.payload_bytes * 0.51
    if which == "demo":  # the checkpoint's bf16 as the full tier: same tokens on the trained model
        sixteen = h.handoff(caches, n, tiers, capacity=n + 16)
        assert h.greedy(ids, sixteen.caches, sixteen.dropped, 6) == reference


@pytest.mark.parametrize("which", ["demo", "qwen"])
def test_dropped_tokens_are_masked_not_shifted(which, request):
    h = request.getfixturevalue(which)
    ids = _prompt(h, 120)
    n = len(ids)
    caches, _, _ = h.prefill(ids, n + 16)
    tiers = allocate(position_importance(n), 0.4, (Tier.FULL,))
    handoff = h.handoff(caches, n, tiers, (Tier.FULL,), capacity=n + 16, full_dtype="float32")
    assert handoff.dropped.sum() == (tiers == Tier.DROP).sum() > 0
    logits = h.forward(ids[-1:], n - 1, handoff.caches, handoff.dropped)
    # whatever the dropped slots hold, decoding ignores them
    slots = torch.nonzero(handoff.dropped).flatten()
    for cache in handoff.caches:
        h.layout.rows_to_cache(cache, slots, torch.full((slots.shape[0], h.layout.row_width), 1e3))
    again = h.forward(ids[-1:], n - 1, handoff.caches, handoff.dropped)
    torch.testing.assert_close(again, logits, rtol=1e-5, atol=1e-5)
    without_mask = h.forward(ids[-1:], n - 1, handoff.caches, None)
    assert not torch.allclose(without_mask, logits, atol=1e-3)


def test_attend_masks_dropped_keys_like_removing_them():
    g = torch.Generator().manual_seed(0)
    ctx, heads, dim = 40, 4, 8
    q, k, v = (torch.randn(3, heads, dim, generator=g), torch.randn(ctx, 2, dim, generator=g),
               torch.randn(ctx, 2, dim, generator=g))
    dropped = torch.zeros(ctx, dtype=torch.bool)
    dropped[[2, 5, 6, 20]] = True
    out = attend(q[-1:], k, v, 0.3, None, dropped)
    keep = ~dropped
    torch.testing.assert_close(out, attend(q[-1:], k[keep], v[keep], 0.3, None))
    causal = attend(q, k, v, 0.3, None, dropped)  # three queries, causal and masked together
    torch.testing.assert_close(causal[-1:], out)
    torch.testing.assert_close(causal[:1], attend(q[:1], k[:-2][keep[:-2]], v[:-2][keep[:-2]], 0.3, None))
