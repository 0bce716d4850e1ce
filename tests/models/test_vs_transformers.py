"""Our models against Hugging Face transformers' own implementations on tiny random-init checkpoints:
prefill logits of a batch of 3 prompts of different lengths (run together over the paged KV cache) within
1e-4 relative in float32, and 16 greedy tokens identical."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridmoe import LLM, SamplingParams
from hybridmoe.models.loader import load_model
from hybridmoe.runtime.model_runner import ModelRunner, SequenceChunk

CONFIGS = {
    "deepseek_v3-dense_first-shared1-groups": ("deepseek_v3", {}),
    "deepseek_v3-qlora-yarn-shared2-4groups": ("deepseek_v3", dict(
        q_lora_rank=24, n_shared_experts=2, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
        norm_topk_prob=False, first_k_dense_replace=0, num_hidden_layers=2,
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128, mscale=1.0,
                          mscale_all_dim=1.0, beta_fast=32, beta_slow=1))),
    "deepseek_v3-no_shared-ungrouped": ("deepseek_v3", dict(n_shared_experts=0, n_group=1, topk_group=1,
                                                            rope_interleave=False)),
    "qwen3_moe-gqa2-norm_topk": ("qwen3_moe", {}),
    "qwen3_moe-gqa4-sparse_step2-mlp_only": ("qwen3_moe", dict(
        num_key_value_heads=1, head_dim=32, decoder_sparse_step=2, mlp_only_layers=[2], norm_topk_prob=False,
        num_hidden_layers=4)),
    "mixtral-gqa2": ("mixtral", {}),
    "mixtral-mha-sliding_window": ("mixtral", dict(num_key_value_heads=4, sliding_window=8, num_local_experts=8)),
}
PROMPT_LENS = (11, 5, 19)


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_logits_and_greedy_tokens_match_transformers(tiny_model_dir, name):
    model_type, overrides = CONFIGS[name]
    model_dir = tiny_model_dir(model_type, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = _prompts(hf.config.vocab_size)
    with torch.no_grad():
        refs = [hf(torch.tensor([p])).logits[0] for p in prompts]  # [n, V] each

    for backend in ("cpu", "torch"):
        runner = ModelRunner(load_model(model_dir, "float32", backend), num_blocks=32, block_size=4)
        chunks, next_block = [], 0
        for p in prompts:  # block tables interleaved across sequences on purpose
            n = -(-len(p) // 4)
            chunks.append(SequenceChunk(p, 0, list(range(next_block, next_block + 2 * n, 2))))
            next_block += 2 * n
        ours = runner.forward(chunks, all_logits=True)  # [T, V]
        start = 0
        for p, ref in zip(prompts, refs):
            err = (ours[start:start + len(p)] - ref).abs().max() / ref.abs().max()
            assert err < 1e-4, f"{name}, {backend} experts: prompt of {len(p)} tokens, relative logit error {err:.2e}"
            start += len(p)

    llm = LLM(model_dir, dtype="float32", block_size=4)  # default: routed experts on the C++ kernels
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    results = llm.generate(prompts, greedy)
    for p, result in zip(prompts, results):
        assert result.token_ids == _hf_greedy(hf, p, 16), f"{name}: greedy tokens differ for prompt of {len(p)}"
