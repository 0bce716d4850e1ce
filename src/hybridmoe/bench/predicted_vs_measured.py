"""`hybridmoe bench costmodel [--json PATH]`: the planner's cost model next to measured step times of this
engine, in one run.

For the demo model and a Qwen3-30B-A3B-shaped model (2 layers of real dimensions, random bf16 weights, built on
the fly and cached), the bench times a decode step (one sequence, 128 tokens cached) and CPU prefill of 128 and
512 tokens through the engine's ModelRunner (median of timed steps after a warm-up), and predicts each with the
planner itself: `placement.estimate.decode` / `estimate.prefill(strategy "cpu")` over a `CostModel` of this
machine whose CPU part carries the engine's op tables for the model (profiling/op_tables.py) and of the case's
routing statistics (counted once from the router's choices, the planner's routing pass). The speed of the same
op drifts by tens of percent within minutes on a shared machine, so the bench runs several short rounds per
model (the models one after the other, each alone in the process as it would be served), measures each round's
op tables right before its steps, and predicts each round from that round's tables; the prediction never sees a
step timing. Reported: the median over rounds of the predictions and of the measured times, every round's pair,
and the predicted time by part of the step.

Stream-loading prefill (`--cases slp`, bench/_slp_case.py): on a small Qwen3-MoE-shaped model, the routed-expert
half of prefill chunks streamed through the engine's StreamPrefill onto this machine's accelerator (the CPU stand-in
here), both copy variants, against the planner's SLP schedule (passes._slp_moe_units, schedule.run) fed with the
copy bandwidth and grouped-matmul rate measured alone in the same round.

Expert parallelism over 2 ranks (`--cases ep`, bench/_ep_case.py): on the same model, a 512-token chunk's
routed-expert half over the engine process and one worker rank (hybridmoe.parallel, gloo on the stand-in), each
streaming its half of the experts, against the planner's 2-GPU schedule with parallel="rank0" (the exchange the
engine runs) fed with the same isolated rates and the link between the ranks measured by a ping-pong.

One thread for torch and the expert kernels by default (--threads): on a machine shared with other jobs every
parallel op otherwise waits for a descheduled thread. The JSON rows say the threads and the load average.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from hybridmoe.placement import estimate
from hybridmoe.placement.costmodel import CostModel
from hybridmoe.placement.hardware import Machine
from hybridmoe.placement.modelspec import ModelSpec
from hybridmoe.placement.passes import PassBuilder, Residency
from hybridmoe.placement.routing import RoutingStats
from hybridmoe.profiling.machine import engine_cpu
from hybridmoe.profiling.op_tables import BLOCK, OpTableBench
from hybridmoe.profiling.timing import timed_runs

DECODE_CONTEXT = 128
PREFILLS = (128, 512)
QWEN_SHAPE = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                  num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8)
PARTS = ("host", "attention", "dense", "moe", "lm_head")  # the planner's units of a CPU step


def register(subparsers) -> None:
    p = subparsers.add_parser("costmodel", help="cost-model predictions vs measured engine step times")
    p.add_argument("--json", metavar="PATH", help="write [{name, predicted_s, measured_s, ...}] to PATH")
    p.add_argument("--tables", metavar="PATH",
                   help="also write each model's measured op tables and each case's routing counts to PATH")
    p.add_argument("--models", metavar="DIR[,DIR]",
                   help="bench these model directories instead of the demo and the Qwen3-shaped model")
    p.add_argument("--layers", type=int, default=2, help="layers of the Qwen3-30B-shaped model (default 2)")
    p.add_argument("--rounds", type=int, default=5,
                   help="rounds of (tables, then timed steps), each predicted from its own tables (default 5)")
    p.add_argument("--repeats", type=int, default=2,
                   help="timed steps per case and round after a warm-up, at least (default 2)")
    p.add_argument("--case-seconds", type=float, default=1.0,
                   help="keep timing a case's steps in a round until this long (default 1 s: fast cases get "
                        "more steps)")
    p.add_argument("--cases", default="cpu,slp,ep",
                   help="comma-separated: cpu (CPU decode and prefill steps), slp (stream-loading prefill on the "
                        "accelerator or its stand-in), ep (the same over 2 ranks: expert parallelism); default all")
    p.add_argument("--cache", default=None, help="where to build the Qwen3-shaped model (default: user cache)")
    p.add_argument("--threads", type=int, default=1,
                   help="threads for torch and the kernels, tables and engine alike (default 1: stable on a "
                        "machine shared with other jobs)")
    p.set_defaults(func=run)


# ---- models -------------------------------------------------------------------------------------------
def qwen_shaped_model(layers: int, cache: Path | None = None, shape: dict | None = None) -> Path:
    """A Qwen3-30B-A3B-shaped checkpoint (real dimensions unless `shape` says otherwise, `layers` layers,
    random bf16 weights, one shard per layer, Hugging Face names), written once into the cache."""
    from safetensors.torch import save_file

    from hybridmoe.checkpoint.default_model import cache_dir

    c = shape or QWEN_SHAPE
    tag = "qwen3-30b-a3b" if shape is None else "qwen3-moe-" + "-".join(str(v) for v in c.values())
    out = (cache or cache_dir()) / f"bench-{tag}-{layers}l"
    if (out / "model.safetensors.index.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    H, V, E, I = c["hidden_size"], c["vocab_size"], c["num_experts"], c["moe_intermediate_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape: (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)
    ones = lambda n: torch.ones(n, dtype=torch.bfloat16)
    shards: dict[str, dict[str, torch.Tensor]] = {
        "embed.safetensors": {"model.embed_tokens.weight": rand(V, H), "lm_head.weight": rand(V, H),
                              "model.norm.weight": ones(H)}}
    for i in range(layers):
        p = f"model.layers.{i}."
        t = {p + "input_layernorm.weight": ones(H), p + "post_attention_layernorm.weight": ones(H),
             p + "self_attn.q_proj.weight": rand(q, H), p + "self_attn.k_proj.weight": rand(kv, H),
             p + "self_attn.v_proj.weight": rand(kv, H), p + "self_attn.o_proj.weight": rand(H, q),
             p + "self_attn.q_norm.weight": ones(c["head_dim"]), p + "self_attn.k_norm.weight": ones(c["head_dim"]),
             p + "mlp.gate.weight": rand(E, H)}
        for e in range(E):
            t[p + f"mlp.experts.{e}.gate_proj.weight"] = rand(I, H)
            t[p + f"mlp.experts.{e}.up_proj.weight"] = rand(I, H)
            t[p + f"mlp.experts.{e}.down_proj.weight"] = rand(H, I)
        shards[f"layer{i}.safetensors"] = t
    index = {}
    for name, tensors in shards.items():
        save_file(tensors, str(out / name))
        index.update({k: name for k in tensors})
    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_hidden_layers": layers,
              "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
              "tie_word_embeddings": False, "norm_topk_prob": True, "torch_dtype": "bfloat16", **c}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    return out


class EngineCase:
    """One model loaded into our engine's runner (default compute dtype), with a KV cache for the longest case."""

    def __init__(self, model_dir: Path):
        from hybridmoe.models.loader import load_model
        from hybridmoe.runtime.model_runner import ModelRunner

        self.model = load_model(model_dir, "auto", "cpu", show_progress=False)
        self.config = self.model.config
        blocks = -(-(max(PREFILLS) + DECODE_CONTEXT + 64) // BLOCK)
        self.runner = ModelRunner(self.model, blocks, BLOCK)
        self.table = list(range(blocks))
        gen = torch.Generator().manual_seed(1)
        self.tokens = torch.randint(0, self.config.vocab_size, (max(PREFILLS) + DECODE_CONTEXT + 64,),
                                    generator=gen).tolist()

    def chunk(self, start: int, length: int):
        from hybridmoe.runtime.model_runner import SequenceChunk

        return [SequenceChunk(self.tokens[start:start + length], start, self.table)]

    @torch.inference_mode()
    def routing(self, kind: str, tokens: int, context: int) -> list[list[int]]:
        """Per MoE layer, how many (token, expert) pairs each expert gets in the step (one untimed step with
        the router's choices counted; the observers are removed again, timed steps run without them)."""
        if kind == "decode":
            self.runner.forward(self.chunk(0, context))  # fill the cache
        routed: list[torch.Tensor] = []  # topk_ids [T, K] per MoE layer, in order
        remove = self.model.add_routing_observer(lambda _index, ids: routed.append(ids))
        try:
            self.runner.forward(self.chunk(context, 1) if kind == "decode" else self.chunk(0, tokens))
        finally:
            remove()
        return [torch.bincount(ids.flatten(), minlength=self.config.moe.num_experts).tolist() for ids in routed]

    @torch.inference_mode()
    def times(self, kind: str, tokens: int, context: int, repeats: int, seconds: float) -> list[float]:
        """Seconds of each timed step after a warm-up (at least `repeats`, more until `seconds` have passed, at
        most MAX_RUNS): a decode step after `context` cached tokens, or a prefill of `tokens` tokens from 0."""
        if kind == "decode":
            self.runner.forward(self.chunk(0, context))  # fill the cache
            return timed_runs(lambda: self.runner.forward(self.chunk(context, 1)), repeats, seconds)
        return timed_runs(lambda: self.runner.forward(self.chunk(0, tokens)), repeats, seconds)


def predict(cpu, config, kind: str, tokens: int, context: int, counts: list[list[int]]):
    """The planner's time of one step (a Timeline) of `config`'s model on a CPU with op tables, with the
    case's routing (per MoE layer, how many of the step's tokens chose each expert)."""
    spec = ModelSpec(config)
    moe_layers = tuple(l.index for l in spec.moe_layers)
    routing = RoutingStats.from_counts(moe_layers, np.array(counts), config.moe.num_experts_per_tok)
    cost = CostModel(Machine("this machine", cpu), spec, routing=routing)
    if cost.ops is None:
        raise RuntimeError(f"the op tables do not cover {config.source}: {'; '.join(cost.ops_missing)}")
    builder = PassBuilder(cost, Residency.none(len(spec.layers), len(moe_layers)))
    if kind == "decode":
        return estimate.decode(builder, 1, context).timeline
    return estimate.prefill(builder, "cpu", tokens).timeline


def parts_s(timeline) -> dict[str, float]:
    parts = dict.fromkeys(PARTS, 0.0)
    for unit in timeline.units:
        parts[unit.name] += unit.compute_s * unit.repeat
    return parts


def run(args) -> int:
    from hybridmoe.checkpoint.default_model import default_model_dir
    from hybridmoe.kernels import isa
    from hybridmoe.models.loader import resolve_dtype

    torch.set_num_threads(args.threads)
    isa.configure_threads(args.threads)
    dtype = resolve_dtype("auto")
    cases = {c.strip() for c in args.cases.split(",") if c.strip()}
    if not cases or cases - {"cpu", "slp", "ep"}:
        raise SystemExit(f"--cases: choose from cpu, slp, ep (got {args.cases!r})")
    if "cpu" not in cases:
        models = {}
    elif args.models:
        models = {Path(d).name: Path(d) for d in args.models.split(",") if d.strip()}
    else:
        models = {"demo": Path(default_model_dir()), f"qwen3-30b-a3b-{args.layers}l":
                  qwen_shaped_model(args.layers, Path(args.cache) if args.cache else None)}
    loads: list[float] = []
    written: dict[str, dict] = {}
    per_round: dict[tuple[str, str], list[tuple]] = {}  # (model, case) -> [(timeline, median step s)]
    cpu = None
    for label, model_dir in models.items():  # one model at a time, as it would be served
        print(f"{label}: loading it and its minimal-width copy ...", flush=True)
        case = EngineCase(model_dir)
        with tempfile.TemporaryDirectory() as scratch:
            tables = OpTableBench(case.model, model_dir, Path(scratch) / label)
        steps = [("decode", 1, DECODE_CONTEXT, f"decode(ctx={DECODE_CONTEXT})")]
        steps += [("prefill", n, 0, f"prefill({n})") for n in PREFILLS]
        written[label] = {"rounds": [], "routing": {name: case.routing(kind, tokens, context)
                                                    for kind, tokens, context, name in steps}}
        for r in range(args.rounds):
            print(f"{label} round {r + 1}/{args.rounds}: op tables, then steps ({args.threads} thread(s), {dtype}) ...",
                  flush=True)
            loads.append(os.getloadavg()[0])
            op_tables = tables.measure()
            written[label]["rounds"].append(op_tables.to_json())
            cpu = engine_cpu(op_tables, log=lambda _: None) if cpu is None else replace(cpu, op_tables=op_tables)
            for kind, tokens, context, name in steps:
                measured = statistics.median(case.times(kind, tokens, context, args.repeats, args.case_seconds))
                timeline = predict(cpu, case.config, kind, tokens, context, written[label]["routing"][name])
                per_round.setdefault((label, name), []).append((timeline, measured))
        del case, tables
        gc.collect()
    loads.append(os.getloadavg()[0])
    rows = [_row(f"{label} {name}", results, args.threads, loads) for (label, name), results in per_round.items()]
    if "slp" in cases:
        from hybridmoe.bench._slp_case import SLP_LAYERS, SLP_SHAPE, slp_rows

        model_dir = qwen_shaped_model(SLP_LAYERS, Path(args.cache) if args.cache else None, SLP_SHAPE)
        rows += slp_rows(model_dir, dtype, args.rounds, args.threads)
    if "ep" in cases:
        from hybridmoe.bench._ep_case import ep_rows
        from hybridmoe.bench._slp_case import SLP_LAYERS, SLP_SHAPE

        model_dir = qwen_shaped_model(SLP_LAYERS, Path(args.cache) if args.cache else None, SLP_SHAPE)
        rows += ep_rows(model_dir, dtype, args.rounds, args.threads)
    _print(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    if args.tables:
        Path(args.tables).write_text(json.dumps(written, indent=2) + "\n")
    return 0


def _row(name: str, results: list[tuple], threads: int, loads: list[float]) -> dict:
    """One case over the rounds: predicted_s from the round whose prediction is the median (its parts too),
    measured_s the median over rounds of each round's median step time."""
    ranked = sorted(results, key=lambda r: r[0].total_s)
    predicted = ranked[(len(ranked) - 1) // 2][0]
    measured = statistics.median(m for _, m in results)
    return {"name": name, "predicted_s": predicted.total_s, "measured_s": measured,
            "ratio": predicted.total_s / measured, "threads": threads, "load_average_1min": loads,
            "predicted_parts_s": parts_s(predicted),
            "rounds": [{"predicted_s": t.total_s, "measured_s": m} for t, m in results]}


def _print(rows: list[dict]) -> None:
    width = max(len(r["name"]) for r in rows)
    print(f"{'case'.ljust(width)}  predicted s  measured s  ratio  " + "  ".join(f"{p:>9}" for p in PARTS))
    for r in rows:
        print(f"{r['name'].ljust(width)}  {r['predicted_s']:11.5f}  {r['measured_s']:10.5f}  {r['ratio']:5.2f}  "
              + "  ".join(f"{r['predicted_parts_s'][p]:9.5f}" for p in PARTS))
    within = sum(abs(r["ratio"] - 1) <= 0.15 for r in rows)
    loads = ", ".join(f"{v:.1f}" for v in rows[0]["load_average_1min"])
    print(f"{within} of {len(rows)} cases within 15% ({rows[0]['threads']} thread(s) for torch and the kernels; "
          f"load average at each round's start (model after model) and at the end: {loads})")
