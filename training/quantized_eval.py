"""Held-out perplexity of int8/int4 copies of the demo model, through hybridmoe's own engine, against BF16.

Each variant is written by `hybridmoe quantize` into a temporary directory: every projection (scope "all": attention,
dense and shared MLPs, routed experts, the LM head in int8, or for the "-head-int4" variants in int4 (`--lm-head int4`);
embeddings, norms, routers and MLA's kv_b_proj stay BF16) or the routed experts alone (--experts-only), int8 or int4 per
group of 32 (and 128) columns. Each model, the BF16 original included, is loaded by hybridmoe.models.loader.load_model
in float32 compute on the CPU kernels (the int formats run in their stored format: int weights, activations quantised to
int8 per group) and scored by evaluate.heldout_perplexity: per source (fortunes, python_docs, chat), 512-token windows
over the first --heldout-tokens of its held-out documents. Writes results/quantized_eval.json and prints ppl per source
and the change against BF16.

Run: .venv/bin/python training/quantized_eval.py [--heldout-tokens 4096] [--groups 32] [--variants NAME,...]
(MODEL_CARD.md's table: --heldout-tokens 40000 --groups 32,128, evaluate.py's budget; about 30 minutes on 2 cores)
(needs training/data/heldout.jsonl: apt-get install fortunes fortunes-min python3-doc, then prepare_data.py)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

import data_stream
from evaluate import HELDOUT_WINDOW, heldout_perplexity
from recipe import DEMO_MODEL_DIR, RESULTS_DIR

BLOCK_SIZE = 16  # KV-cache block size of the runner; one window fills window / BLOCK_SIZE blocks


def variants(groups: list[int]) -> list[dict]:
    """(format, group, scope, lm_head) of every quantised copy: every projection first (int4 with the LM head in
    int8, then in int4), then experts only."""
    every = [{"format": fmt, "group": group, "scope": "all", "lm_head": "int8"}
             for group in groups for fmt in ("int8", "int4")]
    every += [{"format": "int4", "group": group, "scope": "all", "lm_head": "int4"} for group in groups]
    return every + [{"format": fmt, "group": group, "scope": "experts", "lm_head": "keep"}
                    for group in groups for fmt in ("int8", "int4")]


def variant_name(v: dict) -> str:
    return f"{v['format']}-g{v['group']}-{v['scope']}" + ("-head-int4" if v["lm_head"] == "int4" else "")


def engine_logits(model_dir: Path, window: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """hybridmoe's engine on model_dir (float32 compute, CPU kernels) as heldout_perplexity's logits_of: each call
    is one prefill of ids [W] from position 0 into the same KV blocks -> logits [W, V]."""
    from hybridmoe.models.loader import load_model
    from hybridmoe.runtime.model_runner import ModelRunner, SequenceChunk

    model = load_model(model_dir, "float32", "cpu", show_progress=False)
    num_blocks = -(-window // BLOCK_SIZE)
    runner = ModelRunner(model, num_blocks=num_blocks, block_size=BLOCK_SIZE)
    table = list(range(num_blocks))
    return lambda ids: runner.forward([SequenceChunk(ids.tolist(), 0, table)], all_logits=True)


def quantize(out: Path, v: dict) -> None:
    from hybridmoe.cli import main as hybridmoe_main

    argv = ["quantize", "--model", str(DEMO_MODEL_DIR), "--to", v["format"], "--group", str(v["group"]),
            "--out", str(out)] + (["--experts-only"] if v["scope"] == "experts" else ["--lm-head", v["lm_head"]])
    if hybridmoe_main(argv) != 0:
        raise RuntimeError(f"hybridmoe {' '.join(argv)} failed")


def machine() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
             if line.startswith("model name")] if cpuinfo.exists() else []
    return f"{names[0] if names else platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs"


def weight_mib(model_dir: Path) -> float:
    return round(sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / 2**20, 2)


def table(report: dict) -> str:
    sources = sorted(report["bf16"]["heldout"])
    head = "| model | safetensors MiB | " + " | ".join(f"{s} ppl (vs BF16)" for s in sources) + " |"
    lines = [head, "| --- | ---: | " + " | ".join("---:" for _ in sources) + " |"]
    base = report["bf16"]["heldout"]
    lines.append(f"| BF16 | {report['bf16']['weights_mib']:.1f} | "
                 + " | ".join(f"{base[s]['perplexity']:.2f}" for s in sources) + " |")
    for v in report["variants"]:
        cells = [f"{v['heldout'][s]['perplexity']:.2f} ({v['change_vs_bf16'][s]:+.2f}%)" for s in sources]
        lines.append(f"| {v['name']} | {v['weights_mib']:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heldout-tokens", type=int, default=4096,
                        help="predicted tokens per source (default 4096, 8 windows, a few minutes on 2 cores; "
                             "training/evaluate.py's budget, MODEL_CARD.md's table: 40000)")
    parser.add_argument("--groups", default="32", help="group sizes, comma-separated (default 32; also: 32,128)")
    parser.add_argument("--variants", default="",
                        help="only these copies, comma-separated names such as int4-g32-all-head-int4 (default: all)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "quantized_eval.json")
    args = parser.parse_args()
    groups = [int(g) for g in args.groups.split(",")]
    chosen = [v for v in variants(groups) if not args.variants or variant_name(v) in args.variants.split(",")]
    unknown = set(filter(None, args.variants.split(","))) - {variant_name(v) for v in chosen}
    if unknown:
        parser.error(f"--variants: {', '.join(sorted(unknown))} not among "
                     f"{', '.join(variant_name(v) for v in variants(groups))}")
    started = time.time()
    heldout = data_stream.tokenize_split(data_stream.load_tokenizer(DEMO_MODEL_DIR), "heldout")
    window, max_tokens = HELDOUT_WINDOW, args.heldout_tokens

    def score(model_dir: Path) -> dict:
        t0 = time.time()
        result = {"heldout": heldout_perplexity(engine_logits(model_dir, window), heldout, window, max_tokens),
                  "weights_mib": weight_mib(model_dir)}
        result["seconds"] = round(time.time() - t0, 1)
        return result

    report = {"model": DEMO_MODEL_DIR.name, "engine": "hybridmoe load_model(float32, cpu) + ModelRunner",
              "window": window, "heldout_tokens_per_source": max_tokens, "threads": torch.get_num_threads(),
              "machine": machine()}
    report["bf16"] = score(DEMO_MODEL_DIR)
    print("BF16", report["bf16"], flush=True)
    report["variants"] = []
    with tempfile.TemporaryDirectory(prefix="quantized_eval-") as tmp:
        for v in chosen:
            out = Path(tmp) / variant_name(v)
            quantize(out, v)
            result = {"name": variant_name(v), **v, **score(out)}
            result["change_vs_bf16"] = {
                s: round(100 * (r["perplexity"] / report["bf16"]["heldout"][s]["perplexity"] - 1), 2)
                for s, r in result["heldout"].items()}
            report["variants"].append(result)
            print(result["name"], {s: r["perplexity"] for s, r in result["heldout"].items()},
                  result["change_vs_bf16"], flush=True)
    report["eval_seconds"] = round(time.time() - started)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    print(f"wrote {args.out} in {report['eval_seconds']} s")


if __name__ == "__main__":
    main()
