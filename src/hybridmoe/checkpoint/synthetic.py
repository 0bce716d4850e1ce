"""Deterministic random-weight models of each supported architecture, saved as Hugging Face directories.

Used by tests (tiny configs of every shape the engine must handle) and as the fallback default model. The
weights are re-initialised with a larger std than transformers' default (0.02 gives near-uniform routing,
which hides routing bugs), norms get non-trivial gains and the DeepSeek correction bias random values. A
small byte-level BPE tokenizer with a chat template is trained and saved alongside.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

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

TINY_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v3": dict(
        vocab_size=320, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
        topk_group=1, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, routed_scaling_factor=2.5,
        max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False,
    ),
    "qwen3_moe": dict(
        vocab_size=320, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=512,
        rope_theta=10000.0, tie_word_embeddings=False,
    ),
    "mixtral": dict(
        vocab_size=320, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=512,
        rope_theta=10000.0, sliding_window=None, tie_word_embeddings=False,
    ),
}


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
    """Build a random-init model of `model_type` (deepseek_v3 | qwen3_moe | mixtral) with TINY_DEFAULTS
    updated by `overrides`, and save it with a tokenizer to out_dir. Deterministic in seed."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out_dir)
    params = {**TINY_DEFAULTS[model_type], **overrides}
    tokenizer = build_tokenizer(params["vocab_size"])
    params.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config = AutoConfig.for_model(model_type, **params)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _reinitialise(model, std, seed)
    model.to(dtype).save_pretrained(out)
    tokenizer.save_pretrained(out)
    if model_type == "deepseek_v3":  # official checkpoints name the routing; transformers 5 omits it
        cfg_path = out / "config.json"
        raw = json.loads(cfg_path.read_text())
        raw.setdefault("scoring_func", "sigmoid")
        raw.setdefault("topk_method", "noaux_tc")
        cfg_path.write_text(json.dumps(raw, indent=2) + "\n")
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
