"""Save and load checkpoints: ``ckptstore.save(url, state, step=...)``, ``ckptstore.load(url)``.

A *root* (a URL, a local path, or an open :class:`~ckptstore.store.base.Store`) holds the
steps of one run. The async functions (``asave``, ``aload``...) are the canonical ones; the
sync ones run them on ckptstore's background event loop and block until they finish. When
given a URL they open the store and close it again; a Store passed in is left open.

Every save is committed with the protocol of :mod:`ckptstore.layout.commit` and every load
verifies the crc32c of every byte it reads (:mod:`ckptstore.layout.restore`).
"""

from __future__ import annotations

import bisect
import contextlib
import os
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import numpy as np

from ckptstore import background
from ckptstore.errors import NotFoundError
from ckptstore.layout import commit as _commit
from ckptstore.layout.commit import CommitInfo
from ckptstore.layout.gc import GCReport, collect_garbage
from ckptstore.layout.manifest import Manifest
from ckptstore.layout.restore import read_leaves
from ckptstore.layout.tree import flatten, select_paths, unflatten
from ckptstore.pipeline import save as save_path
from ckptstore.store.base import Store
from ckptstore.store.registry import open_store

__all__ = [
    "CommitInfo",
    "GCReport",
    "adelete_step",
    "agc",
    "alist_steps",
    "aload",
    "aread_manifest",
    "asave",
    "delete_step",
    "gc",
    "list_steps",
    "load",
    "load_state",
    "read_manifest",
    "save",
]

Root = str | os.PathLike[str] | Store


@contextlib.asynccontextmanager
async def _opened(root: Root) -> AsyncIterator[Store]:
    if isinstance(root, Store):
        yield root
        return
    store = open_store(os.fspath(root))
    try:
        yield store
    finally:
        await store.close()


# ---------------------------------------------------------------------- async


async def asave(root: Root, state: Any, *, step: int, metadata: Any = None) -> CommitInfo:
    """Save ``state`` as step ``step`` under ``root`` and commit it.

    Args:
        root: URL, path or Store of the run's checkpoint root.
        state: nested dicts/lists/tuples of numpy arrays, numpy scalars and JSON values.
        step: the step number (an int >= 0); each step is written once.
        metadata: JSON stored in the manifest (returned by :func:`aread_manifest`).

    Raises:
        CommitConflictError: ``step`` is already committed (by this or another writer).
        UnsupportedLeafError: a leaf that cannot be stored (named by its path).
    """
    flat = flatten(state)  # refuses an unstorable leaf before the store is opened
    async with _opened(root) as store:
        return await save_path.save_flat(store, flat, step=step, metadata=metadata)


async def aread_manifest(root: Root, step: int | None = None) -> Manifest:
    """The validated manifest of ``step`` (default: the latest committed step)."""
    async with _opened(root) as store:
        return await _read_manifest(store, step)


async def _read_manifest(store: Store, step: int | None) -> Manifest:
    if step is None:
        step = await _commit.latest_step(store)
        if step is None:
            raise NotFoundError(f"{store.url}: no committed checkpoint")
    return await _commit.read_manifest(store, step)


async def aload(
    root: Root,
    step: int | None = None,
    keys: Iterable[str] | None = None,
    into: Any = None,
) -> Any:
    """Load a checkpoint, verifying every byte read.

    Args:
        root: URL, path or Store of the run's checkpoint root.
        step: the step to load; ``None`` loads the latest committed step.
        keys: leaf paths (``"model/layer0/w"``) or path prefixes (``"model"``) to load; only
            their byte ranges are read. The result then holds only those leaves: dicts drop
            the others, lists and tuples keep their length with ``None`` in their place.
        into: a state of the same structure whose arrays are filled in place (dtype and
            shape must match the checkpoint exactly); they appear in the result as the very
            same objects. Leaves of ``into`` that the checkpoint lacks are an error.

    Returns:
        The state, as nested dicts/lists/tuples of numpy arrays and plain values.

    Raises:
        NotFoundError: no such step, or a key matching no leaf.
        CorruptCheckpointError: the manifest or any byte read fails verification.
    """
    async with _opened(root) as store:
        return await load_state(store, step=step, keys=keys, into=into)


async def load_state(
    store: Store,
    *,
    step: int | None = None,
    keys: Iterable[str] | None = None,
    into: Any = None,
    restore: Callable[[np.ndarray[Any, Any], str, dict[str, Any] | None], Any] | None = None,
) -> Any:
    """:func:`aload` on an open store, with a hook for stagers.

    Args:
        restore: called as ``restore(array, path, attrs)`` for every array leaf loaded,
            with the attrs its saver stored; its result takes the array's place in the
            returned state (a torch stager returns a tensor here).
    """
    manifest = await _read_manifest(store, step)
    index = {path: i for i, path in enumerate(manifest.paths)}
    accept = None
    if keys is not None:
        wanted = [keys] if isinstance(keys, str) else list(keys)
        accept = select_paths(wanted)
        _check_keys(store, manifest, wanted)
        leaves = [i for i, path in enumerate(manifest.paths) if accept(path)]
    else:
        leaves = list(range(len(manifest.paths)))
    targets: dict[int, np.ndarray[Any, Any]] = {}
    if into is not None:
        given = flatten(into)
        for path, array in zip(given.paths, given.arrays, strict=True):
            if path not in index:
                raise NotFoundError(
                    f"{store.url}: step {manifest.step} has no array leaf {path!r} to fill into"
                )
            targets[index[path]] = array
    arrays = await read_leaves(store, manifest, leaves, targets)
    hook = None
    if restore is not None:
        paths, attrs = manifest.paths, manifest.attrs

        def hook(array: Any, leaf: int) -> Any:
            return restore(array, paths[leaf], attrs[leaf])

    return unflatten(manifest.tree, arrays, selected=accept, restore=hook)


def _check_keys(store: Store, manifest: Manifest, wanted: list[str]) -> None:
    known = sorted(manifest.all_paths())
    for key in wanted:
        if key == "" and known:
            continue
        at = bisect.bisect_left(known, key)
        if at < len(known) and known[at] == key:
            continue
        at = bisect.bisect_left(known, key + "/")
        if at < len(known) and known[at].startswith(key + "/"):
            continue
        raise NotFoundError(
            f"{store.url}: step {manifest.step} has no leaf {key!r} (paths look like {known[:3]})"
        )


async def alist_steps(root: Root) -> list[int]:
    """Committed steps under ``root``, ascending."""
    async with _opened(root) as store:
        return await _commit.committed_steps(store)


async def adelete_step(root: Root, step: int) -> None:
    """Delete a step (manifest first, so it is never half visible)."""
    async with _opened(root) as store:
        await _commit.delete_step(store, step)


async def agc(root: Root, *, grace: float | None = None) -> GCReport:
    """Remove abandoned save attempts idle for longer than ``grace`` seconds (default
    ``Settings.gc_grace_seconds``); see :mod:`ckptstore.layout.gc`."""
    async with _opened(root) as store:
        return await collect_garbage(store, grace=grace)


# ---------------------------------------------------------------------- sync


def save(root: Root, state: Any, *, step: int, metadata: Any = None) -> CommitInfo:
    """Blocking :func:`asave`."""
    return background.run(asave(root, state, step=step, metadata=metadata))


def load(
    root: Root, step: int | None = None, keys: Iterable[str] | None = None, into: Any = None
) -> Any:
    """Blocking :func:`aload`."""
    return background.run(aload(root, step, keys, into))


def read_manifest(root: Root, step: int | None = None) -> Manifest:
    """Blocking :func:`aread_manifest`."""
    return background.run(aread_manifest(root, step))


def list_steps(root: Root) -> list[int]:
    """Blocking :func:`alist_steps`."""
    return background.run(alist_steps(root))


def delete_step(root: Root, step: int) -> None:
    """Blocking :func:`adelete_step`."""
    background.run(adelete_step(root, step))


def gc(root: Root, *, grace: float | None = None) -> GCReport:
    """Blocking :func:`agc`."""
    return background.run(agc(root, grace=grace))
