"""Where a face's checkpoints live: a URL, a path or an open Store, and the store options.

Every face takes a checkpoint root the same three ways: options in the URL's query
(``s3://b/run?endpoint_url=...``), options as keywords (``endpoint_url=...``), or an open
:class:`~ckptstore.store.base.Store`, which already carries its options and is left open.
Options are validated by :func:`~ckptstore.store.registry.open_store` (each backend knows its
own, every backend knows the Settings fields), so an unknown name or a bad value raises the
same error whichever face it was given to; options given together with an open Store are
refused here, once, for every face.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

from ckptstore import background
from ckptstore.store.base import Store
from ckptstore.store.options import split_settings
from ckptstore.store.registry import open_store

__all__ = ["Root", "aopened", "check_options", "open_root", "opened"]

#: A run's checkpoint root as the faces take it.
Root = str | os.PathLike[str] | Store


def open_root(root: Root, options: Mapping[str, Any]) -> tuple[Store, bool]:
    """The store of ``root`` and whether the caller opened it (and so must close it).

    Raises:
        TypeError: options given with an open Store, or an option the backend does not know.
        ValueError: an option with a bad value (``InvalidURLError`` for a bad URL).
    """
    if isinstance(root, Store):
        if options:
            raise TypeError(
                f"store options {sorted(options)} were given with an open Store "
                f"({root.url}); options apply to a URL, an open Store already has its own"
            )
        return root, False
    return open_store(os.fspath(root), **options), True


@contextlib.asynccontextmanager
async def aopened(root: Root, options: Mapping[str, Any]) -> AsyncIterator[Store]:
    """The store of ``root`` for the ``async with`` block; closed after it if opened here."""
    store, owned = open_root(root, options)
    try:
        yield store
    finally:
        if owned:
            await store.close()


@contextlib.contextmanager
def opened(root: Root, options: Mapping[str, Any]) -> Iterator[Store]:
    """:func:`aopened` for synchronous callers (the store is closed on the background loop)."""
    store, owned = open_root(root, options)
    try:
        yield store
    finally:
        if owned:
            background.run(store.close())


def check_options(root: Root | None, options: Mapping[str, Any]) -> None:
    """Validate ``options`` now, for a face that opens its store later (DCP, Lightning).

    With a root, the store is opened (which validates every option, as on any face) and
    closed again; opening a store makes no request. Without one (a Lightning plug-in learns its
    paths later), the Settings fields among the options are checked, and options meant for a
    backend are checked by that backend when the first path opens.

    Raises:
        TypeError, ValueError: as :func:`open_root`.
    """
    if root is None:
        split_settings(options)  # builds the Settings: a bad value raises here
        return
    store, owned = open_root(root, options)
    if owned:
        background.run(store.close())
