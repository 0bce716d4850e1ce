"""Decode speed with attention through the C++ paged decode kernel against the gather + SDPA path, side by side in
one process (issue 42; not run by CI).

    python benchmarks/decode_attention.py [--model DIR] [--context 512] [--decode-tokens 64] [--rounds 3]
                                          [--threads 2] [--json PATH]
    python benchmarks/decode_attention.py --compare sampling-threads [...]
    python benchmarks/decode_attention.py --layer-only [--contexts 32,512,2048] [--threads 2]

--layer-only times one layer's decode attention alone at the Qwen3-30B-A3B shape (32 query heads, 4 KV heads, head
dim 128, bf16 cache, blocks of 16 scattered over the cache, one sequence): the kernel against gather + SDPA,
alternating, 200 calls a timing, best of 3 rounds each.

The model defaults to the Qwen3-30B-A3B-shaped checkpoint of benchmarks/vs_llamacpp.py (real dimensions, 4 layers,
random weights) quantised to int4 (every projection, groups of 32; LM head int8), made once under
~/.cache/hybridmoe if missing. One engine is loaded; each round decodes --decode-tokens greedy tokens after the
same --context-token prompt once with each variant, the order flipping every round (A, B, B, A, ...), so that a
drifting host meets both alike. The variants: "kernel", the engine as it is; against it (--compare) "sdpa", decode
attention through gather + SDPA (`layers.paged_attention.DECODE_KERNEL = False`), or "sampling-threads", the
step's sampling outside the one-thread torch scope of its forward (the engine before
`model_runner.torch_threads_for_step` covered it). The prompt's KV is
computed once and reused from the prefix cache, so every run decodes from the same context. Decode tok/s = decode
steps / time from the first token to the last. Each run also records how many CPUs' worth of time the rest of the
machine was busy (/proc/stat less this process) while it ran. Cells: median (best) over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def busy_cpus_elsewhere() -> tuple[float, float]:
    """(busy jiffies of the whole machine, of this process) now."""
    fields = Path("/proc/stat").read_text().split("\n")[0].split()[1:]
    values = [int(v) for v in fields]
    busy = sum(values) - values[3] - values[4]  # less idle and iowait
    own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return busy, int(own[11]) + int(own[12])  # utime + stime


def default_model() -> Path:
    from hybridmoe.bench.predicted_vs_measured import qwen_shaped_model
    from hybridmoe.checkpoint.default_model import cache_dir

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from vs_llamacpp import write_tokenizer  # the same synthetic byte-level BPE of the model's 151936 ids

    out = cache_dir() / "bench-qwen3-30b-a3b-4l-int4"
    if not (out / "config.json").is_file():
        base = qwen_shaped_model(4)
        subprocess.run([sys.executable, "-m", "hybridmoe.cli", "quantize", "--model", str(base), "--to", "int4",
                        "--group", "32", "--out", str(out), "--overwrite"], check=True)
    if not (out / "tokenizer.json").is_file():
        write_tokenizer(out)
    return out


def layer_only(contexts: list[int]) -> None:
    import torch

    from hybridmoe.kernels.attention import decode_attention
    from hybridmoe.layers.paged_attention import attend, gather_context

    heads, kv_heads, dim, block, blocks = 32, 4, 128, 16, 512
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, blocks, block, kv_heads, dim, generator=gen).to(torch.bfloat16)
    q = torch.randn(1, heads, dim, generator=gen).to(torch.bfloat16)
    table = torch.randperm(blocks, generator=gen).view(1, -1)
    for ctx in contexts:
        lens = torch.tensor([ctx])
        calls = {
            "kernel": lambda: decode_attention(q, cache[0], cache[1], table, lens, dim ** -0.5),
            "sdpa": lambda: attend(q, gather_context(cache[0], table[0], ctx), gather_context(cache[1], table[0], ctx),
                                   dim ** -0.5, None),
        }
        best = {}
        for _ in range(3):
            for name, fn in calls.items():
                for _ in range(5):
                    fn()
                t = time.perf_counter()
                for _ in range(200):
                    fn()
                best[name] = min(best.get(name, 1e9), (time.perf_counter() - t) / 200)
        print(f"context {ctx:5d}: kernel {best['kernel'] * 1e6:8.1f} us, gather + SDPA {best['sdpa'] * 1e6:8.1f} us, "
              f"{best['sdpa'] / best['kernel']:.1f}x", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path)
    p.add_argument("--compare", choices=("sdpa", "sampling-threads"), default="sdpa")
    p.add_argument("--layer-only", action="store_true")
    p.add_argument("--contexts", default="32,512,2048")
    a = p.parse_args()
    os.environ["HYBRIDMOE_NUM_THREADS"] = str(a.threads)
    import torch

    torch.set_num_threads(a.threads)
    from hybridmoe.kernels import isa

    if a.layer_only:
        isa.configure_threads(a.threads)
        torch.set_num_threads(1)  # as the engine runs torch's ops at decode (model_runner.SINGLE_THREAD_MAX_TOKENS)
        layer_only([int(c) for c in a.contexts.split(",")])
        return 0
    from hybridmoe.layers import paged_attention
    from hybridmoe.runtime.engine import EngineConfig, LLMEngine
    from hybridmoe.runtime.sampling_params import SamplingParams

    isa.configure_threads(a.threads)
    model = a.model or default_model()
    engine = LLMEngine(model, EngineConfig(dtype="auto", kv_cache_gb=0.5, enable_prefix_caching=True,
                                           max_num_batched_tokens=max(2048, a.context)), show_progress=False)
    prompt = [(i * 7919 + 13) % 150000 for i in range(a.context)]  # regular ids of the 151936
    clk = os.sysconf("SC_CLK_TCK")

    import contextlib

    from hybridmoe.runtime import engine as engine_module

    scope = engine_module.torch_threads_for_step

    def decode(variant: str, steps: int) -> dict:
        paged_attention.DECODE_KERNEL = variant != "sdpa"
        engine_module.torch_threads_for_step = (
            (lambda n: contextlib.nullcontext()) if variant == "sampling-threads" else scope)
        params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
        engine.add_request(prompt, params)
        first = marks = None
        tokens = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.new_token_ids and first is None:
                    first, marks = time.perf_counter(), busy_cpus_elsewhere()
                tokens = out.token_ids
        end, (busy, own) = time.perf_counter(), busy_cpus_elsewhere()
        seconds = end - first
        return {"tok_s": (len(tokens) - 1) / seconds, "ms_per_token": 1e3 * seconds / (len(tokens) - 1),
                "others_busy_cpus": ((busy - marks[0]) - (own - marks[1])) / clk / seconds, "tokens": tokens}

    other = a.compare
    decode("kernel", 4)  # warm-up: the prompt's KV into the prefix cache, both variants once
    decode(other, 4)
    runs: dict[str, list[dict]] = {"kernel": [], other: []}
    for r in range(a.rounds):
        order = ("kernel", other) if r % 2 == 0 else (other, "kernel")
        for name in order:
            runs[name].append(decode(name, a.decode_tokens))
            print(f"round {r + 1} {name:16s} {runs[name][-1]['tok_s']:6.2f} tok/s "
                  f"(others busy {runs[name][-1]['others_busy_cpus']:.2f} CPUs)", flush=True)
    same = all(x["tokens"] == y["tokens"] for x, y in zip(runs["kernel"], runs[other]))
    summary = {name: {"tok_s_median": statistics.median(x["tok_s"] for x in v),
                      "tok_s_best": max(x["tok_s"] for x in v),
                      "ms_per_token_median": statistics.median(x["ms_per_token"] for x in v),
                      "others_busy_cpus_median": statistics.median(x["others_busy_cpus"] for x in v)}
               for name, v in runs.items()}
    ratio = summary["kernel"]["tok_s_median"] / summary[other]["tok_s_median"]
    print(f"\nmodel {model.name}, context {a.context}, {a.decode_tokens} decode steps, {a.threads} threads, "
          f"ISA {isa.active_isa()}")
    for name, s in summary.items():
        print(f"  {name:16s} decode {s['tok_s_median']:6.2f} ({s['tok_s_best']:.2f}) tok/s, "
              f"{s['ms_per_token_median']:.1f} ms/token, others busy {s['others_busy_cpus_median']:.2f} CPUs")
    print(f"  kernel / {other}: {ratio:.2f}x; same greedy tokens: {same}")
    if a.json:
        a.json.write_text(json.dumps({"model": str(model), "compare": other, "context": a.context, "decode_tokens": a.decode_tokens,
                                      "threads": a.threads, "isa": isa.active_isa(), "summary": summary,
                                      "ratio": ratio, "same_tokens": same}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
