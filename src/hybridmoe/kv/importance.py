"""How much each prompt token matters to the tokens that come after it, for choosing its precision tier.

Attention importance (SnapKV-style): the attention mass each prompt token receives from a window of the last
`window` prompt queries, summed over those queries, averaged over heads and layers, max-pooled over a small
neighbourhood (a needle's neighbours keep its context), with the first `sinks` tokens (attention sinks) and
the window itself pinned to the top. `AttentionImportance` is an observer for
`MoEDecoderModel.add_attention_observer`: it sees each layer's queries and context keys during prefill and
keeps only one [C] vector per layer. The softmax runs over key chunks (a running max and sum first, then the
normalised mass), so no [window, C] matrix wider than one chunk exists at once, let alone a full [C, C] one.

Position importance (the paper's heuristic, I_j = exp(-lambda (n - j)) with the sinks pinned): recency alone;
its ranking does not depend on lambda.

Legend: n prompt tokens, C context keys, w window queries, N query heads, Nk key heads, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SINKS = 4
WINDOW = 32
POOL = 7
KEY_CHUNK = 1024  # keys per chunk at least
CHUNK_BYTES = 16 << 20  # a chunk's float32 logits [N, w, keys] may take this much (more keys when N w is small)


def window_attention_mass(q: torch.Tensor, k: torch.Tensor, scale: float,
                          key_chunk: int | None = None) -> torch.Tensor:
    """q [w, N, D] (the queries of the last w context positions), k [C, Nk, D] -> float32 [C] on the host:
    attention mass each key receives, summed over the w causal queries, averaged over the N heads (computed where
    q and k are). Keys in chunks of key_chunk (default: KEY_CHUNK, or as many as CHUNK_BYTES of logits hold); a
    context of one chunk is one softmax, longer ones take two passes (running max and sum, then the mass)."""
    w, heads, dim = q.shape
    ctx, kv_heads = k.shape[0], k.shape[1]
    if key_chunk is None:
        key_chunk = max(KEY_CHUNK, CHUNK_BYTES // (4 * w * heads))
    group = heads // kv_heads
    qg = q.float().view(w, kv_heads, group, dim)
    device = q.device
    q_pos = torch.arange(ctx - w, ctx, device=device)[:, None]  # [w, 1]

    def logits(start: int) -> torch.Tensor:  # [Nk, g, w, c] for keys start .. start + c
        kc = k[start: start + key_chunk].float()
        out = torch.einsum("wkgd,ckd->kgwc", qg, kc).mul_(scale)
        first = max(0, ctx - w + 1 - start)  # only the last w - 1 keys lie in some query's future
        if first < kc.shape[0]:
            future = torch.arange(start + first, start + kc.shape[0], device=device)[None, :] > q_pos  # [w, c']
            out[..., first:].masked_fill_(future, float("-inf"))
        return out

    if ctx <= key_chunk:  # one chunk: its logits once, no running max and sum
        return logits(0).softmax(-1).sum(2).mean((0, 1)).cpu()
    run_max = torch.full((kv_heads, group, w, 1), float("-inf"), device=device)
    run_sum = torch.zeros(kv_heads, group, w, 1, device=device)
    for start in range(0, ctx, key_chunk):
        chunk = logits(start)
        new_max = torch.maximum(run_max, chunk.amax(-1, keepdim=True))
        run_sum = run_sum * (run_max - new_max).exp() + (chunk - new_max).exp().sum(-1, keepdim=True)
        run_max = new_max
    log_norm = run_max + run_sum.log()
    mass = torch.empty(ctx, device=device)
    for start in range(0, ctx, key_chunk):
        chunk = logits(start)
        mass[start: start + chunk.shape[-1]] = (chunk - log_norm).exp().sum(2).mean((0, 1))
    return mass.cpu()


class AttentionImportance:
    """Observer (layer, seq, q, k, scale) accumulating attention importance of sequence `seq`'s n-token prompt.

    Uses the forward in which the prompt's last token is computed (C == n) and that forward's last
    min(window, Q) queries; attach it for the prefill and call `scores()` afterwards."""

    def __init__(self, num_tokens: int, window: int = WINDOW, seq: int = 0, key_chunk: int | None = None):
        self.num_tokens, self.window, self.seq, self.key_chunk = num_tokens, window, seq, key_chunk
        self.per_layer: dict[int, torch.Tensor] = {}
        self.window_used = 0

    def __call__(self, layer: int, seq: int, q: torch.Tensor, k: torch.Tensor, scale: float) -> None:
        if seq != self.seq or k.shape[0] != self.num_tokens:
            return
        w = min(self.window, q.shape[0])
        self.window_used = w
        self.per_layer[layer] = window_attention_mass(q[-w:], k, scale, self.key_chunk)

    def raw(self) -> torch.Tensor:
        """Mean over the observed layers [n] (before pooling and pinning)."""
        if not self.per_layer:
            raise RuntimeError("no attention observed for the prompt's last token: attach the observer to the "
                               "prefill forward")
        return torch.stack(list(self.per_layer.values())).mean(0)

    def scores(self, sinks: int = SINKS, pool: int = POOL, pin_window: bool = True) -> torch.Tensor:
        return finalize(self.raw(), sinks, pool, self.window_used if pin_window else 0)


def finalize(raw: torch.Tensor, sinks: int = SINKS, pool: int = POOL, pinned_last: int = 0) -> torch.Tensor:
    """raw [n] -> importance [n]: max-pooled over `pool` neighbours, the first `sinks` tokens pinned to the top
    (+inf), then the last `pinned_last` tokens (just below the sinks)."""
    scores = raw.float()
    if pool > 1:
        scores = F.max_pool1d(scores[None, None], pool, stride=1, padding=pool // 2)[0, 0][: raw.shape[0]]
    scores = scores.clone()
    if pinned_last:
        scores[-pinned_last:] = torch.finfo(torch.float32).max
    scores[:sinks] = float("inf")
    return scores


def position_importance(num_tokens: int, sinks: int = SINKS) -> torch.Tensor:
    """The paper's exp(-lambda (n - j)) as its ranking: later tokens higher, the first `sinks` on top."""
    scores = torch.arange(num_tokens, dtype=torch.float32)
    scores[:sinks] = float("inf")
    return scores
