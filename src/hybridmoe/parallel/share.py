"""A rank's share of the routed experts: loaded from the memory-mapped checkpoint (only its experts' tensors are
touched), placed on the rank's accelerator, and computed for the (token, expert) pairs routed to them.

Legend: n tokens sent to the rank, H hidden, K top-k, A (token, owned expert) pairs.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hybridmoe.accel.accelerator import Accelerator
from hybridmoe.checkpoint.safetensors_reader import CheckpointReader
from hybridmoe.config import ModelConfig, family_of
from hybridmoe.layers.moe.backend import ExpertBackend, ExpertWeights
from hybridmoe.layers.moe.torch_backend import TorchExpertBackend
from hybridmoe.models.weight_loader import WeightLoader
from hybridmoe.parallel.ownership import owned_experts


def expert_names(config: ModelConfig, layer: int, experts: range) -> list[tuple[str, str, str]]:
    """Checkpoint names (gate, up, down) of `experts` of decoder layer `layer` (its family's WeightNames)."""
    names = family_of(config).weights
    prefix = f"model.layers.{layer}.{names.moe_prefix}.experts."
    return [tuple(f"{prefix}{e}.{p}.weight" for p in names.expert_projections) for e in experts]


def load_share(model_dir: str | Path, config: ModelConfig, rank: int, world_size: int, dtype: torch.dtype,
               accel: Accelerator) -> dict[int, ExpertBackend]:
    """Per MoE decoder layer, a backend over this rank's experts placed on `accel` (counted in its ledger as
    "ep.experts.<layer>"). Nothing else of the checkpoint is read."""
    loader = WeightLoader(CheckpointReader(model_dir), config, dtype, show_progress=False)
    moe = config.moe
    share = {}
    for layer, is_moe in enumerate(config.moe_layers):
        if not is_moe:
            continue
        mine = owned_experts(moe.num_experts, world_size, rank)
        weights = loader.experts(expert_names(config, layer, mine), moe.intermediate_size, config.hidden_size)
        share[layer] = TorchExpertBackend(weights.to_device(accel, f"ep.experts.{layer}"))
    loader.close()
    return share


def placed_share(experts: ExpertWeights, num_experts: int, rank: int, world_size: int, accel: Accelerator,
                 layer: int) -> ExpertBackend:
    """Rank 0's share of a layer from the experts the engine already loaded, placed on `accel`."""
    mine = owned_experts(num_experts, world_size, rank)
    return TorchExpertBackend(experts.subset(list(mine)).to_device(accel, f"ep.experts.{layer}"))


def compute_share(backend: ExpertBackend, hidden: torch.Tensor, local_ids: torch.Tensor,
                  weights: torch.Tensor) -> torch.Tensor:
    """hidden [n, H], local_ids [n, K] (this rank's expert index, -1 for an expert another rank owns), weights
    [n, K] -> [n, H]: sum over the token's owned experts of weight * expert(hidden), zeros where it owns none."""
    token_of, slot = (local_ids >= 0).nonzero(as_tuple=True)  # [A], [A]
    out = torch.zeros_like(hidden)
    if token_of.numel() == 0:
        return out
    ids = local_ids[token_of, slot].long()[:, None]  # [A, 1]
    w = weights[token_of, slot].float()[:, None]  # [A, 1]
    partial = backend.wait(backend.submit(hidden[token_of], ids, w))  # [A, H]
    return out.index_add_(0, token_of, partial.to(hidden.dtype))
