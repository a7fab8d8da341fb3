"""Save and load checkpoints: ``ckptstore.save(url, state, step=...)``, ``ckptstore.load(url)``.

A *root* (a URL, a local path, or an open :class:`~ckptstore.store.base.Store`) holds the
steps of one run. The async functions (``asave``, ``aload``...) are the canonical ones; the
sync ones run them on ckptstore's background event loop and block until they finish. When
given a URL they open the store and close it again; a Store passed in is left open.

Every save is committed with the protocol of :mod:`ckptstore.layout.commit` and every load
verifies the crc32c of every byte it reads. Loading is the restore path of
:mod:`ckptstore.pipeline.restore`, the same one every other face reads through, so ``keys``
and ``target`` mean the same here as on ``CheckpointManager.restore``. Store options come
the same three ways as on every face (:mod:`ckptstore.pipeline.root`): in the URL's query,
as keywords (``ckptstore.save("s3://b/run", state, step=1, endpoint_url=...)``), or carried
by an open Store.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ckptstore import background
from ckptstore.errors import CommitConflictError
from ckptstore.pipeline import restore as _restore
from ckptstore.pipeline import save as save_path
from ckptstore.pipeline import steps
from ckptstore.pipeline import streaming as _streaming
from ckptstore.pipeline.restore import LeafRestore
from ckptstore.pipeline.root import Root, aopened, open_root
from ckptstore.pipeline.save import Stager
from ckptstore.pipeline.steps import CommitInfo, GCReport, Manifest, collect_garbage, manifest_key
from ckptstore.store.base import Store

__all__ = [
    "CommitInfo",
    "GCReport",
    "adelete_step",
    "agc",
    "alist_steps",
    "aload",
    "aread_manifest",
    "arecover_step",
    "arollback",
    "asave",
    "delete_step",
    "gc",
    "list_steps",
    "load",
    "load_state",
    "read_manifest",
    "recover_step",
    "rollback",
    "save",
]


# ---------------------------------------------------------------------- async


async def asave(
    root: Root,
    state: Any,
    *,
    step: int,
    metadata: Any = None,
    full: bool = False,
    **store_options: Any,
) -> CommitInfo:
    """Save ``state`` as step ``step`` under ``root`` and commit it.

    With ``Settings.incremental`` (the default), only leaves that changed since the newest
    committed step are written; the manifest references that step's objects for the rest
    (docs/format.md, "Incremental saves").

    Args:
        root: URL, path or Store of the run's checkpoint root.
        state: nested dicts/lists/tuples (named tuples, dataclasses and registered JAX pytree
            nodes too) of numpy arrays and scalars, torch tensors, JAX arrays and JSON values;
            the arrays must not change until the save returns.
        step: the step number (an int >= 0); each step is written once.
        metadata: JSON stored in the manifest (returned by :func:`aread_manifest`).
        full: write every leaf and reference nothing, even with ``Settings.incremental``.
        **store_options: options for a URL ``root`` (see :mod:`ckptstore.pipeline.root`).

    Raises:
        CommitConflictError: ``step`` is already committed (by this or another writer).
        UnsupportedLeafError: a leaf that cannot be stored (named by its path).
        TypeError, ValueError: a store option the backend does not know, or a bad value.
    """
    stager = Stager()
    try:
        # Refuses an unstorable leaf before the store is opened. The state is written
        # before this returns, so its host arrays go uncopied.
        staged = save_path.stage(stager, state, copy=False)
        try:
            async with aopened(root, store_options) as store:
                await _refuse_committed(store, step)
                return await save_path.save_staged(
                    store, staged, step=step, metadata=metadata, full=full
                )
        finally:
            staged.release()
    finally:
        stager.close()


async def _refuse_committed(store: Store, step: int) -> None:
    """Refuse a step the root already holds before anything is written (the commit's
    put-if-absent would refuse it too, after every byte was written and then removed)."""
    if await store.exists(manifest_key(step)):
        newest = await steps.latest_step(store)
        raise CommitConflictError(
            f"{store.url}: step {step} is already committed (the newest step of this root is "
            f"{newest}), and a step is saved once. Save the steps after the newest; to save "
            "this one again, go back to an older step with ckptstore.rollback(root, step) "
            "(the newer steps are set aside, recoverably) first; or save to a new root"
        )


async def aread_manifest(root: Root, step: int | None = None, **store_options: Any) -> Manifest:
    """The validated manifest of ``step`` (default: the latest committed step)."""
    async with aopened(root, store_options) as store:
        return await _restore.find_manifest(store, step)


async def aload(
    root: Root,
    step: int | None = None,
    keys: str | Iterable[str] | None = None,
    into: Any = None,
    *,
    target: Any = None,
    **store_options: Any,
) -> Any:
    """Load a checkpoint, verifying every byte read.

    Args:
        root: URL, path or Store of the run's checkpoint root.
        step: the step to load; ``None`` loads the latest committed step.
        keys: leaf paths (``"model/layer0/w"``) or path prefixes (``"model"``) to load; only
            their byte ranges are read, and each must name something in the step. The result
            then holds only those leaves: dicts drop the others, lists and tuples keep their
            length with ``None`` in their place.
        into: a state of the same structure whose arrays are filled in place (dtype and
            shape must match the checkpoint exactly); they appear in the result as the very
            same objects. Leaves of ``into`` that the checkpoint lacks are an error.
        target: what to rebuild the arrays as, as for ``CheckpointManager.restore``
            (``"numpy"``, ``"torch"``, ``"jax"``, or a state whose structure and leaves the
            result takes). By default each array comes back as the kind it was saved from:
            a torch tensor as a torch tensor (on its device, where that device exists), a
            JAX array as a JAX array, a numpy array as numpy, the same rule as
            ``CheckpointManager.restore``.
        **store_options: options for a URL ``root`` (see :mod:`ckptstore.pipeline.root`).

    Returns:
        The state, as nested dicts/lists/tuples of arrays and plain values.

    Raises:
        NotFoundError: no such step, or a key matching no leaf (every such key is named).
        CorruptCheckpointError: the manifest or any byte read fails verification.
        CheckpointFormatError: a checkpoint only another face reads (DCP's).
    """
    asked = _asked(keys, target, into)
    return _restore.rebuild(await _aread(root, step, asked, into, store_options))


def _asked(
    keys: str | Iterable[str] | None,
    target: Any,
    into: Any,
    stream: bool | str | Iterable[str] = False,
) -> _restore.Request:
    # The arrays of ``into`` are numpy arrays and come back as themselves.
    return _restore.request(
        keys, "numpy" if into is not None and target is None else target, stream
    )


async def _aread(
    root: Root, step: int | None, asked: _restore.Request, into: Any, store_options: Any
) -> _restore.Selection:
    async with aopened(root, store_options) as store:
        return await _restore.read(store, step, asked, into=into)


async def load_state(
    store: Store,
    *,
    step: int | None = None,
    keys: str | Iterable[str] | None = None,
    into: Any = None,
    restore: LeafRestore | None = None,
) -> Any:
    """:func:`aload` on an open store, with a hook for stagers.

    Args:
        restore: called as ``restore(array, path, attrs)`` for every array leaf loaded,
            with the attrs its saver stored; its result takes the array's place in the
            returned state (a torch stager returns a tensor here).
    """
    asked = _restore.request(keys, "numpy")
    return await _restore.arestore(store, step, asked, into=into, leaf=restore)


async def alist_steps(root: Root, **store_options: Any) -> list[int]:
    """Committed steps under ``root``, ascending."""
    async with aopened(root, store_options) as store:
        return await steps.committed_steps(store)


async def adelete_step(root: Root, step: int, **store_options: Any) -> None:
    """Delete a step (manifest first, so it is never half visible)."""
    async with aopened(root, store_options) as store:
        await steps.delete_step(store, step)


async def arollback(root: Root, step: int, **store_options: Any) -> list[int]:
    """Make ``step`` the newest committed step: set aside every newer one, newest first,
    and return them (descending). A set-aside step is invisible to every face; its data
    stays until :func:`agc` finds it abandoned (the grace period counts from the
    roll-back), and :func:`arecover_step` commits it again until then. See
    :mod:`ckptstore.layout.rollback`.

    Raises:
        NotFoundError: ``step`` is not committed (nothing is set aside then).
    """
    async with aopened(root, store_options) as store:
        await _restore.find_manifest(store, step)  # roll back only to a valid step
        return await steps.set_aside(store, step)


async def arecover_step(root: Root, step: int, **store_options: Any) -> Manifest:
    """Commit a step that a roll-back set aside again, exactly as it was (recover several
    oldest first: a step may reference the objects of the one before).

    Raises:
        NotFoundError: ``step`` was not set aside, or gc has removed it.
        CommitConflictError: ``step`` was committed again since.
        CorruptCheckpointError: part of it is gone (nothing is committed then).
    """
    async with aopened(root, store_options) as store:
        return await steps.recover(store, step)


async def agc(root: Root, *, grace: float | None = None, **store_options: Any) -> GCReport:
    """Remove abandoned save attempts idle for longer than ``grace`` seconds (default
    ``Settings.gc_grace_seconds``); see :mod:`ckptstore.layout.gc`."""
    async with aopened(root, store_options) as store:
        return await collect_garbage(store, grace=grace)


# ---------------------------------------------------------------------- sync


def save(
    root: Root,
    state: Any,
    *,
    step: int,
    metadata: Any = None,
    full: bool = False,
    **store_options: Any,
) -> CommitInfo:
    """Blocking :func:`asave`."""
    _streaming.wait_all()  # here: the save's staging runs on the loop, which must not block
    return background.run(
        asave(root, state, step=step, metadata=metadata, full=full, **store_options)
    )


def load(
    root: Root,
    step: int | None = None,
    keys: str | Iterable[str] | None = None,
    into: Any = None,
    *,
    target: Any = None,
    stream: bool | str | Iterable[str] = False,
    **store_options: Any,
) -> Any:
    """Blocking :func:`aload`: the reads run on the background loop, the arrays are built
    (on their device) in the calling thread.

    ``stream`` returns before the whole state is read, as ``CheckpointManager.restore``'s:
    ``True`` once every leaf but the optimizer's state is in place, or once the leaves under
    the keys given are; the rest is read in the background, and a torch optimizer step,
    ``ckptstore.fence()`` and the next save wait for it (:mod:`ckptstore.pipeline.streaming`).
    """
    asked = _asked(keys, target, into, stream)
    if not asked.stream:
        return _restore.rebuild(background.run(_aread(root, step, asked, into, store_options)))
    _streaming.wait_all()
    store, owned = open_root(root, store_options)
    selection: _restore.Selection | None = None
    try:
        selection = background.run(_restore.read(store, step, asked, into=into))
        return _restore.rebuild(selection, store=store, owned=owned)
    finally:
        if owned and (selection is None or selection.stream is None):
            background.run(store.close())


def read_manifest(root: Root, step: int | None = None, **store_options: Any) -> Manifest:
    """Blocking :func:`aread_manifest`."""
    return background.run(aread_manifest(root, step, **store_options))


def list_steps(root: Root, **store_options: Any) -> list[int]:
    """Blocking :func:`alist_steps`."""
    return background.run(alist_steps(root, **store_options))


def delete_step(root: Root, step: int, **store_options: Any) -> None:
    """Blocking :func:`adelete_step`."""
    background.run(adelete_step(root, step, **store_options))


def rollback(root: Root, step: int, **store_options: Any) -> list[int]:
    """Blocking :func:`arollback`."""
    return background.run(arollback(root, step, **store_options))


def recover_step(root: Root, step: int, **store_options: Any) -> Manifest:
    """Blocking :func:`arecover_step`."""
    return background.run(arecover_step(root, step, **store_options))


def gc(root: Root, *, grace: float | None = None, **store_options: Any) -> GCReport:
    """Blocking :func:`agc`."""
    return background.run(agc(root, grace=grace, **store_options))
