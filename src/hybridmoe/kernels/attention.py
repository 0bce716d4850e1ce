"""Paged decode attention on the C++ kernels: one query token per sequence against its context in the paged KV
cache, read in place through the block table (no gather, no copy), the query heads of a group sharing their KV head
(no repeat), online softmax in float32, multi-threaded over (sequence, KV head) on the kernels' pool.

`decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)`:
  q [S, N, D]; k_cache [NB, BS, Nk, D] and v_cache [NB, BS, Nk, Dv] in float32, bfloat16 or float16 (views with
  any strides but a contiguous last dim: GQA's cache[0] / cache[1], or MLA's latent cache as K and its first L
  columns as V, one shared KV head); block_tables [S, max_blocks] int32/int64; seq_lens [S] int32/int64 (each
  sequence's context, the query being its last position) -> [S, N, Dv] in q's dtype (or into `out`).
  Query head h reads KV head h // (N / Nk), as repeat_interleave would pair them. `window` > 0: only the last
  `window` keys (Mixtral's sliding window).

Legend: S sequences, N query heads, Nk KV heads, D key dim, Dv value dim, NB blocks, BS block size.
"""

from __future__ import annotations

import torch
from torch.utils.dlpack import to_dlpack

from hybridmoe.kernels import _native


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, window: int | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """-> out [S, N, Dv] (blocking; checks shapes, dtypes and block ids, ValueError naming the argument)."""
    if out is None:
        out = q.new_empty((q.shape[0], q.shape[1], v_cache.shape[-1]))
    _native.decode_attention(to_dlpack(q), to_dlpack(k_cache), to_dlpack(v_cache), to_dlpack(block_tables),
                             to_dlpack(seq_lens), to_dlpack(out), scale, window or 0)
    return out
