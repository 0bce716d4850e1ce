"""`bench costmodel`'s stream-loading prefill cases on the accelerator this machine has (CUDA, else the CPU stand-in).

For a Qwen3-MoE-shaped model (SLP_SHAPE, SLP_LAYERS layers, random bf16 weights) and chunks of SLP_CHUNKS tokens,
each case times the routed-expert half of a prefill chunk under stream-loading: every MoE layer's experts copied
into two device slots and computed there, through the engine's own `StreamPrefill` (the MoE blocks' prefill
backends, called as the blocks call them), copies overlapped with compute (on the stand-in: the copy thread copies
while the caller computes). Both copy variants: whole layers prefetched ("all") and the activated experts once
routed ("activated").

The prediction is the planner's: the "experts" units of `passes._slp_moe_units` for the chunk (the same routing
counts, the planner's routing pass) scheduled by `schedule.run` over two slots, on a CostModel whose accelerator
is this one as measured in the same round, in isolation: its copy bandwidth (each layer copied alone, nothing
computing) and its grouped-matmul rate (each layer computed alone, its experts already in the slot). So the case
checks the planner's model of the SLP schedule (which copies overlap which compute, what waits for the router,
when slots free up) against the engine's, with the two rates it needs fed from this machine. Rounds alternate
the isolated and the overlapped measurements, as the host's speed drifts.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from hybridmoe.accel.accelerator import select_accelerator

SLP_SHAPE = dict(vocab_size=4096, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=384,
                 num_attention_heads=8, num_key_value_heads=2, head_dim=128, num_experts=64, num_experts_per_tok=8)
SLP_LAYERS = 4
SLP_CHUNKS = (32, 512)


class SlpCase:
    """The model's MoE blocks and a fixed routing per chunk size (hidden states of the compute dtype)."""

    def __init__(self, model_dir: Path, dtype: torch.dtype):
        from hybridmoe.layers.moe.block import MoEBlock
        from hybridmoe.models.loader import load_model

        self.model = load_model(model_dir, dtype, show_progress=False)
        self.blocks = [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoEBlock)]
        self.dtype = dtype
        gen = torch.Generator().manual_seed(2)
        H = self.model.config.hidden_size
        self.inputs = {}
        for chunk in SLP_CHUNKS:
            per_layer = []
            for block in self.blocks:
                x = torch.randn(chunk, H, generator=gen).to(dtype)
                ids, weights = block.router.route(x)
                per_layer.append((x, ids, weights))
            self.inputs[chunk] = per_layer

    def counts(self, chunk: int) -> list[list[int]]:
        E = self.model.config.moe.num_experts
        return [torch.bincount(ids.flatten(), minlength=E).tolist() for _, ids, _ in self.inputs[chunk]]

    def isolated(self, chunk: int, copy: str) -> tuple[float, float, int]:
        """(copy seconds, compute seconds, bytes) of every layer copied alone, then computed alone."""
        from hybridmoe.layers.moe.stream_prefill import ExpertStreamer, expert_weights_of

        accel = select_accelerator()
        streamer = ExpertStreamer([expert_weights_of(b) for b in self.blocks], accel, overlap=False)
        compute_s = 0.0
        try:
            streamer.begin_pass()
            for layer, (x, ids, weights) in enumerate(self.inputs[chunk]):
                streamer.load(layer, torch.unique(ids).tolist() if copy == "activated" else None)
                streamer.drain()  # (a layer over a slot copies its later splits inside run)
                start = time.perf_counter()
                streamer.run(layer, x, ids, weights)
                accel.synchronize()
                compute_s += time.perf_counter() - start
            stats = streamer.stats()
        finally:
            streamer.close()
        return stats.copy_s, compute_s, stats.bytes

    def overlapped(self, chunk: int, copy: str) -> tuple[float, float]:
        """(seconds of the routed-expert half of the chunk under stream-loading, achieved copy GB/s meanwhile)."""
        from hybridmoe.layers.moe.stream_prefill import StreamPrefill

        accel = select_accelerator()
        slp = StreamPrefill(self.model, accel, min_tokens=1, copy=copy, overlap=True)
        try:
            accel.synchronize()
            start = time.perf_counter()
            for block, (x, ids, weights) in zip(self.blocks, self.inputs[chunk]):
                backend = block.prefill_experts
                backend.wait(backend.submit(x, ids, weights))
            accel.synchronize()
            seconds = time.perf_counter() - start
            gbs = slp.stats().last_pass_gbs
        finally:
            slp.detach()
        return seconds, gbs


def stand_in_share(ranks: int, cores: int | None = None, threads: int | None = None) -> tuple[float, bool]:
    """On the CPU stand-in, where `ranks` ranks of `threads` compute threads (default torch's) and one copy thread
    each run on `cores` CPUs (default this process's): the share of the host's measured rates a rank gets, and
    whether its copies overlap its compute (only with a core free for every copy thread; a GPU's copy engine
    always does). Load from other jobs is not modelled: it takes the spare core the overlap needs."""
    cores = cores or len(os.sched_getaffinity(0))
    threads = threads or torch.get_num_threads()
    return min(1.0, cores / (ranks * threads)), ranks * (threads + 1) <= cores


def predict(config, chunk: int, copy: str, counts: list[list[int]], copy_gbs: float, compute_s: float,
            stand_in: bool | None = None, cores: int | None = None, threads: int | None = None):
    """The planner's schedule of the experts units of one chunk on an accelerator with this copy bandwidth and
    a grouped-matmul rate that computes this chunk's experts in `compute_s` (all layers); on the stand-in, copies
    overlap compute as stand_in_share(1, cores, threads) says."""
    from hybridmoe.placement import hardware
    from hybridmoe.placement.costmodel import CostModel
    from hybridmoe.placement.modelspec import ModelSpec
    from hybridmoe.placement.passes import PassBuilder, Residency
    from hybridmoe.placement.routing import RoutingStats
    from hybridmoe.placement.schedule import copies_overlap, run

    stand_in = not torch.cuda.is_available() if stand_in is None else stand_in
    spec = ModelSpec(config)
    moe_layers = tuple(l.index for l in spec.moe_layers)
    pairs = chunk * spec.top_k * len(moe_layers)
    tflops = 2.0 * spec.moe_layers[0].expert * pairs / compute_s / 1e12
    table = [(1.0, tflops), (1e6, tflops)]
    gpu = hardware.GpuSpec(name="stand-in", description="the CPU standing in, as measured in this round",
                           memory_gb=1e3, reserved_gb=0.0, memory_gbs=1e6, memory_efficiency=1.0,
                           peak_tflops={"fp32": tflops, "bf16": tflops}, matmul_efficiency=1.0, h2d_gbs=copy_gbs,
                           d2h_gbs=copy_gbs, link_latency_us=1.0,
                           stand_in=stand_in, matmul_table={"fp32": table, "bf16": table})
    cpu = replace(hardware.reference_profile("desktop-2ch").cpu, memory_read_gbs=1e6)  # never caps the link
    routing = RoutingStats.from_counts(moe_layers, np.array(counts), spec.top_k)
    cost = CostModel(hardware.Machine("stand-in", cpu, gpu), spec, routing=routing)
    builder = PassBuilder(cost, Residency.all_but_experts(len(spec.layers), len(moe_layers)))
    slot = max(cost.layer_expert_bytes(l) for l in moe_layers)
    units = [u for u in builder.prefill_units("slp", chunk, 0, last=False, slot_bytes=slot,
                                              activated_only=copy == "activated") if u.name == "experts"]
    return run(units, buffers=2, overlap=copies_overlap(gpu) or stand_in_share(1, cores, threads)[1])


def slp_rows(model_dir: Path, dtype: torch.dtype, rounds: int, threads: int, log=print) -> list[dict]:
    case = SlpCase(model_dir, dtype)
    rows = []
    for chunk in SLP_CHUNKS:
        counts = case.counts(chunk)
        for copy in ("all", "activated"):
            results, loads = [], []
            for r in range(rounds):
                loads.append(os.getloadavg()[0])
                copy_s, compute_s, nbytes = case.isolated(chunk, copy)
                measured, achieved = case.overlapped(chunk, copy)
                timeline = predict(case.model.config, chunk, copy, counts, nbytes / copy_s / 1e9, compute_s)
                results.append(dict(predicted_s=timeline.total_s, measured_s=measured, copy_gbs=nbytes / copy_s / 1e9,
                                    achieved_copy_gbs=achieved, compute_s=compute_s, copy_s=copy_s, bytes=nbytes))
                log(f"slp({chunk}, copy {copy}) round {r + 1}/{rounds}: predicted {timeline.total_s:.4f} s, "
                    f"measured {measured:.4f} s (copy alone {copy_s:.4f} s, compute alone {compute_s:.4f} s)")
            ranked = sorted(results, key=lambda x: x["predicted_s"])
            mid = ranked[(len(ranked) - 1) // 2]
            measured = statistics.median(x["measured_s"] for x in results)
            parts = {"host": 0.0, "attention": 0.0, "dense": 0.0, "moe": mid["predicted_s"], "lm_head": 0.0}
            rows.append({"name": f"{model_dir.name} slp({chunk}, copy {copy}, experts only)",
                         "predicted_s": mid["predicted_s"], "measured_s": measured,
                         "ratio": mid["predicted_s"] / measured, "threads": threads, "load_average_1min": loads,
                         "predicted_parts_s": parts, "bytes_streamed": mid["bytes"], "copy_gbs": mid["copy_gbs"],
                         "compute_s": mid["compute_s"], "rounds": results})
    return rows
