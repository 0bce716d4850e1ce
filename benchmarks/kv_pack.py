"""SpectrumKV payload sizes and pack/unpack rates on the KV layouts of large models (their packaged configs).

For each model (DeepSeek-V3: MLA, 576 values per token and layer; Qwen3-30B-A3B: GQA, 4 kv heads x 128 x K/V)
and budget, the payload bytes of a prompt of --tokens tokens (header, tier map and every layer's segment, scales
included) against its 16-bit KV, and the time to pack and to unpack one layer of random KV rows (best of
--repeats), as GB/s of 16-bit KV handled. Packing here is torch on the CPU (quantise, gather, copy into bytes).

Run: python benchmarks/kv_pack.py [--tokens 4096] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import hybridmoe.placement as placement
from hybridmoe.config import load_config
from hybridmoe.kv import payload as P
from hybridmoe.kv.allocation import LADDER_3, Tier, allocate, tier_counts
from hybridmoe.kv.importance import position_importance
from hybridmoe.kv.layout import KVLayout

MODELS = ("deepseek-v3", "qwen3-30b-a3b")
CASES = ((0.3, LADDER_3), (0.5, LADDER_3), (0.75, LADDER_3), (0.3, (Tier.FULL,)))


def payload_bytes(layout: KVLayout, n: int, budget: float, ladder) -> int:
    counts = tier_counts(n, budget, ladder)
    seg = P.SegmentLayout(tuple(counts[:3]), layout.row_width, layout.num_groups, 2)
    head = 1024  # the header and prefix, rounded up (a few hundred bytes)
    return head + P._align(-(-n // 4)) + layout.num_layers * seg.segment_bytes


def time_layer(layout: KVLayout, n: int, budget: float, ladder, repeats: int) -> tuple[float, float]:
    one = KVLayout(layout.kind, 1, layout.group_widths)
    rows = torch.randn(n, one.row_width)
    tiers = allocate(position_importance(n), budget, ladder)
    pack = unpack = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        writer = P.PayloadWriter(one, tiers, model="bench", ladder=ladder)
        data = writer.head() + writer.pack_layer(0, rows)
        pack = min(pack, time.perf_counter() - start)
        start = time.perf_counter()
        P.unpack(data)
        unpack = min(unpack, time.perf_counter() - start)
    full = one.full_bytes(n)
    return full / pack / 1e9, full / unpack / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    data = Path(placement.__file__).parent / "data" / "models"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.tokens} tokens")
    print(f"{'model':<15}{'ladder':<16}{'b':>6}{'16-bit MB':>11}{'payload MB':>12}{'real b':>8}"
          f"{'pack GB/s':>11}{'unpack GB/s':>13}")
    for name in MODELS:
        layout = KVLayout.from_config(load_config(data / name))
        full = layout.full_bytes(args.tokens)
        for budget, ladder in CASES:
            size = payload_bytes(layout, args.tokens, budget, ladder)
            pack, unpack = time_layer(layout, args.tokens, budget, ladder, args.repeats)
            label = "/".join(P.TIER_NAMES[t] for t in ladder)
            print(f"{name:<15}{label:<16}{budget:>6.2f}{full / 1e6:>11.1f}{size / 1e6:>12.1f}{size / full:>8.3f}"
                  f"{pack:>11.2f}{unpack:>13.2f}")


if __name__ == "__main__":
    main()
