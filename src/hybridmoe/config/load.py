"""`load_config(dir)` / `parse_config(dict)`: a config.json to a ModelConfig, through the family that reads it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hybridmoe.config.errors import ConfigError
from hybridmoe.config.families import SUPPORTED_ARCHITECTURES, family_for_architecture, family_for_model_type
from hybridmoe.config.fields import Fields
from hybridmoe.config.model_config import ModelConfig


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read `model_dir/config.json` and normalise it; raises ConfigError naming the file and field."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: no config.json in model directory {model_dir}")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); is it a config.json?") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object at top level")
    return parse_config(raw, source=str(path))


def parse_config(raw: dict[str, Any], source: str = "<config>") -> ModelConfig:
    """Normalise a config.json dictionary (see load_config)."""
    archs = raw.get("architectures") or []
    if archs:
        arch, family = archs[0], family_for_architecture(archs[0])
    else:  # configs that name only their model_type read as the family's first architecture
        family = family_for_model_type(raw.get("model_type", ""))
        arch = family.architectures[0] if family else None
    if family is None:
        raise ConfigError(
            f"{source}: unsupported architecture {arch or raw.get('model_type')!r} "
            f"(field 'architectures'); supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return family.parse(Fields(raw, source), arch)
