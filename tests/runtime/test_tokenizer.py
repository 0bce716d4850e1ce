"""load_tokenizer: encode/decode, chat template sources, EOS ids, clear errors for missing or broken files."""

from __future__ import annotations

import json
import logging

import pytest
from tokenizers import Tokenizer as RustTokenizer

from hybridmoe.runtime.tokenizer import load_tokenizer

TEXT = "Mixture of experts: 你好世界, café, 😀 and 3.14159 tokens."
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi 😀 你好"},
]


def test_encode_decode_match_the_tokenizer_file(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    reference = RustTokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    ids = tok.encode(TEXT)
    assert ids == reference.encode(TEXT).ids
    assert tok.decode(ids) == TEXT
    assert tok.vocab_size == reference.get_vocab_size(with_added_tokens=True) == 600


def test_decode_skips_special_tokens_on_request(tokenizer):
    ids = tokenizer.encode("<|user|>hello<|end|>")
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|user|>hello<|end|>"
    assert tokenizer.decode(ids, skip_special_tokens=True) == "hello"
    assert tokenizer.decode(ids) == "hello"


def test_decode_keeps_spaces_verbatim(tokenizer):
    text = "a , b . c ! don 't"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def _expected_chat_text(messages, add_generation_prompt):
    body = "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in messages)
    return "<|bos|>" + body + ("<|assistant|>" if add_generation_prompt else "")


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_from_jinja_file(tokenizer_dir, add_generation_prompt):
    assert (tokenizer_dir / "chat_template.jinja").is_file()
    tok = load_tokenizer(tokenizer_dir)
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt)
    expected = _expected_chat_text(MESSAGES, add_generation_prompt)
    assert tok.decode(ids, skip_special_tokens=False) == expected
    special_ids = {tok.encode(s)[0] for s in ("<|bos|>", "<|system|>", "<|user|>", "<|end|>", "<|assistant|>")}
    assert ids[0] == tok.encode("<|bos|>")[0]  # the template writes BOS once; encoding adds none
    assert sum(i in special_ids for i in ids) == expected.count("<|")


def _move_template_into_config(tokenizer_dir, make_value):
    """Delete chat_template.jinja and put make_value(its text) into tokenizer_config.json's chat_template."""
    template_file = tokenizer_dir / "chat_template.jinja"
    value = make_value(template_file.read_text())
    template_file.unlink()
    config_path = tokenizer_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = value
    config_path.write_text(json.dumps(config))


def test_chat_template_from_tokenizer_config(tokenizer_dir):
    _move_template_into_config(tokenizer_dir, lambda template: template.replace("<|end|>", "<|end|>\n"))
    tok = load_tokenizer(tokenizer_dir)
    text = tok.decode(tok.apply_chat_template(MESSAGES), skip_special_tokens=False)
    assert text == _expected_chat_text(MESSAGES, True).replace("<|end|>", "<|end|>\n")


def test_chat_template_list_form_uses_default(tokenizer_dir):
    _move_template_into_config(
        tokenizer_dir,
        lambda template: [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": template}],
    )
    tok = load_tokenizer(tokenizer_dir)
    assert tok.decode(tok.apply_chat_template(MESSAGES), skip_special_tokens=False) == _expected_chat_text(
        MESSAGES, True
    )


def test_missing_chat_template_names_the_directory(tokenizer_dir):
    (tokenizer_dir / "chat_template.jinja").unlink()
    tok = load_tokenizer(tokenizer_dir)
    assert tok.encode("still works") != []
    with pytest.raises(ValueError, match=f"{tokenizer_dir} has no chat template"):
        tok.apply_chat_template(MESSAGES)


def test_eos_ids_gather_tokenizer_generation_config_and_config(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    eos = tok.encode("<|eos|>")[0]
    end = tok.encode("<|end|>")[0]
    assert tok.eos_token_ids == (eos,)
    (tokenizer_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [end, eos]}))
    (tokenizer_dir / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "eos_token_id": 599}))
    assert load_tokenizer(tokenizer_dir).eos_token_ids == (eos, end, 599)


def test_missing_tokenizer_json_names_the_file(tokenizer_dir):
    (tokenizer_dir / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match=f"{tokenizer_dir / 'tokenizer.json'} is missing"):
        load_tokenizer(tokenizer_dir)


def test_broken_tokenizer_json_names_the_file(tokenizer_dir):
    path = tokenizer_dir / "tokenizer.json"
    path.write_text(path.read_text()[:200])
    with pytest.raises(ValueError, match=f"{path} is not a valid tokenizers file"):
        load_tokenizer(tokenizer_dir)


def test_missing_directory_is_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "nowhere")


def test_broken_generation_config_names_the_file(tokenizer_dir):
    (tokenizer_dir / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json is not valid JSON"):
        load_tokenizer(tokenizer_dir)


def test_a_text_longer_than_model_max_length_encodes_without_transformers_warning(tokenizer_dir):
    """Lengths are the engine's to judge (against the model and the KV cache, with its own error); transformers'
    "indexing errors" warning about the tokenizer's model_max_length would only precede that error."""
    config_path = tokenizer_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["model_max_length"] = 8
    config_path.write_text(json.dumps(config))
    tok = load_tokenizer(tokenizer_dir)
    assert tok.hf_tokenizer.model_max_length == 8
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    transformers_logger = logging.getLogger("transformers")  # its own handler, not propagated to pytest's
    transformers_logger.addHandler(handler)
    try:
        ids = tok.encode(TEXT * 4)
    finally:
        transformers_logger.removeHandler(handler)
    assert len(ids) > 8 and tok.decode(ids) == TEXT * 4
    assert [r.getMessage() for r in records] == []
