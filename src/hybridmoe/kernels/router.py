"""The MoE router's choice on the C++ kernels: from a layer's gate logits to each token's experts and weights in one
call (softmax or sigmoid scores, DeepSeek's correction bias and group-limited choice, top-k, normalisation, the
routed scaling factor), where torch takes six to ten ops, each a dispatch costing more than its arithmetic at one
token.

Legend: T tokens, E experts, K experts a token.
"""

from __future__ import annotations

import torch
from torch.utils.dlpack import to_dlpack

from hybridmoe.kernels import _native


def applies(logits: torch.Tensor) -> bool:
    """Whether the kernel routes these logits [T, E] (else torch does: other devices or dtypes)."""
    return logits.is_cpu and logits.dtype == torch.float32 and logits.is_contiguous()


def route(logits: torch.Tensor, k: int, *, sigmoid: bool, bias: torch.Tensor | None = None, groups: int = 1,
          topk_groups: int = 1, normalize: bool, norm_eps: float = 0.0,
          scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] float32 -> (ids [T, K] int64, descending by the choice, ties to the lower id; weights [T, K]
    float32). With bias [E] (float32), experts are chosen by score + bias and weighted by score."""
    ids = torch.empty(logits.shape[0], k, dtype=torch.int64)
    weights = logits.new_empty((logits.shape[0], k))  # float32, as the logits
    _native.route(to_dlpack(logits), k, sigmoid, to_dlpack(bias) if bias is not None else None, groups, topk_groups,
                  normalize, norm_eps, scale, to_dlpack(ids), to_dlpack(weights))
    return ids, weights
