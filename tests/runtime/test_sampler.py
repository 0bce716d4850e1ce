"""Sampler: greedy, seeded reproducibility, top-k/top-p/min-p kept sets, repetition penalty, distribution."""

from __future__ import annotations

import math

import pytest
import torch

from hybridmoe.runtime.sampler import Sampler, _apply_repetition_penalty, _kept_probabilities
from hybridmoe.runtime.sampling_params import SamplingParams


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _draw_many(logits_row: torch.Tensor, params: SamplingParams, num_draws: int, seed: int = 0) -> torch.Tensor:
    """num_draws independent samples of one row (one shared generator advanced row after row) -> [num_draws]."""
    generator = _generator(seed)
    logits = logits_row[None, :].expand(num_draws, -1)
    return Sampler().sample(logits, [params] * num_draws, [generator] * num_draws, [[]] * num_draws)


def _chi_square(samples: torch.Tensor, expected_probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic of samples against expected_probs (only cells with expected count >= 5 kept)."""
    counts = torch.bincount(samples, minlength=expected_probs.numel()).double()
    expected = expected_probs.double() * samples.numel()
    cells = expected >= 5
    statistic = float((((counts - expected) ** 2)[cells] / expected[cells]).sum())
    return statistic, int(cells.sum()) - 1


def _chi_square_critical(df: int, z: float = 4.753) -> float:
    """Upper critical value of chi-square(df) at p = 1e-6 (z = 4.753), Wilson-Hilferty approximation.

    The seeds are fixed, so no test is flaky; a wrong distribution lands far above this."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_greedy_is_argmax_and_ignores_filters():
    torch.manual_seed(1)
    logits = torch.randn(6, 1000) * 3
    params = [SamplingParams(temperature=0.0, top_k=k, top_p=0.3, min_p=0.2, seed=k) for k in range(6)]
    ids = Sampler().sample(logits, params, [None] * 6, [[] for _ in range(6)])
    assert ids.dtype == torch.long and ids.shape == (6,)
    assert torch.equal(ids, logits.argmax(dim=-1))


def test_greedy_takes_the_first_of_tied_maxima_and_refuses_bad_rows():
    logits = torch.randn(3, 50)
    logits[:, [7, 20, 41]] = 9.0  # three tied maxima a row: the first wins, as torch.argmax picks it
    greedy = [SamplingParams(temperature=0.0)] * 3
    assert Sampler().sample(logits, greedy, [None] * 3, [[]] * 3).tolist() == [7, 7, 7]
    mixed = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.0)]
    ids = Sampler().sample(logits, mixed, [None] * 3, [[]] * 3)
    assert ids[0] == 7 and ids[2] == 7
    for bad in (float("nan"), float("inf")):
        rows = torch.randn(2, 50)
        rows[1, 30] = bad
        with pytest.raises(ValueError, match=r"rows \[1\] contain NaN or \+inf, or are all -inf"):
            Sampler().sample(rows, greedy[:2], [None] * 2, [[]] * 2)
    with pytest.raises(ValueError, match=r"rows \[0\] contain NaN"):
        Sampler().sample(torch.full((1, 50), float("-inf")), greedy[:1], [None], [[]])


def test_input_logits_are_not_modified():
    torch.manual_seed(2)
    logits = torch.randn(3, 50)
    before = logits.clone()
    for penalty in (1.7, 1.0):
        params = [SamplingParams(repetition_penalty=penalty, top_k=5, top_p=0.8, min_p=0.1, temperature=0.5)] * 3
        Sampler().sample(logits, params, [_generator(i) for i in range(3)], [[1, 2, 3]] * 3)
        assert torch.equal(logits, before)


def test_seeded_row_is_reproducible_whatever_the_batch():
    torch.manual_seed(3)
    vocab = 4000
    steps = 25
    request_logits = [torch.randn(vocab) * 2 for _ in range(steps)]
    params = SamplingParams(temperature=0.9, top_k=200, top_p=0.95, min_p=0.01, seed=1234)

    alone_gen = _generator(1234)
    alone = [int(Sampler().sample(l[None], [params], [alone_gen], [[]])[0]) for l in request_logits]

    batch_gen = _generator(1234)
    other_seeded_gen = _generator(99)
    in_batch = []
    for step, own_logits in enumerate(request_logits):
        logits = torch.stack([torch.randn(vocab), torch.randn(vocab), own_logits, torch.randn(vocab)])
        row_params = [
            SamplingParams(temperature=0.0),
            SamplingParams(temperature=1.3, top_p=0.5),
            params,
            SamplingParams(temperature=0.7, seed=99, top_k=3 + step),
        ]
        ids = Sampler().sample(logits, row_params, [None, None, batch_gen, other_seeded_gen], [[]] * 4)
        in_batch.append(int(ids[2]))
    assert in_batch == alone

    other_seed_gen = _generator(4321)
    other_seed = [int(Sampler().sample(l[None], [params], [other_seed_gen], [[]])[0]) for l in request_logits]
    assert other_seed != alone  # 25 draws over thousands of kept tokens: a different seed must differ


# Hand-made distribution (probabilities in descending order, then placed at shuffled vocabulary positions).
_PROBS = [0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02]
_POSITIONS = [5, 2, 6, 0, 3, 1, 4]  # _PROBS[i] sits at vocabulary id _POSITIONS[i]


def _hand_made_logits() -> torch.Tensor:
    logits = torch.empty(len(_PROBS))
    for prob, position in zip(_PROBS, _POSITIONS):
        logits[position] = math.log(prob) + 1.5  # an offset: only differences matter
    return logits


@pytest.mark.parametrize(
    "params, kept_ranks",
    [
        (SamplingParams(top_k=3), [0, 1, 2]),
        (SamplingParams(top_k=1), [0]),
        (SamplingParams(top_k=-1), [0, 1, 2, 3, 4, 5, 6]),
        (SamplingParams(top_p=0.6), [0, 1]),  # mass above rank 2 is 0.65 >= 0.6
        (SamplingParams(top_p=0.7), [0, 1, 2]),  # 0.4 + 0.25 < 0.7 <= 0.8
        (SamplingParams(top_p=0.3), [0]),
        (SamplingParams(min_p=0.3), [0, 1, 2]),  # threshold 0.12
        (SamplingParams(min_p=0.2), [0, 1, 2, 3]),  # threshold 0.08
        # top-k 4 renormalises to .444 .278 .167 .111; top-p .8 keeps 3; min-p .5 (threshold .222) keeps 2
        (SamplingParams(top_k=4, top_p=0.8, min_p=0.5), [0, 1]),
        # temperature 2 flattens to p ~ sqrt(prob): .27 .21 .16 .13 ...; top_p .6 keeps 3
        (SamplingParams(temperature=2.0, top_p=0.6), [0, 1, 2]),
    ],
)
def test_kept_set_is_exact_and_never_left(params, kept_ranks):
    samples = _draw_many(_hand_made_logits(), params, num_draws=6000, seed=11)
    expected_ids = {_POSITIONS[r] for r in kept_ranks}
    assert set(samples.tolist()) == expected_ids
    # Among the kept tokens the draw follows the renormalised softmax(logits / T).
    kept = torch.tensor(sorted(expected_ids))
    probs = torch.softmax(_hand_made_logits().double() / params.temperature, dim=-1)
    expected = torch.zeros_like(probs)
    expected[kept] = probs[kept] / probs[kept].sum()
    if len(kept) > 1:
        statistic, df = _chi_square(samples, expected)
        assert statistic < _chi_square_critical(df), (statistic, df)


def test_top_k_keeps_ties_with_the_kth_value():
    logits = torch.tensor([3.0, 2.0, 1.0, 2.0, 0.5])
    samples = _draw_many(logits, SamplingParams(top_k=2), num_draws=3000, seed=5)
    assert set(samples.tolist()) == {0, 1, 3}


@pytest.mark.parametrize("params", [SamplingParams(top_k=20), SamplingParams(top_p=0.5), SamplingParams(min_p=0.3)])
def test_filters_never_sample_outside_on_random_logits(params):
    torch.manual_seed(7)
    logits = torch.randn(2000) * 2.5
    samples = _draw_many(logits, params, num_draws=4000, seed=3)
    probs = torch.softmax(logits.double(), dim=-1)
    order = probs.argsort(descending=True)
    if params.top_k > 0:
        allowed = set(order[: params.top_k].tolist())
    elif params.top_p < 1:
        mass_above = probs[order].cumsum(0) - probs[order]
        allowed = set(order[mass_above < params.top_p].tolist())
    else:
        allowed = set(torch.nonzero(probs >= params.min_p * probs.max()).flatten().tolist())
    assert set(samples.tolist()) <= allowed
    assert len(set(samples.tolist())) > 1


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_distribution_matches_softmax_over_temperature(temperature):
    torch.manual_seed(int(temperature * 10))
    logits = torch.randn(12) * 1.5
    samples = _draw_many(logits, SamplingParams(temperature=temperature), num_draws=20000, seed=17)
    expected = torch.softmax(logits.double() / temperature, dim=-1)
    statistic, df = _chi_square(samples, expected)
    assert statistic < _chi_square_critical(df), (statistic, df)


def test_distribution_check_detects_a_wrong_temperature():
    """The chi-square bound used above is tight enough to reject a distribution that is slightly off."""
    torch.manual_seed(15)
    logits = torch.randn(12) * 1.5
    samples = _draw_many(logits, SamplingParams(temperature=1.0), num_draws=20000, seed=17)
    wrong = torch.softmax(logits.double() / 1.15, dim=-1)
    statistic, df = _chi_square(samples, wrong)
    assert statistic > _chi_square_critical(df)


def _reference_repetition_penalty(logits: torch.Tensor, penalties, histories) -> torch.Tensor:
    out = logits.double().clone()
    for row, (penalty, history) in enumerate(zip(penalties, histories)):
        for token in set(history):
            value = out[row, token]
            out[row, token] = value / penalty if value > 0 else value * penalty
    return out


def test_repetition_penalty_matches_reference():
    torch.manual_seed(21)
    vocab = 300
    penalties = [1.0, 1.3, 0.7, 2.5]
    histories = [[int(t) for t in torch.randint(0, vocab, (n,))] for n in (10, 40, 25, 0)]
    histories[1] += histories[1][:10]  # repeated ids are penalised once
    logits = torch.randn(4, vocab) * 2
    params = [SamplingParams(repetition_penalty=p) for p in penalties]
    penalised = logits.clone()
    _apply_repetition_penalty(penalised, params, histories)
    expected = _reference_repetition_penalty(logits, penalties, histories)
    torch.testing.assert_close(penalised.double(), expected, rtol=1e-6, atol=1e-6)
    assert not torch.equal(penalised[1], logits[1])

    # End to end, greedy picks the argmax of the penalised logits (history holds each row's argmax).
    histories = [[int(logits[r].argmax())] + histories[r] for r in range(4)]
    greedy = [SamplingParams(temperature=0.0, repetition_penalty=p) for p in penalties]
    ids = Sampler().sample(logits, greedy, [None] * 4, histories)
    expected_ids = _reference_repetition_penalty(logits, penalties, histories).argmax(dim=-1)
    assert torch.equal(ids, expected_ids)
    assert int(ids[3]) != int(logits[3].argmax())  # penalty 2.5 on the argmax moves this row


def test_repetition_penalty_then_temperature_distribution():
    torch.manual_seed(23)
    logits = torch.randn(10) * 1.2
    history = [1, 4, 4, 7]
    params = SamplingParams(temperature=0.8, repetition_penalty=1.8)
    generator = _generator(29)
    num_draws = 20000
    samples = Sampler().sample(
        logits[None].expand(num_draws, -1), [params] * num_draws, [generator] * num_draws, [history] * num_draws
    )
    penalised = _reference_repetition_penalty(logits[None], [1.8], [history])[0]
    statistic, df = _chi_square(samples, torch.softmax(penalised / 0.8, dim=-1))
    assert statistic < _chi_square_critical(df), (statistic, df)


def test_bad_inputs_are_rejected_clearly():
    sampler = Sampler()
    logits = torch.randn(2, 10)
    params = [SamplingParams()] * 2
    with pytest.raises(ValueError, match="generators has 1 entries but logits has 2 rows"):
        sampler.sample(logits, params, [None], [[], []])
    with pytest.raises(ValueError, match=r"must be \[S, V\]"):
        sampler.sample(torch.randn(10), params, [None] * 2, [[], []])
    with pytest.raises(ValueError, match=r"outside \[0, 10\)"):
        sampler.sample(logits, [SamplingParams(repetition_penalty=1.2)] * 2, [None] * 2, [[3], [10]])
    nan_row = torch.randn(10)
    nan_row[3] = float("nan")
    with pytest.raises(ValueError, match=r"rows \[1\] contain NaN or \+inf, or are all -inf"):
        sampler.sample(torch.stack([torch.randn(10), nan_row]), params, [None] * 2, [[]] * 2)
    with pytest.raises(ValueError, match=r"rows \[0\] contain NaN"):
        sampler.sample(torch.stack([torch.full((10,), float("-inf")), torch.randn(10)]), params, [None] * 2, [[]] * 2)


def _reference_kept_probabilities(logits_row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Float64, one filter after the other on explicitly sorted, renormalised distributions -> probs [V]."""
    x = logits_row.double() / params.temperature
    probs = torch.softmax(x, dim=-1)
    order = probs.argsort(descending=True)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if params.top_k > 0:
        keep[order[params.top_k :]] = False
    if params.top_p < 1.0:
        renormalised = torch.where(keep, probs, 0.0)
        renormalised /= renormalised.sum()
        sorted_probs = renormalised[order]
        mass_above = sorted_probs.cumsum(0) - sorted_probs
        keep[order[mass_above >= params.top_p]] = False
    if params.min_p > 0.0:
        keep &= probs >= params.min_p * probs.max()
    kept = torch.where(keep, probs, 0.0)
    return kept / kept.sum()


def test_kept_probabilities_match_a_float64_reference():
    """Random logits and random filter settings, including nuclei larger than the top-p candidate set
    (flat rows with top_p near 1), which take the full-sort path."""
    torch.manual_seed(31)
    vocab = 3000
    rng = torch.Generator().manual_seed(32)
    params, rows = [], []
    for row in range(48):
        scale = [0.05, 1.0, 3.0, 8.0][row % 4]  # 0.05: nearly flat, the nucleus spans most of the vocabulary
        rows.append(torch.randn(vocab, generator=rng) * scale)
        params.append(
            SamplingParams(
                temperature=[0.3, 0.7, 1.0, 1.6][(row // 4) % 4],
                top_k=[0, 5, 40, 2000][(row // 16) % 3 + (row % 2)],
                top_p=[1.0, 0.5, 0.9, 0.97][(row // 2) % 4],
                min_p=[0.0, 0.0, 0.05, 0.3][(row // 3) % 4],
            )
        )
    logits = torch.stack(rows)
    kept = _kept_probabilities(logits, params)
    assert (kept >= 0).all()
    for row in range(len(params)):
        expected = _reference_kept_probabilities(logits[row], params[row])
        assert torch.equal(kept[row] > 0, expected > 0), (row, params[row])
        torch.testing.assert_close((kept[row] / kept[row].sum()).double(), expected, rtol=1e-4, atol=1e-7)


def test_nucleus_larger_than_the_candidate_set_takes_the_full_sort():
    torch.manual_seed(33)
    logits = torch.randn(3, 5000) * torch.tensor([[0.05], [0.3], [4.0]])  # two wide nuclei, one narrow
    params = [SamplingParams(top_p=0.95), SamplingParams(top_p=0.9, min_p=0.2), SamplingParams(top_p=0.9)]
    kept = _kept_probabilities(logits, params)
    for row in range(3):
        expected = _reference_kept_probabilities(logits[row], params[row])
        assert torch.equal(kept[row] > 0, expected > 0)
    assert int((kept[0] > 0).sum()) > 1024 and int((kept[2] > 0).sum()) < 1024


def test_masked_vocabulary_is_never_drawn():
    torch.manual_seed(37)
    logits = torch.randn(200) * 4
    logits[1::2] = float("-inf")
    samples = _draw_many(logits, SamplingParams(temperature=1.5), num_draws=5000, seed=41)
    assert all(token % 2 == 0 for token in samples.tolist())


def test_logit_bias_moves_greedy_and_leaves_the_input_alone():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 0.0]])
    before = logits.clone()
    params = [SamplingParams(temperature=0.0, logit_bias={0: 100.0}),  # forces an unlikely token
              SamplingParams(temperature=0.0, logit_bias={0: -100.0, 2: 0.5})]  # bans the argmax; 2 wins
    next_ids = Sampler().sample(logits, params, [None, None], [[], []])
    assert next_ids.tolist() == [0, 2]
    assert torch.equal(logits, before)
    # rows without a bias are untouched, in the same batch
    mixed = Sampler().sample(logits, [SamplingParams(temperature=0.0), params[1]], [None, None], [[], []])
    assert mixed.tolist() == [1, 2]


def test_logit_bias_comes_before_the_penalties_and_sampling():
    # bias then repetition penalty (vLLM's order): 1.0 + 2.0 = 3.0, / 2 -> 1.5 < 2.0, so id 1 wins
    logits = torch.tensor([[1.0, 2.0]])
    params = SamplingParams(temperature=0.0, logit_bias={0: 2.0}, repetition_penalty=2.0)
    assert Sampler().sample(logits, [params], [None], [[0]]).tolist() == [1]
    # a sampling row never draws a token biased by -100 against ones at 0
    draws = _draw_many(torch.zeros(8), SamplingParams(temperature=1.0, logit_bias={3: -100.0, 5: -100.0}), 2000)
    assert not bool(((draws == 3) | (draws == 5)).any())


def test_logit_bias_outside_the_vocabulary_is_an_error():
    with pytest.raises(ValueError, match=r"logit_bias of row 0 holds ids outside \[0, 4\): \[9\]"):
        Sampler().sample(torch.zeros(1, 4), [SamplingParams(logit_bias={9: 1.0})], [None], [[]])
