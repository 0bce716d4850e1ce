"""`load_tokenizer(model_dir) -> Tokenizer`: the model's own tokenizer and chat template, from a local directory.

Wraps transformers' AutoTokenizer (a `tokenizers`-backed fast tokenizer read from tokenizer.json) and never
touches the network. The chat template comes from chat_template.jinja, else tokenizer_config.json's
`chat_template`; EOS ids are gathered from the tokenizer, generation_config.json and config.json, because
chat models often end a turn with a token that only generation_config.json lists.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _RustTokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerBase


class Tokenizer:
    """Text <-> token ids for one model. Build it with `load_tokenizer`."""

    def __init__(self, hf_tokenizer: PreTrainedTokenizerBase, model_dir: Path) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.model_dir = model_dir
        self.eos_token_ids: tuple[int, ...] = _collect_eos_token_ids(hf_tokenizer, model_dir)
        self._chat_template: str | None = _read_chat_template(model_dir)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included (the model's embedding may be larger)."""
        return len(self.hf_tokenizer)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"Tokenizer.encode: text must be a str, got {type(text).__name__}")
        # verbose=False: no "indexing errors" warning from transformers for a text longer than the tokenizer's
        # model_max_length; the engine judges lengths itself, against the model and the KV cache
        return list(self.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens, verbose=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of ids, verbatim (no clean-up of spaces around punctuation)."""
        return self.hf_tokenizer.decode(
            list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> list[int]:
        """Token ids of the conversation rendered with the model's chat template.

        The template writes any BOS itself, so the rendered text is encoded without adding special tokens.
        template_kwargs reach the template as variables (for example tools=..., enable_thinking=False).
        """
        if self._chat_template is None:
            raise ValueError(
                f"{self.model_dir} has no chat template (looked for chat_template.jinja and "
                f"tokenizer_config.json's chat_template); send a plain prompt instead"
            )
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise TypeError("apply_chat_template: messages must be a list of dicts like {'role': ..., 'content': ...}")
        text = self.hf_tokenizer.apply_chat_template(
            messages,
            chat_template=self._chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **template_kwargs,
        )
        return self.encode(text, add_special_tokens=False)


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """Load the tokenizer in model_dir (must hold tokenizer.json); local files only."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {model_dir} does not exist")
    tokenizer_file = model_dir / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise FileNotFoundError(f"{tokenizer_file} is missing: hybridmoe needs the fast tokenizer file tokenizer.json")
    try:
        _RustTokenizer.from_file(str(tokenizer_file))
    except Exception as error:  # tokenizers raises a bare Exception with the parser's message
        raise ValueError(f"{tokenizer_file} is not a valid tokenizers file: {error}") from error
    try:
        hf_tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as error:
        raise ValueError(f"could not load the tokenizer in {model_dir}: {error}") from error
    return Tokenizer(hf_tokenizer, model_dir)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _read_chat_template(model_dir: Path) -> str | None:
    template_file = model_dir / "chat_template.jinja"
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    template = _read_json(model_dir / "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def _collect_eos_token_ids(hf_tokenizer: PreTrainedTokenizerBase, model_dir: Path) -> tuple[int, ...]:
    """EOS ids from the tokenizer, then generation_config.json, then config.json; each once, in that order."""
    candidates: list[Any] = [hf_tokenizer.eos_token_id]
    for name in ("generation_config.json", "config.json"):
        candidates.append(_read_json(model_dir / name).get("eos_token_id"))
    eos_ids: list[int] = []
    for candidate in candidates:
        values = candidate if isinstance(candidate, list) else [candidate]
        for value in values:
            if isinstance(value, int) and not isinstance(value, bool) and value not in eos_ids:
                eos_ids.append(value)
    return tuple(eos_ids)
