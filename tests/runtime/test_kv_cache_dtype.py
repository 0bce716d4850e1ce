"""A KV cache in another dtype than the compute dtype (EngineConfig.kv_cache_dtype): 16-bit caches under float32
compute hold twice the tokens, both attention paths read them (the C++ decode kernel and gather + SDPA agree), and
the logits stay within 16-bit rounding of a float32 cache's, GQA and MLA alike."""

from __future__ import annotations

import pytest
import torch

from hybridmoe import LLM, SamplingParams
from hybridmoe.layers import paged_attention
from hybridmoe.models.loader import load_model
from hybridmoe.runtime.engine import EngineConfig, LLMEngine
from hybridmoe.runtime.model_runner import ModelRunner, SequenceChunk

BLOCK = 4


def _logits(runner: ModelRunner, prompts: list[list[int]], steps: list[list[int]], kernel: bool) -> torch.Tensor:
    """Prefill the prompts, then one decode step a list of steps -> the logits of every step [steps, S, V]."""
    before = paged_attention.DECODE_KERNEL
    paged_attention.DECODE_KERNEL = kernel
    try:
        tables = [list(range(8 * s, 8 * s + 8)) for s in range(len(prompts))]
        out = [runner.forward([SequenceChunk(p, 0, t) for p, t in zip(prompts, tables)])]
        for k, tokens in enumerate(steps):
            out.append(runner.forward([SequenceChunk([tok], len(p) + k, t)
                                       for tok, p, t in zip(tokens, prompts, tables)]))
        return torch.stack(out)
    finally:
        paged_attention.DECODE_KERNEL = before


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
def test_a_16_bit_cache_under_float32_compute(tiny_model_dir, model_type, kv_dtype):
    model = load_model(tiny_model_dir(model_type), "float32")
    gen = torch.Generator().manual_seed(3)
    vocab = model.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (11, 6)]
    steps = [torch.randint(3, vocab, (2,), generator=gen).tolist() for _ in range(3)]
    full = _logits(ModelRunner(model, 16, BLOCK), prompts, steps, kernel=True)
    half_runner = ModelRunner(model, 16, BLOCK, kv_dtype)
    assert all(c.dtype == kv_dtype for c in half_runner.kv_caches)
    kernel = _logits(half_runner, prompts, steps, kernel=True)
    sdpa = _logits(half_runner, prompts, steps, kernel=False)
    assert ((kernel - sdpa).abs().max() / sdpa.abs().max()).item() < 1e-4  # both read the same rounded keys
    err = ((kernel - full).abs().max() / full.abs().max()).item()
    assert 0 < err < 2e-2, f"{model_type} {kv_dtype}: relative logit error {err:.2e} against a float32 cache"


def test_the_engine_sizes_and_uses_the_cache_in_its_dtype(tiny_model_dir):
    model_dir = tiny_model_dir("qwen3_moe")
    default = LLMEngine(model_dir, EngineConfig(dtype="float32", kv_cache_gb=0.01))
    half = LLMEngine(model_dir, EngineConfig(dtype="float32", kv_cache_gb=0.01, kv_cache_dtype="bfloat16"))
    assert default.runner.kv_caches[0].dtype == torch.float32 and half.runner.kv_caches[0].dtype == torch.bfloat16
    assert half.runner.num_blocks // 2 == default.runner.num_blocks  # the same memory, twice the tokens (floored)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = LLM(model_dir, dtype="float32", kv_cache_dtype="float16").generate([[5, 9, 13, 40, 41]], greedy)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 8
