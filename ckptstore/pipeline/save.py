"""The one save path: stage -> plan -> write -> commit.

Every save is one :class:`SaveSession` (begin -> hold what it references -> write objects ->
draft the manifest -> commit or abandon), and every face that saves calls this module and
nothing below it:

=====================================  =====================================================
face                                   what it keeps of its own
=====================================  =====================================================
``ckptstore.save`` / ``asave``         nothing: :func:`save_flat` of its state
``CheckpointManager.save``             when to save, retention; :func:`stage` in the
                                       caller's thread, :func:`save_staged` in the background
``ckptstore.manager.distributed``      the collectives: every rank :func:`stage`, :func:`plan`
                                       and :func:`write` under the session's ticket; the
                                       coordinator begins the :class:`SaveSession` and
                                       commits it
DCP ``Writer``                         DCP's planner types: every rank :func:`plan` and
                                       :func:`write` under the ticket; the coordinator begins
                                       the session (``prepare_global_plan``) and commits it
                                       (``finish``)
the file adapters                      the directory scan: one session, an
                                       :func:`object_writer` reading the files
Lightning ``StoreCheckpointIO``        its hooks: :func:`stage` and :func:`save_staged`
``cp``, the persistent tier            a session at the destination whose objects are the
                                       source's bytes (:mod:`ckptstore.pipeline.maintenance`)
=====================================  =====================================================

The stages:

1. **stage**: a state's arrays to host arrays the writer may read (:mod:`ckptstore.stage`:
   copied into a pooled arena, or let through in place when the caller waits for the save),
   and the state's tree as :class:`~ckptstore.layout.tree.FlatState`.
2. **plan**: which object and offset each leaf gets (:class:`~ckptstore.layout.plan.PackPlan`,
   the one packer): small leaves packed into few objects at ``Settings.leaf_alignment``,
   large ones objects of their own.
   An incremental save (``Settings.incremental``) first hashes every leaf and plans only
   the leaves that changed since the newest committed step; its manifest references that
   step's objects for the rest (:mod:`ckptstore.layout.incremental`).
3. **write**: every object under the attempt's prefix, packs built in the one buffer pool
   (:data:`~ckptstore.store.buffers.host_buffers`), with each leaf's and object's crc32c;
   durable when it returns; a failed writer removes what it wrote.
4. **commit**: the manifest, assembled by a :class:`ManifestDraft` (the one builder of
   manifests, :mod:`ckptstore.layout.session`; :meth:`SaveSession.draft`), once, with a
   put-if-absent (:meth:`SaveSession.commit`, :mod:`ckptstore.layout.commit`).

The protocol's rules (a fresh attempt prefix, durability before the manifest, the grace-period
and size checks, what a lost response or a conflict means) live in
:mod:`ckptstore.layout.commit`; this module is how faces reach them, so a capability added to a
stage reaches every face. No stage does per-leaf async work: a plan is built in one pass,
packs are filled with one copy per leaf in a worker thread, and one request goes out per
object.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np

from ckptstore.errors import CkptStoreError
from ckptstore.layout.chunks import block_size_for
from ckptstore.layout.commit import (
    Attempt,
    CommitInfo,
    ObjectWriter,
    SaveSession,
    Written,
    hashes_in_turns,
    plan_changed,
    read_manifest,
    remove_objects,
    write_checkpoint,
    write_objects,
)
from ckptstore.layout.incremental import Reuse, plan_reuse
from ckptstore.layout.manifest import Manifest
from ckptstore.layout.plan import PackPlan
from ckptstore.layout.session import ManifestDraft
from ckptstore.layout.tree import FlatState
from ckptstore.pipeline import streaming
from ckptstore.pipeline.deadline import bounded
from ckptstore.stage.lazy import LazyCopy
from ckptstore.stage.stager import StagedState, Stager
from ckptstore.store.base import Store

__all__ = [
    "Attempt",
    "CommitInfo",
    "LazyCopy",
    "ManifestDraft",
    "PackPlan",
    "Reuse",
    "SaveSession",
    "StagedState",
    "Stager",
    "Written",
    "block_size_for",
    "discard",
    "hashes",
    "object_writer",
    "plan",
    "read_base",
    "reuse",
    "save_flat",
    "save_staged",
    "stage",
    "write",
]


# --------------------------------------------------------------------------- 1. stage


def stage(
    stager: Stager, state: Any, *, copy: bool = True, lazy: bool = False, start: bool = True
) -> StagedState:
    """Stage ``state`` and build its flat view, in the calling thread.

    Everything that can refuse a state (an array ckptstore cannot store, a leaf that is
    neither an array nor a plain value) fails here, in the caller's thread, before any
    background work; the arena is given back on such a failure.

    Args:
        stager: whose pool and threads to use.
        state: nested dicts, lists and tuples of numpy, torch or JAX arrays and plain values.
        copy: ``False`` lets host arrays through without a copy (for a caller that waits for
            the save before touching the state again).
        lazy: leave the copies to a background thread (a lazy snapshot,
            :mod:`ckptstore.stage.lazy`); :func:`save_staged` waits for them, so the bytes,
            layout and commit are the eager ones.
        start: with ``lazy``, start that copy now; ``False`` leaves it to
            :meth:`StagedState.start` (an async save starts it on the background loop).

    The background part of every streaming restore of the process is waited for first
    (:mod:`ckptstore.pipeline.streaming`): a state holding arrays it still fills is never
    staged, and its failure is raised here.

    Raises:
        TypeError, UnsupportedLeafError: a leaf that cannot be stored, named by its path.
    """
    streaming.wait_all()
    # named only when it says something, so a Stager subclass written before it still stages
    later: dict[str, Any] = {"start": False} if lazy and not start else {}
    staged = stager.stage(state, copy=copy, lazy=lazy, **later)
    try:
        staged.flat()
    except BaseException:
        staged.release()
        raise
    return staged


# --------------------------------------------------------------------------- 2. plan


def plan(
    store: Store,
    lengths: Sequence[int],
    paths: Sequence[str] | None = None,
    *,
    pack_threshold: int | None = None,
    pack_size: int | None = None,
    reuse: Reuse | None = None,
) -> PackPlan:
    """Plan leaves of ``lengths`` bytes for ``store``: its settings and part limits, or the
    ``pack_threshold`` and ``pack_size`` a face sets for itself (the DCP writer's). With
    ``reuse`` (:func:`reuse`), only the leaves it does not take from the base get bytes.

    Raises:
        ValueError: a leaf larger than the store's largest object (named by ``paths``).
    """
    if reuse is not None:
        return plan_changed(
            store,
            lengths,
            paths or [""] * len(lengths),
            reuse,
            pack_threshold=pack_threshold,
            pack_size=pack_size,
        )
    return PackPlan.for_store(
        lengths,
        store.settings,
        store.capabilities,
        paths,
        pack_threshold=pack_threshold,
        pack_size=pack_size,
    )


# ------------------------------------------------- 2b. incremental saves written in parts
#
# ``save_flat`` does all of this itself. A face whose writers write parts of one attempt (the
# ranks of ``ckptstore.manager.distributed``, the DCP writer's) splits it: the coordinator's
# session finds the base and holds it before any writer starts
# (:meth:`SaveSession.hold_base`); each writer :func:`hashes` its leaves, decides their
# :func:`reuse` and plans the rest (:func:`plan` with ``reuse=``); the coordinator points the
# reused leaves at the base's objects (:meth:`ManifestDraft.reference`).


#: The leaves' xxh3-128 hashes, on the hashing pool, in turns with the writes' checksums.
hashes = hashes_in_turns
#: Which leaves reuse a base's bytes (:func:`ckptstore.layout.incremental.plan_reuse`).
reuse = plan_reuse


async def read_base(store: Store, step: int) -> Manifest | None:
    """The base manifest a coordinator's session held (:meth:`SaveSession.hold_base`), as
    another writer reads it; ``None`` if it
    cannot be read (that writer then writes all its leaves: the save stays whole either
    way)."""
    try:
        return await read_manifest(store, step)
    except CkptStoreError:  # NotFoundError, a damaged manifest, the store's errors
        return None


# --------------------------------------------------------------------------- 3. write


async def write(
    store: Store, arrays: Sequence[np.ndarray[Any, Any]], plan: PackPlan, prefix: str
) -> Written:
    """Write the objects of ``plan`` under ``prefix`` (a session's prefix, plus the writer's
    own part such as ``r3-`` when several write one session); durable when it returns.

    On a failure, what this writer wrote is removed (best effort; it is invisible without a
    manifest either way) and the error is raised.
    """
    try:
        return await write_objects(store, arrays, plan, prefix)
    except Exception:
        await remove_objects(store, prefix)
        raise


def object_writer(
    store: Store, plan: PackPlan, prefix: str, arrays: Sequence[np.ndarray[Any, Any]]
) -> ObjectWriter:
    """The write stage one object at a time, for a face whose leaves become ready one after
    another (the DCP writer resolves its items one by one): call ``write(i)`` once object
    ``i``'s leaves are in ``arrays``, so its upload overlaps the preparation of the rest."""
    return ObjectWriter(store, plan, prefix, arrays)


async def discard(store: Store, prefix: str) -> None:
    """Remove what a writer wrote under ``prefix`` for a session that will not commit (best
    effort, never raises: the objects are invisible without a manifest, and garbage
    collection removes whatever is left)."""
    await remove_objects(store, prefix)


# --------------------------------------------------------------------------- whole saves


async def save_flat(
    store: Store, flat: FlatState, *, step: int, metadata: Any = None, full: bool = False
) -> CommitInfo:
    """Plan, write and commit a flat state in this process (the arrays must not change
    until it returns). With ``Settings.incremental`` only what changed since the newest
    committed step is written, unless ``full`` (:mod:`ckptstore.layout.incremental`).

    Raises:
        DeadlineExceededError: the save took longer than ``Settings.save_deadline``; its
            attempt is abandoned.
    """
    return await bounded(
        write_checkpoint(store, flat, step=step, metadata=metadata, full=full),
        seconds=store.settings.layout.save_deadline,
        what=f"save of step {step} to {store.url}",
        setting="save_deadline",
    )


async def save_staged(
    store: Store, staged: StagedState, *, step: int, metadata: Any = None, full: bool = False
) -> CommitInfo:
    """Plan, write and commit a state :func:`stage` copied (the background half of an async
    save), once its device-to-host copies have landed; the caller releases ``staged`` when
    this returns."""
    if staged.fences:
        await asyncio.to_thread(staged.wait_ready)
    return await save_flat(store, staged.flat(), step=step, metadata=metadata, full=full)
