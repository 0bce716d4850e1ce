"""`Sampler`: turns the last-position logits of a batch into next token ids, one `SamplingParams` per row.

Order per row: logit bias -> repetition penalty -> presence / frequency penalties -> greedy (argmax) when temperature is 0 -> temperature -> top-k -> top-p
-> min-p -> draw. Each filter keeps the logits >= a per-row threshold, so the three combine into one
threshold (the largest) and one mask:
  top-k  the k-th largest logit (tokens tied with it are kept);
  top-p  the logit of the last token of the nucleus, computed on the distribution left by top-k: the
         smallest set of most likely tokens whose probability sums to >= top_p;
  min-p  max logit + log(min_p): p >= min_p * p_max does not change when the kept set is renormalised.
Top-k and top-p look only at the K most likely tokens (K >= 1024, one `topk` instead of sorting the whole
vocabulary); a top-p row whose nucleus does not fit in them falls back to a full sort.

The draw is by inverse CDF: one uniform number per row from the row's own `torch.Generator` (seeded rows do
not depend on what else is in the batch), searched in the float64 cumulative sum of the kept
probabilities. Tokens with probability 0 are never drawn.

Legend: S rows (sequences in the batch), V vocabulary size, R rows that sample (not greedy), K candidates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from hybridmoe.runtime.sampling_params import SamplingParams

_MIN_TOP_P_CANDIDATES = 1024  # most LLM nuclei are far smaller; larger ones fall back to a full sort


class Sampler:
    """Stateless; one instance serves the engine. Logits may live on any device; a row's generator may live
    on the logits' device or on the CPU (its one number per row is then copied over)."""

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        token_history: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> torch.Tensor:
        """logits [S, V] -> next token ids [S] (int64). token_history[i] = prompt + output ids of row i;
        output_token_ids[i] = its output ids alone (needed when a row has a presence or frequency penalty).

        Rows whose generator is None draw from torch's default generator. The input logits are not modified.
        """
        _check_inputs(logits, params, generators, token_history)
        logits = logits.float()  # [S, V]; a copy is made below before anything is written
        if all(p.is_greedy and not _changes_logits(p) for p in params):  # a plain decode batch: one pass in all
            return _greedy(logits)
        _check_row_max(logits.amax(dim=-1))
        copied = False
        if any(p.logit_bias for p in params):
            logits, copied = logits.clone(), True
            _apply_logit_bias(logits, params)
        if any(p.repetition_penalty != 1.0 and len(h) > 0 for p, h in zip(params, token_history)):
            logits = logits if copied else logits.clone()
            copied = True
            _apply_repetition_penalty(logits, params, token_history)
        if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
            if output_token_ids is None or len(output_token_ids) != logits.shape[0]:
                raise ValueError("Sampler: presence/frequency penalties need output_token_ids, one list per row")
            logits = logits if copied else logits.clone()
            _apply_presence_frequency_penalties(logits, params, output_token_ids)

        device = logits.device
        next_ids = torch.empty(logits.shape[0], dtype=torch.long, device=device)  # [S]
        greedy_rows = [i for i, p in enumerate(params) if p.is_greedy]
        sampling_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if greedy_rows:
            rows = torch.tensor(greedy_rows, device=device)
            next_ids[rows] = _argmax(logits[rows])
        if sampling_rows:
            rows = torch.tensor(sampling_rows, device=device)
            row_logits = logits if not greedy_rows else logits[rows]  # [R, V]
            probs = _kept_probabilities(row_logits, [params[i] for i in sampling_rows])  # [R, V], unnormalised
            next_ids[rows] = _draw(probs, [generators[i] for i in sampling_rows])
        return next_ids


def _check_inputs(logits, params, generators, token_history) -> None:
    if logits.dim() != 2:
        raise ValueError(f"Sampler: logits must be [S, V], got shape {tuple(logits.shape)}")
    num_rows = logits.shape[0]
    for name, values in (("params", params), ("generators", generators), ("token_history", token_history)):
        if len(values) != num_rows:
            raise ValueError(f"Sampler: {name} has {len(values)} entries but logits has {num_rows} rows")


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    """logits [S, V] -> each row's largest logit's index [S] (int64), checked as _check_row_max checks. On the CPU
    in numpy: in a decode step the weights streamed before leave torch's code cold, and the torch version's four ops
    (argmax, gather, isfinite, nonzero) took about twice numpy's time there (0.5 against 0.25 ms, caches flushed)."""
    if logits.device.type != "cpu":
        next_ids = logits.argmax(dim=-1)
        _check_row_max(logits.gather(1, next_ids[:, None])[:, 0])
        return next_ids
    rows = logits.numpy()
    next_ids = rows.argmax(axis=-1)  # the first of ties, a NaN's if any
    _fail_rows(np.flatnonzero(~np.isfinite(rows[np.arange(rows.shape[0]), next_ids])).tolist())
    return torch.from_numpy(next_ids.astype(np.int64))


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [S, V] -> the index of each row's largest logit [S] (int64; the first of ties, a NaN's if any)."""
    if logits.device.type != "cpu":
        return logits.argmax(dim=-1)
    # torch's CPU argmax takes ~370 us over 151,936 logits (one row, Zen 3), numpy's vectorised one ~30 us
    return torch.from_numpy(logits.numpy().argmax(axis=-1).astype(np.int64))


def _changes_logits(p: SamplingParams) -> bool:
    """Whether a row's params move its logits before the choice (bias or penalties)."""
    return bool(p.logit_bias) or p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _check_row_max(row_max: torch.Tensor) -> None:
    """row_max [S]: each row's largest logit: NaN when the row holds a NaN, +inf when it holds +inf, -inf when
    nothing can be sampled."""
    _fail_rows((~torch.isfinite(row_max)).nonzero().flatten().tolist())


def _fail_rows(bad_rows: list[int]) -> None:
    """A ValueError naming the rows whose largest logit is not finite, if any."""
    if bad_rows:
        raise ValueError(f"Sampler: logits of rows {bad_rows} contain NaN or +inf, or are all -inf")


def _apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """In place on logits [S, V]: each row's logit_bias added to its ids' logits (OpenAI's logit_bias)."""
    vocab_size = logits.shape[1]
    row_index: list[int] = []
    token_index: list[int] = []
    biases: list[float] = []
    for row, p in enumerate(params):
        if not p.logit_bias:
            continue
        bad = sorted(t for t in p.logit_bias if not 0 <= t < vocab_size)[:5]
        if bad:
            raise ValueError(f"Sampler: logit_bias of row {row} holds ids outside [0, {vocab_size}): {bad}")
        row_index.extend([row] * len(p.logit_bias))
        token_index.extend(p.logit_bias)
        biases.extend(p.logit_bias.values())
    device = logits.device
    rows = torch.tensor(row_index, device=device)  # [N] N = (row, id) pairs
    tokens = torch.tensor(token_index, device=device)  # [N]
    logits[rows, tokens] += torch.tensor(biases, dtype=logits.dtype, device=device)


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


def _apply_presence_frequency_penalties(
    logits: torch.Tensor, params: Sequence[SamplingParams], output_token_ids: Sequence[Sequence[int]]
) -> None:
    """In place on logits [S, V]: logit -= count * frequency_penalty + (count > 0) * presence_penalty, with
    count the times the id was generated in that row (OpenAI's definition; the prompt does not count)."""
    vocab_size = logits.shape[1]
    for row, (p, output) in enumerate(zip(params, output_token_ids)):
        if (p.presence_penalty == 0.0 and p.frequency_penalty == 0.0) or not output:
            continue
        ids = torch.tensor(list(output), dtype=torch.long, device=logits.device)
        if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
            raise ValueError(f"Sampler: output_token_ids[{row}] holds ids outside [0, {vocab_size})")
        counts = torch.bincount(ids, minlength=vocab_size).to(logits.dtype)  # [V]
        logits[row] -= counts * p.frequency_penalty + (counts > 0).to(logits.dtype) * p.presence_penalty


def _kept_probabilities(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """logits [R, V] of sampling rows -> unnormalised probabilities [R, V] after temperature, top-k, top-p
    and min-p (removed tokens exactly 0). Never writes into logits."""
    device = logits.device
    if any(p.temperature != 1.0 for p in params):
        temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device)
        logits = logits / temperature[:, None]  # [R, V]
    row_max = logits.amax(dim=-1)  # [R]
    threshold = torch.full_like(row_max, -math.inf)  # [R] keep logits >= threshold

    use_top_k = any(p.top_k > 0 for p in params)
    use_top_p = any(p.top_p < 1.0 for p in params)
    if use_top_k or use_top_p:
        threshold = torch.maximum(threshold, _top_k_top_p_threshold(logits, params, use_top_p))
    if any(p.min_p > 0.0 for p in params):
        log_min_p = torch.tensor([math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params], device=device)
        threshold = torch.maximum(threshold, row_max + log_min_p)

    probs = (logits - row_max[:, None]).exp_()  # [R, V], the top token has 1
    if bool(torch.isfinite(threshold).any()):
        probs.masked_fill_(logits < threshold[:, None], 0.0)
    return probs


def _top_k_top_p_threshold(logits: torch.Tensor, params: Sequence[SamplingParams], use_top_p: bool) -> torch.Tensor:
    """Per-row logit threshold [R] of top-k followed by top-p (-inf where both are off)."""
    vocab_size = logits.shape[1]
    top_k = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
    num_candidates = max((k for k in top_k if k < vocab_size), default=1)
    if use_top_p:
        num_candidates = max(num_candidates, _MIN_TOP_P_CANDIDATES)
    num_candidates = min(num_candidates, vocab_size)
    candidates = logits.topk(num_candidates, dim=-1).values  # [R, K], descending
    k = torch.tensor(top_k, device=logits.device)  # [R]
    kth_index = (k.clamp(max=num_candidates) - 1)[:, None]  # [R, 1]
    # Rows without top-k (k == V) get -inf: nothing removed by top-k.
    top_k_threshold = torch.where(k < vocab_size, candidates.gather(1, kth_index)[:, 0], -math.inf)  # [R]
    if not use_top_p:
        return top_k_threshold

    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=logits.device)  # [R]
    # Normaliser of the distribution top-p sees: over the top-k survivors, or over the whole row.
    log_norm = candidates.masked_fill(candidates < top_k_threshold[:, None], -math.inf).logsumexp(dim=-1)  # [R]
    without_top_k = k == vocab_size  # [R]
    if bool(without_top_k.any()):
        log_norm = torch.where(without_top_k, logits.logsumexp(dim=-1), log_norm)
    top_p_threshold, covered = _nucleus_threshold(candidates, top_k_threshold, log_norm, top_p)
    uncovered = (~covered).nonzero().flatten()
    if uncovered.numel():  # the nucleus reaches past the candidates: sort those rows in full
        full = logits[uncovered].sort(dim=-1, descending=True).values  # [U, V]
        top_p_threshold[uncovered] = _nucleus_threshold(
            full, top_k_threshold[uncovered], log_norm[uncovered], top_p[uncovered]
        )[0]
    return torch.maximum(top_k_threshold, top_p_threshold)


def _nucleus_threshold(
    sorted_logits: torch.Tensor, top_k_threshold: torch.Tensor, log_norm: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """sorted_logits [R, K] descending (the K best of each row) -> (threshold [R], covered [R]).

    A token is in the nucleus when the probability ranked above it is < top_p (the top token always is).
    covered is False where these K tokens hold less than top_p, so the nucleus may reach past them."""
    probs = (sorted_logits - log_norm[:, None]).exp()  # [R, K]
    probs = probs.masked_fill(sorted_logits < top_k_threshold[:, None], 0.0)
    mass_above = probs.cumsum(dim=-1) - probs  # [R, K]
    # top_p == 1 rows: an unreachable bound, so rounding in the sums cannot remove tail tokens.
    bound = torch.where(top_p < 1.0, top_p, 2.0)[:, None]  # [R, 1]
    in_nucleus = (mass_above < bound) & (probs > 0)  # [R, K]
    last = in_nucleus.sum(dim=-1, keepdim=True) - 1  # [R, 1]
    threshold = sorted_logits.gather(1, last)[:, 0]  # [R]
    threshold = torch.where(top_p < 1.0, threshold, -math.inf)
    # Covered: the candidates hold >= top_p (a token past them has mass_above >= top_p), or top-k already
    # limits the row to its candidates, or top-p is off.
    covered = (probs.sum(dim=-1) >= top_p) | torch.isfinite(top_k_threshold) | (top_p >= 1.0)  # [R]
    return threshold, covered


def _draw(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One id per row of probs [R, V] (unnormalised, >= 0), row i using generators[i] -> [R] int64."""
    device = probs.device
    uniform = torch.empty(probs.shape[0], dtype=torch.float64, device=device)  # [R] in [0, 1)
    unseeded_rows = [i for i, g in enumerate(generators) if g is None]
    if unseeded_rows:
        uniform[torch.tensor(unseeded_rows, device=device)] = torch.rand(
            len(unseeded_rows), dtype=torch.float64, device=device
        )
    for i, generator in enumerate(generators):
        if generator is not None:
            uniform[i] = torch.rand((), dtype=torch.float64, device=generator.device, generator=generator)
    cdf = probs.to(torch.float64).cumsum(dim=-1)  # [R, V]
    total = cdf[:, -1]  # [R]
    # The first token whose cdf exceeds u * total; capped just below total so the search stays in range.
    target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))  # [R]
    return torch.searchsorted(cdf, target[:, None], right=True)[:, 0]
