"""This engine's op tables on this machine (placement/op_tables.py): each op timed as it runs inside the engine.

For one model (loaded into the engine in its default compute dtype), `measure_op_tables` times: a projection at each
weight shape the model's parts multiply against tokens (weights rotated through as many bytes as the model's
weights hold, at most twice the last-level cache, so they come from where the engine finds them) and the fixed
cost of a 16x16 one; MLA's absorption products as the engine runs them (Absorption); the engine's paged-cache
attention at the model's head shape (decode against context, prefill against chunk length); the engine's
expert kernels per active expert against tokens per expert (the model's own weights, rotated cold); elementwise
ops against element count; and the engine's host cost on a minimal-width copy of the same architecture (head,
expert and layer counts kept). Ops run right after a step of the engine on that copy (OpTimer).

Legend: T tokens, C context, H hidden, E experts, K top-k, I expert intermediate, N heads, D head dim.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from hybridmoe.placement.modelspec import ModelSpec
from hybridmoe.placement.op_tables import OpTables, SecondsTable
from hybridmoe.profiling.timing import OpTimer, last_level_cache_bytes, median_s, rotating

BLOCK = 16
# Measurement grids: token and element counts in powers of 4 (a case falls between points and is
# interpolated); attention, whose cost bends where its score matrices leave the caches, in powers of 2.
LINEAR_TOKENS = (1, 4, 16, 64, 256, 1024)
LINEAR_MAX_FLOPS = 2e10  # a matmul is timed at token counts up to this much work (beyond: proportional)
ELEMENTS = tuple(4**i for i in range(3, 12))  # 64 .. 4M
DECODE_CONTEXTS = tuple(2**i for i in range(2, 13))  # 4 .. 4096
PREFILL_TOKENS = tuple(2**i for i in range(2, 11))  # 4 .. 1024
EXPERT_TOKENS = (1, 4, 16, 64, 256)
EXPERT_CALL_FLOPS = 4e9  # work per measured expert-kernel call: fewer experts per call at many tokens each
HOST_DECODE_CONTEXT, HOST_PREFILL_TOKENS = 16, 16  # where the minimal-width engine is timed
TINY_WIDTH = 32  # every width of the minimal-width copy (head dims 16)
KERNEL_FORMATS = {"f32": "fp32", "bf16": "bf16", "f16": "fp16", "fp8": "fp8", "int4": "int4", "int8": "int8"}


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


def measure_linear(timer: OpTimer, shapes: list[tuple[int, int]], dtype: torch.dtype, pool_bytes: int,
                   weight_dtype: torch.dtype | None = None) -> tuple[dict[tuple[int, int], SecondsTable], float]:
    """Seconds of the engine's projection (layers.linear.Linear: the kernels at few tokens, torch's matmul from
    FLOAT_KERNEL_MAX_TOKENS on) of x [T, cols] in dtype through a rows x cols weight in weight_dtype (default
    dtype), for each weight shape against LINEAR_TOKENS (those within LINEAR_MAX_FLOPS), each call with the next
    weights of a pool of `pool_bytes` of copies (or one, if larger). Also the fixed cost of one call (a 16x16
    weight, one token)."""
    from hybridmoe.layers.linear import Linear

    weight_dtype = weight_dtype or dtype
    pool = torch.randn(max(pool_bytes, 1) // weight_dtype.itemsize, dtype=weight_dtype)
    tables = {}
    for rows, cols in shapes:
        size = rows * cols
        weights = ([pool[k * size:(k + 1) * size].view(rows, cols) for k in range(pool.numel() // size)]
                   or [torch.randn(rows, cols, dtype=weight_dtype)])
        projections = [Linear.dense(w) for w in weights]
        tokens = [t for t in LINEAR_TOKENS if t == 1 or 2 * size * t <= LINEAR_MAX_FLOPS]
        seconds = []
        for t in tokens:
            x = torch.randn(t, cols, dtype=dtype)
            seconds.append(timer.median_s(rotating(projections, lambda projection: projection(x))))
        tables[(rows, cols)] = SecondsTable(tuple(tokens), tuple(seconds))
    x, tiny = torch.randn(1, 16, dtype=dtype), Linear.dense(torch.randn(16, 16, dtype=dtype))
    return tables, timer.median_s(lambda: tiny(x), min_repeats=20)


def measure_absorption(timer: OpTimer, config, dtype: torch.dtype) -> dict[tuple[int, int, int], SecondsTable]:
    """Seconds of the engine's two MLA absorption products (layers/attention_mla.Absorption's query and values: the
    kernels' per-head matmul at few tokens, torch's bmm from ABSORB_KERNEL_MAX_TOKENS on) against LINEAR_TOKENS, at
    the model's shapes, the operands laid out as the engine lays them out (q's no-rope half of [T, N, P+R] into the
    first L columns of [T, N, L+R]; W_uk^T made at load, W_uv a view of kv_b_proj). Empty for other attention."""
    from hybridmoe.layers.attention_mla import Absorption, uk_transposed, uv_heads

    a = config.attention
    if a.kind != "mla":
        return {}
    N, P, R, V, L = a.num_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim, a.kv_lora_rank
    kv_b = torch.randn(N * (P + V), L, dtype=dtype)
    absorption = Absorption(uk_transposed(kv_b, a), uv_heads(kv_b, a))

    def query(t: int):
        x, out = torch.randn(t, N, P + R, dtype=dtype)[..., :P], torch.empty(t, N, L + R, dtype=dtype)[..., :L]
        return lambda: absorption.query(x, out)

    def values(t: int):
        x = torch.randn(t, N, L, dtype=dtype)
        return lambda: absorption.values(x)

    tables = {}
    for key, op in (((N, L, P), query), ((N, V, L), values)):
        tokens = [t for t in LINEAR_TOKENS if t == 1 or 2 * N * key[1] * key[2] * t <= LINEAR_MAX_FLOPS]
        tables[key] = SecondsTable(tuple(tokens), tuple(timer.median_s(op(t)) for t in tokens))
    return tables


def weight_bytes(model) -> int:
    """Bytes of the weights one step of `model` may read (everything but the embedding table)."""
    from hybridmoe.layers.linear import Linear
    from hybridmoe.layers.moe.block import MoEBlock

    def tensors(obj) -> int:
        return sum(v.nbytes for v in vars(obj).values() if isinstance(v, (torch.Tensor, Linear)))

    total = model.lm_head.nbytes + model.norm.nbytes
    for layer in model.layers:
        total += tensors(layer.attention.w) + layer.input_norm.nbytes + layer.post_attention_norm.nbytes
        if isinstance(layer.mlp, MoEBlock):
            total += layer.mlp.router.weight.nbytes + layer.mlp.experts.moe.nbytes
            total += tensors(layer.mlp.shared) if layer.mlp.shared is not None else 0
        else:
            total += tensors(layer.mlp)
    return total


def measure_elementwise(timer: OpTimer, dtype: torch.dtype) -> SecondsTable:
    """Seconds of one elementwise product (a new tensor, as the engine's ops make) against element count. The
    bench times it without a step in between: the engine's elementwise ops read activations just written."""
    seconds = []
    for n in ELEMENTS:
        a, b = torch.randn(n, dtype=dtype), torch.randn(n, dtype=dtype)
        seconds.append(timer.median_s(lambda: a * b))
    return SecondsTable(ELEMENTS, tuple(seconds))


def measure_attention(timer: OpTimer, config, dtype: torch.dtype) -> tuple[SecondsTable, SecondsTable]:
    """The engine's context attention of one sequence at the model's head shape: (one query against C keys, read in
    place by the paged kernel as decode steps run it; a chunk of T queries from 0, each a query of the same kernel
    over its causal context as `paged_prefill` runs it, or paged-cache gather + attend + output copy where the
    kernel is switched off, as in layers/attention_*.py)."""
    from hybridmoe.layers.paged_attention import (DECODE_KERNEL, PREFILL_KERNEL, attend, decode_attention,
                                                  gather_context)

    a = config.attention
    if a.kind == "mla":  # one shared latent "head": keys are latent + rope key, values the latent
        heads, kv_heads, key_dim, value_dim, window = a.num_heads, 1, a.kv_lora_rank + a.qk_rope_head_dim, \
            a.kv_lora_rank, None
    else:
        heads, kv_heads, key_dim, value_dim, window = a.num_heads, a.num_kv_heads, a.head_dim, a.head_dim, \
            a.sliding_window
    blocks = -(-max(DECODE_CONTEXTS + PREFILL_TOKENS) // BLOCK)
    table = torch.arange(blocks)
    cache = torch.randn(2, blocks, BLOCK, kv_heads, key_dim, dtype=dtype)  # [2, NB, BS, Nk, D]
    values = cache[0][..., :value_dim] if a.kind == "mla" else cache[1]

    def call(queries: int, context: int):
        q = torch.randn(queries, heads, key_dim, dtype=dtype)
        out = torch.empty(queries, heads, value_dim, dtype=dtype)

        def gathered():
            k = gather_context(cache[0], table, context)  # [C, Nk, D]
            v = k[..., :value_dim] if a.kind == "mla" else gather_context(cache[1], table, context)
            out[0:queries] = attend(q, k, v, a.softmax_scale, window)

        if (queries == 1 and DECODE_KERNEL) or (queries > 1 and PREFILL_KERNEL):
            tables = table[None].expand(queries, -1)  # [T, NB]
            lens = torch.arange(context - queries + 1, context + 1)  # [T]: each query's causal context
            return timer.median_s(lambda: decode_attention(q, cache[0], values, tables, lens, a.softmax_scale,
                                                           window, out=out))
        return timer.median_s(gathered)

    decode = [call(1, c) for c in DECODE_CONTEXTS]
    prefill = [call(t, t) for t in PREFILL_TOKENS]
    return SecondsTable(DECODE_CONTEXTS, tuple(decode)), SecondsTable(PREFILL_TOKENS, tuple(prefill))


def measure_experts(timer: OpTimer, moe, top_k: int, dtype: torch.dtype) -> SecondsTable:
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
    return SecondsTable(EXPERT_TOKENS, tuple(per_expert))


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


def model_matmuls(spec: ModelSpec) -> list[tuple[int, int]]:
    """Every (rows, cols) weight shape the model's parts multiply (ModelSpec.part_matmuls), once each."""
    shapes = {s for layer in spec.layers for part in ("attention", "router", "shared", "dense")
              for s in spec.part_matmuls(part, layer.index)}
    return sorted(shapes | set(spec.part_matmuls("lm_head")))


class OpTableBench:
    """One model loaded into the engine and its minimal-width copy (its host cost), ready to measure the model's
    op tables any number of times (`measure`)."""

    def __init__(self, model, model_dir: Path, scratch: Path):
        from hybridmoe.models.loader import load_model
        from hybridmoe.runtime.model_runner import ModelRunner

        self.model = model
        self.tiny = load_model(minimal_width_copy(model_dir, scratch), "auto", "cpu", show_progress=False)
        self.tiny_runner = ModelRunner(self.tiny, 4, BLOCK)

    def between(self) -> None:
        """A prefill step of HOST_PREFILL_TOKENS tokens on the minimal-width copy (what OpTimer runs between
        timed calls)."""
        from hybridmoe.runtime.model_runner import SequenceChunk

        with torch.inference_mode():
            self.tiny_runner.forward([SequenceChunk(list(range(3, 3 + HOST_PREFILL_TOKENS)), 0, [0, 1, 2, 3])])

    def measure(self) -> OpTables:
        """Every table the cost model reads for this model, on this machine, now."""
        from hybridmoe.layers.linear import keeps_stored
        from hybridmoe.layers.moe.block import MoEBlock

        model, timer = self.model, OpTimer(self.between)
        dtype, spec = model.dtype, ModelSpec(model.config)
        pool = min(weight_bytes(model), 2 * last_level_cache_bytes())
        stored = getattr(torch, model.config.torch_dtype, dtype)
        linear, floor = measure_linear(timer, model_matmuls(spec), dtype, pool,
                                       weight_dtype=stored if keeps_stored(stored, dtype) else dtype)
        decode, prefill = measure_attention(timer, model.config, dtype)
        moe = next((l.mlp.experts.moe for l in model.layers if isinstance(l.mlp, MoEBlock)), None)
        if moe is None:
            raise ValueError(f"{model.config.source}: op tables are measured for MoE models (no MoE layer found)")
        return OpTables(
            linear=linear, linear_floor_s=floor, batched=measure_absorption(timer, model.config, dtype),
            elementwise=measure_elementwise(OpTimer(lambda: None), dtype), attention_shape=spec.attention_shape,
            attention_decode=decode, attention_prefill=prefill,
            expert_shape=(KERNEL_FORMATS[moe.fmt], moe.hidden_size, moe.intermediate_size),
            experts=measure_experts(timer, moe, model.config.moe.num_experts_per_tok, dtype),
            host=measure_host(self.tiny), threads=torch.get_num_threads(), dtype=str(dtype).removeprefix("torch."),
            notes={"ops": "matmul, absorption, attention and expert calls timed right after a step of the engine on "
                          "the minimal-width copy; elementwise ops back to back",
                   "linear": f"the engine's projections at the model's weight shapes, weights rotated through {pool >> 20} MiB",
                   "attention": "the engine's paged-cache gather + attend at the model's head shape",
                   "experts": f"the engine's FusedMoE ({moe.fmt}, H={moe.hidden_size}, I={moe.intermediate_size}), "
                              "seconds per active expert",
                   "host": f"the engine on a copy of the architecture at width {TINY_WIDTH}"})


def measure_op_tables(model_dir: str | Path) -> OpTables:
    """Load the model into the engine (default compute dtype, C++ expert kernels) and measure its op tables."""
    from hybridmoe.models.loader import load_model

    model = load_model(model_dir, "auto", "cpu", show_progress=False)
    with tempfile.TemporaryDirectory() as scratch:
        return OpTableBench(model, Path(model_dir), Path(scratch) / "minimal-width").measure()
