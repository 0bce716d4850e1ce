"""Aggregate decode throughput with dual-batch overlap and without, side by side in one process (issue 45).

One engine is loaded once; rounds alternate the two settings (overlap on: `model.dual_batch = DualBatch()`, every
decode step of >= 2 sequences split in two micro-batches; off: None), each round decoding --batch sequences of
--prompt-tokens random tokens for --tokens tokens each (greedy, no EOS). Measured from the engine's RunStats over the
decode-only steps: tokens / wall time, and the CPU experts' time and the part of it the forward waited for (under
hybrid execution; the overlap hides CPU expert time behind accelerator work, so the waited share drops).

Without --model a Qwen3-MoE-shaped random model is written once (--shape small|gpu) to --cache-dir. With --vram (or
on CUDA) the engine runs the hybrid path: the plan places attention, routers, shared experts and as many hot experts
as fit; the rest of the experts run on the CPU kernels. Without either it is the plain CPU engine.

    python benchmarks/overlap_decode.py --batch 8 --rounds 3                       # plain CPU engine
    python benchmarks/overlap_decode.py --vram 64MB --batch 8 --rounds 3           # the CPU stand-in, hybrid
    python benchmarks/overlap_decode.py --shape gpu --device cuda --vram 2GB --json out.json   # a GPU machine
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

SHAPES = {  # Qwen3-MoE-shaped; experts in bf16
    "small": dict(vocab_size=4096, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=384,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=128, num_experts=64, num_experts_per_tok=8,
                  num_hidden_layers=4),
    "gpu": dict(vocab_size=8192, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=64, num_experts_per_tok=8,
                num_hidden_layers=4),
}


def model_dir(shape: str, cache_dir: Path) -> Path:
    from hybridmoe.checkpoint.synthetic import save_tiny_model

    out = cache_dir / f"qwen3-moe-{shape}"
    if not (out / "config.json").exists():
        print(f"writing the {shape} Qwen3-MoE-shaped model to {out}", file=sys.stderr)
        save_tiny_model(out, "qwen3_moe", dtype=torch.bfloat16, max_position_embeddings=4096,
                        **SHAPES[shape])
    return out


def decode_round(llm, batch: int, prompt_tokens: int, tokens: int, seed: int) -> dict:
    from hybridmoe import SamplingParams

    engine = llm.engine
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.vocab_size
    prompts = [torch.randint(10, vocab, (prompt_tokens,), generator=gen).tolist() for _ in range(batch)]
    before = {k: getattr(engine.run_stats.phases["decode"], k) for k in ("steps", "tokens", "step_s",
                                                                        "cpu_experts_s", "cpu_wait_s")}
    split_before = engine.model.dual_batch.steps if engine.model.dual_batch is not None else 0
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    after = engine.run_stats.phases["decode"]
    d = {k: getattr(after, k) - v for k, v in before.items()}
    split = (engine.model.dual_batch.steps if engine.model.dual_batch is not None else 0) - split_before
    return {"decode_tok_s": d["tokens"] / d["step_s"], "decode_steps": d["steps"], "split_steps": split,
            "step_ms": 1e3 * d["step_s"] / max(1, d["steps"]), "cpu_experts_ms_per_step":
            1e3 * d["cpu_experts_s"] / max(1, d["steps"]), "cpu_waited_ms_per_step":
            1e3 * d["cpu_wait_s"] / max(1, d["steps"]), "tokens": [o.token_ids for o in outputs]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a model directory (default: a Qwen3-MoE-shaped random model, --shape)")
    p.add_argument("--shape", default="small", choices=sorted(SHAPES))
    p.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "hybridmoe", "bench"))
    p.add_argument("--device", default="auto")
    p.add_argument("--vram", default=None, help="accelerator budget: the hybrid path (on the stand-in too)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=8, help="sequences decoding at once")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--tokens", type=int, default=24, help="tokens each sequence decodes per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds of each setting, alternating")
    p.add_argument("--json", help="write the settings, every round and the medians here")
    args = p.parse_args(argv)

    from hybridmoe import LLM
    from hybridmoe.models.dual_batch import DualBatch

    path = Path(args.model) if args.model else model_dir(args.shape, Path(args.cache_dir))
    options = dict(device=args.device, overlap="off", max_num_seqs=max(args.batch, 2), kv_cache_gb=0.25)
    if args.vram:
        options["vram"] = args.vram
    llm = LLM(str(path), dtype=args.dtype, **options)
    engine = llm.engine
    hybrid = engine.placement is not None
    where = (f"hybrid on {engine.accel.device}" if hybrid else "the plain CPU engine")
    print(f"{path.name}: {where}; {args.batch} sequences x {args.tokens} tokens, {args.rounds} rounds per setting",
          file=sys.stderr)
    if hybrid:
        hot = sum(len(v) for v in engine.placement.hot.values())
        print(f"  hot experts on the accelerator: {hot}; {engine.overlap_note} (auto's choice, overridden here)",
              file=sys.stderr)
    decode_round(llm, min(args.batch, 2), 8, 4, seed=0)  # warm-up: one-time costs out of the first round
    rounds = {"off": [], "on": []}
    for r in range(args.rounds):
        for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
            engine.model.dual_batch = DualBatch() if mode == "on" else None
            time.sleep(0.2)  # let torch's OpenMP workers go quiet between settings
            result = decode_round(llm, args.batch, args.prompt_tokens, args.tokens, seed=1000 + r)
            rounds[mode].append(result)
            print(f"  round {r} overlap {mode:3s}: {result['decode_tok_s']:8.1f} tok/s, step {result['step_ms']:.2f} "
                  f"ms, CPU experts {result['cpu_experts_ms_per_step']:.2f} ms (waited for "
                  f"{result['cpu_waited_ms_per_step']:.2f}), split steps {result['split_steps']}", file=sys.stderr)
    # float32 gives the same tokens (tests/hybrid/test_dual_batch_overlap.py); in bf16 a micro-batch's row count
    # can pick another kernel path (GEMV/GEMM, torch's matmul from 8 rows) and round differently, as any change of
    # batch composition can: counted here, not required
    same = sum(x == y for a, b in zip(rounds["off"], rounds["on"]) for x, y in zip(a["tokens"], b["tokens"]))
    total = sum(len(a["tokens"]) for a in rounds["off"])
    medians = {mode: {k: statistics.median(r[k] for r in rs) for k in ("decode_tok_s", "step_ms",
                                                                        "cpu_experts_ms_per_step",
                                                                        "cpu_waited_ms_per_step")}
               for mode, rs in rounds.items()}
    ratio = medians["on"]["decode_tok_s"] / medians["off"]["decode_tok_s"]
    # each round's pair ran back to back: the median of the pairs' ratios is steadier where the load drifts
    paired = [a["decode_tok_s"] / b["decode_tok_s"] for a, b in zip(rounds["on"], rounds["off"])]
    print(f"decode throughput, medians of {args.rounds} rounds ({where}, batch {args.batch}): overlap off "
          f"{medians['off']['decode_tok_s']:.1f} tok/s, on {medians['on']['decode_tok_s']:.1f} tok/s: "
          f"{ratio:.2f}x (rounds' own ratios {', '.join(f'{r:.2f}' for r in paired)}, median "
          f"{statistics.median(paired):.2f}); sequences with the same greedy tokens: {same} of {total}")
    if args.json:
        for rs in rounds.values():
            for r in rs:
                r.pop("tokens")
        report = {"settings": {**vars(args), "model_dir": str(path), "where": where,
                               "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                               "cpus": os.cpu_count(), "load_average_1min": os.getloadavg()[0]},
                  "rounds": rounds, "medians": medians, "ratio_on_over_off": ratio, "round_ratios": paired,
                  "same_token_sequences": [same, total]}
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
