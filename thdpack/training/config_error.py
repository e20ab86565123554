"""The one error a recipe that cannot run raises at start-up (every check module raises it)."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A recipe that cannot run; the message names the keys and what to change."""
