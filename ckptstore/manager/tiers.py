"""Two tiers of one run: every save commits on a fast local tier, chosen steps are copied to
the persistent tier in the background, and a restore reads the nearest copy that verifies.

A save to an object store takes seconds to minutes, and a job that dies during it loses every
step since the last one; a job restarted on the same node then reads its state back over the
network although the bytes sat on its own disk. So a tiered :class:`CheckpointManager` saves
to a *local* tier (a directory on local NVMe, or ``memory://``) at every save, and copies
every ``persistent_every``-th step to the *persistent* tier (any URL) in the background.

Why the persistent copy is a copy of the *committed local step*, not a second save from
training memory: the state would have to stay staged in host memory until the slow tier has
it (a second copy of the state for minutes), and two saves of one step could differ. The
local step is already durable and checksummed; :func:`~ckptstore.layout.maintenance.copy_step`
(the copy behind ``ckptstore cp``) streams its objects to the persistent tier, checks every
object's crc32c on the way and what the destination stored (by the server's own check of each
write where it makes one, else by reading the copy back), and commits it there with the same
put-if-absent protocol, holding the same gc lease a save holds (:mod:`ckptstore.layout.lease`).
Each tier therefore commits on its own: a crash at any moment leaves every visible step on
every tier complete.

Copies run one at a time. When saves outpace them, the queue is bounded (``copy_backlog``):
the oldest waiting copies beyond it are skipped, never a copy the user forced (see
:class:`Replicator`).

What survives a crash, and so what the next start can act on, is only what the stores hold:
a step meant for the persistent tier carries ``"persist": true`` in the manager's part of its
manifest's metadata. On start, every local step so marked that the persistent tier lacks is
*pending* (:func:`list_tiers`) and is replicated again (a killed copy left only an
uncommitted attempt there, which gc removes once its lease expires). No side index records
pending work, so none can go stale.

Retention is per tier. The persistent tier keeps what the manager's usual policy keeps
(``max_to_keep``, ``keep_period``, ``best_fn``...); the local tier is a cache for a fast
restart and keeps its newest ``local_max_to_keep`` steps, plus every step still pending
replication, which is never deleted locally before the persistent tier has committed it.

Restore takes the newest step committed on either tier. It reads the local copy when there
is one, verifying every byte it reads as every restore does, and falls back to the persistent
tier when the local copy is missing, partial (an object gone or short) or corrupt; which tier
served it is logged and kept in :class:`RestoreInfo`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal

from ckptstore import background
from ckptstore.errors import CorruptCheckpointError, NotFoundError, StoreError
from ckptstore.manager.async_save import BackgroundWork
from ckptstore.pipeline.maintenance import CopyReport, copy_step
from ckptstore.pipeline.restore import Request, Selection, later_reader, read, read_leaves
from ckptstore.pipeline.steps import (
    Manifest,
    committed_steps,
    delete_step,
    manifest_key,
    read_manifest,
)
from ckptstore.pipeline.streaming import Reader
from ckptstore.store.base import Store
from ckptstore.store.fanout import gather_all

__all__ = [
    "MANAGER_META_KEY",
    "Replicator",
    "RestoreInfo",
    "TierListing",
    "Tiers",
    "list_tiers",
    "marked_forced",
    "marked_persistent",
    "read_later_nearest",
    "read_nearest",
]

_log = logging.getLogger("ckptstore.tiers")

#: Key of the manager's own entry in a manifest's metadata (its save time, metrics and, with
#: tiers, whether the step is meant for the persistent tier).
MANAGER_META_KEY = "ckptstore.manager"

Tier = Literal["local", "persistent"]


def marked_persistent(manifest: Manifest) -> bool:
    """Whether a step's manifest says the manager meant it for the persistent tier."""
    return _manager_flag(manifest, "persist")


def marked_forced(manifest: Manifest) -> bool:
    """Whether the user asked for this step's persistent copy (``save(force=True)`` or
    ``persist=True``): a copy the backlog bound never skips."""
    return _manager_flag(manifest, "persist_forced")


def _manager_flag(manifest: Manifest, name: str) -> bool:
    doc = manifest.metadata
    own = doc.get(MANAGER_META_KEY) if isinstance(doc, dict) else None
    return isinstance(own, dict) and own.get(name) is True


# ----------------------------------------------------------------- what each tier holds


@dataclass(frozen=True, slots=True)
class TierListing:
    """Which steps each tier has committed.

    Attributes:
        local: steps committed on the local tier, ascending.
        persistent: steps committed on the persistent tier, ascending.
        pending: local steps meant for the persistent tier that it has not committed
            (replication queued, running, failed or cut short by a crash), ascending.
        forced: those of ``pending`` the user asked for (:func:`marked_forced`).
        skipped: steps whose copy this process skipped, as copies fell behind the saves
            (``CheckpointManager(copy_backlog=...)``); they are not pending.
    """

    local: list[int]
    persistent: list[int]
    pending: list[int]
    forced: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)

    @property
    def steps(self) -> list[int]:
        """Steps committed on any tier, ascending."""
        return sorted(set(self.local) | set(self.persistent))

    def tiers_of(self, step: int) -> list[Tier]:
        """The tiers holding ``step``, nearest first."""
        held: list[Tier] = []
        if step in self.local:
            held.append("local")
        if step in self.persistent:
            held.append("persistent")
        return held


async def list_tiers(local: Store, persistent: Store) -> TierListing:
    """List both tiers and find the steps whose replication is pending.

    A local step is pending when its manifest is marked for the persistent tier
    (:func:`marked_persistent`) and the persistent tier has not committed it. A local
    manifest that fails validation is not pending (it cannot be copied); ``ckptstore verify``
    reports it.
    """
    local_steps, persistent_steps = await asyncio.gather(
        committed_steps(local), committed_steps(persistent)
    )
    there = set(persistent_steps)
    candidates = [s for s in local_steps if s not in there]

    async def marked(step: int) -> tuple[bool, bool]:
        try:
            manifest = await read_manifest(local, step)
        except (NotFoundError, CorruptCheckpointError):
            return False, False  # deleted meanwhile, or damaged: nothing to replicate
        return marked_persistent(manifest), marked_forced(manifest)

    flags = await gather_all(marked(s) for s in candidates)
    pending = [s for s, (flag, _) in zip(candidates, flags, strict=True) if flag]
    forced = [s for s, (flag, ask) in zip(candidates, flags, strict=True) if flag and ask]
    return TierListing(local_steps, persistent_steps, pending, forced)


# ----------------------------------------------------------------- replication


class Replicator(BackgroundWork):
    """Copies committed local steps to the persistent tier, one at a time, in the order
    asked, on the background loop; keeps every error for the caller, as async saves do.

    When saves outpace the copies, the queue is bounded: once more than ``backlog`` copies
    wait behind the one in progress, the oldest waiting ones are skipped, as the newer steps
    queued behind them make them redundant for a restart (it takes the newest step). A
    copy the user forced is never skipped, nor counted against the bound. A skipped step
    stops being pending: local retention may then delete it.

    Args:
        local: the local tier.
        persistent: the persistent tier.
        after: a coroutine function run with the step after each committed copy (the
            manager's retention of the persistent tier).
        backlog: copies that may wait (>= 1; the newest always may); ``None``: any number.
    """

    def __init__(
        self,
        local: Store,
        persistent: Store,
        after: Callable[[int], Coroutine[Any, Any, None]] | None = None,
        *,
        backlog: int | None = None,
    ) -> None:
        self.local = local
        self.persistent = persistent
        self._after = after
        self.backlog = backlog
        self._pending_lock = threading.Lock()
        self._pending: set[int] = set()
        self._waiting: list[int] = []  # skippable copies not started yet, in queue order
        #: Steps whose copy the backlog bound skipped, ascending.
        self.skipped: list[int] = []
        where = persistent.url.replace("{", "{{").replace("}", "}}")  # the note is a format
        super().__init__(
            "(raised by the background copy of step {step} to the persistent tier "
            f"{where}; the step stays on the local tier and is copied again on the next start)"
        )
        self._lane: asyncio.Lock | None = None  # made on the loop: one copy at a time
        #: What the last committed copy did.
        self.last_report: CopyReport | None = None

    @property
    def pending(self) -> list[int]:
        """Steps asked for and not yet committed on the persistent tier (queued, copying,
        or failed), ascending."""
        with self._pending_lock:
            return sorted(self._pending)

    def submit(self, step: int, *, forced: bool = False) -> concurrent.futures.Future[Any]:
        """Queue the copy of committed local ``step``; safe from any thread, the loop's too.
        ``forced``: the user asked for it; the backlog bound never skips it. The future's
        result is the :class:`CopyReport`, or ``None`` if the copy was skipped."""
        self._queue(step, forced)
        future = self._start(step)
        self.track(step, future)
        return future

    def _queue(self, step: int, forced: bool) -> None:
        """Mark ``step`` pending, and skip the oldest waiting copies beyond the backlog."""
        with self._pending_lock:
            self._pending.add(step)
            if step in self.skipped:  # asked again: pending again
                self.skipped = [s for s in self.skipped if s != step]
            if not forced:
                self._waiting.append(step)
            skip: list[int] = []
            if self.backlog is not None and len(self._waiting) > self.backlog:
                skip = self._waiting[: len(self._waiting) - self.backlog]
                del self._waiting[: len(skip)]
                self._pending.difference_update(skip)
                self.skipped = sorted({*self.skipped, *skip})
        if skip:
            _log.warning(
                "copies to the persistent tier %s fall behind the saves: the copy of step(s) "
                "%s is skipped, as newer steps wait to be copied (copy_backlog=%d)",
                self.persistent.url,
                skip,
                self.backlog,
            )

    def _start(self, step: int) -> concurrent.futures.Future[Any]:
        """Run the copy of ``step`` after those queued before it."""
        return background.submit(self._replicate(step))

    async def _replicate(self, step: int) -> CopyReport | None:
        if self._lane is None:
            self._lane = asyncio.Lock()
        async with self._lane:
            with self._pending_lock:
                if step not in self._pending:  # skipped while it waited
                    return None
                if step in self._waiting:
                    self._waiting.remove(step)
            # Copies go one at a time: each streams its objects in parallel already, and a
            # second one would only compete with it (and with the next local save).
            report = await copy_step(self.local, self.persistent, step)
            with self._pending_lock:
                self._pending.discard(step)
                self.last_report = report
            _log.info(
                "step %d %s the persistent tier %s",
                step,
                "was already on" if report.skipped else f"({report.nbytes} bytes) copied to",
                self.persistent.url,
            )
            if self._after is not None:
                await self._after(step)
            return report


# ----------------------------------------------------------------- restore


@dataclass(frozen=True, slots=True)
class RestoreInfo:
    """Where a tiered restore read its step from.

    Attributes:
        step: the step restored.
        tier: ``"local"`` or ``"persistent"``.
        url: the URL of that tier's store.
        fallback: why the local copy was passed over (``None`` when it was used).
    """

    step: int
    tier: Tier
    url: str
    fallback: str | None = None


#: Failures of a local copy that a persistent copy can make good: a damaged or partial
#: copy (missing and short objects are CorruptCheckpointErrors), or a local disk that fails.
_LOCAL_DAMAGE = (CorruptCheckpointError, StoreError)


async def read_nearest(
    local: Store, persistent: Store, step: int, asked: Request
) -> tuple[Selection, RestoreInfo]:
    """Read and verify ``step`` from the local tier, or from the persistent tier when the
    local copy is missing, partial or corrupt.

    Raises:
        NotFoundError: neither tier has committed ``step``, or a key of ``asked`` names
            nothing in it.
        CorruptCheckpointError: the persistent copy fails verification too (the note says
            what was wrong with the local one).
    """
    try:
        selection = await read(local, step, asked)
    except NotFoundError:
        if await local.exists(manifest_key(step)):
            raise  # the step is there; a key names nothing in it, on either tier
        why = f"step {step} is not on the local tier {local.url}"
        _log.info("%s; restoring it from the persistent tier %s", why, persistent.url)
        fallback = why
    except _LOCAL_DAMAGE as exc:
        fallback = f"the local copy at {local.url} failed: {exc}"
        _log.warning(
            "step %d: %s; restoring from the persistent tier %s", step, fallback, persistent.url
        )
    else:
        _log.info("step %d restored from the local tier %s", step, local.url)
        return selection, RestoreInfo(step, "local", local.url)
    try:
        selection = await read(persistent, step, asked)
    except (NotFoundError, CorruptCheckpointError) as exc:
        exc.add_note(f"(tried first: {fallback})")
        raise
    _log.info("step %d restored from the persistent tier %s", step, persistent.url)
    return selection, RestoreInfo(step, "persistent", persistent.url, fallback)


def read_later_nearest(
    local: Store, persistent: Store, selection: Selection, info: RestoreInfo
) -> Reader:
    """How a streaming restore's background part reads from the tier its first part came
    from (:func:`read_nearest`), and from the persistent tier when the local copy fails then
    (the nearest verified copy wins, as for the first part).

    The persistent copy of a step may lay its objects out differently; its leaves are matched
    to the local manifest's by path, and read into the same host arrays.
    """
    manifest = selection.manifest
    first = later_reader(local if info.tier == "local" else persistent, selection)
    if info.tier != "local":
        return first

    async def read_later(leaves: list[int], into: dict[int, Any]) -> None:
        try:
            await first(leaves, into)
        except _LOCAL_DAMAGE as exc:
            fallback = f"the local copy at {local.url} failed: {exc}"
        else:
            return
        _log.warning(
            "step %d: %s; reading the rest of the restore from the persistent tier %s",
            manifest.step,
            fallback,
            persistent.url,
        )
        other = await read_manifest(persistent, manifest.step)
        index = {path: i for i, path in enumerate(other.paths)}
        try:
            mapped = {index[manifest.paths[leaf]]: into[leaf] for leaf in leaves}
            await read_leaves(persistent, other, sorted(mapped), mapped)
        except (KeyError, NotFoundError, CorruptCheckpointError) as exc:
            exc.add_note(f"(tried first: {fallback})")
            raise

    return read_later


# ----------------------------------------------------------------- the manager's two tiers


class Tiers:
    """A manager's local tier, its retention, and the replication to the persistent tier.

    Args:
        local: the local tier's store.
        persistent: the persistent tier's store.
        owns_local: close ``local`` in :meth:`close`.
        local_max_to_keep: local steps kept besides those pending replication (``None``:
            all).
        after_copy: run after each committed copy and the local retention that follows it
            (the persistent tier's retention).
    """

    def __init__(
        self,
        local: Store,
        persistent: Store,
        *,
        owns_local: bool,
        local_max_to_keep: int | None,
        after_copy: Callable[[int], Coroutine[Any, Any, None]] | None = None,
        copy_backlog: int | None = None,
    ) -> None:
        self.local = local
        self.persistent = persistent
        self.owns_local = owns_local
        self.local_max_to_keep = local_max_to_keep
        self._after_copy = after_copy
        self.replicator = Replicator(local, persistent, self._copied, backlog=copy_backlog)

    async def _copied(self, step: int) -> None:
        # The copied step may leave the local tier now, if newer ones are there.
        await self.retain_local()
        if self._after_copy is not None:
            await self._after_copy(step)

    def resume(self) -> list[int]:
        """Queue the copy of every local step whose replication a crash or failure left
        pending; returns those steps."""
        listing = background.run(list_tiers(self.local, self.persistent))
        if listing.pending:
            _log.warning(
                "steps %s are committed on the local tier %s but not on the persistent tier "
                "%s; copying them now",
                listing.pending,
                self.local.url,
                self.persistent.url,
            )
        for step in listing.pending:
            self.replicator.submit(step, forced=step in listing.forced)
        return listing.pending

    async def retain_local(self) -> None:
        """Delete local steps beyond ``local_max_to_keep``, never one pending replication
        nor the newest."""
        if self.local_max_to_keep is None:
            return
        steps = await committed_steps(self.local)
        kept = set(steps[-self.local_max_to_keep :]) | set(self.replicator.pending)
        for step in steps:
            if step not in kept:
                with contextlib.suppress(NotFoundError):  # gone already
                    await delete_step(self.local, step)

    def listing(self) -> TierListing:
        """What each tier holds; pending also counts copies queued in this process."""
        listing = background.run(list_tiers(self.local, self.persistent))
        queued = set(self.replicator.pending) - set(listing.persistent)
        skipped = set(self.replicator.skipped)  # not pending in this process any more
        pending = sorted((set(listing.pending) | queued) & set(listing.local) - skipped)
        forced = sorted(set(listing.forced) & set(pending))
        return TierListing(listing.local, listing.persistent, pending, forced, sorted(skipped))

    async def delete(self, step: int) -> None:
        """Delete ``step`` from every tier that holds it.

        Raises:
            NotFoundError: neither tier holds it.
        """
        missing = 0
        for store in (self.local, self.persistent):
            try:
                await delete_step(store, step)
            except NotFoundError:
                missing += 1
        if missing == 2:
            raise NotFoundError(
                f"no step {step} to delete on the local tier {self.local.url} or the "
                f"persistent tier {self.persistent.url}"
            )

    async def manifest(self, step: int) -> Manifest:
        """The manifest of ``step``, from the nearest tier that has it."""
        try:
            return await read_manifest(self.local, step)
        except (NotFoundError, CorruptCheckpointError):
            return await read_manifest(self.persistent, step)

    async def all_steps(self) -> list[int]:
        """Steps committed on either tier, ascending."""
        local, persistent = await asyncio.gather(
            committed_steps(self.local), committed_steps(self.persistent)
        )
        return sorted(set(local) | set(persistent))
