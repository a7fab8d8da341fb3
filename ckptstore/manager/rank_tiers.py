"""The two tiers of a multi-rank :class:`~ckptstore.manager.distributed_manager.CheckpointManager`:
each rank commits its part on a local tier of its own, and chosen steps are committed once on
the persistent tier, every rank copying its own part there.

Why each rank has a root of its own: a rank's local tier is a directory on its node (NVMe,
``/dev/shm``), which no other rank can read; ranks of one node share the directory given as
``local=`` and keep their parts apart under it, in ``rank{r}-of-{world}``. The world is in the
name because a part means something only to the world that saved it: a job restarted on
another number of ranks finds no local parts and restores from the persistent tier, which
reshards.

A step is on the local tier only when it is on *every* rank's: each rank commits its part
as a step of its own root (the single-process commit, put-if-absent, checksummed), then all
ranks tell each other how that went. A rank that failed, or a rank that died, makes every
rank remove its part of that step and raise (the one that failed its own error, the others
an error naming it). A crash can still leave parts on some ranks only; the next start
(:meth:`RankTiers.resume`, a collective) deletes every part that is not on every rank.

Why the persistent copy reads the part back instead of copying its objects: the persistent
step is one multi-rank step, whose objects are named by rank and committed by the
coordinator from every rank's list (:func:`~ckptstore.manager.distributed.commit_parts`), as
a save to that tier would be. So each rank reads its committed local part into host memory,
verifying every byte as any restore does, and takes part in that protocol with it, on a
process group of the copies' own (the saves' group carries the next saves meanwhile). The
copy is incremental against the persistent tier's newest step as a save there would be.
It holds a rank's part in host memory while it runs (one part at a time: copies run one at a
time).

The copies' order and which of them the backlog bound skips are the coordinator's: every
rank queues the same copies in the same order (every rank's save of a step submits it, with
the coordinator's ``persist`` flag), and each copy starts with one ``broadcast`` from the
coordinator saying whether it runs. A rank other than the coordinator keeps every queued
step pending until then, so its local retention never deletes a step the coordinator will
copy.

Restore (:meth:`~ckptstore.manager.distributed_manager.CheckpointManager.restore`) takes the
newest step on every rank's local tier or on the persistent tier, reads each rank's request
from its own local part when every rank can, and otherwise reads the step from the persistent
tier on every rank (with resharding and read-once broadcast, as without tiers), saying why in
:attr:`~ckptstore.manager.tiers.RestoreInfo.fallback`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import urllib.parse
from collections.abc import Callable, Coroutine
from typing import Any

from ckptstore import background
from ckptstore.errors import CkptStoreError, NotFoundError
from ckptstore.manager.distributed import Collectives, _Failure, commit_parts, lost_rank
from ckptstore.manager.tiers import Replicator, Tiers, list_tiers
from ckptstore.pipeline.codec import FlatState
from ckptstore.pipeline.restore import read, request
from ckptstore.pipeline.steps import CommitInfo, committed_steps, delete_step
from ckptstore.store.base import Store
from ckptstore.threads import Pool

__all__ = ["RankReplicator", "RankTiers", "everywhere", "rank_root"]

_log = logging.getLogger("ckptstore.tiers")


def rank_root(local: str | os.PathLike[str], rank: int, world: int) -> str:
    """The root of rank ``rank``'s part under ``local`` (a directory or a URL, whose query
    stays the URL's): ``<local>/rank{rank}-of-{world}``."""
    text = os.fspath(local)
    name = f"rank{rank}-of-{world}"
    parts = urllib.parse.urlsplit(text)
    if not parts.scheme or len(parts.scheme) == 1:  # a path (a Windows drive letter too)
        return os.path.join(text, name)
    return parts._replace(path=parts.path.rstrip("/") + "/" + name).geturl()


def everywhere(comm: Collectives, work: Callable[[], Any], what: str, where: str) -> list[Any]:
    """Run ``work`` on this rank and tell every rank every rank's result, by rank.

    Raises, on every rank, if ``work`` failed on any: its own error on a rank where it
    failed, on the others a ``CkptStoreError`` naming every rank where it did; and a
    ``CkptStoreError`` if the ranks could not hear each other (a rank died).
    """
    error: Exception | None = None
    try:
        mine = work()
    except Exception as exc:
        error, mine = exc, _Failure.of(comm.rank, exc)
    try:
        said = comm.all_gather(mine)
    except Exception as exc:
        raise CkptStoreError(
            f"{where}: {what}: hearing from the other ranks failed, most likely because another "
            f"rank died ({type(exc).__name__}: {exc})"
        ) from exc
    if error is not None:
        raise error
    failures = [s for s in said if isinstance(s, _Failure)]
    if failures:
        raise CkptStoreError(
            f"{where}: {what} failed on " + "; ".join(f.describe() for f in failures)
        )
    return said


async def read_part(local: Store, step: int) -> tuple[FlatState, Any]:
    """This rank's committed part of ``step``, read and verified, and its metadata."""
    selection = await read(local, step, request())
    manifest = selection.manifest
    arrays = [selection.arrays[leaf] for leaf in range(len(manifest.paths))]
    flat = FlatState(manifest.tree, list(manifest.paths), arrays, list(manifest.attrs))
    return flat, manifest.metadata


class RankReplicator(Replicator):
    """Copies committed steps of every rank's local tier to the persistent tier, as one
    multi-rank step each, one at a time, in a thread of its own, on collectives of its own
    (see the module docstring).

    Args:
        local: this rank's local tier.
        persistent: the persistent tier.
        comm: the copies' collectives (no other work may use them).
        coordinator: the rank that decides which copies run and commits them.
        after: run with the step after each committed copy, on every rank (every rank
            raises if it failed on any).
        backlog: as for :class:`~ckptstore.manager.tiers.Replicator`, applied by the
            coordinator.
    """

    def __init__(
        self,
        local: Store,
        persistent: Store,
        comm: Collectives,
        coordinator: int,
        after: Callable[[int], Coroutine[Any, Any, None]] | None = None,
        *,
        backlog: int | None = None,
    ) -> None:
        # Only the coordinator skips at submission; the others learn its decision when the
        # copy comes up, and keep the step pending (undeletable) until then.
        super().__init__(
            local, persistent, after, backlog=backlog if comm.rank == coordinator else None
        )
        self.comm = comm
        self.coordinator = coordinator
        self._thread = Pool(1, "ckptstore-tier-copies")

    def _start(self, step: int) -> Any:
        return self._thread.submit(self._copy, step)

    def _copy(self, step: int) -> CommitInfo | None:
        with self._pending_lock:
            wanted = step in self._pending
        try:
            wanted = self.comm.broadcast(wanted, self.coordinator)
        except Exception as exc:
            raise lost_rank(
                self.persistent,
                step,
                "hearing from the coordinator whether to copy it",
                exc,
                "was not copied to the persistent tier",
            ) from exc
        with self._pending_lock:
            if step in self._waiting:
                self._waiting.remove(step)
            if not wanted:  # the coordinator's backlog bound skipped it
                self._pending.discard(step)
                self.skipped = sorted({*self.skipped, step})
                return None
        flat: FlatState | None = None
        metadata: Any = None
        error: Exception | None = None
        try:
            flat, metadata = background.run(read_part(self.local, step))
        except Exception as exc:  # the others learn of it in the first collective
            error = exc
        info = commit_parts(
            self.comm, self.persistent, flat, error, step, metadata, self.coordinator
        )
        with self._pending_lock:
            self._pending.discard(step)
        _log.info("step %d copied to the persistent tier %s", step, self.persistent.url)
        if self._after is not None:
            after = self._after
            everywhere(
                self.comm,
                lambda: background.run(after(step)),
                f"retention after the copy of step {step}",
                self.persistent.url,
            )
        return info

    def shutdown(self) -> None:
        """Stop the copies' thread (after :meth:`wait_until_finished`)."""
        self._thread.shutdown(wait=True)


class RankTiers(Tiers):
    """This rank's local tier, its retention, and the copies of every rank's parts to the
    persistent tier (:class:`RankReplicator`)."""

    def __init__(
        self,
        local: Store,
        persistent: Store,
        comm: Collectives,
        coordinator: int,
        *,
        owns_local: bool,
        local_max_to_keep: int | None,
        after_copy: Callable[[int], Coroutine[Any, Any, None]] | None = None,
        copy_backlog: int | None = None,
    ) -> None:
        super().__init__(
            local,
            persistent,
            owns_local=owns_local,
            local_max_to_keep=local_max_to_keep,
            after_copy=after_copy,
            copy_backlog=copy_backlog,
        )
        self.replicator: RankReplicator = RankReplicator(
            local, persistent, comm, coordinator, self._copied, backlog=copy_backlog
        )

    def resume(self) -> list[int]:
        """A collective of every rank: delete this rank's parts of steps that are not on
        every rank's local tier (a failure or a crash cut their save short), then queue the
        copy of every step on every rank's local tier that is meant for the persistent tier
        and not there (the coordinator's listing decides). Returns those steps."""
        comm, coordinator = self.replicator.comm, self.replicator.coordinator
        where = self.local.url
        held = everywhere(
            comm,
            lambda: background.run(committed_steps(self.local)),
            "listing the ranks' local tiers",
            where,
        )
        complete = set(held[0]).intersection(*held[1:])
        partial = sorted(set(held[comm.rank]) - complete)

        async def delete_partial() -> None:
            for step in partial:
                with contextlib.suppress(NotFoundError):
                    await delete_step(self.local, step)

        if partial:
            _log.warning(
                "steps %s are on the local tier %s but not on every rank's: a failure or a "
                "crash cut their save short; this rank's parts of them are deleted",
                partial,
                where,
            )
        everywhere(
            comm,
            lambda: background.run(delete_partial()),
            "deleting parts of steps not on every rank",
            where,
        )

        def pending() -> list[tuple[int, bool]] | None:
            if comm.rank != coordinator:
                return None
            listing = background.run(list_tiers(self.local, self.persistent))
            forced = set(listing.forced)
            return [(s, s in forced) for s in listing.pending if s in complete]

        queued: list[tuple[int, bool]] = everywhere(
            comm, pending, "listing the steps to copy", where
        )[coordinator]
        if queued:
            _log.warning(
                "steps %s are committed on every rank's local tier but not on the persistent "
                "tier %s; copying them now",
                [s for s, _ in queued],
                self.persistent.url,
            )
        for step, forced in queued:
            self.replicator.submit(step, forced=forced)
        return [s for s, _ in queued]
