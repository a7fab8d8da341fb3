"""Options handed to ``open_store``: Settings fields split from backend-specific ones."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ckptstore.config import Settings, default_settings
from ckptstore.store.transport import remember_secrets

__all__ = ["Alias", "parse_bool", "split_settings"]

#: An old option name a backend still accepts: the Settings field it sets, and how its value
#: becomes that field's (GCS ``retries`` counted retries, ``retry_attempts`` counts attempts).
Alias = tuple[str, Callable[[Any], Any]]


def split_settings(
    options: Mapping[str, Any], aliases: Mapping[str, Alias] | None = None
) -> tuple[Settings, dict[str, Any]]:
    """Return the Settings described by ``options`` and the options left for the backend.

    ``options`` may carry a whole ``settings=Settings(...)`` and/or individual Settings
    fields (``part_size="64MiB"``), which override it. ``aliases`` maps documented old option
    names to the Settings field they now set; giving both is an error. The values of
    secret-looking options are remembered for redaction.
    """
    remember_secrets(options)
    rest = dict(options)
    for old, (new, convert) in (aliases or {}).items():
        if old not in rest:
            continue
        if new in rest:
            raise TypeError(
                f"options {old!r} and {new!r} both given; {old!r} is the old name of "
                f"{new!r}: give only {new}"
            )
        try:
            rest[new] = convert(rest.pop(old))
        except (TypeError, ValueError):
            raise ValueError(f"option {old}={options[old]!r} is not a whole number") from None
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
