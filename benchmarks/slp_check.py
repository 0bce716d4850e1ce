"""Stream-loading prefill and hybrid decode on this machine's accelerator, next to the cost model's predictions
(run by benchmarks/gpu_check.sh; on a machine without CUDA it runs on the CPU stand-in, with --small).

1. Pinned-copy bandwidth: the best of a few host -> device copies of one page-locked buffer.
2. A DeepSeek-V3-shaped slice: LAYERS MoE layers of real dimensions (256 experts of 7168 x 2048, FP8 e4m3 with
   128x128 float32 block scales; random bytes, one layer's experts shared by every layer of the slice, so that
   host memory holds one layer) streamed through the engine's ExpertStreamer for a prefill chunk of CHUNK tokens
   with uniform random routing (top-8): whole layers prefetched into two slots, copies overlapped with the
   grouped matmul (dequantised per expert on the device). Reported: SLP's achieved H2D throughput (bytes over the
   copies' own time on the copy stream) as a fraction of the pinned-copy bandwidth, the slice's prefill tok/s
   (experts half only), and the planner's prediction of the same schedule (bench/_slp_case.predict) fed with
   the pinned bandwidth and the grouped matmul's rate measured alone.
3. Hybrid decode tok/s of a model through the engine (EngineConfig device=cuda, the plan's placement) next to
   the plan's predicted decode tok/s.

Writes a JSON summary to --json. Usage: python benchmarks/slp_check.py --json OUT/slp.json [--small]
[--model DIR] [--layers 4] [--chunk 4096]
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import torch

from hybridmoe.accel.accelerator import Accelerator, select_accelerator
from hybridmoe.layers.moe.backend import ExpertWeights
from hybridmoe.layers.moe.stream_prefill import ExpertStreamer

DSV3 = dict(hidden=7168, inter=2048, experts=256, top_k=8)
SMALL = dict(hidden=512, inter=256, experts=16, top_k=4)


def sync(accel: Accelerator) -> None:
    accel.synchronize()


def pinned_bandwidth(accel: Accelerator, nbytes: int) -> float:
    """GB/s of a page-locked host buffer copied to the device (best of 5)."""
    host = torch.empty(nbytes, dtype=torch.uint8)
    host, _ = accel.pinned(host) if accel.is_cuda else (host, True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=accel.device)
    best = float("inf")
    for _ in range(5):
        sync(accel)
        start = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        sync(accel)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def fp8_layer(shape: dict, seed: int = 0) -> ExpertWeights:
    """One layer of random FP8 experts with block scales (bytes drawn as e4m3 values of moderate size)."""
    H, I, E = shape["hidden"], shape["inter"], shape["experts"]
    gen = torch.Generator().manual_seed(seed)

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=gen) * 0.5).to(torch.float8_e4m3fn)

    def scales(rows: int, cols: int) -> torch.Tensor:
        return torch.rand(-(-rows // 128), -(-cols // 128), generator=gen) * 0.02 + 0.01

    return ExpertWeights("fp8", [matrix(I, H) for _ in range(E)], [matrix(I, H) for _ in range(E)],
                         [matrix(H, I) for _ in range(E)], [scales(I, H) for _ in range(E)],
                         [scales(I, H) for _ in range(E)], [scales(H, I) for _ in range(E)])


def slice_pass(streamer: ExpertStreamer, inputs, layers: int, overlap_compute: bool = True) -> float:
    """Seconds of one prefill chunk's experts half: whole layers prefetched one ahead (StreamPrefill's "all")."""
    accel = streamer.accel
    sync(accel)
    start = time.perf_counter()
    streamer.begin_pass()
    streamer.load(0)
    if layers > 1:
        streamer.load(1)
    for layer in range(layers):
        x, ids, weights = inputs
        streamer.run(layer, x, ids, weights)
        if layer + 2 < layers:
            streamer.load(layer + 2)
    sync(accel)
    return time.perf_counter() - start


def slp_slice(accel: Accelerator, shape: dict, layers: int, chunk: int, dtype: torch.dtype) -> dict:
    weights = fp8_layer(shape)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(chunk, shape["hidden"], generator=gen).to(dtype).to(accel.device)
    ids = torch.stack([torch.randperm(shape["experts"], generator=gen)[:shape["top_k"]] for _ in range(chunk)])
    topk_w = torch.rand(chunk, shape["top_k"], generator=gen).to(accel.device)
    ids = ids.to(accel.device)
    streamer = ExpertStreamer([weights] * layers, accel, overlap=True)
    inputs = (x, ids, topk_w)
    slice_pass(streamer, inputs, min(layers, 2))  # warm-up (allocator, kernels)
    before = streamer.stats()
    seconds = slice_pass(streamer, inputs, layers)
    stats = streamer.stats()
    moved, copy_s = stats.bytes - before.bytes, stats.copy_s - before.copy_s
    # the grouped matmul alone (the slot already holds the layer): one layer, timed
    streamer.begin_pass()
    streamer.load(0)
    streamer.drain()
    sync(accel)
    start = time.perf_counter()
    streamer.run(0, x, ids, topk_w)
    sync(accel)
    compute_one = time.perf_counter() - start
    streamer.close()
    return {"layers": layers, "chunk_tokens": chunk, "experts": shape["experts"], "hidden": shape["hidden"],
            "intermediate": shape["inter"], "layer_bytes": weights.nbytes(), "seconds": seconds,
            "bytes_streamed": moved, "copy_s": copy_s, "achieved_h2d_gbs": moved / copy_s / 1e9,
            "compute_one_layer_s": compute_one, "prefill_tok_s_experts_half": chunk / seconds,
            "staging": stats.staging, "pinned_staging_bytes": stats.pinned_bytes}


def predicted_slice(result: dict, shape: dict, link_gbs: float) -> float:
    """The planner's schedule of the same slice (bench/_slp_case.predict) on this link and matmul rate."""
    from hybridmoe.bench._slp_case import predict
    from hybridmoe.config import parse_config

    config = parse_config({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                           "vocab_size": 1024, "hidden_size": shape["hidden"], "intermediate_size": shape["inter"],
                           "moe_intermediate_size": shape["inter"], "num_hidden_layers": result["layers"],
                           "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 128,
                           "num_experts": shape["experts"], "num_experts_per_tok": shape["top_k"],
                           "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 8192,
                           "torch_dtype": "bfloat16",
                           "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                                   "weight_block_size": [128, 128]}})
    chunk, E = result["chunk_tokens"], shape["experts"]
    counts = [[chunk * shape["top_k"] // E] * E for _ in range(result["layers"])]
    timeline = predict(config, chunk, "all", counts, link_gbs, result["compute_one_layer_s"] * result["layers"])
    return timeline.total_s


def hybrid_decode(model_dir: str, device: str, tokens: int = 64) -> dict:
    from hybridmoe import LLM, SamplingParams

    llm = LLM(model_dir, device=device)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    prompt = list(range(10, 42))
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    out = llm.generate([prompt], params)[0]
    seconds = time.perf_counter() - start
    placement = getattr(llm.engine, "placement", None)
    plan = getattr(placement, "plan", None)
    predicted = None
    if plan is not None:
        try:
            predicted = float(plan.decode_tok_s)
        except Exception:  # noqa: BLE001 - a plan without a decode tier reports none
            predicted = None
    return {"model": str(model_dir), "tokens": len(out.token_ids), "seconds_incl_prefill": seconds,
            "decode_tok_s": (len(out.token_ids) - 1) / seconds, "plan_decode_tok_s": predicted}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", required=True)
    p.add_argument("--small", action="store_true", help="a small slice (CPU stand-in, quick check of the script)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--model", default=None, help="model directory for hybrid decode (default: demo)")
    args = p.parse_args()
    accel = select_accelerator("auto")
    shape = SMALL if args.small else DSV3
    dtype = torch.bfloat16 if accel.is_cuda else torch.float32
    out: dict = {"device": accel.name, "shape": shape}
    try:
        link = pinned_bandwidth(accel, (64 if args.small else 1024) << 20)
        out["pinned_copy_gbs"] = link
        print(f"pinned host->device copy: {link:.1f} GB/s", flush=True)
        result = slp_slice(accel, shape, args.layers, min(args.chunk, 256) if args.small else args.chunk, dtype)
        result["fraction_of_pinned"] = result["achieved_h2d_gbs"] / link
        result["predicted_s"] = predicted_slice(result, shape, link)
        result["predicted_tok_s_experts_half"] = result["chunk_tokens"] / result["predicted_s"]
        out["slp_slice"] = result
        print(f"SLP slice ({args.layers} layers of {shape['experts']} FP8 experts {shape['inter']}x{shape['hidden']}, "
              f"{result['chunk_tokens']} tokens): {result['seconds']:.3f} s, experts half "
              f"{result['prefill_tok_s_experts_half']:.0f} tok/s (predicted {result['predicted_tok_s_experts_half']:.0f});"
              f" H2D {result['achieved_h2d_gbs']:.1f} GB/s = {result['fraction_of_pinned']:.2f} of pinned "
              f"({result['staging']} staging)", flush=True)
    except Exception as error:  # noqa: BLE001 - report and go on to the next measure
        out["slp_error"] = "".join(traceback.format_exception(error))
        print(out["slp_error"], flush=True)
    try:
        from hybridmoe.checkpoint.default_model import default_model_dir

        model = args.model or str(default_model_dir())
        out["hybrid_decode"] = hybrid_decode(model, "cuda" if accel.is_cuda else "cpu")
        print(f"hybrid decode: {out['hybrid_decode']}", flush=True)
    except Exception as error:  # noqa: BLE001
        out["decode_error"] = "".join(traceback.format_exception(error))
        print(out["decode_error"], flush=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=2)
    return 0 if "slp_error" not in out and "decode_error" not in out else 1


if __name__ == "__main__":
    raise SystemExit(main())
