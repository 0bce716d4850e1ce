"""Paged KV cache plumbing shared by the attention layers.

The KV cache of a layer is a tensor [num_blocks, block_size, ...]; a sequence owns a list of blocks (its
block table) and token position p of the sequence lives in slot block_table[p // block_size] * block_size +
p % block_size. One forward runs a batch of sequences of different lengths: the new tokens of all sequences
are concatenated ([T, ...]), each sequence s contributing query_lens[s] tokens that extend its context to
seq_lens[s] tokens.

Decode steps (one new token per sequence) attend through the C++ kernel `kernels.attention.decode_attention`
(`paged_decode`): it reads each sequence's keys and values in place through its block table, the query heads of
a group sharing their KV head, so nothing is gathered or repeated. Prefill chunks take the same kernel
(`paged_prefill`), each new token one query over its causal context. Sequences with dropped keys, layers with
observers and caches off the CPU take `gather_context` + `attend` (torch's SDPA).

Legend: T new tokens in the batch, S sequences, N heads, C context tokens of one sequence, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from hybridmoe.kernels.attention import decode_attention

# Decode steps through the C++ paged decode-attention kernel; False: every step through gather + SDPA (A/B runs).
DECODE_KERNEL = True
# Prefill chunks through the same kernel, each new token one query over its causal context; False: gather + SDPA.
PREFILL_KERNEL = True


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: cache slot of each new token
    block_tables: torch.Tensor  # [S, max_blocks] long
    query_lens: list[int]  # [S] new tokens per sequence (sum = T)
    seq_lens: list[int]  # [S] context length after this step (cached + new)
    block_size: int
    # [S] per sequence None or bool [>= seq_len], True at positions whose KV was dropped (a compressed prompt
    # handed over by hybridmoe.kv): masked out of every query's attention, their positions kept
    dropped: list[torch.Tensor | None] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    def query_slices(self) -> list[slice]:
        out, start = [], 0
        for n in self.query_lens:
            out.append(slice(start, start + n))
            start += n
        return out

    @cached_property
    def single_slot(self) -> int | None:
        """The cache slot of this step's one new token; None when it has several (read once per step)."""
        return int(self.slot_mapping[0]) if self.slot_mapping.numel() == 1 else None

    @cached_property
    def decode_seqs(self) -> int:
        """How many leading sequences decode one token each with no dropped keys: the kernel's batch (the
        scheduler puts decode tokens before prefill chunks). Computed once per step, shared by every layer."""
        n = 0
        for s, query_len in enumerate(self.query_lens):
            if query_len != 1 or (self.dropped is not None and self.dropped[s] is not None):
                break
            n += 1
        return n

    @cached_property
    def decode_seq_lens(self) -> torch.Tensor:
        """[decode_seqs] long: the context lengths of the kernel's batch."""
        return torch.tensor(self.seq_lens[: self.decode_seqs], dtype=torch.long)

    @cached_property
    def decode_block_tables(self) -> torch.Tensor:
        """[decode_seqs, max_blocks]: the block tables of the kernel's batch (a view, made once per step)."""
        return self.block_tables[: self.decode_seqs]

    def dropped_keys(self, seq: int) -> torch.Tensor | None:
        """bool [C] of sequence seq's context, True where the key is masked out; None when none is."""
        mask = self.dropped[seq] if self.dropped is not None else None
        return None if mask is None else mask[: self.seq_lens[seq]]


def write_to_cache(cache: torch.Tensor, meta: AttentionMetadata, values: torch.Tensor) -> None:
    """cache [NB, BS, *F], values [T, *F] -> stored at the slots meta.slot_mapping [T], in the cache's dtype."""
    slots = cache.view(-1, *cache.shape[2:])  # [NB * BS, *F]
    if meta.single_slot is not None:  # one token: one copy_ (converting), not a conversion and an index_copy_
        slots[meta.single_slot].copy_(values[0])
    else:
        slots.index_copy_(0, meta.slot_mapping, values.to(cache.dtype))


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """cache [NB, BS, *F], block_table [max_blocks] -> the sequence's first context_len entries [C, *F]."""
    block_size = cache.shape[1]
    num_blocks = -(-context_len // block_size)
    return cache[block_table[:num_blocks]].flatten(0, 1)[:context_len]


def attention_mask(query_len: int, context_len: int, sliding_window: int | None,
                   device: torch.device | None = None) -> torch.Tensor | None:
    """[Q, C] bool, True where query i (at position C - Q + i) may attend key j; None when all may."""
    if query_len == 1 and (sliding_window is None or context_len <= sliding_window):
        return None
    q_pos = torch.arange(context_len - query_len, context_len, device=device)[:, None]
    k_pos = torch.arange(context_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, sliding_window: int | None,
           dropped: torch.Tensor | None = None) -> torch.Tensor:
    """q [Q, N, D], k [C, Nk, D], v [C, Nk, Dv] (N a multiple of Nk) -> [Q, N, Dv], causal over the context;
    keys where dropped [C] is True are masked out."""
    mask = attention_mask(q.shape[0], k.shape[0], sliding_window, q.device)
    k, v = k.to(q.dtype), v.to(q.dtype)  # a cache in another dtype (kv_cache_dtype): SDPA wants one dtype
    if dropped is not None:
        keep = ~dropped.to(torch.bool)[None, :]  # [1, C]
        mask = keep.expand(q.shape[0], -1) if mask is None else mask & keep
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )  # [N, Q, Dv]
    return out.transpose(0, 1)


def decode_kernel_seqs(meta: AttentionMetadata, cache: torch.Tensor, observers: list) -> int:
    """How many leading sequences of this step `paged_decode` computes (0: none; the rest take `attend`)."""
    if not DECODE_KERNEL or observers or not cache.is_cpu:
        return 0
    return meta.decode_seqs


def prefill_kernel_applies(meta: AttentionMetadata, seq: int, cache: torch.Tensor, observers: list) -> bool:
    """Whether `paged_prefill` computes sequence seq's chunk (else gather + `attend`: observers, dropped keys, a
    cache off the CPU)."""
    return PREFILL_KERNEL and not observers and cache.is_cpu and meta.dropped_keys(seq) is None


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, seq: int,
                  scale: float, sliding_window: int | None, out: torch.Tensor) -> None:
    """Sequence seq's new tokens' causal attention, read in place from the paged cache (their own keys written
    already): q [n, N, D] -> out [n, N, Dv]. Each token is one query of the decode kernel over the context up to
    its own position: the sequence's block table for every row, context lengths C - n + 1 .. C. torch's SDPA took
    about 90 ms a layer at 512 tokens of Qwen3-30B-A3B's heads on 2 Zen 3 threads (12 GMAC/s)."""
    n, end = q.shape[0], meta.seq_lens[seq]
    lens = torch.arange(end - n + 1, end + 1)  # [n]
    tables = meta.block_tables[seq].expand(n, -1)  # [n, max_blocks], one row seen n times
    decode_attention(q, k_cache, v_cache, tables, lens, scale, sliding_window, out=out)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                 sliding_window: int | None, out: torch.Tensor) -> None:
    """The decode sequences' attention, read in place from the paged cache: q [S', N, D] (the first S' =
    q.shape[0] sequences, one token each), k_cache [NB, BS, Nk, D], v_cache [NB, BS, Nk, Dv] -> out [S', N, Dv]."""
    num = q.shape[0]
    tables, lens = meta.decode_block_tables, meta.decode_seq_lens
    if num != lens.shape[0]:
        tables, lens = tables[:num], lens[:num]
    decode_attention(q, k_cache, v_cache, tables, lens, scale, sliding_window, out=out)
