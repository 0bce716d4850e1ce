"""The decode stack (models/decode_stack.py): a decode step's layers in one native call give bit for bit the Python
decoder's logits and KV cache, GQA and MLA attention, MoE layers with and without shared experts and dense layers, in
every weight format, compute dtype and cache dtype it takes; it stands aside where the layers must run in Python
(observers, many tokens, prefill chunks, unsupported models), and its native call checks its arguments."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from hybridmoe.checkpoint.default_model import resolve_model_dir
from hybridmoe.checkpoint.fp8 import write_fp8_checkpoint
from hybridmoe.cli import main
from hybridmoe.kernels import _native
from hybridmoe.models import decode_stack
from hybridmoe.models.loader import load_model
from hybridmoe.runtime.model_runner import ModelRunner, SequenceChunk

BLOCK = 4


def _decode(model, kv_dtype, stacked: bool, prompts, steps) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """Prefill the prompts, then one decode step per list of steps (a token a sequence; sequences drop out as the
    lists shorten) -> (the decode steps' logits [steps, S, V] padded with NaN, the KV caches, stack runs)."""
    runner = ModelRunner(model, 16 * len(prompts), BLOCK, kv_dtype)
    tables = [list(range(16 * s, 16 * s + 16)) for s in range(len(prompts))]
    runs = 0
    native_run = decode_stack.DecodeStack.run

    def counted(self, *args):
        nonlocal runs
        runs += 1
        return native_run(self, *args)

    before = decode_stack.ENABLED
    decode_stack.ENABLED, decode_stack.DecodeStack.run = stacked, counted
    try:
        runner.forward([SequenceChunk(p, 0, t) for p, t in zip(prompts, tables)])
        out = torch.full((len(steps), len(prompts), model.config.vocab_size), float("nan"))
        for k, tokens in enumerate(steps):
            chunks = [SequenceChunk([tok], len(p) + k, t) for tok, p, t in zip(tokens, prompts, tables)]
            out[k, : len(tokens)] = runner.forward(chunks)
    finally:
        decode_stack.ENABLED, decode_stack.DecodeStack.run = before, native_run
    return out, runner.kv_caches, runs


def _inputs(vocab: int, lengths=(11, 6, 3)):
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
    steps = [torch.randint(3, vocab, (len(lengths) - (k >= 3) - (k >= 5),), generator=gen).tolist()
             for k in range(7)]  # 3, 2 then 1 sequences: contexts crossing several blocks
    return prompts, steps


def _same_as_python(model, kv_dtype):
    prompts, steps = _inputs(model.config.vocab_size)
    python, python_caches, none = _decode(model, kv_dtype, False, prompts, steps)
    stacked, stacked_caches, runs = _decode(model, kv_dtype, True, prompts, steps)
    assert none == 0 and runs == len(steps), model.decode_stack_verdict
    assert torch.equal(python.isnan(), stacked.isnan())
    assert torch.equal(python.nan_to_num(), stacked.nan_to_num())
    for a, b in zip(python_caches, stacked_caches):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype,kv_dtype", [("float32", torch.float32), ("float32", torch.float16),
                                            ("bfloat16", torch.bfloat16), ("bfloat16", torch.float16)])
@pytest.mark.parametrize("model_type,overrides", [("qwen3_moe", {}), ("qwen3_moe", {"mlp_only_layers": [0]}),
                                                  ("mixtral", {"sliding_window": 9}), ("deepseek_v3", {}),
                                                  ("deepseek_v3", {"q_lora_rank": 24})])
def test_float_models_match_the_python_decoder(tiny_model_dir, model_type, overrides, dtype, kv_dtype):
    model = load_model(tiny_model_dir(model_type, **overrides), dtype)
    assert decode_stack.unsupported(model) is None
    _same_as_python(model, kv_dtype)


def test_the_demo_models_match_the_python_decoder(each_isa):
    for name in ("demo", "demo-gqa"):
        _same_as_python(load_model(resolve_model_dir(name), "bfloat16"), torch.bfloat16)


@pytest.mark.parametrize("fmt,scope", [("int4", "all"), ("int8", "all"), ("int4", "experts")])
def test_int_models_match_the_python_decoder(tiny_model_dir, tmp_path, fmt, scope):
    out = tmp_path / fmt
    extra = ["--experts-only"] if scope == "experts" else []
    assert main(["quantize", "--model", str(tiny_model_dir("qwen3_moe")), "--to", fmt, "--group", "32",
                 "--out", str(out), *extra]) == 0
    for dtype in ("bfloat16", "float32"):
        _same_as_python(load_model(out, dtype), torch.float16)


def test_fp8_models_match_the_python_decoder(tiny_model_dir, tmp_path):
    fp8 = write_fp8_checkpoint(tiny_model_dir("qwen3_moe"), tmp_path / "fp8", block=(16, 16))
    model = load_model(fp8, "bfloat16")
    assert model.layers[0].attention.w.q_proj.fmt == "fp8"
    _same_as_python(model, torch.bfloat16)


def test_the_stack_stands_aside_where_layers_must_run_in_python(tiny_model_dir):
    model = load_model(tiny_model_dir("qwen3_moe"), "float32")
    prompts, steps = _inputs(model.config.vocab_size, lengths=(5,) * 8)
    assert _decode(model, torch.float32, True, prompts, steps[:2])[2] == 0  # float weights: torch's matmul from 8
    seen = []
    remove = model.add_routing_observer(lambda layer, ids: seen.append(layer))
    assert _decode(model, torch.float32, True, prompts[:2], [s[:2] for s in steps[:2]])[2] == 0
    assert len(seen) == 3 * model.config.num_layers  # the prefill and both decode steps, every layer
    remove()
    assert _decode(model, torch.float32, True, prompts[:2], [s[:2] for s in steps[:2]])[2] == 2


def test_another_list_of_layers_gets_a_stack_of_its_own(tiny_model_dir):
    """The op tables' host costs run a model with subsets of its layers (profiling.op_tables.measure_host)."""
    model = load_model(tiny_model_dir("qwen3_moe"), "float32")
    prompts, steps = _inputs(model.config.vocab_size)
    assert _decode(model, torch.float32, True, prompts, steps[:2])[2] == 2
    every, layers = model.decode_stack, model.layers
    try:
        model.layers = layers[:1]
        _same_as_python(model, torch.float32)
        assert model.decode_stack is not every and model.decode_stack.layers is model.layers
        model.layers = []
        assert _decode(model, torch.float32, True, prompts, steps[:2])[2] == 0
        assert model.decode_stack_verdict == ([], "no layers")
    finally:
        model.layers = layers


@pytest.mark.parametrize("model_type,overrides,backend,why", [
    ("qwen3_moe", {"attention_bias": True}, "cpu", "layer 0: an attention projection with a bias"),
    ("qwen3_moe", {}, "torch", "layer 0: a MoE block off the CPU expert kernels")])
def test_models_it_does_not_take_say_why(tiny_model_dir, model_type, overrides, backend, why):
    model = load_model(tiny_model_dir(model_type, **overrides), "float32", backend)
    assert why in decode_stack.unsupported(model)
    prompts, steps = _inputs(model.config.vocab_size)
    assert _decode(model, torch.float32, True, prompts, steps[:2])[2] == 0


def test_the_native_call_checks_its_arguments(tiny_model_dir):
    model = load_model(tiny_model_dir("qwen3_moe"), "float32")
    runner = ModelRunner(model, 8, BLOCK)
    stack = decode_stack.DecodeStack(model, runner.kv_caches)
    H, half = model.config.hidden_size, model.config.attention.head_dim // 2
    good = dict(residual=torch.zeros(1, H), x=torch.zeros(1, H), cos=torch.ones(1, half), sin=torch.zeros(1, half),
                slots=torch.tensor([3]), block_tables=torch.tensor([[0, 1]]), seq_lens=torch.tensor([4]))
    stack._native.run(**good)
    for change, message in [(dict(slots=torch.tensor([32])), "slots: slot 32 of sequence 0 is outside"),
                            (dict(seq_lens=torch.tensor([9])), "seq_lens: sequence 0: length 9 outside [1, 8]"),
                            (dict(block_tables=torch.tensor([[0, 8]]), seq_lens=torch.tensor([5])),
                             "block_tables: block 8 at [0, 1] is out of range [0, 8)"),
                            (dict(x=torch.zeros(1, H, dtype=torch.bfloat16)), "x: dtype must be float32"),
                            (dict(cos=torch.ones(1, half + 1)), "cos: expected shape [1, 8]")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            stack._native.run(**{**good, **change})


def test_cache_rows_round_to_half_as_torch_does():
    values = np.concatenate([
        np.random.default_rng(0).standard_normal(4096).astype(np.float32) * np.float32(10.0) ** np.repeat(
            np.arange(-9, 6, dtype=np.float32), 4096 // 15 + 1)[:4096],
        np.array([65504, 65519.99, 65520, 1e6, -1e6, 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26, 2.0 ** -26, 0.0, -0.0,
                  np.inf, -np.inf, 6.1e-5, 5.96e-8], dtype=np.float32)])
    expected = torch.from_numpy(values).half().view(torch.int16).numpy()
    assert np.array_equal(_native.round_to_half(values).view(np.int16), expected)
    assert np.isnan(_native.round_to_half(np.array([np.nan], dtype=np.float32)).view(np.float16)).all()
