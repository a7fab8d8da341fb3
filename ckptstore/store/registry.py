"""URL scheme to backend: ``open_store("s3://bucket/prefix", **options)``.

Each entry names the backend's class by import path, so that importing ckptstore imports no
client library; the class is imported on first use and a missing client library fails with
the command that installs it. Schemes not in the table go, in order, to a backend registered
by a third-party package under the ``ckptstore.backends`` entry point group, then to the
generic fsspec backend if fsspec knows the protocol. ``fsspec+PROTOCOL://`` always goes to
the fsspec backend (``fsspec+memory://`` is fsspec's memory filesystem).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from ckptstore.errors import InvalidURLError, MissingDependencyError, NotSupportedError
from ckptstore.store.base import Store
from ckptstore.store.transport import redact_url, remember_secrets

__all__ = ["BackendSpec", "open_store", "register_backend", "registered_schemes"]


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """Where a backend lives and how to install what it needs.

    Attributes:
        target: ``"module:Class"`` of a :class:`~ckptstore.store.base.Store` subclass.
        install_hint: the command that installs the backend's client library.
    """

    target: str
    install_hint: str = ""

    def load(self, scheme: str) -> type[Store]:
        module_name, _, class_name = self.target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                raise NotSupportedError(
                    f"{scheme}:// URLs", module_name, "that backend is not part of this version"
                ) from exc
            hint = f"; install it with: {self.install_hint}" if self.install_hint else ""
            raise MissingDependencyError(
                f"the {scheme}:// backend needs the package {exc.name!r}{hint}"
            ) from exc
        cls = getattr(module, class_name)
        if not (isinstance(cls, type) and issubclass(cls, Store)):
            raise TypeError(f"{self.target} is not a ckptstore Store subclass")
        return cls


_BACKENDS: dict[str, BackendSpec] = {
    "memory": BackendSpec("ckptstore.store.memory:MemoryStore"),
    "file": BackendSpec("ckptstore.store.local:LocalStore"),
    "nfs": BackendSpec("ckptstore.store.nfs:NFSStore"),
    "s3": BackendSpec("ckptstore.store.s3:S3Store", "pip install 'ckptstore[s3]'"),
    "gs": BackendSpec("ckptstore.store.gcs:GCSStore", "pip install 'ckptstore[gcs]'"),
    "gcs": BackendSpec("ckptstore.store.gcs:GCSStore", "pip install 'ckptstore[gcs]'"),
}
_FSSPEC = BackendSpec("ckptstore.store.fsspec:FsspecStore", "pip install 'ckptstore[fsspec]'")
_ENTRY_POINT_GROUP = "ckptstore.backends"


def register_backend(
    scheme: str, target: str, install_hint: str = "", *, replace: bool = False
) -> None:
    """Route ``scheme://`` URLs to the Store class at ``target`` (``"module:Class"``).

    Args:
        scheme: the URL scheme, case-insensitive.
        target: ``"module:Class"`` of a :class:`~ckptstore.Store` subclass, imported on use.
        install_hint: what to install when ``module`` is missing.
        replace: allow taking over a scheme that already has a backend, a built-in one
            (``s3``, ``file``...) included. Registering the same target again is always fine.

    Raises:
        ValueError: for an invalid scheme, or a scheme served by another backend unless
            ``replace`` is true: a plugin must not silently take ``s3://`` away.
    """
    if not scheme or not scheme.isascii() or "://" in scheme:
        raise ValueError(f"invalid scheme {scheme!r}")
    scheme = scheme.lower()
    current = _BACKENDS.get(scheme)
    if current is not None and current.target != target and not replace:
        raise ValueError(
            f"{scheme}:// URLs already go to {current.target}; pass replace=True to send them "
            f"to {target} instead"
        )
    _BACKENDS[scheme] = BackendSpec(target, install_hint)


def registered_schemes() -> list[str]:
    """Schemes with a dedicated backend (fsspec protocols are served besides these)."""
    return sorted(_BACKENDS)


def _scheme_of(url: str) -> str:
    if "://" not in url:
        return "file"
    scheme = url.split("://", 1)[0].lower()
    if not scheme or not all(c.isalnum() or c in "+-." for c in scheme):
        raise InvalidURLError(f"{url!r} has no valid scheme")
    return scheme


def _spec_for(scheme: str) -> BackendSpec:
    if scheme in _BACKENDS:
        return _BACKENDS[scheme]
    if scheme.startswith("fsspec+"):  # fsspec's implementation, even where we have our own
        return _FSSPEC
    for entry in importlib.metadata.entry_points(group=_ENTRY_POINT_GROUP):
        if entry.name.lower() == scheme:
            return BackendSpec(entry.value)
    try:
        import fsspec
    except ImportError:
        raise InvalidURLError(
            f"no backend for {scheme}:// URLs; known: {', '.join(registered_schemes())}; other "
            f"protocols go through fsspec: {_FSSPEC.install_hint}"
        ) from None
    if scheme in fsspec.available_protocols():
        return _FSSPEC
    raise InvalidURLError(
        f"no backend for {scheme}:// URLs; known: {', '.join(registered_schemes())} and the "
        "fsspec protocols (fsspec.available_protocols())"
    )


def open_store(url: str | os.PathLike[str], **options: Any) -> Store:
    """Open the store at ``url``, choosing the backend by its scheme.

    Args:
        url: ``/path`` or ``file:///path`` (local disk), ``nfs:///mount/path``,
            ``s3://bucket/prefix``, ``gs://bucket/prefix``, ``memory://name``, or any fsspec
            URL. Backends that take options in the URL query accept ``?name=value`` too.
        **options: backend options and :class:`~ckptstore.config.Settings` fields
            (``part_size="64MiB"``); a backend rejects options it does not know.

    Raises:
        InvalidURLError: nothing serves the scheme, or the URL is malformed.
        MissingDependencyError: the backend's client library is missing (message has the fix).
    """
    text = os.fspath(url)
    if not isinstance(text, str) or not text:
        raise InvalidURLError(f"a store URL must be a non-empty string, got {url!r}")
    remember_secrets(options)
    scheme = _scheme_of(text)
    cls = _spec_for(scheme).load(scheme)
    if cls.url_query_options and "?" in text:
        parts = urlsplit(text)
        try:
            query = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=True)
        except ValueError:
            raise InvalidURLError(
                f"{redact_url(text)!r}: the query is not a list of name=value options"
            ) from None
        remember_secrets(dict(query))
        for name, value in query:
            if name in options and options[name] != value:
                raise InvalidURLError(
                    f"option {name!r} is given both in the URL query and as a keyword"
                )
            options.setdefault(name, value)
        text = parts._replace(query="").geturl()
    return cls.from_url(text, **options)
