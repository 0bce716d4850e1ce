"""A worker rank (`python -m hybridmoe.parallel.worker`, started by group.RankGroup): it maps its share of every
MoE layer's routed experts (views of the memory-mapped checkpoint), joins the process group, then serves rank 0's
dispatches (exchange.py), streaming its share of each layer into its accelerator, until told to stop. It exits by
itself when its engine process is gone (a parent watchdog; a closed connection also ends a pending receive).

Legend: n tokens sent to this rank, H hidden, K top-k.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

from hybridmoe.parallel.exchange import (COPY_CODES, HEADER_SIZE, OP_COMPUTE, OP_STATS, OP_STOP, TAG_HEADER,
                                         TAG_HIDDEN, TAG_IDS, TAG_OUTPUT, TAG_STATS, TAG_WEIGHTS)

IDLE_TIMEOUT = datetime.timedelta(days=365)  # between prefills a worker waits for its next header indefinitely


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--prefix", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--device", choices=("cpu", "cuda"), required=True)
    p.add_argument("--timeout", type=float, required=True)
    p.add_argument("--startup-timeout", type=float, required=True)
    p.add_argument("--parent", type=int, required=True)
    p.add_argument("--threads", type=int)
    p.add_argument("--budget", type=int)
    p.add_argument("--staging", type=int, required=True)
    p.add_argument("--overlap", choices=("auto", "on", "off"), default="auto")
    args = p.parse_args(argv)
    _watch_parent(args.parent)
    if args.threads:
        torch.set_num_threads(args.threads)
    store = dist.TCPStore("127.0.0.1", args.port, args.world_size, False,
                          timeout=datetime.timedelta(seconds=args.startup_timeout))
    try:
        share, accel, hidden_size = _load(args)
    except Exception:  # reported to rank 0, which raises it as the engine's error
        store.set(f"{args.prefix}error/{args.rank}", traceback.format_exc(limit=4))
        return 1
    store.set(f"{args.prefix}loaded/{args.rank}", "1")
    pg = _process_group(args, dist.PrefixStore(args.prefix, store), IDLE_TIMEOUT)
    try:
        serve(pg, share, hidden_size, accel.device, getattr(torch, args.dtype),
              datetime.timedelta(seconds=args.timeout))
    finally:
        share.close()
    return 0


def serve(pg, share, hidden_size: int, device: torch.device, dtype: torch.dtype,
          timeout: datetime.timedelta) -> None:
    """Answer rank 0's dispatches until OP_STOP: receive the tokens, stream and compute this rank's experts of the
    layer (share: a ShareStreamer), send the partial output back."""
    comm = device if pg.name().lower() == "nccl" else torch.device("cpu")
    while True:
        head = torch.empty(HEADER_SIZE, dtype=torch.int64, device=comm)
        pg.recv([head], 0, TAG_HEADER).wait(IDLE_TIMEOUT)
        op, layer, n, top_k, copy = head.tolist()
        if op == OP_STOP:
            return
        if op == OP_STATS:
            s = share.stats()
            figures = [s.passes, s.bytes, s.copy_s, s.last_pass_bytes]
            pg.send([torch.tensor(figures, dtype=torch.float64, device=comm)], 0, TAG_STATS).wait(timeout)
            continue
        if op != OP_COMPUTE:
            raise RuntimeError(f"unknown message {op} from rank 0")
        hidden = torch.empty(n, hidden_size, dtype=dtype, device=comm)
        ids = torch.empty(n, top_k, dtype=torch.int32, device=comm)
        weights = torch.empty(n, top_k, dtype=torch.float32, device=comm)
        if n:
            for tensor, tag in ((hidden, TAG_HIDDEN), (ids, TAG_IDS), (weights, TAG_WEIGHTS)):
                pg.recv([tensor], 0, tag).wait(timeout)
        # every layer runs, with or without tokens: the streamer's pass goes through the layers in order
        out = share.run(layer, hidden.to(device), ids.to(device), weights.to(device), COPY_CODES[copy])
        if n:
            pg.send([out.to(comm)], 0, TAG_OUTPUT).wait(timeout)


def _load(args):
    from hybridmoe.accel.accelerator import select_accelerator
    from hybridmoe.config import load_config
    from hybridmoe.parallel.share import ShareStreamer, load_share

    device = f"cuda:{args.rank}" if args.device == "cuda" else "cpu"
    if args.device == "cuda":
        torch.cuda.set_device(args.rank)
    accel = select_accelerator(device, args.budget)
    config = load_config(args.model)
    layers = load_share(args.model, config, args.rank, args.world_size, getattr(torch, args.dtype))
    overlap = {"auto": None, "on": True, "off": False}[args.overlap]
    share = ShareStreamer(layers, accel, args.staging, f"ep{args.rank}", overlap)
    return share, accel, config.hidden_size


def _process_group(args, store, timeout: datetime.timedelta):
    if args.device == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, args.rank, args.world_size, options)
    return dist.ProcessGroupGloo(store, args.rank, args.world_size, timeout)


def _watch_parent(parent: int) -> None:
    """Exit when the engine process is gone (this process is then re-parented)."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="hybridmoe-ep-parent").start()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:
        traceback.print_exc()
        os._exit(1)  # not sys.exit: a blocked gloo thread must not keep a dead worker alive
