"""Train the byte-level BPE tokenizer on the training split and save it as a transformers tokenizer.

Digits are split one per token (so a passkey is copied digit by digit), BOS is added by the
post-processor as DeepSeek-V3's tokenizer does, and the chat template is chat_template.jinja.
Output: data/tokenizer/ (tokenizer.json, tokenizer_config.json, chat_template.jinja).
Run after prepare_data.py: .venv/bin/python training/train_tokenizer.py
"""

from __future__ import annotations

import json
import os
import random

os.environ.setdefault("RAYON_NUM_THREADS", "1")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

import passkey  # noqa: E402
import sources  # noqa: E402
from recipe import (BOS_TOKEN, CHAT_TEMPLATE_FILE, DATA_DIR, EOS_TOKEN, PAD_TOKEN, SEED,  # noqa: E402
                    SPECIAL_TOKENS, VOCAB_SIZE)


def training_texts():
    with open(DATA_DIR / "train.jsonl") as f:
        for line in f:
            yield json.loads(line)["text"]
    rng = random.Random(SEED)
    filler_pool = passkey.filler_sentences_from_fortunes(sources.read_fortunes())
    for i in range(200):  # passkey prompts, so their fixed phrases get merged tokens
        pool = filler_pool if i % 3 == 0 else None
        yield passkey.make_passkey_example(rng, 600, lambda t: len(t) // 4, pool).prompt


def build_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(training_texts(), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, bos_id)])
    return tokenizer


def main() -> None:
    tokenizer = build_tokenizer()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN,
                                   pad_token=PAD_TOKEN, model_max_length=4096, add_bos_token=True,
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE_FILE.read_text()
    out = DATA_DIR / "tokenizer"
    fast.save_pretrained(out)
    print(f"vocab {tokenizer.get_vocab_size()} -> {out}")


if __name__ == "__main__":
    main()
