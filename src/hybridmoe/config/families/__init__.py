"""The model families, one module each, and the registry that lists them.

A family module declares `FAMILY = Family(...)` (base.py): the HF architectures and model types it reads,
its parser into ModelConfig, its checkpoint's weight names, its packaged models and its tiny config. Adding a
family is one module here and one line in `FAMILY_MODULES` (see ARCHITECTURE.md, "Adding a model family").
"""

from __future__ import annotations

from importlib import import_module

from hybridmoe.config.errors import ConfigError
from hybridmoe.config.families.base import Family, WeightNames
from hybridmoe.config.model_config import ModelConfig

# The registry: one line per family module. The order is the order errors list what is supported in.
FAMILY_MODULES = (
    "deepseek_v3",
    "qwen3_moe",
    "mixtral",
)

FAMILIES: tuple[Family, ...] = tuple(import_module(f"{__name__}.{name}").FAMILY for name in FAMILY_MODULES)


def _index(what: str, pairs) -> dict[str, Family]:
    """name -> family; two families claiming one name fail here, at import, rather than one shadowing the
    other."""
    index: dict[str, Family] = {}
    for name, family in pairs:
        if name in index:
            raise ValueError(f"model families {index[name].name!r} and {family.name!r} both claim {what} {name!r}")
        index[name] = family
    return index


_BY_ARCHITECTURE = _index("architecture", ((a, f) for f in FAMILIES for a in f.architectures))
_BY_MODEL_TYPE = _index("model type", ((t, f) for f in FAMILIES for t in f.model_types))
_index("packaged model", ((n, f) for f in FAMILIES for group in f.packaged for n in group))
SUPPORTED_ARCHITECTURES = tuple(_BY_ARCHITECTURE)
# packaged model name or alias -> its directory under placement/data/models
PACKAGED_ALIASES = {name: group[0] for family in FAMILIES for group in family.packaged for name in group}
PACKAGED_MODELS = tuple(group[0] for family in FAMILIES for group in family.packaged)


def family_for_architecture(architecture: str) -> Family | None:
    return _BY_ARCHITECTURE.get(architecture)


def family_for_model_type(model_type: str) -> Family | None:
    return _BY_MODEL_TYPE.get(model_type)


def family_of(config: ModelConfig) -> Family:
    """The family a parsed config belongs to."""
    family = _BY_ARCHITECTURE.get(config.architecture)
    if family is None:
        raise ConfigError(f"{config.source or '<config>'}: architecture {config.architecture!r} belongs to no "
                          f"model family; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return family


__all__ = ["FAMILIES", "FAMILY_MODULES", "PACKAGED_ALIASES", "PACKAGED_MODELS", "SUPPORTED_ARCHITECTURES", "Family",
           "WeightNames", "family_for_architecture", "family_for_model_type", "family_of"]
