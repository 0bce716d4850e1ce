"""`hybridmoe bench costmodel [--json PATH]`: predicted next to measured step times of our engine, in one run.

For the demo model and a Qwen3-30B-A3B-shaped model (2 layers of real dimensions, random bf16 weights, built on
the fly and cached), the bench times a decode step (one sequence, 128 tokens cached) and CPU prefill of 128 and
512 tokens through the engine's ModelRunner (median of timed steps after a warm-up), and measures the tables
`placement.engine.predict_step` reads: F.linear at each of the model's weight shapes against tokens, MLA's
absorption einsums, the engine's paged-cache attention at the model's head shape, the engine's expert kernels
per active expert against tokens per expert, elementwise ops, and the engine's host cost on a minimal-width
copy of the same architecture. Ops are timed as they run inside the engine (OpTimer). The speed of the same op
drifts by tens of percent within minutes on a shared machine, so the bench runs several short rounds per model
(the models one after the other, each alone in the process as it would be served), each round's tables right
before its steps, and predicts each round from that round's tables (with the model's
config and the case's routing, counted once from the router's choices); the prediction never sees a step
timing. Reported: the median over rounds of the predictions and of the measured times, and every round's pair.

One thread for torch and the expert kernels by default (--threads): on a machine shared with other jobs every
parallel op otherwise waits for a descheduled thread. The JSON rows say the threads and the load average.
Legend: T tokens, C context, H hidden, E experts, K top-k, I expert intermediate, N heads, D head dim.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from hybridmoe.placement.engine import EngineTables, GridTable, predict_step
from hybridmoe.placement.engine_ops import weight_shapes

DECODE_CONTEXT = 128
PREFILLS = (128, 512)
BLOCK = 16
QWEN_SHAPE = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                  num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8)
# Measurement grids: token and element counts in powers of 4 (the cases fall between points and are
# interpolated); attention, whose cost bends where its score matrices leave the caches, in powers of 2.
LINEAR_TOKENS = (1, 4, 16, 64, 256, 1024)
LINEAR_MAX_FLOPS = 2e10  # F.linear is timed at token counts up to this much work (beyond: proportional)
ELEMENTS = tuple(4**i for i in range(3, 12))  # 64 .. 4M
DECODE_CONTEXTS = tuple(2**i for i in range(2, 13))  # 4 .. 4096
PREFILL_TOKENS = tuple(2**i for i in range(2, 11))  # 4 .. 1024
EXPERT_TOKENS = (1, 4, 16, 64, 256)
EXPERT_CALL_FLOPS = 4e9  # work per measured expert-kernel call: fewer experts per call at many tokens each
MAX_RUNS = 50  # timed runs of one measurement at most
HOST_DECODE_CONTEXT, HOST_PREFILL_TOKENS = 16, 16  # where the minimal-width engine is timed
TINY_WIDTH = 32  # every width of the minimal-width copy (head dims 16)


def register(subparsers) -> None:
    p = subparsers.add_parser("costmodel", help="cost-model predictions vs measured engine step times")
    p.add_argument("--json", metavar="PATH", help="write [{name, predicted_s, measured_s, ...}] to PATH")
    p.add_argument("--tables", metavar="PATH",
                   help="also write each model's measured tables and each case's routing counts to PATH")
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


WIDTH_KEYS = {"hidden_size": TINY_WIDTH, "intermediate_size": TINY_WIDTH, "moe_intermediate_size": TINY_WIDTH,
              "head_dim": 16, "kv_lora_rank": TINY_WIDTH, "q_lora_rank": TINY_WIDTH, "qk_nope_head_dim": 16,
              "qk_rope_head_dim": 16, "v_head_dim": 16, "vocab_size": 320}
DROPPED_KEYS = ("architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "auto_map",
                "quantization_config", "bos_token_id", "eos_token_id", "pad_token_id", "qk_head_dim")


def minimal_width_copy(model_dir: Path, out: Path) -> Path:
    """The same architecture (layer kinds, head, expert and top-k counts, routing) with every width cut to
    TINY_WIDTH (head dims 16), random weights stored in the model's dtype: where the engine's host cost shows."""
    from transformers.utils import logging

    from hybridmoe.checkpoint.synthetic import save_tiny_model

    logging.disable_progress_bar()
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    params = {k: v for k, v in raw.items() if k not in DROPPED_KEYS}
    params.update({k: min(v, raw[k]) for k, v in WIDTH_KEYS.items() if raw.get(k) is not None})
    stored = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(raw.get("torch_dtype", raw.get("dtype")),
                                                                        torch.float32)
    return save_tiny_model(out, raw["model_type"], seed=0, dtype=stored, **params)


# ---- timing -------------------------------------------------------------------------------------------
def timed_runs(fn, min_repeats: int = 3, budget_s: float = 0.1) -> list[float]:
    """Seconds of each timed run of fn: one warm-up, then at least min_repeats runs (more while within
    budget_s, at most MAX_RUNS)."""
    fn()
    times: list[float] = []
    while len(times) < min_repeats or (sum(times) < budget_s and len(times) < MAX_RUNS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def median_s(fn, min_repeats: int = 3, budget_s: float = 0.1) -> float:
    return statistics.median(timed_runs(fn, min_repeats, budget_s))


def last_level_cache_bytes() -> int:
    """Size of this CPU's largest cache (sysfs), 32 MiB when unknown."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()
            sizes.append(int(text[:-1]) * {"K": 2**10, "M": 2**20}[text[-1]] if text[-1] in "KM" else int(text))
        except (OSError, ValueError):
            continue
    return max(sizes, default=32 * 2**20)


# ---- tables ---------------------------------------------------------------------------------------------
class OpTimer:
    """Times single op calls the way they run inside the engine: each right after `between()` (untimed; the
    bench passes a step of the engine's code on the minimal-width copy), which leaves the core's caches, branch
    predictors and allocator as the engine's surrounding ops do. Measured on the development VM: a 128x256
    F.linear of 128 tokens took 140 us in a tight loop of its own, 210-300 us inside engine steps, 220-270 us
    after a minimal-width step."""

    def __init__(self, between):
        self.between = between

    def median_s(self, fn, min_repeats: int = 5, budget_s: float = 0.1) -> float:
        """Median seconds of fn() over at least min_repeats calls (more while within budget_s, at most
        MAX_RUNS), each after between(); one untimed call first."""
        fn()
        times: list[float] = []
        start = time.perf_counter()
        while len(times) < min_repeats or (time.perf_counter() - start < budget_s and len(times) < MAX_RUNS):
            self.between()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)


def rotating(pool: list, op):
    """A call that applies op to the next item of pool each time (cyclically)."""
    cursor = [0]

    def call():
        op(pool[cursor[0] % len(pool)])
        cursor[0] += 1
    return call


def measure_linear(timer: OpTimer, shapes: list[tuple[int, int]], dtype: torch.dtype,
                   pool_bytes: int) -> tuple[dict[tuple[int, int], GridTable], float]:
    """Seconds of F.linear(x [T, cols], W [rows, cols]) for each weight shape against LINEAR_TOKENS (those
    within LINEAR_MAX_FLOPS), each call with the next weights of a pool of `pool_bytes` of copies (or one, if
    larger). Also the fixed cost of one call (a 16x16 weight, one token)."""
    pool = torch.randn(max(pool_bytes, 1) // dtype.itemsize, dtype=dtype)
    tables = {}
    for rows, cols in shapes:
        size = rows * cols
        weights = ([pool[k * size:(k + 1) * size].view(rows, cols) for k in range(pool.numel() // size)]
                   or [torch.randn(rows, cols, dtype=dtype)])
        tokens = [t for t in LINEAR_TOKENS if t == 1 or 2 * size * t <= LINEAR_MAX_FLOPS]
        seconds = []
        for t in tokens:
            x = torch.randn(t, cols, dtype=dtype)
            seconds.append(timer.median_s(rotating(weights, lambda w: torch.nn.functional.linear(x, w))))
        tables[(rows, cols)] = GridTable((tuple(tokens),), np.array(seconds))
    x, w = torch.randn(1, 16, dtype=dtype), torch.randn(16, 16, dtype=dtype)
    return tables, timer.median_s(lambda: torch.nn.functional.linear(x, w), min_repeats=20)


def measure_einsums(timer: OpTimer, config, dtype: torch.dtype) -> dict[tuple[int, int, int], GridTable]:
    """Seconds of the engine's two MLA absorption einsums (layers/attention_mla.py) against LINEAR_TOKENS, at
    the model's shapes, the operands laid out as the engine lays them out (q's no-rope half of [T, N, P+R];
    W_uk and W_uv strided views of kv_b_proj). Empty for other attention."""
    a = config.attention
    if a.kind != "mla":
        return {}
    N, P, R, V, L = a.num_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim, a.kv_lora_rank
    kv_b = torch.randn(N * (P + V), L, dtype=dtype).view(N, P + V, L)
    cases = (((N, L, P), "tnp,npl->tnl", lambda t: torch.randn(t, N, P + R, dtype=dtype)[..., :P], kv_b[:, :P]),
             ((N, V, L), "tnl,nvl->tnv", lambda t: torch.randn(t, N, L, dtype=dtype), kv_b[:, P:]))
    tables = {}
    for key, equation, make_x, w in cases:
        tokens = [t for t in LINEAR_TOKENS if t == 1 or 2 * N * key[1] * key[2] * t <= LINEAR_MAX_FLOPS]
        seconds = []
        for t in tokens:
            x = make_x(t)
            seconds.append(timer.median_s(lambda: torch.einsum(equation, x, w)))
        tables[key] = GridTable((tuple(tokens),), np.array(seconds))
    return tables


def weight_bytes(model) -> int:
    """Bytes of the weights one step of `model` may read (everything but the embedding table)."""
    from hybridmoe.layers.moe.block import MoEBlock

    def tensors(obj) -> int:
        return sum(v.nbytes for v in vars(obj).values() if isinstance(v, torch.Tensor))

    total = model.lm_head.nbytes + model.norm.nbytes
    for layer in model.layers:
        total += tensors(layer.attention.w) + layer.input_norm.nbytes + layer.post_attention_norm.nbytes
        if isinstance(layer.mlp, MoEBlock):
            total += layer.mlp.router.weight.nbytes + layer.mlp.experts.moe.nbytes
            total += tensors(layer.mlp.shared) if layer.mlp.shared is not None else 0
        else:
            total += tensors(layer.mlp)
    return total


def measure_elementwise(timer: OpTimer, dtype: torch.dtype) -> GridTable:
    """Seconds of one elementwise product (a new tensor, as the engine's ops make) against element count. The
    bench times it without a step in between: the engine's elementwise ops read activations just written."""
    seconds = []
    for n in ELEMENTS:
        a, b = torch.randn(n, dtype=dtype), torch.randn(n, dtype=dtype)
        seconds.append(timer.median_s(lambda: a * b))
    return GridTable((ELEMENTS,), np.array(seconds))


def measure_attention(timer: OpTimer, config, dtype: torch.dtype) -> tuple[GridTable, GridTable]:
    """The engine's context attention of one sequence (paged-cache gather + attend + output copy, as in
    layers/attention_*.py) at the model's head shape: (one query against C keys, a chunk of T queries from 0)."""
    from hybridmoe.layers.paged_attention import attend, gather_context

    a = config.attention
    if a.kind == "mla":  # one shared latent "head": keys are latent + rope key, values the latent
        heads, kv_heads, key_dim, value_dim, window = a.num_heads, 1, a.kv_lora_rank + a.qk_rope_head_dim, \
            a.kv_lora_rank, None
    else:
        heads, kv_heads, key_dim, value_dim, window = a.num_heads, a.num_kv_heads, a.head_dim, a.head_dim, \
            a.sliding_window
    blocks = -(-max(DECODE_CONTEXTS + PREFILL_TOKENS) // BLOCK)
    table = torch.arange(blocks)
    cache = torch.randn(2, blocks, BLOCK, kv_heads, key_dim, dtype=dtype)

    def call(queries: int, context: int):
        q = torch.randn(queries, heads, key_dim, dtype=dtype)
        out = torch.empty(queries, heads, value_dim, dtype=dtype)

        def body():
            k = gather_context(cache[0], table, context)  # [C, Nk, D]
            v = k[..., :value_dim] if a.kind == "mla" else gather_context(cache[1], table, context)
            out[0:queries] = attend(q, k, v, a.softmax_scale, window)
        return timer.median_s(body)

    decode = [call(1, c) for c in DECODE_CONTEXTS]
    prefill = [call(t, t) for t in PREFILL_TOKENS]
    return GridTable((DECODE_CONTEXTS,), np.array(decode)), GridTable((PREFILL_TOKENS,), np.array(prefill))


def measure_experts(timer: OpTimer, moe, top_k: int, dtype: torch.dtype) -> GridTable:
    """Seconds per active expert of one call of a layer's expert kernels (`moe`: the engine's FusedMoE, its
    own weights) against tokens per expert: each call routes tokens to top_k of n experts so that every one of
    them gets t tokens, the n experts rotate between calls (cold, as in a model), and the fixed cost of a call
    (a 16x16 expert, one token) is left out."""
    from hybridmoe.kernels.moe import FusedMoE

    tiny = FusedMoE("f32", [torch.randn(16, 16)], [torch.randn(16, 16)], [torch.randn(16, 16)],
                    hidden_size=16, intermediate_size=16)
    one, x1, w1 = torch.zeros(1, 1, dtype=torch.int64), torch.randn(1, 16), torch.ones(1, 1)
    fixed = timer.median_s(lambda: tiny(x1, one, w1), min_repeats=20)
    E, H, I = moe.num_experts, moe.hidden_size, moe.intermediate_size
    per_expert = []
    for t in EXPERT_TOKENS:
        n = int(min(E, max(1, EXPERT_CALL_FLOPS // (6 * H * I * t))))
        n = max(top_k, n // top_k * top_k)  # every token's top_k experts distinct, every expert t tokens
        x = torch.randn(n * t // top_k, H, dtype=dtype)
        weights = torch.full((n * t // top_k, top_k), 1.0 / top_k)
        pairs = torch.arange(n * t) % n  # [n*t] expert of each (token, slot), t of each
        ids = [((pairs + offset) % E).view(-1, top_k) for offset in range(0, E, n)]  # [n*t/K, K] per rotation
        seconds = timer.median_s(rotating(ids, lambda i: moe(x, i, weights)), budget_s=0.3)
        per_expert.append(max(1e-9, (seconds - fixed) / n))
    return GridTable((EXPERT_TOKENS,), np.array(per_expert))


def measure_host(model) -> dict[str, dict[str, float]]:
    """The engine's step time on `model` (a minimal-width copy, see minimal_width_copy) with no layers, only its
    dense layers and only its MoE layers: host cost per step and per layer kind, for decode and prefill."""
    from hybridmoe.runtime.model_runner import ModelRunner, SequenceChunk

    runner = ModelRunner(model, 4, BLOCK)
    table = list(range(4))
    tokens = list(range(3, 3 + HOST_PREFILL_TOKENS))
    layers = model.layers
    kinds = {"dense_layer": [l for l, moe in zip(layers, model.config.moe_layers) if not moe],
             "moe_layer": [l for l, moe in zip(layers, model.config.moe_layers) if moe]}
    steps = {"decode": lambda: runner.forward([SequenceChunk(tokens[:1], HOST_DECODE_CONTEXT, table)]),
             "prefill": lambda: runner.forward([SequenceChunk(tokens, 0, table)])}
    host: dict[str, dict[str, float]] = {}
    try:
        with torch.inference_mode():
            runner.forward([SequenceChunk(tokens, 0, table)])  # fill the cache the decode step reads
            for kind, step in steps.items():
                model.layers = []
                base = median_s(step, min_repeats=30, budget_s=0.3)
                host[kind] = {"step": base}
                for part, subset in kinds.items():
                    model.layers = subset
                    host[kind][part] = (median_s(step, min_repeats=30, budget_s=0.3) - base) / len(subset) \
                        if subset else 0.0
    finally:
        model.layers = layers
    return host


class ModelBench:
    """One model in our engine (its timed cases) and its minimal-width copy (its host cost), both loaded."""

    def __init__(self, model_dir: Path, scratch: Path):
        from hybridmoe.models.loader import load_model
        from hybridmoe.runtime.model_runner import ModelRunner

        self.case = EngineCase(model_dir)
        self.tiny = load_model(minimal_width_copy(model_dir, scratch), "auto", "cpu", show_progress=False)
        self.tiny_runner = ModelRunner(self.tiny, 4, BLOCK)
        self.cases = [("decode", 1, DECODE_CONTEXT, f"decode(ctx={DECODE_CONTEXT})")]
        self.cases += [("prefill", n, 0, f"prefill({n})") for n in PREFILLS]

    def between(self) -> None:
        """A prefill step of HOST_PREFILL_TOKENS tokens on the minimal-width copy (what OpTimer runs between
        timed calls)."""
        from hybridmoe.runtime.model_runner import SequenceChunk

        with torch.inference_mode():
            self.tiny_runner.forward([SequenceChunk(list(range(3, 3 + HOST_PREFILL_TOKENS)), 0, [0, 1, 2, 3])])

    def tables(self) -> EngineTables:
        """Every table `predict_step` reads for this model, on this machine, now."""
        from hybridmoe.layers.moe.block import MoEBlock

        model, dtype, timer = self.case.model, self.case.model.dtype, OpTimer(self.between)
        pool = min(weight_bytes(model), 2 * last_level_cache_bytes())
        shapes = weight_shapes(model.config)
        linear, floor = measure_linear(timer, [s for s in shapes if len(s) == 2], dtype, pool)
        decode, prefill = measure_attention(timer, model.config, dtype)
        moe = next(l.mlp.experts.moe for l in model.layers if isinstance(l.mlp, MoEBlock))
        return EngineTables(
            linear=linear, linear_floor=floor, batched=measure_einsums(timer, model.config, dtype),
            elementwise=measure_elementwise(OpTimer(lambda: None), dtype), attention_decode=decode,
            attention_prefill=prefill,
            experts=measure_experts(timer, moe, model.config.moe.num_experts_per_tok, dtype),
            host=measure_host(self.tiny), threads=torch.get_num_threads(),
            compute_dtype=str(dtype).removeprefix("torch."),
            notes={"ops": "linear, einsum, attention and expert calls timed right after a step of the engine on "
                          "the minimal-width copy; elementwise ops back to back",
                   "linear": f"F.linear at the model's weight shapes, weights rotated through {pool >> 20} MiB",
                   "attention": "the engine's paged-cache gather + attend at the model's head shape",
                   "experts": f"the engine's FusedMoE ({moe.fmt}, H={moe.hidden_size}, I={moe.intermediate_size}), "
                              "seconds per active expert",
                   "host": f"the engine on a copy of the architecture at width {TINY_WIDTH}"})

    def time_cases(self, repeats: int, seconds: float) -> dict[str, list[float]]:
        return {name: self.case.times(kind, tokens, context, repeats, seconds)
                for kind, tokens, context, name in self.cases}


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


def run(args) -> int:
    from hybridmoe.checkpoint.default_model import default_model_dir
    from hybridmoe.kernels import isa
    from hybridmoe.models.loader import resolve_dtype

    torch.set_num_threads(args.threads)
    isa.configure_threads(args.threads)
    dtype = resolve_dtype("auto")
    if args.models:
        models = {Path(d).name: Path(d) for d in args.models.split(",") if d.strip()}
    else:
        models = {"demo": Path(default_model_dir()), f"qwen3-30b-a3b-{args.layers}l":
                  qwen_shaped_model(args.layers, Path(args.cache) if args.cache else None)}
    loads: list[float] = []
    written: dict[str, dict] = {}
    per_round: dict[tuple[str, str], list[tuple]] = {}  # (model, case) -> [(prediction, median step s)]
    for label, model_dir in models.items():  # one model at a time, as it would be served
        print(f"{label}: loading it and its minimal-width copy ...", flush=True)
        with tempfile.TemporaryDirectory() as scratch:
            bench = ModelBench(model_dir, Path(scratch) / label)
        written[label] = {"rounds": [], "routing": {name: bench.case.routing(kind, tokens, context)
                                                    for kind, tokens, context, name in bench.cases}}
        for r in range(args.rounds):
            print(f"{label} round {r + 1}/{args.rounds}: tables, then steps ({args.threads} thread(s), {dtype}) ...",
                  flush=True)
            loads.append(os.getloadavg()[0])
            tables = bench.tables()
            written[label]["rounds"].append(tables.to_json())
            runs = bench.time_cases(args.repeats, args.case_seconds)
            for kind, tokens, context, name in bench.cases:
                predicted = predict_step(bench.case.config, tables, kind, tokens, context,
                                         written[label]["routing"][name])
                per_round.setdefault((label, name), []).append((predicted, statistics.median(runs[name])))
        del bench
        gc.collect()
    loads.append(os.getloadavg()[0])
    rows = [_row(f"{label} {name}", results, args.threads, loads) for (label, name), results in per_round.items()]
    _print(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    if args.tables:
        Path(args.tables).write_text(json.dumps(written, indent=2) + "\n")
    return 0


def _row(name: str, results: list[tuple], threads: int, loads: list[float]) -> dict:
    """One case over the rounds: predicted_s from the round whose prediction is the median (its parts too),
    measured_s the median over rounds of each round's median step time."""
    ranked = sorted(results, key=lambda r: r[0].seconds)
    predicted = ranked[(len(ranked) - 1) // 2][0]
    measured = statistics.median(m for _, m in results)
    return {"name": name, "predicted_s": predicted.seconds, "measured_s": measured,
            "ratio": predicted.seconds / measured, "threads": threads, "load_average_1min": loads,
            "predicted_parts_s": predicted.parts,
            "rounds": [{"predicted_s": p.seconds, "measured_s": m} for p, m in results]}


def _print(rows: list[dict]) -> None:
    width = max(len(r["name"]) for r in rows)
    parts = list(rows[0]["predicted_parts_s"])
    print(f"{'case'.ljust(width)}  predicted s  measured s  ratio  " + "  ".join(f"{p:>11}" for p in parts))
    for r in rows:
        print(f"{r['name'].ljust(width)}  {r['predicted_s']:11.5f}  {r['measured_s']:10.5f}  {r['ratio']:5.2f}  "
              + "  ".join(f"{r['predicted_parts_s'][p]:11.5f}" for p in parts))
    within = sum(abs(r["ratio"] - 1) <= 0.15 for r in rows)
    loads = ", ".join(f"{v:.1f}" for v in rows[0]["load_average_1min"])
    print(f"{within} of {len(rows)} cases within 15% ({rows[0]['threads']} thread(s) for torch and the kernels; "
          f"load average at each round's start (model after model) and at the end: {loads})")
