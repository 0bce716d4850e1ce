"""`hybridmoe bench costmodel [--json PATH]`: the cost model's predictions next to measured times of our engine.

In one run: profile this machine (quick; or --profile FILE), then for two model sizes - the demo model and a
Qwen3-30B-A3B-shaped model with 2 layers of real dimensions and random bf16 weights (built on the fly, cached)
- time a decode step (one sequence, 128 tokens cached) and CPU prefill of 128 and 512 tokens through the
engine's ModelRunner, and predict each with the cost model on the measured profile. The prediction knows the
model's shapes, the profile's rates and how many ops our forward launches (counted, not timed); it never sees
the timings it is compared with.

Reported per case: predicted_s, measured_s (median of repeats) and their ratio. Goal: within 15%. Machines
shared with other jobs make both numbers noisy: the ratio is what to read.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from hybridmoe.placement import estimate
from hybridmoe.placement.costmodel import CostModel
from hybridmoe.placement.hardware import Machine, load_profile
from hybridmoe.placement.modelspec import ModelSpec
from hybridmoe.placement.passes import PassBuilder, Residency

DECODE_CONTEXT = 128
PREFILLS = (128, 512)
BLOCK = 16
QWEN_SHAPE = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                  num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8)


def register(subparsers) -> None:
    p = subparsers.add_parser("costmodel", help="cost-model predictions vs measured engine step times")
    p.add_argument("--json", metavar="PATH", help="write [{name, predicted_s, measured_s}] to PATH")
    p.add_argument("--profile", help="use this measured profile instead of profiling now")
    p.add_argument("--layers", type=int, default=2, help="layers of the Qwen3-30B-shaped model (default 2)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per case (median)")
    p.add_argument("--cache", default=None, help="where to build the Qwen3-shaped model (default: user cache)")
    p.add_argument("--threads", type=int, default=None,
                   help="threads for torch and the kernels, profile and engine alike (default: all CPUs; use 1 "
                        "on a machine shared with other jobs, where idle threads wait at every barrier)")
    p.set_defaults(func=run)


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
    """One model loaded into our engine's runner, with a KV cache for the longest case."""

    def __init__(self, model_dir: Path):
        from hybridmoe.models.loader import load_model
        from hybridmoe.runtime.model_runner import ModelRunner

        self.model = load_model(model_dir, "bfloat16", "cpu", show_progress=False)
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
    def prefill_s(self, tokens: int, repeats: int) -> tuple[float, int]:
        run = lambda: self.runner.forward(self.chunk(0, tokens))
        ops = count_aten_ops(run)
        return _median(run, repeats), ops

    @torch.inference_mode()
    def decode_s(self, context: int, repeats: int) -> tuple[float, int]:
        self.runner.forward(self.chunk(0, context))  # fill the cache
        run = lambda: self.runner.forward(self.chunk(context, 1))
        ops = count_aten_ops(run)
        return _median(run, repeats), ops


def count_aten_ops(fn) -> int:
    """How many aten ops one call of fn dispatches (a count of the implementation, not a timing)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counter.ops += 1
            return func(*args, **(kwargs or {}))

    with Counter():
        fn()
    return Counter.ops


def profile_now(threads: int, out: Path) -> Path:
    """Run `hybridmoe profile --quick` in a child process (the same command a user runs) with `threads`."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "hybridmoe.cli", "profile", "--quick", "--formats", "bf16", "--threads",
           str(threads), "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"hybridmoe profile failed: {done.stderr.strip()[-500:]}")
    return out


def _median(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def predict(machine: Machine, config, kind: str, tokens: int, ops: int) -> float:
    """The cost model for our engine on this machine: every non-expert part on the accelerator stand-in (torch),
    routed experts on the CPU kernels, MLA in the absorbed form the engine uses."""
    spec = ModelSpec(config, "bench")
    cost = CostModel(machine, spec, "bf16", "bf16", mla_form="absorbed")
    builder = PassBuilder(cost, Residency.all_but_experts(len(spec.layers), len(spec.moe_layers)), ops_per_step=ops)
    if kind == "decode":
        return estimate.decode(builder, 1, tokens).step_s
    return estimate.prefill(builder, "hybrid", tokens).ttft_s


def run(args) -> int:
    import os

    from hybridmoe.checkpoint.default_model import default_model_dir
    from hybridmoe.kernels import isa

    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    isa.configure_threads(threads)
    if args.profile:
        profile = load_profile(args.profile)
    else:
        import tempfile

        print("profiling this machine (hybridmoe profile --quick) ...", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            profile = load_profile(profile_now(threads, Path(tmp) / "profile.json"))
    machine = Machine(profile.name, profile.cpu, profile.gpu, 1)
    models = {"demo": Path(default_model_dir()),
              f"qwen3-30b-a3b-{args.layers}l": qwen_shaped_model(args.layers, Path(args.cache) if args.cache else None)}
    rows = []
    for label, model_dir in models.items():
        print(f"loading {label} ...", flush=True)
        case = EngineCase(model_dir)
        measured = {f"decode(ctx={DECODE_CONTEXT})": ("decode", DECODE_CONTEXT, *case.decode_s(DECODE_CONTEXT,
                                                                                                args.repeats))}
        for n in PREFILLS:
            measured[f"prefill({n})"] = ("prefill", n, *case.prefill_s(n, args.repeats))
        for name, (kind, tokens, seconds, ops) in measured.items():
            predicted = predict(machine, case.config, kind, tokens, ops)
            rows.append({"name": f"{label} {name}", "predicted_s": predicted, "measured_s": seconds,
                         "ratio": predicted / seconds, "ops": ops})
        del case
    width = max(len(r["name"]) for r in rows)
    print(f"{'case'.ljust(width)}  predicted s  measured s  predicted/measured")
    for r in rows:
        print(f"{r['name'].ljust(width)}  {r['predicted_s']:11.5f}  {r['measured_s']:10.5f}  {r['ratio']:18.2f}")
    within = sum(abs(r["ratio"] - 1) <= 0.15 for r in rows)
    print(f"{within} of {len(rows)} cases within 15% ({threads} threads; profile: {profile.description})")
    if args.json:
        Path(args.json).write_text(json.dumps([{k: r[k] for k in ("name", "predicted_s", "measured_s")}
                                               for r in rows], indent=2) + "\n")
    return 0
