"""`bench costmodel`'s 2-rank expert-parallel case (`--cases ep`) on the CPU stand-in (or CUDA devices).

On the stream-loading case's Qwen3-MoE-shaped model (bench/_slp_case.py: SLP_SHAPE, SLP_LAYERS layers), the
routed-expert half of a prefill chunk of EP_CHUNK tokens runs through the engine's expert parallelism
(hybridmoe.parallel: the engine process and one worker rank it spawns, gloo between them on the stand-in): every
MoE block's `prefill_experts` called as the block calls it, each rank streaming its half of every layer's experts
(whole layers prefetched, copies beside compute) and computing it, tokens sent to the worker and its partial
outputs back.

The prediction is the planner's: the experts, dispatch and combine units of `passes._slp_moe_units` for two GPUs
with parallel="rank0" (the exchange the engine runs), scheduled by `schedule.run` over two slots, on a CostModel
whose accelerator is this one as measured in the same round, in isolation: its copy bandwidth and grouped-matmul
rate (the SLP case's measurement: each layer copied alone, then computed alone, on one rank) and the link between
the two ranks (a gloo ping-pong between this process and a helper process, of the size the exchange sends: tokens
x hidden in the compute dtype, latency included). The prediction never sees an exchange's timing.

Each round also streams the same chunk on one rank alone (the SLP case's engine path) next to the planner's
one-GPU schedule, so the row carries the 2-rank speedup, measured and predicted. On the stand-in both ranks, each
with its compute threads and a copy thread, share the host's cores: the prediction gives each rank its share of
the host's measured rates and overlaps its copies with compute only where a core is free for each copy thread
(`_slp_case.stand_in_share`), where real GPUs would each bring their own. The rows say the load average.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

EP_CHUNK = 512
EP_GPUS = 2
PING_REPEATS = 5


class EpCase:
    """The model loaded with expert parallelism attached, and a fixed routing of one chunk per MoE layer."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, threads: int):
        from hybridmoe.layers.moe.block import MoEBlock
        from hybridmoe.models.loader import load_model
        from hybridmoe.parallel.attach import attach_expert_parallel

        self.model = load_model(model_dir, dtype, show_progress=False)
        self.blocks = [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoEBlock)]
        gen = torch.Generator().manual_seed(2)
        H = self.model.config.hidden_size
        self.inputs = []
        for block in self.blocks:
            x = torch.randn(EP_CHUNK, H, generator=gen).to(dtype)
            ids, weights = block.router.route(x)
            self.inputs.append((x, ids, weights))
        self.ep = attach_expert_parallel(self.model, model_dir, EP_GPUS, min_tokens=1, copy="all", threads=threads,
                                         overlap=True)

    def counts(self) -> list[list[int]]:
        E = self.model.config.moe.num_experts
        return [torch.bincount(ids.flatten(), minlength=E).tolist() for _, ids, _ in self.inputs]

    def measure(self) -> float:
        """Seconds of the routed-expert half of the chunk over both ranks (every MoE layer, in order)."""
        start = time.perf_counter()
        for block, (x, ids, weights) in zip(self.blocks, self.inputs):
            backend = block.prefill_experts
            backend.wait(backend.submit(x, ids, weights))
        self.ep.accel.synchronize()
        return time.perf_counter() - start

    def tokens_sent(self) -> float:
        """Tokens per MoE layer that the worker gets (its share of the chunk's tokens, as routed)."""
        owner = self.ep.backends[min(self.ep.backends)].owner
        return statistics.mean(int((owner[ids] == 1).any(dim=1).sum()) for _, ids, _ in self.inputs)

    def close(self) -> None:
        self.ep.close()


def link_gbs(num_bytes: int, repeats: int = PING_REPEATS) -> float:
    """One-way GB/s of a `num_bytes` message between this process and a helper over gloo (a ping-pong: the
    message there and back, halved; best of `repeats`, latency included)."""
    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False, timeout=datetime.timedelta(seconds=120))
    child = subprocess.Popen([sys.executable, "-m", "hybridmoe.bench._ep_case", "--echo", str(store.port),
                              str(num_bytes), str(repeats + 1)])
    try:
        pg = dist.ProcessGroupGloo(store, 0, 2, datetime.timedelta(seconds=120))
        message = torch.ones(num_bytes, dtype=torch.uint8)
        back = torch.empty_like(message)
        best = float("inf")
        for _ in range(repeats + 1):  # the first warms the connection
            start = time.perf_counter()
            pg.send([message], 1, 1).wait()
            pg.recv([back], 1, 2).wait()
            best = min(best, time.perf_counter() - start)
        return num_bytes / (best / 2) / 1e9
    finally:
        child.wait(timeout=60)


def _echo(port: int, num_bytes: int, times: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=120))
    pg = dist.ProcessGroupGloo(store, 1, 2, datetime.timedelta(seconds=120))
    message = torch.empty(num_bytes, dtype=torch.uint8)
    for _ in range(times):
        pg.recv([message], 0, 1).wait()
        pg.send([message], 0, 2).wait()


def predict(config, counts: list[list[int]], copy_gbs: float, compute_s: float, p2p_gbs: float,
            stand_in: bool | None = None, cores: int | None = None, threads: int | None = None):
    """The planner's schedule of one GPU's experts, dispatch and combine units of the chunk for two GPUs with
    parallel="rank0": this copy bandwidth, a grouped-matmul rate that computes the whole chunk's experts (all
    layers, one GPU) in `compute_s`, and this GPU<->GPU link; on the stand-in, each rank's share of the host's
    rates and whether its copies overlap as stand_in_share(2, cores, threads) says."""
    from hybridmoe.bench._slp_case import stand_in_share
    from hybridmoe.placement import hardware
    from hybridmoe.placement.costmodel import CostModel
    from hybridmoe.placement.modelspec import ModelSpec
    from hybridmoe.placement.passes import PassBuilder, Residency
    from hybridmoe.placement.routing import RoutingStats
    from hybridmoe.placement.schedule import copies_overlap, run

    spec = ModelSpec(config)
    moe_layers = tuple(l.index for l in spec.moe_layers)
    pairs = EP_CHUNK * spec.top_k * len(moe_layers)
    tflops = 2.0 * spec.moe_layers[0].expert * pairs / compute_s / 1e12
    stand_in = not torch.cuda.is_available() if stand_in is None else stand_in
    share, overlap = stand_in_share(EP_GPUS, cores, threads) if stand_in else (1.0, True)
    tflops, copy_gbs = tflops * share, copy_gbs * share  # the ranks stand in on one host: they share its cores
    table = [(1.0, tflops), (1e6, tflops)]
    gpu = hardware.GpuSpec(name="stand-in", description="the CPU standing in, as measured in this round",
                           memory_gb=1e3, reserved_gb=0.0, memory_gbs=1e6, memory_efficiency=1.0,
                           peak_tflops={"fp32": tflops, "bf16": tflops}, matmul_efficiency=1.0, h2d_gbs=copy_gbs,
                           d2h_gbs=copy_gbs, link_latency_us=0.0, p2p_gbs=p2p_gbs, stand_in=stand_in,
                           matmul_table={"fp32": table, "bf16": table})
    cpu = replace(hardware.reference_profile("desktop-2ch").cpu, memory_read_gbs=1e6)  # never caps the link
    routing = RoutingStats.from_counts(moe_layers, np.array(counts), spec.top_k)
    cost = CostModel(hardware.Machine("stand-in", cpu, gpu, num_gpus=EP_GPUS), spec, routing=routing)
    builder = PassBuilder(cost, Residency.all_but_experts(len(spec.layers), len(moe_layers)))
    slot = max(cost.layer_expert_bytes(l) for l in moe_layers) / EP_GPUS
    units = [u for u in builder.prefill_units("slp", EP_CHUNK, 0, last=False, gpus=EP_GPUS, slot_bytes=slot,
                                              parallel="rank0") if u.name in ("experts", "dispatch", "combine")]
    return run(units, buffers=2, overlap=copies_overlap(gpu) or overlap)


def ep_rows(model_dir: Path, dtype: torch.dtype, rounds: int, threads: int, log=print) -> list[dict]:
    from hybridmoe.bench._slp_case import SlpCase
    from hybridmoe.bench._slp_case import predict as slp_predict
    from hybridmoe.placement.costmodel import ACTIVATION_BYTES

    isolated = SlpCase(model_dir, dtype)  # one rank's copy bandwidth and grouped-matmul rate, measured alone
    case = EpCase(model_dir, dtype, threads)
    results, loads = [], []
    try:
        counts = case.counts()
        item = torch.empty((), dtype=dtype).element_size()
        message = int(case.tokens_sent()) * case.model.config.hidden_size * item
        case.measure()  # warm-up: the worker's first pass
        for r in range(rounds):
            loads.append(os.getloadavg()[0])
            copy_s, compute_s, nbytes = isolated.isolated(EP_CHUNK, "all")
            # the planner counts hidden states in bf16 (ACTIVATION_BYTES); the wire carries the compute dtype
            p2p = link_gbs(message) * ACTIVATION_BYTES / item
            measured = statistics.median(case.measure() for _ in range(3))
            one_rank, _ = isolated.overlapped(EP_CHUNK, "all")  # the same chunk streamed by one rank alone
            copy_gbs = nbytes / copy_s / 1e9
            timeline = predict(case.model.config, counts, copy_gbs, compute_s, p2p)
            one_rank_predicted = slp_predict(case.model.config, EP_CHUNK, "all", counts, copy_gbs, compute_s)
            results.append(dict(predicted_s=timeline.total_s, measured_s=measured, copy_gbs=copy_gbs,
                                compute_s=compute_s, link_gbs=p2p * item / ACTIVATION_BYTES, message_bytes=message,
                                one_rank_predicted_s=one_rank_predicted.total_s, one_rank_measured_s=one_rank))
            log(f"ep({EP_CHUNK}, {EP_GPUS} ranks) round {r + 1}/{rounds}: predicted {timeline.total_s:.4f} s, "
                f"measured {measured:.4f} s; one rank: predicted {one_rank_predicted.total_s:.4f} s, measured "
                f"{one_rank:.4f} s (copy alone {copy_s:.4f} s, compute alone {compute_s:.4f} s, link "
                f"{results[-1]['link_gbs']:.2f} GB/s)")
        stats = case.ep.stream_stats()
    finally:
        case.close()
    ranked = sorted(results, key=lambda x: x["predicted_s"])
    mid = ranked[(len(ranked) - 1) // 2]
    measured = statistics.median(x["measured_s"] for x in results)
    parts = {"host": 0.0, "attention": 0.0, "dense": 0.0, "moe": mid["predicted_s"], "lm_head": 0.0}
    return [{"name": f"{model_dir.name} ep({EP_CHUNK}, {EP_GPUS} ranks, copy all, experts only)",
             "predicted_s": mid["predicted_s"], "measured_s": measured, "ratio": mid["predicted_s"] / measured,
             "threads": threads, "load_average_1min": loads, "predicted_parts_s": parts,
             "bytes_streamed_per_rank": [s.last_pass_bytes for s in stats], "copy_gbs": mid["copy_gbs"],
             "link_gbs": mid["link_gbs"], "compute_s": mid["compute_s"],
             "one_rank_predicted_s": statistics.median(x["one_rank_predicted_s"] for x in results),
             "one_rank_measured_s": statistics.median(x["one_rank_measured_s"] for x in results), "rounds": results}]


if __name__ == "__main__":  # the ping-pong helper of link_gbs
    p = argparse.ArgumentParser()
    p.add_argument("--echo", nargs=3, type=int, metavar=("PORT", "BYTES", "TIMES"), required=True)
    port, num_bytes, times = p.parse_args().echo
    _echo(port, num_bytes, times)
