"""Shared fixtures for runtime tests: a small byte-level BPE tokenizer saved the way a model directory holds it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]

TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog. Tokenizers split text into pieces called tokens.",
    "A mixture of experts routes every token to a few experts; the others stay idle for that token.",
    "Large language models generate one token at a time, reading the whole context before each step.",
    "Café au lait, naïve résumé, jalapeño and smörgåsbord keep their accents in UTF-8.",
    "你好世界。今天天气很好，我们去公园散步吧。机器学习和深度学习。",
    "こんにちは世界。日本語のテキストも少し入れておきます。",
    "Emoji travel too: 😀 🎉 🚀 👍🏽 ❤️ and the end of the paragraph.",
    "Numbers like 3.14159, 2718 and 1,000,000 appear in text as well; so do symbols such as @#$%&*.",
]


def _train_tokenizer_dir(directory: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(TRAINING_TEXT * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|bos|>", eos_token="<|eos|>", chat_template=CHAT_TEMPLATE
    )
    fast.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="session")
def _trained_tokenizer_dir(tmp_path_factory) -> Path:
    return _train_tokenizer_dir(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture
def tokenizer_dir(_trained_tokenizer_dir, tmp_path) -> Path:
    """A fresh copy per test (tests may edit it): tokenizer.json, tokenizer_config.json, chat_template.jinja."""
    directory = tmp_path / "model"
    shutil.copytree(_trained_tokenizer_dir, directory)
    return directory


@pytest.fixture(scope="session")
def tokenizer(_trained_tokenizer_dir):
    from hybridmoe.runtime.tokenizer import load_tokenizer

    return load_tokenizer(_trained_tokenizer_dir)
