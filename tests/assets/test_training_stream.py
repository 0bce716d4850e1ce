"""The training stream's passkey rows: which targets carry loss, with and without the prompt's own tokens."""

from __future__ import annotations

import pytest


@pytest.fixture
def mixed_batches(demo_dir, training_modules, monkeypatch):
    """A MixedBatches with the shipped model's last run's settings over the shipped tokenizer and a few tiny
    documents (no training data needed)."""
    from tokenizers import Tokenizer

    import data_stream
    import sources

    recipe = training_modules["recipe"]
    for name, value in recipe.VARIANTS[recipe.SHIPPED_VARIANT]["train"].items():
        monkeypatch.setitem(recipe.TRAIN, name, value)
    monkeypatch.setattr(sources, "read_fortunes", lambda: {"tiny": ["Patience is a virtue.", "Look before you leap."]})
    tokenizer = Tokenizer.from_file(str(demo_dir / "tokenizer.json"))
    documents = {source: [tokenizer.encode(f"{source} text number {i}.").ids for i in range(4)]
                 for source in ("fortunes", "python_docs", "chat")}
    return data_stream.MixedBatches(tokenizer, documents, seed=3), tokenizer


@pytest.mark.parametrize("prompt_loss, end_loss", [(True, False), (False, False), (False, True)])
def test_passkey_row_weights(mixed_batches, training_modules, monkeypatch, prompt_loss, end_loss):
    stream, tokenizer = mixed_batches
    monkeypatch.setitem(training_modules["recipe"].TRAIN, "passkey_prompt_loss", prompt_loss)
    monkeypatch.setitem(training_modules["recipe"].TRAIN, "passkey_answer_end_loss", end_loss)
    ids, weights = stream._passkey_row(300)
    assert len(weights) == len(ids) - 1  # weights[t] belongs to target ids[t + 1]
    heavy = [t for t, w in enumerate(weights) if w > 1]
    scored = "".join(tokenizer.id_to_token(ids[t + 1]) for t in heavy)
    key = scored[:5]
    assert key.isdigit() and f"The pass key is {key}." in tokenizer.decode(ids)
    # With the end's loss the answer's "." and the EOS after it weigh as much as a digit: a model that
    # keeps writing digits after the fifth is wrong there.
    assert scored == (key + "." + "<|end|>" if end_loss else key)
    digit_weight = (len(ids) - 1 - 5) / 5  # the answer digits: half of the row's loss with the prompt's
    assert all(weights[t] == pytest.approx(digit_weight) for t in heavy)
    others = [w for t, w in enumerate(weights) if t not in heavy]
    assert set(others) == ({1.0} if prompt_loss else {0.0})
