"""IncrementalDetokenizer: streamed pieces == decode(all ids), whole characters only, stop strings."""

from __future__ import annotations

import random

import pytest

from hybridmoe.runtime.detokenizer import IncrementalDetokenizer

MULTI_BYTE_TEXTS = [
    "Café naïve résumé, jalapeño, smörgåsbord, Ünïcödé.",
    "你好世界。今天天气很好，我们去公园散步吧。",
    "Emoji: 😀🎉🚀 👍🏽 ❤️ 🧑‍🚀 🇯🇵 and text after.",
    "Mixed 日本語 with 한국어 and Ελληνικά, العربية, עברית ✓",
]


def _stream(detokenizer: IncrementalDetokenizer, ids) -> list[str]:
    """All pieces: one per add, then the flush."""
    return [detokenizer.add(token_id) for token_id in ids] + [detokenizer.flush()]


def test_multi_byte_text_splits_characters_across_tokens(tokenizer):
    """The texts below really do put one character's bytes into several tokens (the test has teeth)."""
    for text in MULTI_BYTE_TEXTS[1:3]:
        single_token_texts = [tokenizer.decode([i]) for i in tokenizer.encode(text)]
        assert any("\ufffd" in piece for piece in single_token_texts)


@pytest.mark.parametrize("text", MULTI_BYTE_TEXTS)
def test_multi_byte_text_streams_whole_characters(tokenizer, text):
    ids = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Prompt: "))
    pieces = _stream(detokenizer, ids)
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == text == tokenizer.decode(ids) == detokenizer.text
    assert pieces[-1] == ""  # nothing left to flush for complete text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_random_ids_concatenate_to_decode(tokenizer, seed, skip_special_tokens):
    rng = random.Random(seed)
    prompt = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(0, 12))]
    ids = [rng.randrange(tokenizer.vocab_size) for _ in range(200)]
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
    pieces = _stream(detokenizer, ids)
    expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "".join(pieces) == expected == detokenizer.text


def test_prompt_ending_mid_character_does_not_leak_into_output(tokenizer):
    emoji_ids = tokenizer.encode("😀")
    assert len(emoji_ids) > 1
    prompt = tokenizer.encode("Say: ") + emoji_ids[:-1]  # the prompt stops inside the emoji's bytes
    output = tokenizer.encode(" 你好 ok")
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    assert "".join(_stream(detokenizer, output)) == tokenizer.decode(output)


def test_stop_string_across_token_boundaries(tokenizer):
    text = "The quick brown fox jumps over the lazy dog. Tokenizers split text."
    ids = tokenizer.encode(text)
    # A stop string that starts inside one token and ends inside a later one.
    boundaries = []
    position = 0
    for token_id in ids:
        position += len(tokenizer.decode([token_id]))
        boundaries.append(position)
    start = boundaries[3] - 2
    end = boundaries[5] + 1
    stop = text[start:end]
    assert any(start < b < end for b in boundaries)
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=[stop])
    pieces = [detokenizer.add(token_id) for token_id in ids]
    assert detokenizer.stopped and detokenizer.stop_reason == stop
    assert "".join(pieces) == text[:start] == detokenizer.text
    assert detokenizer.add(ids[0]) == "" and detokenizer.flush() == ""
    stop_token_index = next(i for i, b in enumerate(boundaries) if b >= end)
    assert all(piece == "" for piece in pieces[stop_token_index + 1 :])


def test_stop_string_at_start_gives_empty_text(tokenizer):
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["The"])
    pieces = _stream(detokenizer, tokenizer.encode("The end"))
    assert "".join(pieces) == "" and detokenizer.stopped and detokenizer.text == ""


def test_earliest_of_several_stop_strings_wins(tokenizer):
    text = "alpha beta gamma delta"
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["delta", "beta g", "gamma"])
    pieces = _stream(detokenizer, tokenizer.encode(text))
    assert detokenizer.stop_reason == "beta g"
    assert "".join(pieces) == "alpha "


def test_multi_byte_stop_string(tokenizer):
    text = "你好世界。今天天气很好"
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["界。今"])
    pieces = _stream(detokenizer, tokenizer.encode(text))
    assert detokenizer.stopped and "".join(pieces) == "你好世"
    assert all("\ufffd" not in piece for piece in pieces)


def test_tail_that_may_become_a_stop_string_is_held_back(tokenizer):
    text = "the lazy dog"
    ids = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["dog!", "zebra"])
    streamed = "".join(detokenizer.add(token_id) for token_id in ids)
    assert streamed == "the lazy "  # "dog" could still become "dog!"
    assert detokenizer.text == text and not detokenizer.stopped
    assert detokenizer.flush() == "dog"

    # Once the tail can no longer start a stop string it is released.
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["dog!"])
    streamed = "".join(detokenizer.add(token_id) for token_id in tokenizer.encode("the lazy dog."))
    assert streamed == "the lazy dog." and not detokenizer.stopped


@pytest.mark.parametrize("seed", range(4))
def test_random_stops_match_a_direct_search(tokenizer, seed):
    """Streaming with stops == cutting decode(all ids) at the first occurrence of any stop string."""
    rng = random.Random(100 + seed)
    text = " ".join(rng.choice(MULTI_BYTE_TEXTS + ["the lazy dog", "a fox"]) for _ in range(4))
    ids = tokenizer.encode(text)
    full = tokenizer.decode(ids)
    stops = []
    for _ in range(3):
        start = rng.randrange(len(full) - 6)
        stops.append(full[start : start + rng.randrange(1, 6)])
    stops.append("never appears ✗")
    found = [(full.find(s), s) for s in stops if s in full]
    cut = min(found)[0]
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=stops)
    pieces = _stream(detokenizer, ids)
    assert "".join(pieces) == full[:cut] == detokenizer.text
    assert detokenizer.stopped and full.find(detokenizer.stop_reason) == cut


def test_bad_stop_strings_are_rejected(tokenizer):
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(tokenizer, [], stop=[""])


def test_min_tokens_ignores_stop_strings_completed_by_the_first_tokens(tokenizer):
    text = "one stop two stop three"
    ids = tokenizer.encode(text)
    first_stop_end = next(n for n in range(1, len(ids) + 1) if "stop" in tokenizer.decode(ids[:n]))
    plain = IncrementalDetokenizer(tokenizer, [], stop=["stop"])
    "".join(_stream(plain, ids))
    assert plain.stopped and plain.text == "one "

    held = IncrementalDetokenizer(tokenizer, [], stop=["stop"], min_tokens=first_stop_end)
    pieces = _stream(held, ids)
    assert held.stopped and held.text == "one stop two " == "".join(pieces)

    never = IncrementalDetokenizer(tokenizer, [], stop=["stop"], min_tokens=len(ids))
    assert "".join(_stream(never, ids)) == text and not never.stopped
