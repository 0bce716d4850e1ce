"""Shared by generate, chat and demo: engine construction from CLI flags, streaming output, speed summary."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

from hybridmoe.accel.accelerator import DeviceMemoryError
from hybridmoe.runtime.engine import EngineConfig, LLMEngine
from hybridmoe.runtime.sampling_params import SamplingParams


MODEL_HELP = ("a local Hugging Face model directory, or demo (the default): the embedded demo model; demo-gqa: its "
              "companion with GQA attention")


def add_model_arguments(parser: argparse.ArgumentParser, kv_cache_gb: float = 1.0) -> None:
    parser.add_argument("--model", default="demo", help=MODEL_HELP)
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"],
                        help="compute dtype (auto: bfloat16 where the hardware has it natively, else float32)")
    parser.add_argument("--kv-cache-gb", type=float, default=kv_cache_gb,
                        help=f"GB (2**30 bytes) of memory for the paged KV cache (default {kv_cache_gb:g})")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                        help="the KV cache's dtype (auto: the compute dtype). A 16-bit cache under float32 compute "
                             "holds twice the tokens and halves what decode attention reads")
    parser.add_argument("--expert-backend", default="cpu", choices=["cpu", "torch"],
                        help="routed experts on the C++ CPU kernels (default) or the plain-torch reference")
    parser.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                        help="compute every prompt in full rather than reuse the KV of an earlier request's equal "
                             "prefix (a chat's earlier turns, a shared system prompt); the tokens are the same")
    add_hybrid_arguments(parser)


def add_hybrid_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the model runs (docs/hybrid.md): accelerator, its memory budget, the plan."""
    group = parser.add_argument_group("hybrid execution (docs/hybrid.md)")
    group.add_argument("--device", default="auto",
                       help="auto (default: CUDA when torch sees a GPU, else the CPU), cpu, cuda or cuda:N")
    group.add_argument("--vram", default=None,
                       help="accelerator memory the plan may use, e.g. 24GB or 22.5GiB (default on CUDA: free memory "
                            "minus a reserve). Without a GPU a budget (or --plan) runs the plan on the CPU standing in "
                            "for one; without either the plain CPU engine runs (the fastest there)")
    group.add_argument("--gpus", type=int, default=1, dest="num_gpus",
                       help="accelerators for stream-loading prefill with expert parallelism (default 1)")
    group.add_argument("--stream-prefill", default="auto", choices=["auto", "on", "off"],
                       help="stream-loading prefill: auto (from the plan's crossover prompt length), on, off")
    group.add_argument("--plan", default=None, metavar="FILE",
                       help="run the plan in FILE (written by `hybridmoe plan --json`) instead of planning at load")
    group.add_argument("--routing", default=None, metavar="FILE",
                       help="routing statistics (`hybridmoe profile --routing-model`): the hot experts to place")
    overlap = group.add_mutually_exclusive_group()
    overlap.add_argument("--overlap", default="auto", choices=["auto", "on", "off"],
                         help="dual-batch overlap of decode steps: two micro-batches, one's attention on the accelerator "
                              "while the CPU computes the other's routed experts. auto (default): under hybrid "
                              "execution where the plan predicts a gain, off on the plain CPU engine")
    overlap.add_argument("--no-overlap", dest="overlap", action="store_const", const="off",
                         help="decode steps run whole (the same as --overlap off)")
    group.add_argument("--verbose", action="store_true",
                       help="print the plan and what was placed where at load, and what ran where after generating")


def engine_config(args: argparse.Namespace, **more) -> EngineConfig:
    """EngineConfig from the flags of add_model_arguments (and `more` fields)."""
    return EngineConfig(dtype=args.dtype, kv_cache_gb=args.kv_cache_gb, kv_cache_dtype=args.kv_cache_dtype,
                        expert_backend=args.expert_backend,
                        enable_prefix_caching=args.enable_prefix_caching, device=args.device, vram=args.vram,
                        num_gpus=args.num_gpus, stream_prefill=args.stream_prefill, plan=args.plan,
                        routing=args.routing, verbose=args.verbose, overlap=args.overlap, **more)


def add_sampling_arguments(parser: argparse.ArgumentParser, max_tokens: int = 128) -> None:
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, seed=args.seed, stop=args.stop,
        max_tokens=args.max_tokens, ignore_eos=args.ignore_eos,
    )


def build_engine(args: argparse.Namespace) -> LLMEngine:
    """The engine for args.model (a directory, or demo), with the engine flags of add_model_arguments."""
    try:
        return LLMEngine(args.model, engine_config(args))
    except DeviceMemoryError as error:  # a placement over the vram budget: bad input, said as such
        raise ValueError(str(error)) from None


@dataclass
class GenerationStats:
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    decode_s: float
    finish_reason: str | None

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.ttft_s if self.ttft_s > 0 else float("inf")

    @property
    def decode_tok_s(self) -> float:
        steps = self.output_tokens - 1  # the first token comes out of the prefill
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0

    def summary(self) -> str:
        return (f"prompt tokens: {self.prompt_tokens} | output tokens: {self.output_tokens} | "
                f"time to first token: {self.ttft_s:.3f} s | prefill: {self.prefill_tok_s:.1f} tok/s | "
                f"decode: {self.decode_tok_s:.1f} tok/s")


def stream(engine: LLMEngine, prompt: str | list[int], params: SamplingParams, out=None) -> tuple[str, GenerationStats]:
    """Run one request, writing text to `out` (default: stdout) as it is produced; returns text and timings."""
    out = out or sys.stdout
    start = time.perf_counter()
    req_id = engine.add_request(prompt, params)
    first = None
    text, prompt_tokens, output_tokens, reason = "", 0, 0, None
    while engine.has_unfinished_requests():
        for result in engine.step():
            if result.req_id != req_id:
                continue
            if result.new_token_ids and first is None:
                first = time.perf_counter()
            out.write(result.new_text)
            out.flush()
            text, prompt_tokens, output_tokens = result.text, len(result.prompt_token_ids), len(result.token_ids)
            if result.finished:
                reason = result.finish_reason
                if result.error:
                    raise RuntimeError(f"generation failed: {result.error}")
    end = time.perf_counter()
    first = first or end
    return text, GenerationStats(prompt_tokens, output_tokens, first - start, end - first, reason)
