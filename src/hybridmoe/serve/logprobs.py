"""Logprobs in the API's two shapes: chat's `{"content": [{token, logprob, bytes, top_logprobs}]}` and the legacy
completions' `{tokens, token_logprobs, top_logprobs, text_offset}`. A token's text is its id decoded alone, special
tokens included (a piece of a multi-byte character shows as U+FFFD, as in vLLM)."""

from __future__ import annotations

from collections.abc import Sequence

from hybridmoe.runtime.logprobs import TokenLogprobs
from hybridmoe.runtime.tokenizer import Tokenizer


class TokenStrings:
    """Token id -> its text, decoded once per id."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer, self._cache = tokenizer, {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def chat_logprobs(entries: Sequence[TokenLogprobs], strings: TokenStrings) -> list[dict]:
    def one(token_id: int, logprob: float) -> dict:
        text = strings(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return [{**one(e.token_id, e.logprob), "top_logprobs": [one(i, lp) for i, lp in e.top]} for e in entries]


def completion_logprobs(entries: Sequence[TokenLogprobs | None], token_ids: Sequence[int], strings: TokenStrings,
                        text_offset: int = 0) -> dict:
    """entries[i] scores token_ids[i] (None: unscored, the first prompt token). The top dict holds the k most
    likely tokens and the scored one (as vLLM's does)."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for entry, token_id in zip(entries, token_ids):
        text = strings(token_id)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(entry.logprob)
        top = {strings(i): lp for i, lp in entry.top}
        top.setdefault(text, entry.logprob)
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def merge_completion_logprobs(parts: Sequence[dict]) -> dict:
    return {key: [v for part in parts for v in part[key]] for key in
            ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
