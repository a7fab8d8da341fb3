"""Options handed to ``open_store``: Settings fields split from backend-specific ones."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptstore.config import Settings, default_settings

__all__ = ["parse_bool", "split_settings"]


def split_settings(options: Mapping[str, Any]) -> tuple[Settings, dict[str, Any]]:
    """Return the Settings described by ``options`` and the options left for the backend.

    ``options`` may carry a whole ``settings=Settings(...)`` and/or individual Settings
    fields (``part_size="64MiB"``), which override it.
    """
    rest = dict(options)
    settings = rest.pop("settings", None)
    if settings is None:
        settings = default_settings()
    elif not isinstance(settings, Settings):
        raise TypeError(f"settings must be a ckptstore.Settings, not {type(settings).__name__}")
    names = Settings.field_names()
    fields = {name: rest.pop(name) for name in list(rest) if name in names}
    return (settings.replace(**fields) if fields else settings), rest


def parse_bool(name: str, value: object) -> bool:
    """Accept a bool or the strings a URL query carries (true/false, 1/0, yes/no)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in {"1", "true", "yes", "0", "false", "no"}:
        return value.lower() in {"1", "true", "yes"}
    raise ValueError(f"option {name}={value!r} is not a boolean")
