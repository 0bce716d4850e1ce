"""Quantisation round trips, tier allocation (closed form, monotone, drops), importance, KV rows of a cache."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.kv import quant
from hybridmoe.kv.allocation import LADDER_2, LADDER_3, PAPER_COSTS, Tier, allocate, paper_budget, real_costs, tier_counts
from hybridmoe.kv.importance import AttentionImportance, finalize, position_importance, window_attention_mass
from hybridmoe.kv.layout import KVLayout

MLA = KVLayout("mla", 2, (128, 32))
GQA = KVLayout("gqa", 2, (16,) * 4)


@pytest.mark.parametrize("layout", [MLA, GQA], ids=["mla", "gqa"])
@pytest.mark.parametrize("bits", [8, 4])
def test_round_trip_error_at_most_half_a_step(layout, bits):
    g = torch.Generator().manual_seed(bits)
    rows = torch.randn(300, layout.row_width, generator=g) * torch.logspace(-3, 3, 300)[:, None]
    rows[0] = 0  # an all-zero token: scale 0, codes 0
    rows[1, :5] = 1e4  # an outlier group
    codes, scales = quant.quantize(rows, layout.group_widths, bits)
    assert scales.dtype == torch.float16 and scales.shape == (300, layout.num_groups)
    assert codes.shape == (300, layout.row_width if bits == 8 else layout.row_width // 2)
    back = quant.dequantize(codes, scales, layout.group_widths, bits)
    step = quant.expand_scales(scales, layout.group_widths)
    err = (back - rows).abs()
    assert (err <= step / 2 * (1 + 1e-5) + 1e-30).all(), float((err - step / 2).max())
    assert back[0].abs().max() == 0


def test_quantising_inside_and_outside_inference_mode_alike():
    """The reused buffers are per inference mode: the PD prefill worker packs inside the forward's
    inference_mode, other callers outside it, in one process."""
    rows = torch.randn(6, 64)
    with torch.inference_mode():
        inside = quant.quantize(rows, (64,), 8)
    outside = quant.quantize(rows, (64,), 8)
    assert all(torch.equal(a, b) for a, b in zip(inside, outside))
    gathered = torch.index_select(rows, 0, torch.tensor([1, 3]), out=quant.scratch("t", (2, 64), rows.dtype))
    assert torch.equal(gathered, rows[[1, 3]])


def test_int4_packs_two_codes_per_byte():
    rows = torch.tensor([[7.0, -7.0, 1.0, 0.0]])
    codes, scales = quant.quantize(rows, (4,), 4)
    assert float(scales[0, 0]) == 1.0
    assert codes.tolist() == [[(8 + 7) | ((8 - 7) << 4), (8 + 1) | (8 << 4)]]


@pytest.mark.parametrize("b,f16,f8,f4", [(0.25, 0, 0, 1), (0.3, 0, 0.2, 0.8), (0.5, 0, 1, 0), (0.75, 0.5, 0.5, 0)])
def test_closed_form_tier_fractions(b, f16, f8, f4):
    n = 1000
    counts = tier_counts(n, b, LADDER_3)
    assert counts == [round(f16 * n), round(f8 * n), round(f4 * n), 0]
    if b >= 0.5:
        assert counts[:2] == [round((2 * b - 1) * n), round((2 - 2 * b) * n)]
    else:
        assert counts[1:3] == [round((4 * b - 1) * n), round((2 - 4 * b) * n)]


def test_drop_only_below_the_cheapest_kept_tier():
    n = 1000
    assert tier_counts(n, 0.3, LADDER_3)[Tier.DROP] == 0
    assert tier_counts(n, 0.2, LADDER_3) == [0, 0, 800, 200]  # below INT4's 1/4
    assert tier_counts(n, 0.3, LADDER_2) == [0, 600, 0, 400]  # below INT8's 1/2 when INT4 is refused
    assert tier_counts(n, 0.5, LADDER_2)[Tier.DROP] == 0
    assert tier_counts(n, 0.3, (Tier.FULL,)) == [300, 0, 0, 700]  # PDTrim-style


@pytest.mark.parametrize("b", [0.1, 0.27, 0.3, 0.43, 0.5, 0.61, 0.75, 1.0])
@pytest.mark.parametrize("ladder", [LADDER_3, LADDER_2], ids=["3tier", "2tier"])
def test_tiers_monotone_in_importance_and_within_budget(b, ladder):
    importance = torch.rand(777, generator=torch.Generator().manual_seed(1))
    tiers = allocate(importance, b, ladder)
    order = torch.argsort(importance, descending=True)
    assert (tiers[order][1:] >= tiers[order][:-1]).all()  # dearer tiers (lower codes) to higher importance
    assert paper_budget(tiers) <= b + 1e-9
    cheapest = min(PAPER_COSTS[t] for t in ladder)
    assert b - paper_budget(tiers) < cheapest  # nothing left that would buy another step


def test_real_costs_count_the_scales():
    costs = real_costs(MLA)
    assert costs[Tier.INT8] == (160 + 4) / 320 and costs[Tier.INT4] == (80 + 4) / 320
    counts = tier_counts(1000, 0.5, LADDER_3, costs)
    assert counts[Tier.DROP] == 0 and counts[Tier.INT4] > 0  # INT8 everywhere no longer fits


def test_window_attention_mass_matches_dense_softmax():
    g = torch.Generator().manual_seed(0)
    ctx, w, heads, kv_heads, dim = 300, 16, 8, 2, 32
    q, k = torch.randn(w, heads, dim, generator=g), torch.randn(ctx, kv_heads, dim, generator=g)
    chunked = window_attention_mass(q, k, 0.2, key_chunk=64)
    logits = torch.einsum("wnd,cnd->nwc", q, k.repeat_interleave(heads // kv_heads, dim=1)) * 0.2
    causal = torch.arange(ctx)[None, :] > torch.arange(ctx - w, ctx)[:, None]
    dense = logits.masked_fill(causal, float("-inf")).softmax(-1).sum(1).mean(0)
    torch.testing.assert_close(chunked, dense, rtol=1e-5, atol=1e-6)
    assert abs(float(chunked.sum()) - w) < 1e-3  # each query's mass sums to 1
    torch.testing.assert_close(window_attention_mass(q, k, 0.2), dense, rtol=1e-5, atol=1e-6)  # one chunk


def test_importance_pins_sinks_and_window_and_pools():
    raw = torch.zeros(40)
    raw[20] = 1.0
    scores = finalize(raw, sinks=4, pool=3, pinned_last=5)
    assert torch.isinf(scores[:4]).all() and (scores[-5:] == torch.finfo(torch.float32).max).all()
    assert scores[19] == scores[20] == scores[21] == 1.0 and scores[23] == 0
    pos = position_importance(10, sinks=2)
    assert torch.argsort(pos, descending=True, stable=True).tolist() == [0, 1, 9, 8, 7, 6, 5, 4, 3, 2]
    observer = AttentionImportance(num_tokens=30, window=8)
    observer(0, 0, torch.randn(30, 4, 8), torch.randn(30, 2, 8), 0.3)
    observer(1, 0, torch.randn(30, 4, 8), torch.randn(20, 2, 8), 0.3)  # not the prompt's end: ignored
    assert list(observer.per_layer) == [0] and observer.scores().shape == (30,)


@pytest.mark.parametrize("layout,shape", [(MLA, (5, 4, 160)), (GQA, (2, 5, 4, 2, 16))], ids=["mla", "gqa"])
def test_rows_from_and_to_a_paged_cache(layout, shape):
    cache = torch.randn(shape)
    slots = torch.tensor([3, 7, 12, 0])
    rows = layout.rows_from_cache(cache, slots)
    assert rows.shape == (4, layout.row_width)
    if layout.kind == "gqa":  # K heads then V heads
        torch.testing.assert_close(rows[1, :16], cache[0, 1, 3, 0])
        torch.testing.assert_close(rows[1, 32:48], cache[1, 1, 3, 0])
    other = torch.zeros(shape)
    layout.rows_to_cache(other, slots, rows)
    torch.testing.assert_close(layout.rows_from_cache(other, slots), rows)
    assert other.count_nonzero() == rows.count_nonzero()
