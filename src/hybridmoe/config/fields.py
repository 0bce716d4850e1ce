"""`Fields`: typed access to a config.json's fields, with errors that name the field and the file."""

from __future__ import annotations

import math
from typing import Any

from hybridmoe.config.errors import ConfigError


class Fields:
    """Typed access to config.json fields with errors that name the field and the file (a `default` of `...`
    makes the field required)."""

    def __init__(self, raw: dict[str, Any], source: str):
        self.raw, self.source = raw, source

    def error(self, name: str, why: str) -> ConfigError:
        return ConfigError(f"{self.source}: field '{name}' {why}")

    def int(self, name: str, default: Any = ..., minimum: int = 1) -> Any:
        value = self._get(name, default)
        if value is None and default is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(name, f"must be an integer, got {value!r}")
        if value < minimum:
            raise self.error(name, f"must be >= {minimum}, got {value}")
        return value

    def float(self, name: str, default: Any = ..., positive: bool = True) -> Any:
        value = self._get(name, default)
        if value is None and default is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.error(name, f"must be a number, got {value!r}")
        if positive and value <= 0:
            raise self.error(name, f"must be > 0, got {value}")
        return float(value)

    def bool(self, name: str, default: Any = ...) -> bool:
        value = self._get(name, default)
        if not isinstance(value, bool):
            raise self.error(name, f"must be true or false, got {value!r}")
        return value

    def choice(self, name: str, options: tuple[str, ...], default: Any = ...) -> str:
        value = self._get(name, default)
        if value not in options:
            raise self.error(name, f"must be one of {list(options)}, got {value!r}")
        return value

    def _get(self, name: str, default: Any) -> Any:
        if name in self.raw and self.raw[name] is not None:
            return self.raw[name]
        if default is ...:
            raise self.error(name, "is missing")
        return default
