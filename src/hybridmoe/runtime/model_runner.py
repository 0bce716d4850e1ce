"""Turns a step's scheduled sequences into one batched forward over the paged KV cache.

The runner owns the KV cache tensors (one per layer, [num_blocks, block_size, ...] as the model's attention
lays them out; on the accelerator, counted in its ledger as "kv cache.N", for the layers whose attention a plan
placed there) and builds the flat batch: token ids and positions of every sequence's new tokens, their cache
slots, block tables and lengths, and, for a step holding a sequence whose prompt KV was partly dropped (a
compressed handoff, hybridmoe.disagg), each sequence's mask of dropped keys (`AttentionMetadata.dropped`; None
in every other step, which keeps the plain path and the C++ decode kernel).

Legend: T new tokens in the batch, S sequences, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from hybridmoe.layers.paged_attention import AttentionMetadata
from hybridmoe.models.decoder import MoEDecoderModel


@dataclass
class SequenceChunk:
    """New tokens of one sequence for this step: they sit at positions start_pos .. start_pos + len - 1."""

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    dropped: torch.Tensor | None = None  # bool [n]: leading positions whose KV was dropped (masked, kept in place)


# Below this many tokens in a step, torch's own ops (attention, norms, small matmuls) run on one thread: their
# work is microseconds, and waking a team of intra-op threads costs more than it saves (ten times more when
# another process holds a core). The routed experts keep all cores through the C++ kernels' own pool. The
# caller's thread count is restored after the step (larger steps use it). The engine holds the same scope over
# the step's sampling too: a multi-threaded op on the logits there left torch's OpenMP workers spinning into the next
# step's kernels, and a loaded host stalled it at its barrier (decode 1.5x faster single-threaded on the 2-vCPU VM).
SINGLE_THREAD_MAX_TOKENS = 64


@contextmanager
def torch_threads_for_step(num_tokens: int) -> Iterator[None]:
    """torch's ops on one thread while a step of at most SINGLE_THREAD_MAX_TOKENS tokens runs (nested: no-op)."""
    caller_threads = torch.get_num_threads()
    single = num_tokens <= SINGLE_THREAD_MAX_TOKENS and caller_threads != 1
    if single:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if single:
            torch.set_num_threads(caller_threads)


def dropped_masks(chunks: list[SequenceChunk]) -> list[torch.Tensor | None]:
    """Each chunk's bool [C] of dropped keys over its context (None where it has none): its mask, False past it
    and at the positions this step computes (their KV is being written now)."""
    out: list[torch.Tensor | None] = []
    for chunk in chunks:
        if chunk.dropped is None:
            out.append(None)
            continue
        end = chunk.start_pos + len(chunk.token_ids)
        mask = torch.zeros(end, dtype=torch.bool)
        n = min(chunk.dropped.shape[0], chunk.start_pos)
        mask[:n] = chunk.dropped[:n]
        out.append(mask)
    return out


class ModelRunner:
    def __init__(self, model: MoEDecoderModel, num_blocks: int, block_size: int, kv_dtype: torch.dtype | None = None):
        """kv_dtype: the caches' dtype (default: the model's compute dtype; keys and values are rounded to it as
        they are written and read back in the compute dtype)."""
        self.model, self.num_blocks, self.block_size = model, num_blocks, block_size
        self.kv_dtype = kv_dtype = kv_dtype or model.dtype
        shape = model.kv_cache_shape(num_blocks, block_size)
        placed = model.device_placement  # a layer whose attention runs on the accelerator has its cache there
        self.kv_caches = [placed.accel.empty(shape, kv_dtype, f"kv cache.{i}").zero_()
                          if placed is not None and placed.attention[i] else torch.zeros(shape, dtype=kv_dtype)
                          for i in range(model.config.num_layers)]

    @staticmethod
    def blocks_for_memory(model: MoEDecoderModel, kv_cache_bytes: int, block_size: int,
                          kv_dtype: torch.dtype | None = None) -> int:
        """How many whole KV blocks fit in kv_cache_bytes (0 when not one does)."""
        return kv_cache_bytes // (model.kv_bytes_per_token(kv_dtype) * block_size)

    def forward(self, chunks: list[SequenceChunk], all_logits: bool = False) -> torch.Tensor:
        """-> logits [S, V] for the last new token of each chunk (or [T, V] for every token) in float32."""
        bs = self.block_size
        token_ids, positions, slots, query_lens, seq_lens = [], [], [], [], []
        max_blocks = max(len(c.block_table) for c in chunks)
        for s, chunk in enumerate(chunks):
            n, end = len(chunk.token_ids), chunk.start_pos + len(chunk.token_ids)
            if -(-end // bs) > len(chunk.block_table):
                raise ValueError(f"sequence {s}: {end} tokens need {-(-end // bs)} blocks, "
                                 f"block table has {len(chunk.block_table)}")
            token_ids += chunk.token_ids
            pos = range(chunk.start_pos, end)
            positions += pos
            slots += [chunk.block_table[p // bs] * bs + p % bs for p in pos]
            query_lens.append(n)
            seq_lens.append(end)
        # one tensor for the whole table (a decode step builds this metadata once for every layer: few torch calls)
        block_tables = torch.tensor([c.block_table + [0] * (max_blocks - len(c.block_table)) for c in chunks],
                                    dtype=torch.long)  # [S, max_blocks]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long), block_tables=block_tables,
            query_lens=query_lens, seq_lens=seq_lens, block_size=bs,
            dropped=dropped_masks(chunks) if any(c.dropped is not None for c in chunks) else None,
        )
        logits_indices = None  # every token's logits: also each sequence's last when every one has a single token
        if not all_logits and len(token_ids) != len(chunks):
            logits_indices = torch.tensor(query_lens, dtype=torch.long).cumsum(0) - 1  # last token of each
        with torch_threads_for_step(len(token_ids)):
            return self.model.forward(torch.tensor(token_ids, dtype=torch.long),
                                      torch.tensor(positions, dtype=torch.long), meta, self.kv_caches, logits_indices)
