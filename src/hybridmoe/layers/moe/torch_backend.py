"""The plain-torch ExpertBackend: routed experts grouped by expert (one matmul per active expert).

It runs wherever its weights live: on the host it is the reference the CPU kernels are checked against, on the
accelerator it computes the experts resident there (hot experts, streamed slots). It computes in the hidden states'
dtype (the model's compute dtype). FP8 and int4/int8 experts are dequantised per call (accel.dequant, exact), only
for the experts that tokens were routed to.

Legend: T tokens, H hidden, K top-k, I expert intermediate, A (token, expert) assignments = T*K.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridmoe.accel.dequant import dequantize
from hybridmoe.layers.moe.backend import ExpertWeights


class TorchExpertBackend:
    def __init__(self, weights: ExpertWeights):
        self.w = weights

    def submit(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """hidden [T, H], topk_ids [T, K], topk_weights [T, K] -> computed at once; the handle is the output."""
        num_tokens, top_k = topk_ids.shape
        flat_ids = topk_ids.reshape(-1)  # [A]
        order = flat_ids.argsort(stable=True)  # assignments sorted by expert
        token_of = order // top_k  # [A] token row of each sorted assignment
        counts = torch.bincount(flat_ids, minlength=self.w.num_experts).tolist()
        dtype = hidden.dtype
        weights = topk_weights.reshape(-1)[order].to(dtype)  # [A]
        x = hidden
        out = torch.zeros(num_tokens, x.shape[1], dtype=dtype, device=x.device)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = token_of[start:start + count]
            gate, up, down = self._expert(expert, dtype)
            h = F.silu(F.linear(x[rows], gate)) * F.linear(x[rows], up)  # [n, I]
            out.index_add_(0, rows, F.linear(h, down) * weights[start:start + count, None])
            start += count
        return out

    def wait(self, handle: torch.Tensor) -> torch.Tensor:
        return handle

    def _expert(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        w = self.w
        if w.fmt not in ("dense", "fp8", "int4", "int8"):
            raise ValueError(f"TorchExpertBackend: unsupported expert weight format {w.fmt!r}")
        scales = (w.gate_scale, w.up_scale, w.down_scale) if w.gate_scale is not None else (None, None, None)
        cols = (w.hidden_size, w.hidden_size, w.intermediate_size)
        return tuple(dequantize(w.fmt, q[e], s[e] if s is not None else None, k, dtype, w.block_size)
                     for q, s, k in zip((w.gate, w.up, w.down), scales, cols))
