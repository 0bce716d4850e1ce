"""The paged decode-attention kernel (kernels.attention.decode_attention) against its float64 reference, on fresh
random data: GQA ratios, block sizes, context lengths that are not multiples of the block size, batches of
sequences of different lengths, f32/bf16/f16 caches, sliding windows, MLA's shared latent view, and its checks."""

from __future__ import annotations

import zlib

import pytest
import torch

from hybridmoe.kernels import isa, reference
from hybridmoe.kernels.attention import decode_attention

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def random_case(gen, num_heads, num_kv, head_dim, v_dim, block_size, lens, dtype, table_dtype=torch.long):
    """Caches [NB, BS, Nk, D/Dv], queries [S, N, D], shuffled block tables [S, max_blocks] and lengths [S]."""
    max_blocks = max(-(-n // block_size) for n in lens) + 1  # one spare (unused) entry per row
    num_blocks = len(lens) * max_blocks + 3
    k = torch.randn(num_blocks, block_size, num_kv, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_blocks, block_size, num_kv, v_dim, generator=gen).to(dtype)
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[: len(lens) * max_blocks].view(len(lens), max_blocks)
    return q, k, v, tables.to(table_dtype), torch.tensor(lens)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("num_heads,num_kv,head_dim,block_size", [
    (32, 4, 128, 16),  # Qwen3-30B-A3B's attention
    (8, 8, 64, 5),     # no grouping
    (4, 2, 16, 1),     # one token a block
    (12, 3, 24, 7),    # head dim not a multiple of any vector width
    (20, 1, 40, 32),   # one KV head (multi-query)
])
def test_matches_float64_reference(each_isa, dtype, num_heads, num_kv, head_dim, block_size):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{dtype} {num_heads} {head_dim} {block_size}".encode()))
    lens = [1, 2, 37, 64, 65, 131, 300]
    q, k, v, tables, seq_lens = random_case(gen, num_heads, num_kv, head_dim, head_dim, block_size, lens, DTYPES[dtype])
    scale = head_dim ** -0.5
    want = reference.paged_decode_attention(q, k, v, tables, seq_lens, scale)
    out = torch.empty(len(lens), num_heads, head_dim)  # float32 output: only the kernel's own rounding
    decode_attention(q, k, v, tables, seq_lens, scale, out=out)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-4)
    got = decode_attention(q, k, v, tables, seq_lens, scale)  # in q's dtype
    assert got.dtype == q.dtype
    tol = {"f32": 2e-5, "bf16": 1e-2, "f16": 2e-3}[dtype]
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [1, 16, 50, 1000])
def test_sliding_window(each_isa, window):
    gen = torch.Generator().manual_seed(window)
    q, k, v, tables, seq_lens = random_case(gen, 8, 2, 32, 32, 16, [1, 17, 49, 50, 51, 200], torch.bfloat16)
    want = reference.paged_decode_attention(q, k, v, tables, seq_lens, 0.3, window)
    out = torch.empty(q.shape[0], 8, 32)
    decode_attention(q, k, v, tables, seq_lens, 0.3, window, out=out)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-4)


def test_mla_latent_view_and_int32_tables(each_isa):
    """MLA's absorbed decode: one shared KV head, K = the cached latent + rope key [L+R], V = its first L columns
    (a strided view of the same cache); queries as a non-contiguous view; int32 block tables and lengths."""
    gen = torch.Generator().manual_seed(7)
    lora, rope, heads, block_size = 48, 8, 20, 16
    lens = [3, 16, 60, 97]
    cache = torch.randn(30, block_size, lora + rope, generator=gen).to(torch.bfloat16)  # [NB, BS, L+R]
    latents = cache[:, :, None, :]
    q_wide = torch.randn(len(lens), heads, lora + rope + 5, generator=gen).to(torch.bfloat16)
    q = q_wide[..., : lora + rope]
    tables = torch.randperm(30, generator=gen)[:28].view(4, 7).to(torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    want = reference.paged_decode_attention(q, latents, latents[..., :lora], tables, seq_lens, 0.1)
    out = torch.empty(len(lens), heads, lora)
    decode_attention(q, latents, latents[..., :lora], tables, seq_lens, 0.1, out=out)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-4)


@pytest.mark.slow
def test_many_sequences_and_long_contexts_split_over_the_pool():
    """A batch large enough for many tasks, with contexts from 1 to 3000 tokens, on every thread count."""
    gen = torch.Generator().manual_seed(3)
    lens = torch.randint(1, 3000, (24,), generator=gen).tolist() + [1, 2, 3]
    q, k, v, tables, seq_lens = random_case(gen, 16, 4, 64, 64, 32, lens, torch.float16)
    want = reference.paged_decode_attention(q, k, v, tables, seq_lens, 0.125)
    threads = isa.num_threads()
    try:
        for n in (1, 3):
            isa.configure_threads(n)
            out = torch.empty(len(lens), 16, 64)
            decode_attention(q, k, v, tables, seq_lens, 0.125, out=out)
            torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-4)
    finally:
        isa.configure_threads(threads)


def test_checks_name_the_argument():
    gen = torch.Generator().manual_seed(0)
    q, k, v, tables, seq_lens = random_case(gen, 4, 2, 16, 16, 8, [5, 9], torch.float32)
    with pytest.raises(ValueError, match="seq_lens"):
        decode_attention(q, k, v, tables, torch.tensor([5, 0]), 1.0)
    with pytest.raises(ValueError, match="seq_lens"):
        decode_attention(q, k, v, tables, torch.tensor([5, 8 * tables.shape[1] + 1]), 1.0)
    bad = tables.clone()
    bad[1, 0] = k.shape[0]
    with pytest.raises(ValueError, match="block_tables"):
        decode_attention(q, k, v, bad, seq_lens, 1.0)
    with pytest.raises(ValueError, match="heads"):
        decode_attention(q[:, :3], k, v, tables, seq_lens, 1.0)
    with pytest.raises(ValueError, match="v_cache"):
        decode_attention(q, k, v.half(), tables, seq_lens, 1.0)
    with pytest.raises(ValueError, match="q"):
        decode_attention(q.double(), k, v, tables, seq_lens, 1.0)


@pytest.mark.parametrize("window", [None, 1000])
def test_long_context_split_over_more_threads_than_units(window):
    """Fewer (sequence, KV head) units than threads: long contexts are split into parts merged afterwards (the
    pool may have more threads than CPUs)."""
    gen = torch.Generator().manual_seed(11)
    q, k, v, tables, seq_lens = random_case(gen, 8, 2, 64, 48, 16, [3000, 700, 5], torch.bfloat16)
    want = reference.paged_decode_attention(q, k, v, tables, seq_lens, 0.125, window)
    threads = isa.num_threads()
    try:
        for n in (8, 13):
            isa.configure_threads(n)
            out = torch.empty(3, 8, 48)
            decode_attention(q, k, v, tables, seq_lens, 0.125, window, out=out)
            torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-4)
            single = decode_attention(q[:1], k, v, tables[:1], seq_lens[:1], 0.125, window)  # one sequence alone
            torch.testing.assert_close(single.double(), want[:1], atol=1e-2, rtol=1e-2)
    finally:
        isa.configure_threads(threads)
