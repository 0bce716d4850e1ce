"""Routing statistics: the expected number of distinct activated experts against Monte Carlo sampling, the
hot-expert order, counting, files and validation."""

from __future__ import annotations

import numpy as np
import pytest

from hybridmoe.placement.routing import RoutingStats


def sample_distinct(rng, probs_logits: np.ndarray, top_k: int, tokens: int, trials: int) -> np.ndarray:
    """Distinct experts hit by `tokens` tokens, each taking the top-k of noisy logits (a real router)."""
    out = np.empty(trials)
    for i in range(trials):
        logits = probs_logits[None, :] + rng.gumbel(size=(tokens, probs_logits.size))
        chosen = np.argpartition(-logits, top_k - 1, axis=1)[:, :top_k]  # [T, K]
        out[i] = np.unique(chosen).size
    return out


@pytest.mark.parametrize("experts, top_k, tokens", [(8, 2, 1), (8, 2, 3), (64, 6, 10), (256, 8, 40)])
def test_uniform_expected_distinct_matches_sampling(experts, top_k, tokens):
    rng = np.random.default_rng(1)
    stats = RoutingStats.uniform((0,), experts, top_k)
    draws = sample_distinct(rng, np.zeros(experts), top_k, tokens, 3000)
    sigma = draws.std() / np.sqrt(draws.size)
    assert abs(stats.expected_distinct(0, tokens) - draws.mean()) < 4 * sigma + 1e-9


def test_skewed_expected_distinct_matches_sampling():
    """Marginals measured from one sample of a skewed router predict the distinct count of fresh batches."""
    rng = np.random.default_rng(2)
    experts, top_k = 32, 4
    bias = rng.normal(scale=1.5, size=experts)  # some experts are much hotter than others
    logits = bias[None, :] + rng.gumbel(size=(200_000, experts))
    ids = np.argpartition(-logits, top_k - 1, axis=1)[:, :top_k]
    stats = RoutingStats.from_topk_ids({5: ids}, experts)
    for tokens in (1, 4, 16):
        draws = sample_distinct(rng, bias, top_k, tokens, 2000)
        # tokens draw independently; within a token the K picks are distinct: the formula is exact for the
        # marginals, up to sampling noise
        assert stats.expected_distinct(0, tokens) == pytest.approx(draws.mean(), rel=0.02)


def test_excluded_experts_are_not_counted_and_fractions_add_up():
    stats = RoutingStats.from_counts((3, 4), np.array([[4, 2, 1, 1], [2, 2, 2, 2]]), top_k=2)
    assert stats.tokens == 4 and stats.measured
    hot = np.array([True, False, False, False])
    assert stats.routed_fraction(0, hot) == pytest.approx(0.5)
    whole = stats.expected_distinct(0, 5)
    parts = stats.expected_distinct(0, 5, exclude=hot) + stats.expected_distinct(0, 5, exclude=~hot)
    assert parts == pytest.approx(whole)
    assert stats.expected_distinct(0, 5, exclude=hot) < whole


def test_hot_order_is_by_frequency_then_layer_then_expert():
    stats = RoutingStats.from_counts((1, 2), np.array([[1, 5, 1, 1], [5, 1, 1, 1]]), top_k=1)
    rows, experts = stats.hot_order
    assert list(zip(rows[:4].tolist(), experts[:4].tolist())) == [(0, 1), (1, 0), (0, 0), (0, 2)]
    again = RoutingStats.from_counts((1, 2), np.array([[1, 5, 1, 1], [5, 1, 1, 1]]), top_k=1).hot_order
    assert np.array_equal(again[0], rows) and np.array_equal(again[1], experts)


def test_json_round_trip(tmp_path):
    stats = RoutingStats.from_counts((3, 5), np.array([[3, 1, 2], [1, 2, 3]]), top_k=2)
    stats.to_json(tmp_path / "r.json", model="tiny")
    back = RoutingStats.from_json(tmp_path / "r.json")
    assert back.layers == (3, 5) and back.tokens == 3 and np.allclose(back.probs, stats.probs)
    uniform = RoutingStats.uniform((0, 1), 4, 2)
    uniform.to_json(tmp_path / "u.json")
    assert np.allclose(RoutingStats.from_json(tmp_path / "u.json").probs, 0.5)


@pytest.mark.parametrize("content, message", [
    ('{"schema": "other"}', "schema"),
    ('{"schema": "hybridmoe-routing-stats", "top_k": 2}', "layers"),
    ('{"schema": "hybridmoe-routing-stats", "top_k": 0, "layers": {"0": [1, 1]}}', "top_k"),
    ("not json", "cannot read"),
])
def test_bad_files_say_what_is_wrong(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        RoutingStats.from_json(path)


def test_validation():
    with pytest.raises(ValueError, match="sum to top_k"):
        RoutingStats((0,), np.array([[0.5, 0.2]]), top_k=1)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):  # 3 tokens cannot pick one expert 5 times
        RoutingStats.from_counts((0,), np.array([[5, 1]]), top_k=2)
    with pytest.raises(ValueError, match="same tokens"):
        RoutingStats.from_counts((0, 1), np.array([[2, 0], [1, 0]]), top_k=1)
    stats = RoutingStats.uniform((0, 1), 4, 2)
    with pytest.raises(ValueError, match="the model has"):
        stats.check_model((0, 1, 2), 4, 2)
