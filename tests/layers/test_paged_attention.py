"""Decode steps and prefill chunks through the C++ paged attention kernel (a prefill's tokens each one query over its
causal context) give the logits of the gather + SDPA path (GQA with q/k norms, a sliding window, MLA's absorbed
latents): whole prompts, a step of decodes alone and a step that mixes decodes with a chunk continuing a cached
prefix; sequences with dropped keys and layers with observers keep the SDPA path."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.layers import paged_attention
from hybridmoe.layers.paged_attention import AttentionMetadata
from hybridmoe.models.loader import load_model
from hybridmoe.runtime.model_runner import ModelRunner, SequenceChunk

MODELS = {
    "qwen3_moe": ("qwen3_moe", {}),
    "mixtral-sliding_window": ("mixtral", dict(sliding_window=8)),
    "deepseek_v3-mla": ("deepseek_v3", {}),
}
BLOCK = 4


def _step(runner, chunks, kernel: bool) -> torch.Tensor:
    before = paged_attention.DECODE_KERNEL, paged_attention.PREFILL_KERNEL
    paged_attention.DECODE_KERNEL = paged_attention.PREFILL_KERNEL = kernel
    try:
        return runner.forward(chunks)
    finally:
        paged_attention.DECODE_KERNEL, paged_attention.PREFILL_KERNEL = before


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(MODELS))
def test_decode_kernel_matches_sdpa_path(tiny_model_dir, name, dtype):
    model_type, overrides = MODELS[name]
    model = load_model(tiny_model_dir(model_type, **overrides), dtype)
    runner = ModelRunner(model, num_blocks=64, block_size=BLOCK)
    gen = torch.Generator().manual_seed(5)
    vocab = model.config.vocab_size
    lens = (13, 3, 22)  # not multiples of the block size; 22 > the sliding window
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lens]
    tables = [list(range(16 * s + 15, 16 * s - 1, -1)) for s in range(len(lens))]  # blocks in reverse order
    prefill = [SequenceChunk(p, 0, t) for p, t in zip(prompts, tables)]
    tol = 1e-5 if dtype == "float32" else 2e-2
    want = _step(runner, prefill, kernel=False)  # [S, V]; both write the same keys into the cache
    got = _step(runner, prefill, kernel=True)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < tol, f"{name} {dtype} prefill: relative logit error {err:.2e}"

    decode = [SequenceChunk([int(torch.randint(3, vocab, (1,), generator=gen))], n, t) for n, t in zip(lens, tables)]
    # mixed: two decodes first (the scheduler's order), then a prefill chunk of the third sequence
    mixed = decode[:2] + [SequenceChunk(torch.randint(3, vocab, (5,), generator=gen).tolist(), lens[2], tables[2])]
    for chunks in (decode, mixed):
        want = _step(runner, chunks, kernel=False)  # [S, V] (rewrites the same slots: the cache is unchanged)
        got = _step(runner, chunks, kernel=True)
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err < tol, f"{name} {dtype}: relative logit error {err:.2e}"


def test_which_sequences_the_kernel_takes():
    def meta(query_lens, dropped=None):
        return AttentionMetadata(slot_mapping=torch.zeros(sum(query_lens), dtype=torch.long),
                                 block_tables=torch.zeros(len(query_lens), 4, dtype=torch.long),
                                 query_lens=query_lens, seq_lens=[8] * len(query_lens), block_size=4, dropped=dropped)

    cache = torch.zeros(2, 4, 4, 1, 8)
    assert paged_attention.decode_kernel_seqs(meta([1, 1, 1]), cache, []) == 3
    assert paged_attention.decode_kernel_seqs(meta([1, 1, 5]), cache, []) == 2
    assert paged_attention.decode_kernel_seqs(meta([5, 1]), cache, []) == 0
    assert paged_attention.decode_kernel_seqs(meta([1, 1, 1], [None, torch.zeros(8, dtype=torch.bool), None]),
                                              cache, []) == 1
    assert paged_attention.decode_kernel_seqs(meta([1, 1]), cache, [lambda *a: None]) == 0
    assert meta([1, 1, 4]).decode_seq_lens.tolist() == [8, 8]
    # prefill chunks: the kernel unless the sequence has dropped keys or the layer has observers
    assert paged_attention.prefill_kernel_applies(meta([1, 5]), 1, cache, [])
    assert not paged_attention.prefill_kernel_applies(meta([1, 5], [None, torch.zeros(8, dtype=torch.bool)]), 1,
                                                      cache, [])
    assert not paged_attention.prefill_kernel_applies(meta([5]), 0, cache, [lambda *a: None])
