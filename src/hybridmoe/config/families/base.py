"""`Family`: what the engine knows about one model family, declared once as plain data and a parse function.

Each family module next to this one declares a `FAMILY`; the registry (`__init__`) lists the modules. Config
parsing (`hybridmoe.config.parse_config`), the model builder (models/) and the planner (placement/) all read
this one description, so it imports no torch and no numpy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hybridmoe.config.fields import Fields
from hybridmoe.config.model_config import ModelConfig


@dataclass(frozen=True)
class WeightNames:
    """The checkpoint names of the parts of an MoE layer that differ between families. Embeddings, norms,
    dense MLPs and each attention kind's projections share Hugging Face's names (models/)."""

    moe_prefix: str = "mlp"  # model.layers.N.{moe_prefix}.gate, .experts.E.{projection}
    expert_projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # gate, up, down
    shared_experts_prefix: str | None = None  # model.layers.N.{prefix}.{gate,up,down}_proj


@dataclass(frozen=True)
class Family:
    """One model family: which configs it reads, how it parses them, how its checkpoints name their weights,
    and the large models the planner can plan for without their weights."""

    name: str
    architectures: tuple[str, ...]  # HF `architectures` entries it reads (the first: configs that name none)
    model_types: tuple[str, ...]  # HF `model_type`s it reads from configs that list no architectures
    parse: Callable[[Fields, str], ModelConfig]  # (the config's fields, its architecture) -> ModelConfig
    weights: WeightNames = field(default_factory=WeightNames)
    # packaged configs (placement/data/models/<first name>/config.json), each with the names it answers to
    packaged: tuple[tuple[str, ...], ...] = ()
    # config.json fields of a tiny random-weight model (checkpoint.synthetic: the tests' models, `profile`'s
    # minimal-width copies), small enough to build in a moment, each feature the parser reads switched on
    tiny: dict[str, Any] = field(default_factory=dict, compare=False)
