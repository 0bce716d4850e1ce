"""A rank's share of the routed experts: its experts of every MoE layer (views of the memory-mapped checkpoint:
only their tensors are ever touched), streamed into the rank's accelerator by stream-loading prefill's
`ExpertStreamer` (layers/moe/stream_prefill.py: two device slots of bounded size, a copy stream, layers streamed as
splits of a slot's worth of experts, whole layers prefetched as slots free up or the chunk's activated experts once
routed) and computed there as a grouped matmul over the tokens sent to
the rank.

Legend: n tokens sent to the rank, H hidden, K top-k, A (token, owned expert) pairs.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hybridmoe.accel.accelerator import Accelerator
from hybridmoe.checkpoint.safetensors_reader import CheckpointReader
from hybridmoe.config import ModelConfig, family_of
from hybridmoe.layers.moe.backend import ExpertWeights
from hybridmoe.layers.moe.staging import DEFAULT_STAGING_BYTES
from hybridmoe.layers.moe.stream_prefill import COPY_MODES, ExpertStreamer, StreamStats
from hybridmoe.models.weight_loader import WeightLoader
from hybridmoe.parallel.ownership import owned_experts


def expert_names(config: ModelConfig, layer: int, experts: range) -> list[tuple[str, str, str]]:
    """Checkpoint names (gate, up, down) of `experts` of decoder layer `layer` (its family's WeightNames)."""
    names = family_of(config).weights
    prefix = f"model.layers.{layer}.{names.moe_prefix}.experts."
    return [tuple(f"{prefix}{e}.{p}.weight" for p in names.expert_projections) for e in experts]


def load_share(model_dir: str | Path, config: ModelConfig, rank: int, world_size: int,
               dtype: torch.dtype) -> dict[int, ExpertWeights]:
    """Decoder layer -> this rank's experts of that MoE layer, as stored (zero-copy views of the checkpoint)."""
    loader = WeightLoader(CheckpointReader(model_dir), config, dtype, show_progress=False)
    moe = config.moe
    mine = owned_experts(moe.num_experts, world_size, rank)
    share = {layer: loader.experts(expert_names(config, layer, mine), moe.intermediate_size, config.hidden_size)
             for layer, is_moe in enumerate(config.moe_layers) if is_moe}
    loader.close()
    return share


class ShareStreamer:
    """One rank's share of every MoE layer, streamed and computed layer by layer through a chunk's pass.

    run(layer, ...) is called for every MoE layer of a chunk in model order (a worker gets every layer's message,
    with or without tokens): the first MoE layer starts a pass (a layer out of that order starts a pass there);
    copy "all" queues every layer from there on, each split's copy issued as soon as its slot is free; copy
    "activated" queues the experts the rank's tokens chose once they are known. overlap, slot_bytes: as
    ExpertStreamer's (default: copies run beside compute on CUDA, on the stand-in when True; 1 GiB slots).
    """

    def __init__(self, layers: dict[int, ExpertWeights], accel: Accelerator,
                 staging_bytes: int = DEFAULT_STAGING_BYTES, name: str = "ep", overlap: bool | None = None,
                 slot_bytes: int | None = None):
        self.order = sorted(layers)
        self.position = {layer: p for p, layer in enumerate(self.order)}
        self.streamer = ExpertStreamer([layers[l] for l in self.order], accel, staging_bytes, name, overlap=overlap,
                                       slot_bytes=slot_bytes)
        self.mode = "all"
        self.expected = 0  # the position the pass reaches next

    def run(self, layer: int, hidden: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor,
            mode: str = "all") -> torch.Tensor:
        """hidden [n, H], local_ids [n, K] (this rank's expert index, -1 for another rank's expert), weights [n, K]
        -> [n, H]: per token, the sum over its experts on this rank of weight * expert(hidden)."""
        streamer, position = self.streamer, self.position[layer]
        if position == 0 or position != self.expected:  # a new pass (or one resumed where an earlier one broke off)
            if mode not in COPY_MODES:
                raise ValueError(f"copy mode must be one of {', '.join(COPY_MODES)}, got {mode!r}")
            self.mode = mode
            streamer.begin_pass()
            if mode == "all":
                for ahead in range(position, len(self.order)):
                    streamer.load(ahead)
        self.expected = position + 1
        token_of, slot = (local_ids >= 0).nonzero(as_tuple=True)  # [A], [A]
        ids = local_ids[token_of, slot].long()[:, None]  # [A, 1]
        if self.mode == "activated":
            streamer.load(position, torch.unique(ids).tolist())
        partial = streamer.run(position, hidden[token_of], ids, weights[token_of, slot].float()[:, None])  # [A, H]
        return torch.zeros_like(hidden).index_add_(0, token_of, partial.to(hidden.dtype))

    def stats(self) -> StreamStats:
        return self.streamer.stats()

    def close(self) -> None:
        self.streamer.close()
