"""A decode step's decoder layers in one C++ call (`_native.DecodeStack`, csrc/decode_stack.h).

A decode step makes about a dozen kernel calls a layer: the attention's projections, RoPE, the cache write, paged
attention, o, two residual norms, the router's gate and choice, the experts (and shared experts) or a dense MLP.
Each costs tens of microseconds of Python around it, several times its warm cost in a real step, where the weights
streamed since the last call leave the interpreter's code and data cold. The stack makes the same kernel calls in the
same order and dtypes from C++, so its output is bit for bit the Python decoder's.

It runs a forward when every sequence decodes one token with nothing that needs the layers in Python: no observers
(layer, attention, routing), no dropped keys, no stream-loading prefill backend for this many tokens, the paged decode
kernel on (`paged_attention.DECODE_KERNEL`), and fewer tokens than any projection's kernel threshold (from there on
float weights go to torch's matmul: `FLOAT_KERNEL_MAX_TOKENS` for the router's float32 gate). A model qualifies when
every layer is grouped-query attention (Qwen3-MoE, Mixtral) or multi-head latent attention with its absorbed products
on the kernels (DeepSeek-V3, Kimi-K2), and a MoE block on the CPU expert kernels (with or without shared experts) or a
dense gated MLP, every projection a plain `Linear` without bias, in float32 or bfloat16, with a KV cache of float32,
bfloat16 or float16 on the CPU. `unsupported(model)` says why one does not.

Legend: S sequences (= tokens), H hidden.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.utils.dlpack import to_dlpack

from hybridmoe.kernels import _native
from hybridmoe.layers import paged_attention
from hybridmoe.layers.attention_gqa import GQAttention
from hybridmoe.layers.attention_mla import MLAttention
from hybridmoe.layers.linear import FLOAT_KERNEL_MAX_TOKENS, Linear
from hybridmoe.layers.mlp import GatedMLP
from hybridmoe.layers.moe.block import MoEBlock
from hybridmoe.layers.moe.cpu_backend import CpuExpertBackend
from hybridmoe.layers.paged_attention import AttentionMetadata

if TYPE_CHECKING:
    from hybridmoe.models.decoder import DecoderLayer, MoEDecoderModel

# False: every decode step through the Python decoder (A/B runs, benchmarks of the per-call kernels).
ENABLED = True

_DTYPES = (torch.float32, torch.bfloat16)
_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def unsupported(model: MoEDecoderModel) -> str | None:
    """Why the model's layers cannot run as one stack, or None when they can."""
    if model.dtype not in _DTYPES:
        return f"compute dtype {model.dtype} (float32 or bfloat16)"
    if not model.layers:
        return "no layers"
    for i, layer in enumerate(model.layers):
        why = _attention_unsupported(model, layer) or _mlp_unsupported(layer.mlp)
        if why:
            return f"layer {i}: {why}"
        if any(n is not None and (n.dtype != model.dtype or not n.is_cpu)
               for n in (layer.input_norm, layer.post_attention_norm)):
            return f"layer {i}: norm weights not in the compute dtype on the CPU"
    if model.norm.dtype != model.dtype:
        return "final norm weight not in the compute dtype"
    return None


def _plain(*projections) -> bool:
    return all(type(p) is Linear and p.bias is None for p in projections)


def _attention_unsupported(model: MoEDecoderModel, layer: DecoderLayer) -> str | None:
    attention, dtype, att = layer.attention, model.dtype, model.config.attention
    if isinstance(attention, GQAttention):
        w = attention.w
        if not _plain(w.q_proj, w.k_proj, w.v_proj, w.o_proj):
            return "an attention projection with a bias or off the kernels"
        if (w.q_norm is None) != (w.k_norm is None):
            return "a q norm without a k norm"
        if model.config.rope.rotary_dim != att.head_dim:
            return "partial rotary dims"
        norms = [n for n in (w.q_norm, w.k_norm) if n is not None]
    elif isinstance(attention, MLAttention):
        w = attention.w
        first = w.q_proj if w.q_proj is not None else w.q_a_proj
        if not _plain(first, w.kv_a_proj, w.o_proj, *([w.q_b_proj] if w.q_proj is None else [])):
            return "an attention projection with a bias or off the kernels"
        if attention.absorption.uk is None or attention.absorption.uv is None:
            return "MLA's absorbed products off the kernels"
        norms = [n for n in (w.kv_a_norm, w.q_a_norm) if n is not None]
    else:
        return f"{type(attention).__name__} (grouped-query or multi-head latent attention only)"
    if any(n.dtype != dtype or not n.is_cpu for n in norms):
        return "attention norm weights not in the compute dtype on the CPU"
    return None


def _mlp_unsupported(mlp) -> str | None:
    if isinstance(mlp, GatedMLP):
        return None if _plain(mlp.gate_proj, mlp.up_proj, mlp.down_proj) else "a dense MLP off the kernels"
    if not isinstance(mlp, MoEBlock) or type(mlp.experts) is not CpuExpertBackend:
        return "a MoE block off the CPU expert kernels"
    if mlp.shared is not None and _mlp_unsupported(mlp.shared):
        return "shared experts off the kernels"
    return None


class DecodeStack:
    """One model's layers over one set of KV caches, as a native stack; `run` computes a decode step's layers."""

    def __init__(self, model: MoEDecoderModel, kv_caches: list[torch.Tensor]):
        cfg, att = model.config, model.config.attention
        self.layers, self.caches = model.layers, tuple(kv_caches)  # what it was made of (their identities)
        self.rope = model.layers[0].attention.rope
        # the attention observers' and routing observers' lists, and the MoE blocks (stream-loading prefill's backend)
        self._observer_lists = [layer.attention.observers for layer in model.layers]
        self._blocks = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoEBlock)]
        self._observer_lists += [block.routing_observers for block in self._blocks]
        mla = att.kind == "mla"
        shape = dict(hidden=cfg.hidden_size, heads=att.num_heads, mla=mla, bf16=model.dtype == torch.bfloat16,
                     eps=cfg.rms_norm_eps, scale=att.softmax_scale, window=att.sliding_window or 0,
                     interleaved=cfg.rope.interleaved)
        if mla:
            shape.update(nope_dim=att.qk_nope_head_dim, rope_dim=att.qk_rope_head_dim, v_dim=att.v_head_dim,
                         lora=att.kv_lora_rank, q_lora=att.q_lora_rank or 0)
        else:
            shape.update(kv_heads=att.num_kv_heads, head_dim=att.head_dim)
        routing = next((block.router.kernel_args for block in self._blocks), {})
        routing = {key: value for key, value in routing.items() if key != "bias"}  # the bias is per layer
        next_norms = [layer.input_norm for layer in model.layers[1:]] + [model.norm]
        layers = [dict(_attention_entry(layer.attention), **_mlp_entry(layer.mlp), cache=cache,
                       post_norm=layer.post_attention_norm, next_norm=next_norm)
                  for layer, cache, next_norm in zip(model.layers, kv_caches, next_norms)]
        self._native = _native.DecodeStack(shape, routing, layers)

    def applies(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        """Whether this step's layers run as the stack (see the module's docstring)."""
        return (num_tokens > 0 and paged_attention.DECODE_KERNEL
                and meta.decode_seqs == num_tokens == meta.num_seqs and not any(self._observer_lists)
                and all(b.prefill_experts is None or num_tokens < b.prefill_min_tokens for b in self._blocks))

    def run(self, residual: torch.Tensor, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """residual [S, H] (updated in place), x [S, H]: the first layer's normed input in, the final norm's out."""
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        self._native.run(to_dlpack(residual), to_dlpack(x), to_dlpack(cos), to_dlpack(sin),
                         to_dlpack(meta.slot_mapping), to_dlpack(meta.decode_block_tables),
                         to_dlpack(meta.decode_seq_lens))


def _attention_entry(attention) -> dict:
    """The native layer's attention items."""
    w = attention.w
    if isinstance(attention, GQAttention):
        return dict(q=w.q_proj.matrix, k=w.k_proj.matrix, v=w.v_proj.matrix, o=w.o_proj.matrix, q_norm=w.q_norm,
                    k_norm=w.k_norm)
    lora = w.q_proj is None
    return dict(q_first=(w.q_a_proj if lora else w.q_proj).matrix, q_b=w.q_b_proj.matrix if lora else None,
                q_a_norm=w.q_a_norm if lora else None, kv_a=w.kv_a_proj.matrix, kv_a_norm=w.kv_a_norm,
                uk=attention.absorption.uk.native, uv=attention.absorption.uv.native, o=w.o_proj.matrix)


def _mlp_entry(mlp) -> dict:
    """The native layer's MLP items: the routed experts with their router, and the shared experts or dense MLP."""
    dense = mlp if isinstance(mlp, GatedMLP) else mlp.shared
    entry = dict(mlp=None if dense is None else (dense.gate_proj.matrix, dense.up_proj.matrix,
                                                 dense.down_proj.matrix), experts=None)
    if isinstance(mlp, MoEBlock):
        entry.update(experts=mlp.experts.moe.native, gate=mlp.router.gate.matrix, bias=mlp.router.kernel_args["bias"])
    return entry


def decode_stack_for(model: MoEDecoderModel, meta: AttentionMetadata, num_tokens: int,
                     kv_caches: list[torch.Tensor]) -> DecodeStack | None:
    """The model's stack when this step can run on it (made, or remade for other caches, here), else None."""
    # from FLOAT_KERNEL_MAX_TOKENS tokens on the router's float32 gate goes to torch's matmul (every other projection
    # stays on the kernels at least that far)
    if not ENABLED or model.layer_observers or num_tokens >= FLOAT_KERNEL_MAX_TOKENS:
        return None
    stack = model.decode_stack
    if stack is None or stack.layers is not model.layers or not (
            len(kv_caches) == len(stack.caches) and all(a is b for a, b in zip(kv_caches, stack.caches))):
        verdict = model.decode_stack_verdict
        if verdict is None or verdict[0] is not model.layers:  # the op tables' host costs run subsets of the layers
            verdict = model.decode_stack_verdict = (model.layers, unsupported(model) or "")
        if verdict[1] or not _caches_fit(kv_caches):
            return None
        stack = model.decode_stack = DecodeStack(model, kv_caches)
    return stack if stack.applies(meta, num_tokens) else None


def _caches_fit(kv_caches: list[torch.Tensor]) -> bool:
    """Whether the stack reads these caches: on the CPU, one of its dtypes, rows contiguous."""
    return all(c.is_cpu and c.dtype in _CACHE_DTYPES and c.stride(-1) == 1 for c in kv_caches)
