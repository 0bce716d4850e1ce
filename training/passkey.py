"""Synthetic passkey-retrieval examples: a 5-digit number hidden in filler text, asked for at the end.

The format follows the passkey test of Mohtashami & Jaggi (Landmark Attention, 2023). Filler is either the
classic repeated sentences or real fortune-cookie text without digits. Lengths are counted in tokens of the
tokenizer passed in, so "a 1K example" means about 1024 tokens including the question.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

INTRO = ("There is an important info hidden inside a lot of irrelevant text. "
         "Find it and memorize it. I will quiz you about the important information there.")
CLASSIC_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"


@dataclass(frozen=True)
class PasskeyExample:
    prompt: str  # ends with QUESTION; the model should continue with " <key>."
    key: str
    depth: float  # where the needle sits in the filler, 0 = start, 1 = end

    @property
    def answer(self) -> str:
        return f" {self.key}."


def filler_sentences_from_fortunes(fortunes: dict[str, list[str]]) -> list[str]:
    """Fortunes flattened to one line each, without digits (a digit in the filler would be a decoy)."""
    flat = (" ".join(text.split()) for texts in fortunes.values() for text in texts)
    return [text for text in flat if not any(ch.isdigit() for ch in text) and len(text) < 400]


def make_passkey_example(rng: random.Random, target_tokens: int, count_tokens: Callable[[str], int],
                         filler_pool: list[str] | None = None) -> PasskeyExample:
    """An example of about `target_tokens` tokens (prompt only). filler_pool None = the classic filler."""
    key = str(rng.randint(10000, 99999))
    needle = NEEDLE.format(key=key)
    fixed = count_tokens(f"{INTRO}\n{needle}\n{QUESTION}") + 4  # + BOS and the joining newlines
    budget = max(0, target_tokens - fixed)
    units: list[str] = []
    used = 0
    classic_cost = count_tokens(CLASSIC_FILLER) + 1
    while used < budget:
        unit = CLASSIC_FILLER if filler_pool is None else rng.choice(filler_pool)
        cost = classic_cost if filler_pool is None else count_tokens(unit) + 1
        if used + cost / 2 > budget and units:
            break  # stop at the unit boundary nearest the budget
        units.append(unit)
        used += cost
    depth = rng.random()
    split = round(depth * len(units))
    before, after = " ".join(units[:split]), " ".join(units[split:])
    parts = [INTRO, before, needle, after, QUESTION]
    prompt = "\n".join(part for part in parts if part)
    return PasskeyExample(prompt=prompt, key=key, depth=split / max(1, len(units)))


def parse_answer(generated: str) -> str:
    """The first run of digits in the model's continuation ('' when there is none)."""
    digits = ""
    for ch in generated.strip():
        if ch.isdigit():
            digits += ch
        elif digits or not ch.isspace():
            break
    return digits


def make_passkey_example_near(rng: random.Random, target_tokens: int, count_tokens: Callable[[str], int],
                              filler_pool: list[str] | None = None, tolerance: int = 16) -> PasskeyExample:
    """Like make_passkey_example, but when the first try falls short of the target by more than `tolerance`
    tokens, the same draw is repeated with the shortfall added, so evaluation lengths mean what they say."""
    state = rng.getstate()
    example = make_passkey_example(rng, target_tokens, count_tokens, filler_pool)
    shortfall = target_tokens - count_tokens(example.prompt) - 1  # - 1: the BOS token
    if shortfall > tolerance:
        rng.setstate(state)
        example = make_passkey_example(rng, target_tokens + shortfall, count_tokens, filler_pool)
    return example
