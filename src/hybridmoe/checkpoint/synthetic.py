"""Deterministic random-weight models of each supported family, saved as Hugging Face directories.

Used by tests (each family's tiny config from hybridmoe.config.families, with overrides for every shape the
engine must handle), by `profile`'s minimal-width copies and as the fallback default model. The weights are
re-initialised with a larger std than transformers' default (0.02 gives near-uniform routing, which hides
routing bugs), norms get non-trivial gains and the DeepSeek correction bias random values. A small byte-level
BPE tokenizer with a chat template is trained and saved alongside.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hybridmoe.config.families import FAMILIES, family_for_model_type

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]

_TOKENIZER_TEXT = """\
The quick brown fox jumps over the lazy dog. A mixture of experts routes every token to a few experts.
Memory bandwidth bounds decoding; compute bounds long prefills. Attention runs on the accelerator while the
processor streams expert weights from memory. Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 128 2048 7168.
Café, naïve, Zürich, 東京, 🙂 — punctuation: ()[]{}<>!?;:'",.-_/\\|@#$%^&*+=~`
def forward(self, x): return x * 2  # code is text too
"""

def build_tokenizer(vocab_size: int):
    """A byte-level BPE (at most vocab_size entries) with SPECIAL_TOKENS and CHAT_TEMPLATE."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_TOKENIZER_TEXT] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tiny_model(out_dir: str | Path, model_type: str, seed: int = 0, std: float = 0.08,
                    dtype: torch.dtype = torch.float32, **overrides: Any) -> Path:
    """Build a random-init model of `model_type` (deepseek_v3 | qwen3_moe | mixtral, or another model type of
    their families) with its family's tiny config updated by `overrides`, and save it with a tokenizer to
    out_dir. Deterministic in seed."""
    from transformers import AutoConfig, AutoModelForCausalLM

    family = family_for_model_type(model_type)
    if family is None or not family.tiny:
        known = [t for f in FAMILIES if f.tiny for t in f.model_types]
        raise ValueError(f"no tiny config for model type {model_type!r}; known: {', '.join(known)}")
    out = Path(out_dir)
    params = {**family.tiny, **overrides}
    tokenizer = build_tokenizer(params["vocab_size"])
    params.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    # the family's first model type is the one transformers builds (Kimi-K2's kimi_k2 is a DeepSeek-V3)
    config = AutoConfig.for_model(family.model_types[0], **params)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _reinitialise(model, std, seed)
    model.to(dtype).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@torch.no_grad()
def _reinitialise(model, std: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
        else:
            param.copy_(std * torch.randn(param.shape, generator=gen))
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(0.1 * torch.randn(buf.shape, generator=gen))
