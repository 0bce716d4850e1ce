"""Helpers for references built from transformers models: writing a per-expert checkpoint weight into the
fused expert tensors transformers 5 keeps in memory."""

from __future__ import annotations

import torch

PROJ = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


def set_expert_weight(model, name: str, weight: torch.Tensor) -> None:
    """name: a checkpoint key like model.layers.1.mlp.experts.3.up_proj.weight (Mixtral: block_sparse_moe...w3);
    weight: [I, H] for gate/up, [H, I] for down."""
    module_path, rest = name.split(".experts.")
    expert, proj = int(rest.split(".")[0]), PROJ[rest.split(".")[1]]
    experts = model.get_submodule(module_path.replace("block_sparse_moe", "mlp") + ".experts")
    inter = experts.down_proj.shape[2]  # gate_up_proj [E, 2I, H], down_proj [E, H, I]
    if proj == "gate":
        experts.gate_up_proj.data[expert, :inter] = weight
    elif proj == "up":
        experts.gate_up_proj.data[expert, inter:] = weight
    else:
        experts.down_proj.data[expert] = weight
