"""Log-probabilities the engine reports: `TokenLogprobs` (a token's log-probability and the k most likely ids at
its position), computed from a step's raw logits.

They are the model's own: log-softmax of the logits in float32, before penalties, temperature and filters (what
vLLM reports by default), so a client scoring text gets the same numbers whatever it samples with.

Legend: R rows (positions), V vocabulary, K top ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the k most likely (id, logprob) at this position, most likely first


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], num_top: int) -> list[TokenLogprobs]:
    """logits [R, V] of R positions, token_ids [R] (the token at each) -> one TokenLogprobs per row with the
    num_top most likely ids."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=logits.device)  # [R]
    chosen = logprobs.gather(1, ids[:, None])[:, 0].tolist()  # [R]
    if num_top > 0:
        top_values, top_ids = logprobs.topk(min(num_top, logprobs.shape[1]), dim=-1)  # [R, K]
        tops = [tuple(zip(i, v)) for i, v in zip(top_ids.tolist(), top_values.tolist())]
    else:
        tops = [()] * len(chosen)
    return [TokenLogprobs(int(t), lp, top) for t, lp, top in zip(token_ids, chosen, tops)]


class PromptLogprobs:
    """A request's prompt log-probabilities, gathered chunk by chunk as its prefill runs: position p's logits
    score prompt token p + 1; the first prompt token has none. After a preemption the prompt is computed again;
    positions already scored are not scored twice."""

    def __init__(self, prompt_token_ids: Sequence[int], num_top: int) -> None:
        self.prompt_token_ids, self.num_top = list(prompt_token_ids), num_top
        self.values: list[TokenLogprobs | None] = [None]

    @property
    def complete(self) -> bool:
        return len(self.values) == len(self.prompt_token_ids)

    def wants(self, start: int, num_tokens: int) -> bool:
        """Whether a chunk of positions start .. start + num_tokens - 1 holds the next position to score."""
        return not self.complete and start <= len(self.values) - 1 < start + num_tokens

    def add_chunk(self, logits: torch.Tensor, start: int) -> None:
        """logits [N, V] of positions start .. start + N - 1 (one chunk of the prefill)."""
        first = len(self.values) - 1  # the position whose logits score the next unscored token
        last = min(start + logits.shape[0], len(self.prompt_token_ids) - 1) - 1
        if first < start or last < first:
            return
        targets = self.prompt_token_ids[first + 1:last + 2]
        self.values += token_logprobs(logits[first - start:last - start + 1], targets, self.num_top)
