"""`Sampler`: turns the last-position logits of a batch into next token ids, one `SamplingParams` per row.

Order per row: repetition penalty -> greedy (argmax) when temperature is 0 -> temperature -> top-k -> top-p
-> min-p -> draw. Every step is vectorised over rows; only the random draw is per row, because each seeded
row draws from its own `torch.Generator` so that its tokens do not depend on what else is in the batch.

The draw is the exponential race: argmax_v p_v / q_v with q_v ~ Exp(1) i.i.d. picks v with probability
p_v / sum(p), so it needs no normalisation and no cumulative sum over the vocabulary.

Legend: S rows (sequences in the batch), V vocabulary size, R rows that sample (not greedy).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridmoe.runtime.sampling_params import SamplingParams

# Smallest Exp(1) draw used as a divisor: keeps p / q finite (and 0 / q == 0 for removed tokens).
_MIN_EXPONENTIAL = torch.finfo(torch.float32).tiny


class Sampler:
    """Stateless; one instance serves the engine. Logits may live on any device; a row's generator must
    live on the same device as the logits."""

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        token_history: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        """logits [S, V] -> next token ids [S] (int64). token_history[i] = prompt + output ids of row i.

        Rows whose generator is None draw from torch's default generator. The input logits are not modified.
        """
        self._check_inputs(logits, params, generators, token_history)
        num_rows = logits.shape[0]
        logits = logits.to(torch.float32, copy=True)  # [S, V]
        _apply_repetition_penalty(logits, params, token_history)

        next_ids = torch.empty(num_rows, dtype=torch.long, device=logits.device)  # [S]
        greedy_rows = [i for i, p in enumerate(params) if p.is_greedy]
        sampling_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if greedy_rows:
            rows = torch.tensor(greedy_rows, device=logits.device)
            next_ids[rows] = logits[rows].argmax(dim=-1)
        if sampling_rows:
            rows = torch.tensor(sampling_rows, device=logits.device)
            row_params = [params[i] for i in sampling_rows]
            probs = _filtered_probs(logits[rows], row_params)  # [R, V], not normalised after min-p
            next_ids[rows] = _draw(probs, [generators[i] for i in sampling_rows])
        return next_ids

    @staticmethod
    def _check_inputs(logits, params, generators, token_history) -> None:
        if logits.dim() != 2:
            raise ValueError(f"Sampler: logits must be [S, V], got shape {tuple(logits.shape)}")
        num_rows = logits.shape[0]
        for name, values in (("params", params), ("generators", generators), ("token_history", token_history)):
            if len(values) != num_rows:
                raise ValueError(f"Sampler: {name} has {len(values)} entries but logits has {num_rows} rows")
        nan_rows = torch.isnan(logits).any(dim=-1).nonzero().flatten().tolist()
        if nan_rows:
            raise ValueError(f"Sampler: logits contain NaN in rows {nan_rows}")


def _apply_repetition_penalty(
    logits: torch.Tensor, params: Sequence[SamplingParams], token_history: Sequence[Sequence[int]]
) -> None:
    """In place on logits [S, V]: every distinct id seen in a row: positive logit / penalty, negative * penalty."""
    vocab_size = logits.shape[1]
    row_index: list[int] = []
    token_index: list[int] = []
    penalties: list[float] = []
    for row, (p, history) in enumerate(zip(params, token_history)):
        if p.repetition_penalty == 1.0 or not history:
            continue
        distinct = set(history)
        if min(distinct) < 0 or max(distinct) >= vocab_size:
            bad = sorted(t for t in distinct if not 0 <= t < vocab_size)[:5]
            raise ValueError(f"Sampler: token_history[{row}] holds ids outside [0, {vocab_size}): {bad}")
        row_index.extend([row] * len(distinct))
        token_index.extend(distinct)
        penalties.extend([p.repetition_penalty] * len(distinct))
    if not row_index:
        return
    device = logits.device
    rows = torch.tensor(row_index, device=device)  # [N] N = (row, id) pairs
    tokens = torch.tensor(token_index, device=device)  # [N]
    penalty = torch.tensor(penalties, dtype=logits.dtype, device=device)  # [N]
    seen = logits[rows, tokens]  # [N]
    logits[rows, tokens] = torch.where(seen > 0, seen / penalty, seen * penalty)


def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """logits [R, V] of sampling rows -> probabilities [R, V] after temperature, top-k, top-p, min-p.

    Removed tokens get probability exactly 0. Rows are normalised after top-p but not after min-p (the draw
    does not need it)."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device)
    logits = logits / temperature[:, None]  # [R, V]

    if any(p.top_k > 0 for p in params):
        logits = _apply_top_k(logits, [p.top_k for p in params])
    if any(p.top_p < 1.0 for p in params):
        logits = _apply_top_p(logits, [p.top_p for p in params])
    probs = torch.softmax(logits, dim=-1)  # [R, V]
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=device)
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values  # [R, 1]
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def _apply_top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """Keep, per row, logits >= the row's k-th largest (k <= 0: keep all). logits [R, V]."""
    vocab_size = logits.shape[1]
    k = torch.tensor([vocab_size if t <= 0 else min(t, vocab_size) for t in top_k], device=logits.device)  # [R]
    largest = logits.topk(int(k.max()), dim=-1).values  # [R, max k], descending
    kth_largest = largest.gather(1, (k - 1)[:, None])  # [R, 1]
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """Keep, per row, the smallest set of most likely tokens whose probability sums to >= top_p.

    A token is kept when the probability of the tokens ranked above it is < top_p, so the most likely token
    is always kept. Rows with top_p == 1 are left as they are. logits [R, V]."""
    probs = torch.softmax(logits, dim=-1)  # [R, V]
    sorted_probs, order = probs.sort(dim=-1, descending=True)  # [R, V] each
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs  # [R, V]
    # top_p == 1 rows: an unreachable threshold, so rounding in the cumulative sum cannot remove tail tokens.
    threshold = torch.tensor([p if p < 1.0 else 2.0 for p in top_p], dtype=probs.dtype, device=logits.device)
    remove_sorted = mass_above >= threshold[:, None]  # [R, V] in sorted order
    remove = torch.zeros_like(remove_sorted).scatter_(1, order, remove_sorted)  # [R, V] in vocabulary order
    return logits.masked_fill(remove, float("-inf"))


def _draw(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One id per row of probs [R, V] (unnormalised, >= 0), row i using generators[i] -> [R] int64."""
    exponential = torch.empty_like(probs)  # [R, V]
    unseeded_rows = [i for i, g in enumerate(generators) if g is None]
    if unseeded_rows:
        rows = torch.tensor(unseeded_rows, device=probs.device)
        exponential[rows] = torch.empty((len(rows), probs.shape[1]), device=probs.device).exponential_()
    for i, generator in enumerate(generators):
        if generator is not None:
            exponential[i].exponential_(generator=generator)
    exponential.clamp_(min=_MIN_EXPONENTIAL)
    return (probs / exponential).argmax(dim=-1)
