"""A model's KV cache as rows: one row per token and layer, the concatenation of its quantisation groups.

GQA caches K and V per kv head ([2, num_blocks, block_size, Nk, D] per layer): a row is K's Nk heads then V's,
2 * Nk groups of D values. MLA caches one normalised latent and one rotated rope key per token
([num_blocks, block_size, L + R]): a row is those two groups, L and R values. Each group gets its own scale
when quantised (hybridmoe.kv.quant).

Legend: n tokens, W row width (values per token and layer), G groups per row.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

from hybridmoe.config import ModelConfig


@dataclass(frozen=True)
class KVLayout:
    kind: str  # "gqa" | "mla"
    num_layers: int
    group_widths: tuple[int, ...]  # values per quantisation group, in row order

    @staticmethod
    def from_config(config: ModelConfig) -> "KVLayout":
        att = config.attention
        if att.kind == "mla":
            groups = (att.kv_lora_rank, att.qk_rope_head_dim)
        elif att.kind == "gqa":
            groups = (att.head_dim,) * (2 * att.num_kv_heads)
        else:
            raise ValueError(f"no KV layout for attention kind {att.kind!r}")
        return KVLayout(att.kind, config.num_layers, groups)

    @property
    def row_width(self) -> int:
        return sum(self.group_widths)

    @property
    def num_groups(self) -> int:
        return len(self.group_widths)

    def full_bytes(self, num_tokens: int, element_bytes: int = 2) -> int:
        """Bytes of num_tokens tokens' KV, every layer, at element_bytes per value (2: FP16/BF16)."""
        return num_tokens * self.num_layers * self.row_width * element_bytes

    def to_json(self) -> dict:
        return {"kind": self.kind, "num_layers": self.num_layers, "group_widths": list(self.group_widths)}

    @staticmethod
    def from_json(d: dict) -> "KVLayout":
        return KVLayout(str(d["kind"]), int(d["num_layers"]), tuple(int(w) for w in d["group_widths"]))

    def rows_from_cache(self, cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One layer's paged cache, slots [n] long -> rows [n, W] (a copy, in the cache's dtype, on its device)."""
        slots = slots.to(cache.device)
        if self.kind == "gqa":
            kv = cache.flatten(1, 2)[:, slots]  # [2, n, Nk, D]
            return kv.permute(1, 0, 2, 3).reshape(slots.shape[0], self.row_width)
        return cache.flatten(0, 1)[slots]

    def rows_to_cache(self, cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Write rows [n, W] into one layer's paged cache at slots [n] (either may be on another device)."""
        n = slots.shape[0]
        slots, rows = slots.to(cache.device), rows.to(cache.device)
        if self.kind == "gqa":
            heads, dim = cache.shape[-2], cache.shape[-1]
            values = rows.view(n, 2, heads, dim).permute(1, 0, 2, 3).to(cache.dtype)  # [2, n, Nk, D]
            cache.flatten(1, 2).index_copy_(1, slots, values)
        else:
            cache.flatten(0, 1).index_copy_(0, slots, rows.to(cache.dtype))


def config_fingerprint(config: ModelConfig) -> str:
    """A short hash of the normalised config (the shapes a payload depends on)."""
    text = json.dumps(repr(config), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
