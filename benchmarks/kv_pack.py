"""SpectrumKV payload sizes and pack/unpack rates on the KV layouts of large models (their packaged configs).

For each model (DeepSeek-V3: MLA, 576 values per token and layer; Qwen3-30B-A3B: GQA, 4 kv heads x 128 x K/V)
and budget, the payload bytes of a prompt of --tokens tokens (header, tier map and every layer's segment, scales
included) against its 16-bit KV, and the time to pack and to unpack one layer of random KV rows (best of
--repeats), as GB/s of 16-bit KV handled. Packing here is torch on the CPU (quantise, gather, copy into bytes).

With --transfer, also the payload of DeepSeek-V3's layout (all layers, b = 0.3, packed beforehand) sent between
two processes over torch.distributed gloo on loopback: bytes and seconds as the receiver counts them (it
validates the head and receives each layer into its preallocated buffer; unpacking is timed above).

Run: python benchmarks/kv_pack.py [--tokens 4096] [--repeats 5] [--threads N] [--transfer]
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


def _transfer_rank(rank: int, port: int, tokens: int, out) -> None:
    import torch.distributed as dist

    from hybridmoe.kv.transfer import receive_payload, send_payload

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    data = Path(placement.__file__).parent / "data" / "models"
    layout = KVLayout.from_config(load_config(data / "deepseek-v3"))
    tiers = allocate(position_importance(tokens), 0.3, LADDER_3)
    if rank == 0:
        writer = P.PayloadWriter(layout, tiers, model="bench", ladder=LADDER_3)
        one = writer.pack_layer(0, torch.randn(tokens, layout.row_width))
        segments = [bytearray(one) for _ in range(layout.num_layers)]
        for i, seg in enumerate(segments):  # the same rows in every layer, each segment naming its layer
            P.SEGMENT_PREFIX.pack_into(seg, 0, i, P.SEGMENT_PREFIX.unpack_from(one)[1])
        dist.barrier()
        send_payload(writer.head(), segments, dst=1)
    else:
        dist.barrier()
        capacity = P.payload_capacity(layout, tokens, 0.3)
        _, _, stats = receive_payload(0, capacity=capacity, model="bench", layout=layout)
        out.put((stats.bytes, stats.seconds))
    dist.destroy_process_group()


def transfer(tokens: int) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_transfer_rank, args=(rank, port, tokens, out)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    sent, seconds = out.get(timeout=600)
    for proc in procs:
        proc.join()
    print(f"gloo loopback, deepseek-v3 layout, {tokens} tokens, b = 0.3: {sent / 1e6:.1f} MB in {seconds:.2f} s "
          f"= {sent / seconds / 1e9:.2f} GB/s (received into the preallocated buffer and validated; unpacking not included)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--transfer", action="store_true", help="also time a payload over gloo on loopback")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
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
    if args.transfer:
        transfer(args.tokens)


if __name__ == "__main__":
    main()
