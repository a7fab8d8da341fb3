"""CheckpointManager: when to save, the async save handle, retention, and restore.

::

    with CheckpointManager("s3://bucket/run1", max_to_keep=3, save_interval_steps=100) as mgr:
        for step in range(start, steps):
            train_step()
            mgr.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})
        mgr.wait_until_finished()
    state = mgr.restore()                    # latest step, tensors as they were saved

A save blocks only while the state is copied into pooled host buffers
(:mod:`ckptstore.stage`); the write, the put-if-absent commit and then retention run on the
background loop (:mod:`ckptstore.manager.async_save`). Retention runs only after the new step's
manifest is durable, and never deletes the newest committed step, so a crash at any moment
costs at most the save that was in progress: the previous good checkpoint stays. Retention
reconsiders every committed step each time, so steps a crash left beyond ``max_to_keep`` are
removed by the next successful save.

With ``snapshot="lazy"`` a save does not even copy: it records what to copy and returns, the
copy runs in the background, and a fence waits for what is left of it before the state
changes (automatically before the step of an optimizer whose state is being saved;
:meth:`CheckpointManager.fence` and :meth:`CheckpointManager.fenced` for changes made by hand;
see :mod:`ckptstore.manager.snapshot`).

Retention, as in Orbax: the newest ``max_to_keep`` steps are kept (with ``best_fn``, the
``max_to_keep`` best by their metrics, steps without metrics counting as worst); besides them
every step divisible by ``keep_period`` is kept forever, and of the others a step is kept if at
least ``keep_time_interval`` seconds separate it from the last step kept that way.

With a local tier (``local=``), every save commits on the local tier, and every
``persistent_every``-th step is then copied, verified, to the run's URL in the background; the
retention above applies to that persistent tier, ``local_max_to_keep`` to the local one, and
:meth:`CheckpointManager.restore` reads the nearest copy that verifies
(:mod:`ckptstore.manager.tiers`)::

    mgr = CheckpointManager("s3://bucket/run1", local="/nvme/run1", local_every=100,
                            persistent_every=1000, max_to_keep=3)
"""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401  (its exit hook must be registered before ours)
import datetime
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from types import TracebackType
from typing import Any, Literal, NoReturn, Self

from ckptstore import background
from ckptstore.errors import CommitConflictError, NotFoundError
from ckptstore.manager.async_save import AsyncSaver, SaveHandle
from ckptstore.manager.preemption import (
    Notice,
    PreemptionWatch,
    save_margin,
    signals_of,
    stop,
    watch,
)
from ckptstore.manager.snapshot import LazyFence
from ckptstore.manager.tiers import (
    MANAGER_META_KEY,
    RestoreInfo,
    TierListing,
    Tiers,
    read_later_nearest,
    read_nearest,
)
from ckptstore.pipeline import save as save_path
from ckptstore.pipeline import streaming
from ckptstore.pipeline.restore import rebuild, request, restore
from ckptstore.pipeline.root import Root, open_root
from ckptstore.pipeline.save import StagedState, Stager
from ckptstore.pipeline.steps import (
    CommitInfo,
    Manifest,
    attempt_prefix,
    committed_steps,
    delete_step,
    delete_steps,
    read_manifest,
    set_aside,
)
from ckptstore.store.base import Store

__all__ = ["CheckpointManager"]


#: Key of the manager's own entry in a manifest's metadata.
_META_KEY = MANAGER_META_KEY


class CheckpointManager:
    """Saves a training state every few steps, keeps the ones worth keeping, restores any.

    Args:
        url: the run's checkpoint root (any URL ``open_store`` takes), or an open Store (left
            open by :meth:`close`).
        max_to_keep: steps kept by recency (or by ``best_fn``); ``None`` keeps every step.
        keep_period: also keep forever every step divisible by this.
        keep_time_interval: also keep a step if this long (seconds or a ``timedelta``) has
            passed since the last step kept this way.
        save_interval_steps: :meth:`save` saves only steps divisible by this (or ``force``).
        best_fn: maps a step's ``metrics`` to a number; retention then keeps the best steps.
        best_mode: ``"min"`` or ``"max"``: which values of ``best_fn`` are best.
        async_save: ``save`` returns after staging; ``False`` waits for the commit.
        max_in_flight: async saves writing at once; the next save waits for one to finish.
        stager: the stager (and so the buffer pool) to use; one per manager by default.
        full_every: with ``Settings.incremental`` (the default), make every this-many-th
            save of this manager, its first included, a full save that references no
            earlier step, so old steps' objects stop being kept alive by newer steps
            (Orbax-style); ``None``: only ``save(..., full=True)`` is full.
        snapshot: ``"eager"`` copies the state in the ``save`` call; ``"lazy"`` returns
            at once and copies in the background, fenced before the state changes
            (:meth:`fence`; automatic before an optimizer step).
        local: a local tier (a directory, a ``memory://`` URL or an open Store): saves commit
            there, and ``url`` becomes the persistent tier that chosen steps are copied to in
            the background (:mod:`ckptstore.manager.tiers`).
        local_every: with ``local``, save every this many steps (the ``save_interval_steps``
            of a tiered manager; give one of the two).
        persistent_every: with ``local``, copy saved steps divisible by this to the
            persistent tier (a multiple of ``local_every``; default ``local_every``: all).
        local_max_to_keep: with ``local``, newest steps kept on the local tier, besides
            those not yet copied to the persistent tier; ``None`` keeps every step.
        local_options: store options for a URL ``local``.
        copy_backlog: with ``local``, how many copies to the persistent tier may wait behind
            the one in progress (>= 1: the newest step's copy always waits). When saves
            outpace the copies, the oldest waiting copies beyond this are skipped (logged),
            as the newer steps queued behind them make them redundant for a restart; a
            forced save's copy (``save(force=True)`` or
            ``persist=True``, and the save a preemption notice starts) is never skipped.
            ``None``: copies may wait without bound, and the local tier keeps every step
            waiting for one.
        preemption: save on a termination notice: ``True`` watches SIGTERM, or give the
            signal numbers. After one arrives, the next :meth:`save` saves its step whatever
            the interval, waits until it is durable and raises
            :class:`~ckptstore.manager.preemption.Preempted` (a ``SystemExit`` with status
            ``128 + signal``); see :mod:`ckptstore.manager.preemption`. From the main thread.
        save_before: a wall-clock limit (seconds since the epoch or an aware ``datetime``):
            the first :meth:`save` with less time left than twice the longest save so far
            (a minute before the first) does the same, with status 124.
        **store_options: options for a URL ``url``, given as on every face
            (:mod:`ckptstore.pipeline.root`); refused with an open Store.

    Attributes:
        last_restore: with a local tier, which tier the last :meth:`restore` read and why
            (:class:`~ckptstore.manager.tiers.RestoreInfo`).
        set_aside: the steps the last ``restore(..., rollback=True)`` set aside, ascending.
    """

    #: Whether a manager left open is closed when the main thread ends
    #: (:func:`ckptstore.background.close_at_exit`).
    _closes_at_exit = True

    def __init__(
        self,
        url: str | os.PathLike[str] | Store,
        *,
        max_to_keep: int | None = None,
        keep_period: int | None = None,
        keep_time_interval: float | datetime.timedelta | None = None,
        save_interval_steps: int = 1,
        best_fn: Callable[[Any], float] | None = None,
        best_mode: Literal["min", "max"] = "max",
        async_save: bool = True,
        max_in_flight: int = 1,
        stager: Stager | None = None,
        full_every: int | None = None,
        snapshot: Literal["eager", "lazy"] = "eager",
        local: Root | None = None,
        local_every: int | None = None,
        persistent_every: int | None = None,
        local_max_to_keep: int | None = 2,
        local_options: dict[str, Any] | None = None,
        copy_backlog: int | None = 2,
        preemption: bool | int | Iterable[int] = False,
        save_before: float | datetime.datetime | None = None,
        **store_options: Any,
    ) -> None:
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1 or None, got {max_to_keep}")
        if keep_period is not None and keep_period < 1:
            raise ValueError(f"keep_period must be >= 1 or None, got {keep_period}")
        if full_every is not None and full_every < 1:
            raise ValueError(f"full_every must be >= 1 or None, got {full_every}")
        if save_interval_steps < 1:
            raise ValueError(f"save_interval_steps must be >= 1, got {save_interval_steps}")
        if best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', got {best_mode!r}")
        if snapshot not in ("eager", "lazy"):
            raise ValueError(f"snapshot must be 'eager' or 'lazy', got {snapshot!r}")
        if local is None and (local_every or persistent_every or local_options):
            raise ValueError("local_every, persistent_every and local_options need local=")
        if local is not None:
            if local_every is not None and save_interval_steps != 1:
                raise ValueError(
                    "a tiered manager saves every local_every steps; give local_every or "
                    "save_interval_steps, not both"
                )
            save_interval_steps = local_every if local_every is not None else save_interval_steps
            if save_interval_steps < 1:
                raise ValueError(f"local_every must be >= 1, got {save_interval_steps}")
            if persistent_every is None:
                persistent_every = save_interval_steps
            if persistent_every < 1 or persistent_every % save_interval_steps:
                raise ValueError(
                    f"persistent_every must be a positive multiple of local_every "
                    f"({save_interval_steps}), got {persistent_every}: steps it names would "
                    "otherwise never be saved"
                )
            if local_max_to_keep is not None and local_max_to_keep < 1:
                raise ValueError(f"local_max_to_keep must be >= 1 or None, got {local_max_to_keep}")
            if copy_backlog is not None and (type(copy_backlog) is not int or copy_backlog < 1):
                raise ValueError(f"copy_backlog must be an int >= 1 or None, got {copy_backlog!r}")
        signals = signals_of(preemption)
        PreemptionWatch.check(signals, save_before)  # refused before anything is opened
        if isinstance(keep_time_interval, datetime.timedelta):
            keep_time_interval = keep_time_interval.total_seconds()
        self.max_to_keep = max_to_keep
        self.keep_period = keep_period
        self.keep_time_interval = keep_time_interval
        self.save_interval_steps = save_interval_steps
        self.best_fn = best_fn
        self.best_mode = best_mode
        self.async_save = async_save
        self.full_every = full_every
        self._saves = 0  # saves started by this manager, for full_every
        self.snapshot = snapshot
        self._fence = LazyFence()
        self.persistent_every = persistent_every
        self._store, self._owns_store = open_root(url, store_options)
        self._tiers: Tiers | None = None
        #: Which tier the last restore read (``None`` without a local tier).
        self.last_restore: RestoreInfo | None = None
        #: Steps the last rolling-back restore set aside.
        self.set_aside: list[int] = []
        if local is not None:
            try:
                local_store, owns_local = open_root(local, local_options or {})
            except BaseException:
                if self._owns_store:
                    background.run(self._store.close())
                raise
            if local_store.url == self._store.url:
                for store, owned in ((local_store, owns_local), (self._store, self._owns_store)):
                    if owned:
                        background.run(store.close())
                raise ValueError(
                    f"local= and the run's URL are the same root ({local_store.url}); the "
                    "local tier must be a root of its own"
                )
            self._tiers = self._open_tiers(
                local_store,
                owns_local=owns_local,
                local_max_to_keep=local_max_to_keep,
                copy_backlog=copy_backlog,
            )
        saves_to = self._store if self._tiers is None else self._tiers.local
        if stager is None:
            stager = Stager(leaf_alignment=saves_to.settings.layout.leaf_alignment)
        self._stager = stager
        self._saver = AsyncSaver(max_in_flight)
        self._info: dict[int, tuple[float, Any]] = {}  # step -> (save time, metrics)
        # step -> the attempt prefixes its manifest in self._store names or references, so
        # retention need not read every manifest before marking what it deletes
        self._uses: dict[int, frozenset[str]] = {}
        self._closed = False
        # the newest committed step, listed at the first save and raised by every commit
        # since; a save of a step not after it (or after one in flight) is refused at once
        self._newest: int | None = None
        self._newest_known = False
        self._clock: Callable[[], float] = time.time
        self.last_handle: SaveHandle | None = None
        self._watch = watch(preemption, save_before)
        self._save_seconds: list[float] = []  # how long saves took, for save_before
        if self._closes_at_exit:
            background.close_at_exit(self, "a background save failed")
        if self._tiers is not None:
            # Steps a crash or a failure left on the local tier only are copied now; the
            # first save's local retention keeps them until they are.
            try:
                self._resume_tiers()
            except BaseException:
                self.close()
                raise

    def _open_tiers(
        self,
        local: Store,
        *,
        owns_local: bool,
        local_max_to_keep: int | None,
        copy_backlog: int | None,
    ) -> Tiers:
        """The local tier, its retention and the copies to the persistent tier."""
        return Tiers(
            local,
            self._store,
            owns_local=owns_local,
            local_max_to_keep=local_max_to_keep,
            after_copy=self._after_copy,
            copy_backlog=copy_backlog,
        )

    def _resume_tiers(self) -> None:
        """Queue the copies a crash or a failure left pending (see :meth:`Tiers.resume`)."""
        assert self._tiers is not None
        self._tiers.resume()

    @property
    def store(self) -> Store:
        """The store the checkpoints live in (with a local tier: the persistent tier)."""
        return self._store

    @property
    def local_store(self) -> Store | None:
        """The local tier's store, or ``None`` without one."""
        return None if self._tiers is None else self._tiers.local

    # ------------------------------------------------------------------ saving

    def should_save(self, step: int) -> bool:
        """Whether :meth:`save` would save ``step`` without ``force``."""
        return step % self.save_interval_steps == 0

    def save(
        self,
        step: int,
        state: Any,
        metadata: Any = None,
        force: bool = False,
        metrics: Any = None,
        full: bool = False,
        persist: bool | None = None,
    ) -> bool:
        """Save ``state`` as ``step`` if the interval says so (or ``force``).

        Blocks while the previous save is still writing (see ``max_in_flight``) and while the
        arrays are copied into host buffers; the write, commit and retention follow in the
        background (with ``async_save=False`` this waits for them). Once it returns, changing
        or freeing the state cannot change what is written; with ``snapshot="lazy"`` it
        returns before the copy, and that holds once :meth:`fence` has returned.

        Args:
            step: the step number (an int >= 0; each step is saved once).
            state: nested dicts/lists/tuples of torch tensors, JAX or numpy arrays and plain
                JSON values.
            metadata: JSON stored with the step (see :meth:`metadata`).
            force: save even if ``step`` is off the interval.
            metrics: JSON metrics for ``best_fn``.
            full: write every leaf and reference no earlier step (an incremental save
                otherwise writes only what changed; see ``full_every``).
            persist: with a local tier, whether to copy this step to the persistent tier
                once it is committed locally; by default when ``step`` is divisible by
                ``persistent_every`` or the save is forced.

        Returns:
            Whether a save was started.

        Raises:
            CommitConflictError: ``step`` is not after the newest step committed (or being
                saved) in the root: a rerun that should resume, or go back with
                ``restore(step, rollback=True)``. Refused here, before anything is copied.
            Exception: the error of an earlier background save or copy to the persistent
                tier, not yet reported (nothing of this step is saved then).
            UnsupportedLeafError, TypeError: a leaf that cannot be stored.
            TornSnapshotError: (from the next call, as a background error) a lazy
                snapshot's leaf changed before it was copied.
        """
        self._check_open()
        notice = None
        if self._watch is not None:
            notice = self._watch.notice(save_margin(self._save_seconds))
            if notice is not None:
                self._save_and_stop(step, state, metadata, metrics, notice)
        tiers = self._tiers
        if tiers is None and persist is not None:
            raise ValueError("persist= needs a local tier (CheckpointManager(local=...))")
        if tiers is not None:
            tiers.replicator.raise_errors()
        if not (force or self.should_save(step)):
            self._saver.raise_errors()
            return False
        self._check_after_newest(step)
        manager_meta: dict[str, Any] = {"time": self._clock(), "metrics": metrics}
        if tiers is not None:
            persist = self._mark_persist(manager_meta, step, force, persist)
        document = self._document(manager_meta, metadata)

        every = self.full_every
        full = full or (every is not None and self._saves % every == 0)
        self._saves += 1

        def stage() -> StagedState:
            # in the caller's thread, so an unstorable leaf fails this call, not a later one
            staged = save_path.stage(self._stager, state, lazy=self.snapshot == "lazy", start=False)
            self._fence.track(staged)
            return staged

        async def write(staged: StagedState) -> None:
            if tiers is None:
                info = await save_path.save_staged(
                    self._store, staged, step=step, metadata=document, full=full
                )
                self._info[step] = (manager_meta["time"], metrics)
                self._remember_uses(info)
                self._committed(step)
                return
            await save_path.save_staged(
                tiers.local, staged, step=step, metadata=document, full=full
            )
            self._info[step] = (manager_meta["time"], metrics)
            self._committed(step)
            if persist:  # pending from here: local retention keeps it
                tiers.replicator.submit(step, forced=bool(manager_meta.get("persist_forced")))

        async def retain() -> None:  # once committed: the handle does not wait for it
            await (self._retain() if tiers is None else tiers.retain_local())

        began = time.monotonic()
        self.last_handle = handle = self._saver.submit(step, stage, write, retain)
        if self._watch is not None:  # how long a save takes, for save_before's margin
            handle._future.add_done_callback(
                lambda _: self._save_seconds.append(time.monotonic() - began)
            )
        if not self.async_save:
            self.wait_until_finished()
        return True

    def _mark_persist(
        self, manager_meta: dict[str, Any], step: int, force: bool, persist: bool | None
    ) -> bool:
        """Whether a tiered save of ``step`` is meant for the persistent tier, marked in
        ``manager_meta`` (with whether the user asked, so the backlog bound never skips it)."""
        assert self.persistent_every is not None
        forced = bool(persist) or force
        if persist is None:
            persist = force or step % self.persistent_every == 0
        manager_meta["persist"] = bool(persist)
        if persist and forced:
            manager_meta["persist_forced"] = True
        return bool(persist)

    def _save_and_stop(
        self, step: int, state: Any, metadata: Any, metrics: Any, notice: Notice
    ) -> NoReturn:
        """The last save after a preemption notice: this step, durable, then stop."""
        newest = self._newest_accepted()
        watching, self._watch = self._watch, None  # the save below is an ordinary one
        try:
            if newest is None or step > newest:
                self.save(step, state, metadata=metadata, force=True, metrics=metrics)
            else:
                step = newest  # saved already (or being saved): that one is the last
            self.wait_until_finished()
        finally:
            self._watch = watching
        stop(step, notice, self._store.url if self._tiers is None else self._tiers.local.url)

    def _check_after_newest(self, step: int) -> None:
        """Refuse, in the ``save`` call, a step that is not after the newest committed (or
        in-flight) one: its commit would fail in the background, a save late, or a rerun in
        the same root would write old step numbers between the previous run's.

        Raises:
            CommitConflictError: naming the newest step and how to resume or roll back.
        """
        if not self._newest_known:
            newest = self.latest_step()
            self._newest, self._newest_known = newest, True
        newest = self._newest_accepted()
        if newest is None or step > newest:
            return
        where = self._store.url if self._tiers is None else self._tiers.local.url
        raise CommitConflictError(
            f"{where}: cannot save step {step}: the newest step of this root is {newest}, and "
            "a step is saved once, in increasing order. To resume that run, restore it "
            "(mgr.restore() returns the newest step) and save the steps after it; to go back "
            f"to an older step and save the steps after it again, mgr.restore(step, "
            "rollback=True), which sets the newer steps aside; or save to a new root"
        )

    def _newest_accepted(self) -> int | None:
        """The newest step committed or being saved, as this manager knows it."""
        steps = (self._newest, self._saver.newest_in_flight())
        return max((s for s in steps if s is not None), default=None)

    def _committed(self, step: int) -> None:
        if self._newest is None or step > self._newest:
            self._newest = step

    @staticmethod
    def _document(manager_meta: dict[str, Any], metadata: Any) -> dict[str, Any]:
        """What a step's manifest holds as its metadata: the manager's own entry (save time,
        metrics) beside the user's ``metadata``.

        Raises:
            TypeError: either is not plain JSON.
        """
        document = {_META_KEY: manager_meta, "user": metadata}
        try:
            json.dumps(document)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"metadata and metrics must be plain JSON: {exc}") from None
        return document

    def wait_until_finished(self) -> None:
        """Block until every save has committed and its retention has run (with a local
        tier: on the local tier, and every copy to the persistent tier has ended); raise the
        first background error."""
        self._saver.wait_until_finished()
        if self._tiers is not None:
            self._tiers.replicator.wait_until_finished()

    async def _after_copy(self, step: int) -> None:
        await self._retain()

    def fence(self) -> bool:
        """Wait until the state may change and every restored value is in place: whatever of
        a lazy snapshot's copy is left is done (CUDA copies: ordered before the caller's
        later work on its stream), and so is the background part of every streaming restore
        (``restore(..., stream=...)``). Call it before changing saved tensors by hand, or
        before using what a streaming restore reads in the background; optimizer steps are
        fenced automatically. Never raises a copy's error (the save does); raises a
        streaming restore's (:mod:`ckptstore.pipeline.streaming`).

        Returns:
            Whether there was a copy or a restore to wait for.
        """
        copied = self._fence.wait()
        return streaming.wait_all() or copied

    @contextmanager
    def fenced(self) -> Iterator[None]:
        """``with mgr.fenced(): ...``: a block that changes the state, entered after
        :meth:`fence`."""
        with self._fence.fenced():
            yield

    # ------------------------------------------------------------------ retention

    async def _step_info(
        self, steps: Iterable[int], read: dict[int, Manifest] | None = None
    ) -> dict[int, tuple[float, Any]]:
        """Save time and metrics of ``steps``, reading the manifests of the steps not known
        yet (into ``read``, when given)."""
        for step in steps:
            if step not in self._info:
                try:
                    if self._tiers is not None:  # the same manifest on either tier
                        manifest = await self._tiers.manifest(step)
                    else:
                        # not shared: the metrics kept below are handed to the user
                        # (metrics()), who may change them
                        manifest = await read_manifest(self._store, step)
                        if read is not None:
                            read[step] = manifest
                        self._uses[step] = frozenset(
                            (
                                attempt_prefix(step, manifest.attempt),
                                *manifest.referenced_attempts(),
                            )
                        )
                except NotFoundError:
                    continue
                doc = manifest.metadata
                own = doc.get(_META_KEY) if isinstance(doc, dict) else None
                if isinstance(own, dict):
                    when = float(own.get("time", manifest.created))
                    self._info[step] = (when, own.get("metrics"))
                else:
                    self._info[step] = (manifest.created, None)
        return self._info

    def _kept(self, steps: list[int], info: Mapping[int, tuple[float, Any]]) -> set[int]:
        """Which of ``steps`` (ascending, all committed) retention keeps."""
        if self.max_to_keep is None or not steps:
            return set(steps)
        if self.best_fn is not None:
            sign = 1.0 if self.best_mode == "max" else -1.0

            def score(step: int) -> float:
                metrics = info.get(step, (0.0, None))[1]
                if metrics is None:
                    return -math.inf
                return sign * float(self.best_fn(metrics))  # type: ignore[misc]

            ranked = sorted(steps, key=lambda s: (score(s), s), reverse=True)
            kept = set(ranked[: self.max_to_keep])
        else:
            kept = set(steps[-self.max_to_keep :])
        kept.add(steps[-1])  # the newest committed step is never deleted
        if self.keep_period is not None:
            kept.update(s for s in steps if s % self.keep_period == 0)
        if self.keep_time_interval is not None:
            last: float | None = None
            for step in steps:
                when = info.get(step, (0.0, None))[0]
                if last is None or when - last >= self.keep_time_interval:
                    kept.add(step)
                    last = when
        return kept

    def _remember_uses(self, info: CommitInfo) -> None:
        """Keep which attempts a step this manager committed names, so that retention need
        not read its manifest to mark what the kept steps use."""
        self._uses[info.step] = frozenset(
            (attempt_prefix(info.step, info.attempt), *info.referenced_attempts)
        )

    async def _retain(self) -> None:
        """Delete the steps retention does not keep, reading each manifest once: the steps
        this manager has not seen yet, to decide; then every kept one, after marking, as the
        gc rule requires (:func:`~ckptstore.layout.references.reclaim`; what the manager
        remembers of its steps stands in for the read before marking)."""
        if self.max_to_keep is None:
            return
        steps = await committed_steps(self._store)
        read: dict[int, Manifest] = {}
        info = await self._step_info(steps, read)
        kept = self._kept(steps, info)
        doomed = [step for step in steps if step not in kept]
        if not doomed:
            return
        # what the kept steps use, if the manager knows it for all of them (not for steps it
        # read from another tier); otherwise reclaim reads it
        used = (
            set().union(*(self._uses[step] for step in kept))
            if all(step in self._uses for step in kept)
            else None
        )
        try:
            await delete_steps(self._store, doomed, used=used, manifests=read)
        finally:
            for step in doomed:
                self._info.pop(step, None)
                self._uses.pop(step, None)

    # ------------------------------------------------------------------ reading

    def all_steps(self) -> list[int]:
        """Committed steps (with a local tier: committed on either tier), ascending."""
        self._check_open()
        if self._tiers is not None:
            return background.run(self._tiers.all_steps())
        return background.run(committed_steps(self._store))

    def tiers(self) -> TierListing:
        """Which steps each tier holds, and which await their copy to the persistent tier.

        Raises:
            ValueError: the manager has no local tier.
        """
        self._check_open()
        if self._tiers is None:
            raise ValueError("this CheckpointManager has no local tier (local=)")
        return self._tiers.listing()

    def latest_step(self) -> int | None:
        """The newest committed step, or ``None``."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def metadata(self, step: int) -> Any:
        """The ``metadata`` given when ``step`` was saved."""
        self._check_open()
        if self._tiers is not None:
            manifest = background.run(self._tiers.manifest(step))
        else:
            manifest = background.run(read_manifest(self._store, step))
        doc = manifest.metadata
        return doc.get("user") if isinstance(doc, dict) and _META_KEY in doc else doc

    def metrics(self, step: int) -> Any:
        """The ``metrics`` given when ``step`` was saved."""
        self._check_open()
        return background.run(self._step_info([step])).get(step, (0.0, None))[1]

    def restore(
        self,
        step: int | None = None,
        target: Any = None,
        keys: Any = None,
        *,
        rollback: bool = False,
        stream: bool | str | Iterable[str] = False,
    ) -> Any:
        """Read a committed step back, verifying every byte.

        With a local tier, the newest step committed on either tier is taken, and read from
        the local tier unless its copy there is missing, partial or corrupt; then from the
        persistent tier. :attr:`last_restore` says which, and why.

        Args:
            step: the step; ``None`` takes the newest committed one (after waiting for saves
                in flight).
            target: what to rebuild the arrays as: ``None`` as saved (torch tensors on their
                device with ``requires_grad``, JAX or numpy arrays); ``"torch"``, ``"jax"`` or
                ``"numpy"`` for every array; or a state (a pytree) whose leaves give each
                array's type, dtype and placement (device, sharding). A state also says what
                to read, unless ``keys`` does: exactly its leaves, each of which must be in
                the step, and the result is built in its own containers (named tuples,
                dataclasses, flax and other registered pytree nodes). A ``None`` leaf in it
                stands for whatever the checkpoint holds at its path, as saved.
            keys: leaf paths or prefixes (``"model"``, ``"optim/state/0/exp_avg"``) to read;
                only their bytes are fetched. Each must name something in the step.
            rollback: make ``step`` the newest step, so that training can go on from it and
                save the steps after it again: once it has been read and verified, every
                newer committed step (on every tier) is set aside, newest first
                (:mod:`ckptstore.layout.rollback`): invisible to every face, its data kept
                until ``gc`` finds it abandoned, and recoverable until then with
                :func:`ckptstore.recover_step`. :attr:`set_aside` lists them.
            stream: return before the whole state is read (:mod:`ckptstore.pipeline.streaming`):
                ``True`` once every leaf but the optimizer's state is in place, or once the
                leaves under the keys given are (``stream=["model"]``); the rest is read and
                verified in the background, into the arrays already returned (a JAX leaf:
                a :class:`~ckptstore.pipeline.streaming.Pending` until
                ``ckptstore.fence(state)``). A torch optimizer step, :meth:`fence`,
                ``ckptstore.fence()`` and the next save wait for it, and raise its error.

        Raises:
            NotFoundError: no committed step, no such step, or a key (or leaf of a target)
                matching nothing; every such key is named.
            CorruptCheckpointError: anything read fails verification (with a local tier: on
                the persistent tier too).
            CheckpointFormatError: a checkpoint only another face reads (DCP's).
            ValueError: a target leaf's shape differs from the checkpoint's.

        The rule for ``keys`` and ``target`` is the one of every face
        (:mod:`ckptstore.pipeline.restore`).
        """
        self._check_open()
        asked = request(keys, target, stream)
        streaming.wait_all()  # a newer restore must not race an older one's background part
        if rollback:
            self.wait_until_finished()  # the copies too: no step above may land after
        if step is None:
            self._saver.wait_until_finished()  # not the copies: the local tier has the step
            step = self.latest_step()
            if step is None:
                where = self._store.url
                if self._tiers is not None:
                    where = f"{self._tiers.local.url} and {where}"
                raise NotFoundError(f"{where}: no committed checkpoint to restore")
        elif self.last_handle is not None and self.last_handle.step == step:
            self._saver.wait_until_finished()
        if self._tiers is None:
            state = restore(self._store, step, asked)
        else:
            selection, self.last_restore = background.run(
                read_nearest(self._tiers.local, self._store, step, asked)
            )
            later = read_later_nearest(self._tiers.local, self._store, selection, self.last_restore)
            state = rebuild(selection, store=self._store, reader=later)
        if rollback:
            self._roll_back_to(step)
        return state

    def _roll_back_to(self, step: int) -> None:
        stores = [self._store] if self._tiers is None else [self._tiers.local, self._store]
        aside: set[int] = set()
        for store in stores:
            aside.update(background.run(set_aside(store, step)))
        for gone in aside:
            self._info.pop(gone, None)
            self._uses.pop(gone, None)
        self.set_aside = sorted(aside)
        self._newest, self._newest_known = step, True

    def delete(self, step: int) -> None:
        """Delete a committed step (its manifest first, so it is never half visible); with a
        local tier, from every tier that holds it."""
        self._check_open()
        self.wait_until_finished()
        if self._tiers is not None:
            background.run(self._tiers.delete(step))
        else:
            background.run(delete_step(self._store, step))
        self._info.pop(step, None)
        self._uses.pop(step, None)
        self._newest_known = False  # the newest step may be the one deleted

    # ------------------------------------------------------------------ lifetime

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this CheckpointManager is closed")

    def close(self) -> None:
        """Wait for saves in flight (and copies to the persistent tier), remove the optimizer
        fence hook of lazy snapshots, free the staging buffers, close the stores.

        Raises the first unreported background error, after closing.
        """
        if self._closed:
            return
        self._closed = True
        background.forget_at_exit(self)
        if self._watch is not None:
            self._watch.close()
        try:
            try:
                streaming.wait_all()  # a streaming restore may still read from the stores
            finally:
                self._saver.wait_until_finished()
        finally:
            try:  # after a failed save too: no copy may run on to closed stores
                if self._tiers is not None:
                    self._tiers.replicator.wait_until_finished()
            finally:
                self._fence.close()
                self._stager.close()
                if self._tiers is not None and self._tiers.owns_local:
                    background.run(self._tiers.local.close())
                if self._owns_store:
                    background.run(self._store.close())

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
            return
        try:  # do not hide the caller's exception behind a background one
            self.close()
        except Exception as background_error:
            exc.add_note(f"and a background save failed: {background_error!r}")

    def __repr__(self) -> str:
        if self._tiers is not None:
            return f"CheckpointManager({self._store.url!r}, local={self._tiers.local.url!r})"
        return f"CheckpointManager({self._store.url!r})"
