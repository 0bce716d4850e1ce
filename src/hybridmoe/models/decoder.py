"""The MoE decoder shared by all families: embeddings -> N x (attention, dense MLP or MoE) -> norm -> head.

Families differ in their attention kind (built by models/attention.py from `config.attention.kind`), router
and shared experts (both in ModelConfig) and the checkpoint names of their MoE blocks (their family's
`WeightNames`, hybridmoe.config.families); nothing here names a family.

Legend: T new tokens in the batch, H hidden, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

import torch

from hybridmoe.config import ModelConfig, WeightNames, family_of
from hybridmoe.layers.linear import Linear
from hybridmoe.layers.mlp import GatedMLP
from hybridmoe.layers.moe.backend import ExpertBackend, ExpertWeights
from hybridmoe.layers.moe.block import MoEBlock
from hybridmoe.layers.moe.router import Router
from hybridmoe.layers.norm import add_rms_norm_, rms_norm
from hybridmoe.layers.paged_attention import AttentionMetadata
from hybridmoe.layers.rope import RotaryEmbedding
from hybridmoe.models.attention import Attention, attention_kind
from hybridmoe.models.decode_stack import DecodeStack, decode_stack_for
from hybridmoe.models.weight_loader import WeightLoader

if TYPE_CHECKING:
    from hybridmoe.models.dual_batch import DualBatch
    from hybridmoe.models.placement import DevicePlacement

ExpertBackendFactory = Callable[[ExpertWeights], ExpertBackend]  # computes in the hidden states' dtype


@dataclass
class DecoderLayer:
    input_norm: torch.Tensor  # [H]
    attention: Attention
    post_attention_norm: torch.Tensor  # [H]
    mlp: GatedMLP | MoEBlock
    experts: ExpertWeights | None = None  # an MoE layer's routed experts as loaded (hot experts are copied from it)


class MoEDecoderModel:
    def __init__(self, config: ModelConfig, embed: torch.Tensor, layers: list[DecoderLayer], norm: torch.Tensor,
                 lm_head: Linear, dtype: torch.dtype):
        self.config, self.dtype = config, dtype
        self.embed, self.layers, self.norm, self.lm_head = embed, layers, norm, lm_head
        # where the parts run when a plan placed some on the accelerator (models.placement.place_model)
        self.device_placement: DevicePlacement | None = None
        # dual-batch overlap of decode steps (models/dual_batch.py; the engine sets it from EngineConfig.overlap)
        self.dual_batch: DualBatch | None = None
        # observe(layer_index) after each layer of a forward, once its KV is in the cache (the PD prefill worker
        # sends a prompt's KV layer by layer); a forward with one runs layer by layer (no dual-batch split)
        self.layer_observers: list[Callable[[int], None]] = []
        # a decode step's layers in one native call where they qualify (models/decode_stack.py): made at the first
        # decode step, remade for other caches or another list of layers; and the layers' verdict (the list it was
        # made for, why they do not qualify: "" when they do)
        self.decode_stack: DecodeStack | None = None
        self.decode_stack_verdict: tuple[list[DecoderLayer], str] | None = None

    def add_routing_observer(self, observe: Callable[[int, torch.Tensor], None]) -> Callable[[], None]:
        """Call observe(layer_index, topk_ids [T, K]) at every MoE layer of every forward (routing statistics);
        returns a function that removes the observer again."""
        return _add_observers([(i, layer.mlp.routing_observers) for i, layer in enumerate(self.layers)
                               if isinstance(layer.mlp, MoEBlock)], observe)

    def add_attention_observer(self, observe: Callable[[int, int, torch.Tensor, torch.Tensor, float], None]
                               ) -> Callable[[], None]:
        """Call observe(layer_index, seq, q [Q, N, D], k [C, Nk, D], scale) at every attention layer of every
        forward for each sequence (its new tokens' queries, its whole context's keys, post-rope; for MLA the
        absorbed queries and cached latents, Nk = 1); hybridmoe.kv scores prompt tokens by it. Returns the remover."""
        return _add_observers([(i, layer.attention.observers) for i, layer in enumerate(self.layers)], observe)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of one layer's KV cache tensor."""
        return attention_kind(self.config).cache_shape(self.config, num_blocks, block_size)

    def kv_bytes_per_token(self, kv_dtype: torch.dtype | None = None) -> int:
        """Bytes of KV cache a token takes over all layers, in kv_dtype (default: the compute dtype)."""
        per_block = torch.Size(self.kv_cache_shape(1, 1)).numel()
        return per_block * self.config.num_layers * (kv_dtype or self.dtype).itemsize

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[torch.Tensor], logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [T] -> logits [len(logits_indices) or T, V] float32 (on the host)."""
        if self.dual_batch is not None and self.dual_batch.applies(self, meta):
            return self.dual_batch.forward(self, input_ids, positions, meta, kv_caches, logits_indices)
        if self.device_placement is not None:
            return self._forward_placed(input_ids, positions, meta, kv_caches, logits_indices)
        eps, layers = self.config.rms_norm_eps, self.layers
        h = self.embed[input_ids]  # [T, H], the residual stream (a copy: updated in place below)
        # each residual add goes with the norm after it (one kernel call): the next layer's input norm, or the last
        next_norms = [layer.input_norm for layer in layers[1:]] + [self.norm]
        x = rms_norm(h, layers[0].input_norm if layers else self.norm, eps)  # [T, H]
        stack = decode_stack_for(self, meta, input_ids.shape[0], kv_caches)
        if stack is not None:  # the same kernel calls from C++: x becomes the final norm's output
            stack.run(h, x, positions, meta)
        else:
            for i, (layer, cache) in enumerate(zip(layers, kv_caches)):
                x = add_rms_norm_(h, layer.attention.forward(x, positions, meta, cache), layer.post_attention_norm, eps)
                x = add_rms_norm_(h, layer.mlp.forward(x), next_norms[i], eps)
                for observe in self.layer_observers:
                    observe(i)
        if logits_indices is not None:
            x = x[logits_indices]
        return self.lm_head(x).float()

    def _forward_placed(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                        kv_caches: list[torch.Tensor], logits_indices: torch.Tensor | None) -> torch.Tensor:
        """The forward with parts on the accelerator: the residual stream h moves to where each part runs (the
        accelerator, or the host for what the plan left there) before it runs; positions and the attention
        metadata are copied to the accelerator once per forward. On the CPU stand-in the moves are no-ops."""
        placed, eps = self.device_placement, self.config.rms_norm_eps
        stats, device, host = placed.stats, placed.accel.device, torch.device("cpu")
        inputs = {host: (positions, meta)}
        if any(placed.attention):
            inputs[device] = (positions.to(device), _metadata_to(meta, device))
        h = self.embed[input_ids]  # [T, H] on the host
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            where = device if placed.attention[i] else host
            h = h.to(where)
            with stats.accel_section() if placed.attention[i] else nullcontext():
                h = h + layer.attention.forward(rms_norm(h, layer.input_norm, eps), *inputs[where], cache)
            h = h.to(device if placed.mlp[i] else host)
            timed = placed.mlp[i] and not isinstance(layer.mlp, MoEBlock)  # a MoE block times its own parts
            with stats.accel_section() if timed else nullcontext():
                h = h + layer.mlp.forward(rms_norm(h, layer.post_attention_norm, eps))
            for observe in self.layer_observers:
                observe(i)
        h = h.to(device if placed.lm_head else host)
        if logits_indices is not None:
            h = h[logits_indices.to(h.device)]
        with stats.accel_section() if placed.lm_head else nullcontext():
            logits = self.lm_head(rms_norm(h, self.norm, eps)).float()
        return logits.to(host)


def _add_observers(lists: list[tuple[int, list]], observe: Callable) -> Callable[[], None]:
    """Append to each layer's observer list a hook calling observe(layer_index, *args); returns the remover."""
    added = []
    for index, observers in lists:
        hook = lambda *args, index=index: observe(index, *args)  # noqa: E731
        observers.append(hook)
        added.append((observers, hook))

    def remove() -> None:
        for observers, hook in added:
            observers.remove(hook)

    return remove


def _metadata_to(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    """A copy of meta whose tensors (and lists of tensors) are on `device`."""
    changes = {}
    for f in fields(meta):
        value = getattr(meta, f.name)
        if isinstance(value, torch.Tensor):
            changes[f.name] = value.to(device)
        elif isinstance(value, list) and any(isinstance(v, torch.Tensor) for v in value):
            changes[f.name] = [v.to(device) if isinstance(v, torch.Tensor) else v for v in value]
    return replace(meta, **changes) if changes else meta


def build_decoder(config: ModelConfig, loader: WeightLoader, backend_factory: ExpertBackendFactory) -> MoEDecoderModel:
    """Build the model from a checkpoint (weights are zero-copy views where the dtypes allow)."""
    hidden, vocab = config.hidden_size, config.vocab_size
    names, build_attention = family_of(config).weights, attention_kind(config).build
    rope = RotaryEmbedding(config.rope)
    embed = loader.dense("model.embed_tokens.weight", (vocab, hidden))
    layers = []
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}."
        attention = build_attention(loader, prefix + "self_attn.", config, rope)
        experts = None
        if config.moe_layers[i]:
            mlp, experts = _build_moe(config, names, loader, prefix + names.moe_prefix + ".", prefix,
                                      backend_factory)
        else:
            mlp = _gated_mlp(loader, prefix + "mlp.", hidden, config.intermediate_size)
        layers.append(DecoderLayer(
            input_norm=loader.dense(prefix + "input_layernorm.weight", (hidden,)),
            attention=attention,
            post_attention_norm=loader.dense(prefix + "post_attention_layernorm.weight", (hidden,)),
            mlp=mlp,
            experts=experts,
        ))
        loader.layer_done()
    norm = loader.dense("model.norm.weight", (hidden,))
    if config.tie_word_embeddings:
        lm_head = Linear.dense(embed)
    else:
        lm_head = loader.linear("lm_head.weight", (vocab, hidden))
    loader.close()
    return MoEDecoderModel(config, embed, layers, norm, lm_head, loader.dtype)


def _gated_mlp(loader: WeightLoader, prefix: str, hidden: int, inter: int) -> GatedMLP:
    return GatedMLP(
        gate_proj=loader.linear(prefix + "gate_proj.weight", (inter, hidden)),
        up_proj=loader.linear(prefix + "up_proj.weight", (inter, hidden)),
        down_proj=loader.linear(prefix + "down_proj.weight", (hidden, inter)),
    )


def _build_moe(config: ModelConfig, names: WeightNames, loader: WeightLoader, moe_prefix: str, layer_prefix: str,
               backend_factory: ExpertBackendFactory) -> tuple[MoEBlock, ExpertWeights]:
    moe, hidden = config.moe, config.hidden_size
    bias = None
    if moe.topk_method == "noaux_tc":
        bias = loader.float32(moe_prefix + "gate.e_score_correction_bias", (moe.num_experts,))
    router = Router(moe, loader.float32(moe_prefix + "gate.weight", (moe.num_experts, hidden)), bias)
    projections = names.expert_projections  # gate, up, down
    expert_names = [tuple(f"{moe_prefix}experts.{e}.{p}.weight" for p in projections) for e in range(moe.num_experts)]
    experts = loader.experts(expert_names, moe.intermediate_size, hidden)
    shared = None
    if names.shared_experts_prefix and moe.num_shared_experts:
        shared = _gated_mlp(loader, layer_prefix + names.shared_experts_prefix + ".", hidden,
                            moe.shared_intermediate_size)
    return MoEBlock(router, backend_factory(experts), shared), experts
