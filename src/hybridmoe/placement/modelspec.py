"""What a model weighs and costs, per layer and per component, derived from the normalised config.

`ModelSpec` counts the weights of every part the planner places separately (attention half, router, shared
experts, dense MLP, one routed expert, embedding, LM head), the KV-cache bytes per token, and the
floating-point work of a forward pass over T tokens, including attention against a context. Counts match
Hugging Face's own modules exactly (checked by the tests on tiny configs). Packaged configs of the large
models (`resolve_model("deepseek-v3")`) let the planner run without weights.

MLA attention has two forms: "absorbed" (attention in the latent space; the engine's form, cheap per token,
dear per query-key pair) and "expanded" (latents decompressed into per-head keys/values once per chunk; the
usual form for long prefills). Legend: T tokens, H hidden, N heads, L kv_lora_rank, R rope dims, P no-rope
q/k dims, V value dims, C context, K top-k, I expert intermediate size.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from hybridmoe.config import ModelConfig, load_config, parse_config
from hybridmoe.config.families import PACKAGED_ALIASES, PACKAGED_MODELS  # noqa: F401 (PACKAGED_MODELS: re-exported)

KV_CACHE_BYTES = 2  # the engine caches keys/values (or MLA latents) in bf16
QUERY_BLOCK = 4096  # prefill attention processes at most this many queries at a time
MLP_BLOCK = 65536  # and the MLP at most this many (token, expert) pairs at a time


def resolve_model(name_or_dir: str | Path) -> ModelConfig:
    """A model directory (with config.json) or the name of a packaged config (e.g. "DeepSeek-V3",
    "deepseek-ai/DeepSeek-V3", "Qwen/Qwen3-30B-A3B"); each family lists its packaged models and their other
    names (hybridmoe.config.families), their config.json files are in data/models."""
    path = Path(name_or_dir)
    if path.is_dir():
        return load_config(path)
    key = str(name_or_dir).strip().lower().rsplit("/", 1)[-1]
    if key not in PACKAGED_ALIASES:
        raise ValueError(f"{name_or_dir!r} is neither a model directory nor a packaged model; "
                         f"packaged: {', '.join(PACKAGED_MODELS)}")
    directory = PACKAGED_ALIASES[key]
    text = resources.files("hybridmoe.placement").joinpath(f"data/models/{directory}/config.json")
    return parse_config(json.loads(text.read_text()), source=f"packaged:{directory}/config.json")


@dataclass(frozen=True)
class LayerShape:
    """Weights (element counts) of one decoder layer, by the parts the planner places separately."""

    index: int
    attention: int  # projections + both RMSNorms of the block (the "attention half" with its norms)
    dense_mlp: int  # gate/up/down of a dense layer (0 in MoE layers)
    router: int  # gate weight (+ DeepSeek's correction bias)
    shared_experts: int
    expert: int  # one routed expert (gate, up, down)
    num_experts: int

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


class ModelSpec:
    """Weights, KV bytes and FLOPs of a model (see module docstring)."""

    def __init__(self, config: ModelConfig, name: str | None = None):
        self.config = config
        self.name = name or Path(config.source).parent.name or config.model_type
        c, a, m = config, config.attention, config.moe
        self.hidden = c.hidden_size
        self.top_k = m.num_experts_per_tok
        self.num_experts = m.num_experts
        self.expert_intermediate = m.intermediate_size
        if a.kind == "mla":
            n, p, r, v, lat = a.num_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim, a.kv_lora_rank
            q = c.hidden_size * n * (p + r) if a.q_lora_rank is None else (
                c.hidden_size * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * n * (p + r))
            self.kv_b_weights = lat * n * (p + v)
            norms = lat + (a.q_lora_rank or 0)  # kv_a_layernorm, q_a_layernorm
            attn = q + c.hidden_size * (lat + r) + lat + self.kv_b_weights + n * v * c.hidden_size
            self.kv_values_per_token = lat + r
        else:
            n, hd, kv = a.num_heads, a.head_dim, a.num_kv_heads
            attn = c.hidden_size * hd * (n + 2 * kv) + n * hd * c.hidden_size
            norms = ((n + 2 * kv) * hd if a.bias else 0) + (2 * hd if a.qk_norm else 0)  # biases, q/k norms
            attn += norms
            self.kv_b_weights = 0
            self.kv_values_per_token = 2 * kv * hd
        attn += 2 * c.hidden_size  # input_layernorm + post_attention_layernorm
        self.attention_matmul_weights = attn - norms - 2 * c.hidden_size  # what the projections multiply
        bias = m.num_experts if m.topk_method == "noaux_tc" else 0
        expert = 3 * c.hidden_size * m.intermediate_size
        self.layers = tuple(
            LayerShape(i, attn, 0 if is_moe else 3 * c.hidden_size * c.intermediate_size,
                       m.num_experts * c.hidden_size + bias if is_moe else 0,
                       3 * c.hidden_size * m.shared_intermediate_size if is_moe else 0,
                       expert if is_moe else 0, m.num_experts if is_moe else 0)
            for i, is_moe in enumerate(c.moe_layers))
        self.embedding = c.vocab_size * c.hidden_size
        self.lm_head = 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size
        self.final_norm = c.hidden_size
        self.native_format = "fp8" if c.quantization is not None else "bf16"
        # routed experts as stored: quantised by `hybridmoe quantize`, FP8, or the checkpoint's float type; the
        # other projections quantised too where quantize converted them all
        stored = {"float32": "fp32", "float16": "fp16"}.get(c.torch_dtype, self.native_format)
        quant = c.expert_quantization
        self.expert_format = quant.method if quant else stored
        self.dense_format = quant.method if quant and quant.scope == "all" else self.native_format

    # ---- weights -------------------------------------------------------------------------------------
    @functools.cached_property
    def moe_layers(self) -> tuple[LayerShape, ...]:
        return tuple(layer for layer in self.layers if layer.is_moe)

    def total_weights(self) -> int:
        per_layer = sum(l.attention + l.dense_mlp + l.router + l.shared_experts + l.expert * l.num_experts
                        for l in self.layers)
        return per_layer + self.embedding + self.lm_head + self.final_norm

    def active_weights(self) -> int:
        """Weights one token multiplies with (embedding lookup excluded, LM head included)."""
        per_layer = sum(l.attention + l.dense_mlp + l.router + l.shared_experts + l.expert * self.top_k
                        for l in self.layers)
        return per_layer + (self.lm_head or self.embedding) + self.final_norm

    def routed_expert_weights(self) -> int:
        return sum(l.expert * l.num_experts for l in self.layers)

    # ---- KV cache -----------------------------------------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token occupies over all layers (MLA: latent + rope key; GQA: K and V)."""
        return self.kv_values_per_token * KV_CACHE_BYTES * len(self.layers)

    # ---- arithmetic ---------------------------------------------------------------------------------
    def attention_pairs(self, query_tokens: int, context_before: int) -> float:
        """Causal query-key pairs of `query_tokens` new tokens after `context_before` cached ones."""
        window = self.config.attention.sliding_window
        t, c = query_tokens, context_before
        full = t * c + t * (t + 1) / 2
        if window is None or c + t <= window:
            return full
        # each query sees at most `window` keys
        capped_from = max(0, window - c)  # queries before this index see fewer than `window` keys
        head = min(t, capped_from)
        return head * c + head * (head + 1) / 2 + (t - head) * window

    def mla_form(self, query_tokens: int, form: str = "auto") -> str:
        if form not in ("auto", "absorbed", "expanded"):
            raise ValueError(f"MLA form must be auto|absorbed|expanded, got {form!r}")
        if form != "auto":
            return form
        return "absorbed" if query_tokens <= 64 else "expanded"

    def _pair_flops(self, query_tokens: int, form: str) -> float:
        a = self.config.attention
        if a.kind != "mla":
            return 4 * a.num_heads * a.head_dim
        n, p, r, v, lat = a.num_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim, a.kv_lora_rank
        if self.mla_form(query_tokens, form) == "absorbed":
            return 2 * n * (lat + r) + 2 * n * lat
        return 2 * n * (p + r) + 2 * n * v

    def attention_linear_flops(self, query_tokens: int, context_before: int, form: str = "auto") -> float:
        """Matmul FLOPs of one layer's attention half for a chunk (they run at the weights' matmul rate).

        Projections for every query; MLA absorbed adds the W_uk absorption (N*P*L) and W_uv expansion
        (N*L*V) per query; MLA expanded instead decompresses every context latent through kv_b (C+T tokens).
        """
        a = self.config.attention
        projections = 2 * (self.attention_matmul_weights - self.kv_b_weights) * query_tokens
        if a.kind != "mla":
            return projections
        n, p, v, lat = a.num_heads, a.qk_nope_head_dim, a.v_head_dim, a.kv_lora_rank
        if self.mla_form(query_tokens, form) == "absorbed":
            return projections + (2 * n * p * lat + 2 * n * lat * v) * query_tokens
        return projections + 2 * self.kv_b_weights * (context_before + query_tokens)

    def attention_pair_flops(self, query_tokens: int, context_before: int, form: str = "auto") -> float:
        """Score and value-product FLOPs of one layer (what an attention kernel does): pairs x per-pair
        FLOPs; MLA absorbed 2N(L+R) + 2NL, MLA expanded 2N(P+R) + 2NV, GQA 4*N*head_dim."""
        return self.attention_pairs(query_tokens, context_before) * self._pair_flops(query_tokens, form)

    def attention_activation_bytes(self, query_tokens: int, keys: int, form: str = "auto") -> float:
        """Transient accelerator memory of one layer's attention for `query_tokens` queries against `keys`
        keys (the chunk included), bf16. Queries are processed in sub-chunks of at most QUERY_BLOCK tokens
        (attention is independent per query), so only one sub-chunk's queries and outputs are live; MLA
        expanded also holds every key's decompressed per-head key and value once per layer."""
        a = self.config.attention
        block = min(query_tokens, QUERY_BLOCK)
        if a.kind != "mla":
            return 2 * block * a.num_heads * a.head_dim * 2
        n, p, r, v, lat = a.num_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim, a.kv_lora_rank
        if self.mla_form(query_tokens, form) == "absorbed":
            return block * n * (lat + r + lat) * 2
        return (block + max(keys, query_tokens)) * n * (p + r + v) * 2

    def activation_bytes(self, chunk_tokens: int, keys: int, form: str = "auto") -> float:
        """Peak transient accelerator memory of a prefill chunk attending to `keys` keys: the residual
        stream, its normed copy and an fp32 MoE accumulator (8 bytes per hidden value), one layer's attention
        working set, and the MLP intermediate of at most MLP_BLOCK (token, expert) pairs at a time (bf16)."""
        width = max([self.expert_intermediate] * bool(self.moe_layers)
                    + [l.dense_mlp // (3 * self.hidden) for l in self.layers if l.dense_mlp])
        pairs = min(chunk_tokens * (self.top_k if self.moe_layers else 1), MLP_BLOCK)
        return (chunk_tokens * self.hidden * 8 + self.attention_activation_bytes(chunk_tokens, keys, form)
                + pairs * 2 * width * 2)

    # ---- the matrices each part multiplies (the shapes an engine's measured op tables are read at) ------
    @functools.cached_property
    def attention_matmuls(self) -> tuple[tuple[int, int], ...]:
        """(rows, cols) of every projection a query goes through in one attention half (MLA: absorbed form,
        kv_b_proj enters through `absorption_matmuls` instead)."""
        a, H = self.config.attention, self.hidden
        if a.kind != "mla":
            q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
            return ((q, H), (kv, H), (kv, H), (H, q))
        n, qk = a.num_heads, a.qk_nope_head_dim + a.qk_rope_head_dim
        q = ((n * qk, H),) if a.q_lora_rank is None else ((a.q_lora_rank, H), (n * qk, a.q_lora_rank))
        return q + ((a.kv_lora_rank + a.qk_rope_head_dim, H), (H, n * a.v_head_dim))

    @functools.cached_property
    def absorption_matmuls(self) -> tuple[tuple[int, int, int], ...]:
        """(heads, rows, cols) of MLA's two absorbed products per query: q_nope through W_uk into the latent,
        the attended latent through W_uv (empty for GQA)."""
        a = self.config.attention
        if a.kind != "mla":
            return ()
        return ((a.num_heads, a.kv_lora_rank, a.qk_nope_head_dim), (a.num_heads, a.v_head_dim, a.kv_lora_rank))

    def part_matmuls(self, part: str, layer: int = 0) -> tuple[tuple[int, int], ...]:
        """(rows, cols) of the weights one token goes through in a part of `layer`: "attention", "router",
        "shared", "dense" (gate, up, down) or "lm_head"."""
        H, shape = self.hidden, self.layers[layer]
        if part == "attention":
            return self.attention_matmuls
        if part == "lm_head":
            return ((self.config.vocab_size, H),)
        if part == "router":
            return ((self.num_experts, H),) if shape.is_moe else ()
        width = {"shared": shape.shared_experts, "dense": shape.dense_mlp}[part] // (3 * H)
        return ((width, H), (width, H), (H, width)) if width else ()

    @functools.cached_property
    def attention_shape(self) -> tuple:
        """What the cost of one sequence's context attention depends on besides its lengths: (kind, heads,
        cached heads, key dim, value dim, sliding window or 0); MLA attends in the latent space."""
        a = self.config.attention
        if a.kind == "mla":
            return ("mla", a.num_heads, 1, a.kv_lora_rank + a.qk_rope_head_dim, a.kv_lora_rank, 0)
        return ("gqa", a.num_heads, a.num_kv_heads, a.head_dim, a.head_dim, a.sliding_window or 0)

    def elementwise_elements(self, tokens: float, layer: int) -> float:
        """Elements one layer's elementwise passes touch for `tokens` tokens: two RMSNorms (4 passes each) and
        two residual adds over the hidden state, rope and the cache write over q/k (and q/k norms, MLA's latent
        norms and concatenations), the router's scoring over the experts, the gated activation of dense and
        shared MLPs. Routed experts' activations are inside the expert kernels."""
        a, H, shape = self.config.attention, self.hidden, self.layers[layer]
        if a.kind == "mla":
            n, lat, r = a.num_heads, a.kv_lora_rank, a.qk_rope_head_dim
            attention = 4 * (n + 1) * r + 4 * (lat + (a.q_lora_rank or 0)) + 2 * (lat + r) + n * (lat + r) \
                + n * a.v_head_dim
        else:
            heads = (a.num_heads + a.num_kv_heads) * a.head_dim
            attention = 4 * heads + (4 * heads if a.qk_norm else 0) + 2 * a.num_kv_heads * a.head_dim
        mlp = 2 * (shape.shared_experts + shape.dense_mlp) // (3 * H)
        router = (5 if self.config.moe.topk_method == "noaux_tc" else 2) * shape.num_experts
        return tokens * (10 * H + attention + mlp + router + (H if shape.shared_experts else 0))
