"""The deterministic stream of training batches: packed text rows and single passkey examples.

`TrainingBatches(seed)` yields the same batches in the same order on every machine, so a run resumed from
a checkpoint skips the batches it has already seen and continues exactly. A batch is
(input_ids [B, T+1] int64, loss_weights [B, T] float32): the model reads input_ids[:, :-1] and predicts
input_ids[:, 1:], each target weighted by loss_weights (passkey answer digits weigh more). From
phase2_start_step on, passkey steps come more often and hold batches of right-padded examples.
`MixedBatches` is the stream of the variants the shipped model was trained with (recipe.VARIANTS): copy, text
and passkey rows side by side in every batch.
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import torch
from tokenizers import Tokenizer

import passkey
import sources
from recipe import BOS_TOKEN, DATA_DIR, EOS_TOKEN, PAD_TOKEN, PASSKEY_FILLER_MIX, TEXT_MIX, TRAIN


def load_tokenizer(directory: Path = DATA_DIR / "tokenizer") -> Tokenizer:
    path = directory / "tokenizer.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run training/prepare_data.py and training/train_tokenizer.py")
    return Tokenizer.from_file(str(path))


def tokenize_split(tokenizer: Tokenizer, split: str) -> dict[str, list[list[int]]]:
    """{source: [[BOS, ..., EOS] per document]} for data/<split>.jsonl."""
    path = DATA_DIR / f"{split}.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run training/prepare_data.py")
    texts: dict[str, list[str]] = {}
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            texts.setdefault(record["source"], []).append(record["text"])
    bos, eos = tokenizer.token_to_id(BOS_TOKEN), tokenizer.token_to_id(EOS_TOKEN)
    out = {}
    for source, docs in sorted(texts.items()):
        encodings = tokenizer.encode_batch(docs, add_special_tokens=False)
        # chat text already starts with BOS and ends each turn with EOS (the template writes them)
        out[source] = [e.ids if source == "chat" else [bos, *e.ids, eos] for e in encodings]
    return out


def answer_half_weights(ids: list[int], digits: list[int]) -> list[float]:
    """Loss weights of a passkey example's targets (ids[1:]): 1 each, except the answer digits (target indices
    `digits`), which together weigh as much as all the other targets."""
    weights = [1.0] * (len(ids) - 1)
    for index in digits:
        weights[index] = (len(ids) - 1 - len(digits)) / len(digits)
    return weights


class TrainingBatches:
    """Iterator over (input_ids, loss_weights); step i is a passkey step with probability passkey_step_fraction."""

    def __init__(self, tokenizer: Tokenizer, documents: dict[str, list[list[int]]], seed: int):
        self.tokenizer = tokenizer
        self.documents = documents
        self.rng = random.Random(seed)
        self.order = {src: self._shuffled(src) for src in TEXT_MIX}
        self.tokens_by_source = {src: 0 for src in TEXT_MIX}
        self.buffer: list[int] = []
        self.filler_pool = passkey.filler_sentences_from_fortunes(sources.read_fortunes())
        self.bos = tokenizer.token_to_id(BOS_TOKEN)
        self.eos = tokenizer.token_to_id(EOS_TOKEN)
        self.pad = tokenizer.token_to_id(PAD_TOKEN)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        step = 0
        while True:
            phase2 = step >= TRAIN["phase2_start_step"]
            fraction = TRAIN["phase2_passkey_step_fraction" if phase2 else "passkey_step_fraction"]
            if self.rng.random() < fraction:
                yield self.passkey_batch(phase2)
            else:
                yield self.text_batch()
            step += 1

    def _shuffled(self, source: str) -> list[int]:
        order = list(range(len(self.documents[source])))
        self.rng.shuffle(order)
        return order

    def _next_document(self) -> list[int]:
        total = sum(self.tokens_by_source.values()) + 1
        source = max(TEXT_MIX, key=lambda s: TEXT_MIX[s] - self.tokens_by_source[s] / total)  # largest deficit
        if not self.order[source]:
            self.order[source] = self._shuffled(source)
        document = self.documents[source][self.order[source].pop()]
        self.tokens_by_source[source] += len(document)
        return document

    def text_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows, width = TRAIN["text_rows"], TRAIN["text_seq_len"] + 1
        while len(self.buffer) < rows * width:
            self.buffer.extend(self._next_document())
        ids = torch.tensor(self.buffer[: rows * width], dtype=torch.int64).view(rows, width)  # [B, T+1]
        del self.buffer[: rows * width]
        return ids, torch.ones(rows, width - 1)

    def passkey_batch(self, phase2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Phase 1: one example, answer digits weighted passkey_answer_weight. Phase 2: as many examples of
        one log-uniform length as fit phase2_passkey_batch_tokens, right-padded (pads weigh 0), the digits of
        each carrying half of its loss however long its filler is."""
        low, high = TRAIN["passkey_min_tokens"], TRAIN["passkey_max_tokens"]
        if not phase2:
            ids, digits = self._passkey_example(self.rng.randint(low, high))
            weights = torch.ones(len(ids) - 1)  # weights[t] belongs to target ids[t + 1]
            weights[digits] = TRAIN["passkey_answer_weight"]
            return torch.tensor(ids, dtype=torch.int64)[None], weights[None]
        target = round(math.exp(self.rng.uniform(math.log(low), math.log(high))))
        examples = [self._passkey_example(target) for _ in range(max(1, TRAIN["phase2_passkey_batch_tokens"] // target))]
        width = max(len(ids) for ids, _ in examples)
        input_ids = torch.full((len(examples), width), self.pad, dtype=torch.int64)  # [B, T+1]
        weights = torch.zeros(len(examples), width - 1)  # [B, T]
        for row, (ids, digits) in enumerate(examples):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            weights[row, : len(ids) - 1] = torch.tensor(answer_half_weights(ids, digits))
        return input_ids, weights

    def _passkey_example(self, target: int) -> tuple[list[int], list[int]]:
        """(token ids [BOS, prompt, answer, EOS], target indices of the answer digits)."""
        kinds = list(PASSKEY_FILLER_MIX)
        kind = self.rng.choices(kinds, [PASSKEY_FILLER_MIX[k] for k in kinds])[0]
        pool = self.filler_pool if kind == "fortunes" else None
        example = passkey.make_passkey_example(self.rng, target, self.count_tokens, pool)
        prompt = self.tokenizer.encode(example.prompt, add_special_tokens=False).ids
        answer = self.tokenizer.encode(example.answer, add_special_tokens=False).ids
        ids = [self.bos, *prompt, *answer, self.eos]
        first_answer_target = len(prompt)  # target index (into ids[1:]) of the first answer token
        digits = [first_answer_target + offset for offset, token in enumerate(answer)
                  if self.tokenizer.id_to_token(token).isdigit()]
        return ids, digits

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)


class MixedBatches(TrainingBatches):
    """The mixed curriculum: every step is one batch of rows of one width, each row a copy row, a text row or
    a passkey example (kinds drawn per row), so copy practice never runs without text beside it.

    - copy row: BOS, then a random pattern (mixed_copy_pattern_tokens long, tokens drawn from the most frequent
      training tokens and the ten digits) repeated to fill the row; loss only on the repeats;
    - text row: packed documents, as in text_batch;
    - passkey row: one example of about the row's width, right-padded, the answer digits carrying half of
      its loss (with passkey_prompt_loss False: all of it, the prompt's tokens weighing nothing).
    Until mixed_short_steps every row is mixed_short_width wide (many cheap rows: induction forms on short
    sequences); after that each step's width is log-uniform in [mixed_short_width, passkey_max_tokens] and the
    row count keeps about mixed_tokens_per_step tokens per step. Yields (input_ids, weights, kinds) with kinds
    one of "copy", "text", "passkey" per row.
    """

    def __init__(self, tokenizer: Tokenizer, documents: dict[str, list[list[int]]], seed: int):
        super().__init__(tokenizer, documents, seed)
        special = {tokenizer.token_to_id(t) for t in (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)}
        counts = Counter(t for docs in documents.values() for doc in docs for t in doc)
        frequent = [t for t, _ in counts.most_common() if t not in special]
        self.copy_vocabulary = frequent[: TRAIN["mixed_copy_vocabulary"]]
        self.digits = [tokenizer.token_to_id(str(d)) for d in range(10)]

    def __iter__(self):
        step = 0
        while True:
            yield self.mixed_batch(step)
            step += 1

    def mixed_batch(self, step: int):
        short = step < TRAIN["mixed_short_steps"]
        low, high = TRAIN["mixed_short_width"], TRAIN["passkey_max_tokens"]
        width = low if short else round(math.exp(self.rng.uniform(math.log(low), math.log(high))))
        rows = max(2, round(TRAIN["mixed_tokens_per_step"] / width))
        shares = TRAIN["mixed_row_shares_short" if short else "mixed_row_shares_long"]
        kinds = self.rng.choices(list(shares), list(shares.values()), k=rows)
        kinds.sort(key=["copy", "text", "passkey"].index)
        made = []
        for kind in kinds:
            if kind == "copy":
                made.append(self._copy_row(width))
            elif kind == "text":
                made.append(self._text_row(width))
            else:
                made.append(self._passkey_row(width))
        full = max(len(ids) for ids, _ in made)
        input_ids = torch.full((rows, full), self.pad, dtype=torch.int64)  # [B, T+1]
        weights = torch.zeros(rows, full - 1)  # [B, T]
        for row, (ids, w) in enumerate(made):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            weights[row, : len(w)] = torch.tensor(w)
        return input_ids, weights, kinds

    def _copy_row(self, width: int) -> tuple[list[int], list[float]]:
        low, high = TRAIN["mixed_copy_pattern_tokens"]
        length = self.rng.randint(low, min(high, max(low, width // 2)))
        digit_share = TRAIN["mixed_copy_digit_share"]
        pattern = [self.rng.choice(self.digits) if self.rng.random() < digit_share
                   else self.rng.choice(self.copy_vocabulary) for _ in range(length)]
        body = (pattern * (width // length + 1))[:width]
        ids = [self.bos, *body]
        return ids, [0.0] * length + [1.0] * (width - length)  # weights[t] belongs to ids[t + 1]

    def _text_row(self, width: int) -> tuple[list[int], list[float]]:
        while len(self.buffer) < width + 1:
            self.buffer.extend(self._next_document())
        ids = self.buffer[: width + 1]
        del self.buffer[: width + 1]
        return ids, [1.0] * width

    def _passkey_row(self, width: int) -> tuple[list[int], list[float]]:
        ids, digits = self._passkey_example(max(TRAIN["passkey_min_tokens"], width - 8))
        weights = answer_half_weights(ids, digits)
        if not TRAIN.get("passkey_prompt_loss", True):  # the answer digits alone, at the same weight each
            scored = set(digits)
            if TRAIN.get("passkey_answer_end_loss", False):  # and what ends the answer: its "." and EOS
                scored.update(range(digits[-1] + 1, len(ids) - 1))
            weights = [weights[digits[0]] if index in scored else 0.0 for index in range(len(weights))]
        return ids, weights
