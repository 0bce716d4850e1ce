"""A decode step's decoder layers in one C++ call (`_native.DecodeStack`, csrc/decode_stack.h).

A decode step of a grouped-query-attention MoE model (Qwen3-MoE, Mixtral) makes about a dozen kernel calls a layer:
q / k / v, RoPE, the cache write, paged attention, o, two residual norms, the router's gate and choice, the experts.
Each costs tens of microseconds of Python around it, several times its warm cost in a real step, where the weights
streamed since the last call leave the interpreter's code and data cold. The stack makes the same kernel calls in the
same order and dtypes from C++, so its output is bit for bit the Python decoder's.

It runs a forward when every sequence decodes one token with nothing that needs the layers in Python: no observers
(layer, attention, routing), no dropped keys, no stream-loading prefill backend for this many tokens, the paged decode
kernel on (`paged_attention.DECODE_KERNEL`), and fewer tokens than any projection's kernel threshold (from there on
float weights go to torch's matmul: `FLOAT_KERNEL_MAX_TOKENS` for the router's float32 gate). A model qualifies when every layer is GQA attention and a MoE block without
shared experts on the CPU expert kernels, every projection a plain `Linear` without bias, in float32 or bfloat16,
with a KV cache of float32, bfloat16 or float16 on the CPU. `unsupported(model)` says why one does not.

Legend: S sequences (= tokens), H hidden.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.utils.dlpack import to_dlpack

from hybridmoe.kernels import _native
from hybridmoe.layers import paged_attention
from hybridmoe.layers.attention_gqa import GQAttention
from hybridmoe.layers.linear import FLOAT_KERNEL_MAX_TOKENS, Linear
from hybridmoe.layers.moe.block import MoEBlock
from hybridmoe.layers.moe.cpu_backend import CpuExpertBackend
from hybridmoe.layers.paged_attention import AttentionMetadata

if TYPE_CHECKING:
    from hybridmoe.models.decoder import MoEDecoderModel

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
        attention, mlp = layer.attention, layer.mlp
        if not isinstance(attention, GQAttention):
            return f"layer {i}: {type(attention).__name__} (grouped-query attention only)"
        if model.config.rope.rotary_dim != model.config.attention.head_dim:
            return "partial rotary dims"
        if not isinstance(mlp, MoEBlock) or mlp.shared is not None or type(mlp.experts) is not CpuExpertBackend:
            return f"layer {i}: not a MoE block of CPU experts without shared experts"
        w = attention.w
        if any(type(p) is not Linear or p.bias is not None for p in (w.q_proj, w.k_proj, w.v_proj, w.o_proj)):
            return f"layer {i}: a projection with a bias or off the kernels"
        if (w.q_norm is None) != (w.k_norm is None):
            return f"layer {i}: a q norm without a k norm"
        norms = [layer.input_norm, layer.post_attention_norm] + [n for n in (w.q_norm, w.k_norm) if n is not None]
        if any(n.dtype != model.dtype or not n.is_cpu for n in norms):
            return f"layer {i}: norm weights not in the compute dtype on the CPU"
    if model.norm.dtype != model.dtype:
        return "final norm weight not in the compute dtype"
    return None


class DecodeStack:
    """One model's layers over one set of KV caches, as a native stack; `run` computes a decode step's layers."""

    def __init__(self, model: MoEDecoderModel, kv_caches: list[torch.Tensor]):
        cfg, att = model.config, model.config.attention
        self.caches = tuple(kv_caches)
        self.rope = model.layers[0].attention.rope
        # the attention observers' and routing observers' lists, and the MoE blocks (stream-loading prefill's backend)
        self._observer_lists = [lst for layer in model.layers
                                for lst in (layer.attention.observers, layer.mlp.routing_observers)]
        self._blocks = [layer.mlp for layer in model.layers]
        next_norms = [layer.input_norm for layer in model.layers[1:]] + [model.norm]
        args = model.layers[0].mlp.router.kernel_args  # the same config for every layer; the bias is per layer
        layers = []
        for layer, cache, next_norm in zip(model.layers, kv_caches, next_norms):
            w, mlp = layer.attention.w, layer.mlp
            layers.append({
                "q": w.q_proj.matrix, "k": w.k_proj.matrix, "v": w.v_proj.matrix, "o": w.o_proj.matrix,
                "q_norm": w.q_norm, "k_norm": w.k_norm, "cache": cache, "post_norm": layer.post_attention_norm,
                "gate": mlp.router.gate.matrix, "bias": mlp.router.kernel_args["bias"],
                "experts": mlp.experts.moe.native, "next_norm": next_norm,
            })
        self._native = _native.DecodeStack(
            cfg.hidden_size, att.num_heads, att.num_kv_heads, att.head_dim, model.dtype == torch.bfloat16,
            cfg.rms_norm_eps, att.softmax_scale, att.sliding_window or 0, cfg.rope.interleaved, args["k"],
            args["sigmoid"], args["groups"], args["topk_groups"], args["normalize"], args["norm_eps"], args["scale"],
            layers)

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


def decode_stack_for(model: MoEDecoderModel, meta: AttentionMetadata, num_tokens: int,
                     kv_caches: list[torch.Tensor]) -> DecodeStack | None:
    """The model's stack when this step can run on it (made, or remade for other caches, here), else None."""
    # from FLOAT_KERNEL_MAX_TOKENS tokens on the router's float32 gate goes to torch's matmul (every other projection
    # stays on the kernels at least that far)
    if not ENABLED or model.layer_observers or num_tokens >= FLOAT_KERNEL_MAX_TOKENS:
        return None
    stack = model.decode_stack
    if stack is None or not (len(kv_caches) == len(stack.caches)
                             and all(a is b for a, b in zip(kv_caches, stack.caches))):
        if model.decode_stack_unsupported is None:
            model.decode_stack_unsupported = unsupported(model) or ""
        if model.decode_stack_unsupported or not _caches_fit(kv_caches):
            return None
        stack = model.decode_stack = DecodeStack(model, kv_caches)
    return stack if stack.applies(meta, num_tokens) else None


def _caches_fit(kv_caches: list[torch.Tensor]) -> bool:
    """Whether the stack reads these caches: [2, NB, BS, Nk, D] each on the CPU, one of its dtypes, rows contiguous."""
    return all(c.is_cpu and c.dim() == 5 and c.dtype in _CACHE_DTYPES and c.stride(-1) == 1 for c in kv_caches)
