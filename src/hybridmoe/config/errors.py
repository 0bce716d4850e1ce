"""`ConfigError`: the one error a model configuration that cannot be used raises."""

from __future__ import annotations


class ConfigError(ValueError):
    """A model configuration that cannot be used; the message names the file and the field."""
