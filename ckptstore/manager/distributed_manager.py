"""The multi-rank CheckpointManager: every rank saves its part asynchronously, one commit.

::

    import torch.distributed as dist
    import ckptstore.distributed

    dist.init_process_group("nccl")                      # or "gloo"
    rank = dist.get_rank()
    with ckptstore.distributed.CheckpointManager("s3://bucket/run", max_to_keep=3) as mgr:
        for step in range(start, steps):
            train_step()
            mgr.save(step, {"model": {f"shard{rank}": shard}, "step": step})  # every rank
    state = mgr.restore(target=like)

:func:`ckptstore.distributed.save <ckptstore.manager.distributed.save>` blocks every rank
until the commit, so a rank loses the whole write where a single-process async save loses
only the copy. Here ``save`` returns once this rank's part is copied into pooled host buffers
(as :class:`~ckptstore.CheckpointManager` does); the rest of the multi-rank protocol
(:func:`~ckptstore.manager.distributed.commit_parts`: the ``all_gather`` of the ranks'
trees, this rank's writes, the ``gather`` of their object lists, the one commit, the
``broadcast`` of the outcome) and then retention run in a thread of the manager's own.

Why a process group of its own: those background collectives run while the training loop
issues its own (gradient all-reduces), and collectives on one group must be issued in the
same order on every rank. Interleaved on the training's group, a rank whose background
thread reached its ``gather`` before the training's ``all_reduce`` and a rank where it was
the other way round would pair the wrong calls and hang or corrupt both. So with
``torch.distributed`` the manager creates, at construction, a gloo group over the same
ranks (``dist.new_group``, a collective of the whole world): gloo carries the small Python
objects the protocol exchanges on CPU, whatever backend the training uses. Another launcher
passes ``comm=``: a :class:`~ckptstore.manager.distributed.Collectives` the training does
not use.

Why every rank takes part in every save, even one that failed: the others' background
thread is already waiting in the first collective. A rank whose staging fails (an
unstorable leaf) raises at once, and its background thread still shares the failure, so the
others' saves fail with an error naming it instead of waiting for the group timeout. Errors
of the background work are kept and raised once each, on every rank, by the next ``save``
(before it stages anything) and by :meth:`CheckpointManager.wait_until_finished`, the rule of
:class:`~ckptstore.manager.async_save.BackgroundWork`; since every rank waits for its previous
save before the next one, every rank raises at the same call and the ranks' sequences of
collectives stay aligned. A rank that dies makes the others' collectives fail (at once when
gloo sees the closed connection, at the group's ``timeout`` at worst): nothing is committed,
and the survivors' next ``save`` or ``wait_until_finished`` raises.

Retention is :class:`~ckptstore.CheckpointManager`'s, run by the coordinator alone once the
step is committed; its outcome is broadcast so that a failed deletion surfaces on every rank.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import os
import time
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, Literal

from ckptstore import background
from ckptstore.errors import CkptStoreError, CorruptCheckpointError, NotFoundError
from ckptstore.manager.checkpoint_manager import CheckpointManager as _SingleProcessManager
from ckptstore.manager.distributed import (
    Collectives,
    TorchCollectives,
    _Failure,
    check_coordinator,
    commit_parts,
    load,
)
from ckptstore.manager.preemption import Notice, save_margin
from ckptstore.manager.rank_tiers import RankTiers, everywhere, rank_root
from ckptstore.manager.tiers import RestoreInfo, read_later_nearest
from ckptstore.pipeline import save as save_path
from ckptstore.pipeline.codec import FlatState
from ckptstore.pipeline.restore import (
    Request,
    Selection,
    missing_keys,
    read,
    rebuild,
    request,
    select_paths,
)
from ckptstore.pipeline.save import StagedState, Stager
from ckptstore.pipeline.steps import (
    CommitInfo,
    Manifest,
    check_step,
    committed_steps,
    delete_step,
    read_manifest,
    set_aside,
)
from ckptstore.store.base import Store
from ckptstore.threads import Pool

__all__ = ["CheckpointManager"]

_log = logging.getLogger("ckptstore.tiers")

#: What a save with a local tier failed to do, when a rank could not commit its part there.
_LOCAL_SAVE = "step {step} was not saved: committing the ranks' parts on their local tiers"


class CheckpointManager(_SingleProcessManager):
    """A :class:`~ckptstore.CheckpointManager` whose saves every rank of a group makes, each
    with its part of the state, merged and committed once (see
    :func:`ckptstore.distributed.save <ckptstore.manager.distributed.save>` for how parts
    merge).

    Every rank constructs it, and calls :meth:`save` with the same steps (and ``force``),
    :meth:`wait_until_finished`, :meth:`restore`, :meth:`delete` and :meth:`close`, in the
    same order: each is, or waits for, a collective.

    Args:
        url: the run's checkpoint root, the same on every rank (any URL ``open_store``
            takes, or an open Store, left open by :meth:`close`).
        max_to_keep, keep_period, keep_time_interval, save_interval_steps, best_fn,
            best_mode, async_save, stager, full_every, snapshot: as for
            :class:`~ckptstore.CheckpointManager`; retention runs on the coordinator after
            each commit, with the coordinator's ``metrics``. Saves are incremental as there
            (``Settings.incremental``, the coordinator's): each rank hashes the leaves it
            writes and leaves out those unchanged since the newest committed step. With
            ``snapshot="lazy"`` a rank's ``save`` returns before its state is copied; the
            copy finishes in the background, fenced before the next optimizer step (or by
            :meth:`fence`), and a leaf changed before its copy fails that save on every
            rank (``TornSnapshotError`` on its own).
        local, local_every, persistent_every, local_max_to_keep, local_options,
            copy_backlog: a local tier, as for :class:`~ckptstore.CheckpointManager`, on
            every rank: rank ``r`` of ``n`` commits its part under ``<local>/rank{r}-of-{n}``
            (``local`` is a directory or a URL, not an open Store), and each chosen step is
            committed once on the persistent tier with every rank's part
            (:mod:`ckptstore.manager.rank_tiers`).
        group: the ``torch.distributed`` process group whose ranks save (default: the
            world). The manager's collectives run on a new gloo group over the same ranks,
            created here; constructing the manager is then a collective of the whole world
            (``torch.distributed.new_group``).
        comm: collectives to use instead of ``torch.distributed``; they must be the
            manager's alone (see the module docstring).
        coordinator: the rank (within the group) that commits and applies retention.
        timeout: seconds the new gloo group waits in a collective before failing (how long
            survivors of a rank that died silently wait at most); default: torch's
            (30 minutes). Only with ``torch.distributed``.
        preemption, save_before: as for :class:`~ckptstore.CheckpointManager`: a signal on
            any rank (or the time limit on any rank's clock) makes every rank save the step
            of its next :meth:`save` call, wait until it is durable and raise
            :class:`~ckptstore.manager.preemption.Preempted`. Every ``save()`` call then
            runs one small collective to agree (a second gloo group, made here).
        preemption_comm: with ``comm=`` and ``preemption``/``save_before``: collectives of
            their own for that agreement (e.g. ``JaxCollectives("manager-preemption")``).
        tier_comm: with ``comm=`` and ``local=``: collectives of their own for the copies to
            the persistent tier (e.g. ``JaxCollectives("manager-tiers")``); with
            ``torch.distributed`` the manager makes a third gloo group for them.
        **store_options: options for a URL ``url``, as on every face.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised and no ``comm`` is given.
        ValueError: ``comm`` with ``group`` or ``timeout``; a coordinator outside the group;
            ``preemption`` with ``comm`` but no ``preemption_comm``; ``local`` with ``comm``
            but no ``tier_comm``.
        TypeError: ``local`` is an open Store.
    """

    # Its close() runs collectives of its own, which at interpreter exit could pair with a
    # peer's training that goes on: at exit, only the saves already accepted are finished
    # (their collectives pair with the peers' same saves), by _FinishSaves.
    _closes_at_exit = False

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
        stager: Stager | None = None,
        full_every: int | None = None,
        snapshot: Literal["eager", "lazy"] = "eager",
        local: str | os.PathLike[str] | None = None,
        local_every: int | None = None,
        persistent_every: int | None = None,
        local_max_to_keep: int | None = 2,
        local_options: dict[str, Any] | None = None,
        copy_backlog: int | None = 2,
        group: Any = None,
        comm: Collectives | None = None,
        coordinator: int = 0,
        timeout: float | None = None,
        preemption: bool | int | Iterable[int] = False,
        save_before: float | datetime.datetime | None = None,
        preemption_comm: Collectives | None = None,
        tier_comm: Collectives | None = None,
        **store_options: Any,
    ) -> None:
        self._own_group: Any = None
        self._flags_group: Any = None
        self._tier_group: Any = None
        watching = preemption is not False or save_before is not None
        if isinstance(local, Store):
            raise TypeError(
                f"local= of a multi-rank manager is a directory or a URL, not an open Store "
                f"({local.url}): each rank keeps its part in a root of its own under it"
            )
        if comm is not None:
            if group is not None or timeout is not None:
                raise ValueError(
                    "give comm= or a torch.distributed group= (and its timeout=), not both"
                )
            if watching and preemption_comm is None:
                raise ValueError(
                    "preemption= and save_before= with comm= need preemption_comm=: collectives "
                    'of their own (e.g. JaxCollectives("manager-preemption")), on which every '
                    "save() agrees whether any rank was told to stop"
                )
            if (local is None) != (tier_comm is None):
                raise ValueError(
                    "with comm=, local= and tier_comm= go together: the copies to the "
                    "persistent tier run on collectives of their own (e.g. JaxCollectives("
                    '"manager-tiers")) while the saves go on'
                )
        else:
            if preemption_comm is not None or tier_comm is not None:
                raise ValueError(
                    "preemption_comm= and tier_comm= go with comm=; without it the manager "
                    "makes groups of its own for them"
                )
            comm, self._own_group = _group_of_its_own(group, timeout)
            try:
                if watching:
                    preemption_comm, self._flags_group = _group_of_its_own(group, timeout)
                if local is not None:
                    tier_comm, self._tier_group = _group_of_its_own(group, timeout)
            except BaseException:
                self._destroy_group()
                raise
        self._flags = preemption_comm if watching else None
        self._tier_comm = tier_comm
        self._comm = comm
        self.coordinator = coordinator
        # One thread: the background collectives of successive saves run in save order.
        # ckptstore's pool, which takes work while the interpreter exits: a save accepted
        # just before the script's end reaches it after Python's own pools refuse work.
        self._thread = Pool(1, "ckptstore-ranks")
        # made before the base class's start, whose failure closes the manager
        self._finish_at_exit = _FinishSaves(self)
        try:
            check_coordinator(comm, coordinator)
            if local is not None:
                local = rank_root(local, comm.rank, comm.world)
            super().__init__(
                url,
                max_to_keep=max_to_keep,
                keep_period=keep_period,
                keep_time_interval=keep_time_interval,
                save_interval_steps=save_interval_steps,
                best_fn=best_fn,
                best_mode=best_mode,
                async_save=async_save,
                max_in_flight=1,  # two saves in flight would interleave their collectives
                stager=stager,
                full_every=full_every,
                snapshot=snapshot,
                local=local,
                local_every=local_every,
                persistent_every=persistent_every,
                local_max_to_keep=local_max_to_keep,
                local_options=local_options,
                copy_backlog=copy_backlog,
                preemption=preemption,
                save_before=save_before,
                **store_options,
            )
        except BaseException:
            self._thread.shutdown(wait=True)
            self._destroy_group()
            raise
        background.close_at_exit(
            self._finish_at_exit, "a save this rank accepted was not committed"
        )

    def _open_tiers(
        self,
        local: Store,
        *,
        owns_local: bool,
        local_max_to_keep: int | None,
        copy_backlog: int | None,
    ) -> RankTiers:
        assert self._tier_comm is not None
        return RankTiers(
            local,
            self._store,
            self._tier_comm,
            self.coordinator,
            owns_local=owns_local,
            local_max_to_keep=local_max_to_keep,
            after_copy=self._after_copy,
            copy_backlog=copy_backlog,
        )

    async def _after_copy(self, step: int) -> None:
        # every rank runs it (RankReplicator): the persistent tier's retention is the
        # coordinator's, whose metrics rank the steps
        if self.rank == self.coordinator:
            await self._retain()

    @property
    def rank(self) -> int:
        """This rank's rank in the manager's group."""
        return self._comm.rank

    # ------------------------------------------------------------------ saving

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
        """Save this rank's part of the state as ``step`` if the interval says so (or
        ``force``); every rank calls it, with the same ``step`` and ``force``.

        Blocks while this rank's previous save is still in flight and while this rank's
        arrays are copied into host buffers; once it returns, changing or freeing the state
        cannot change what is written. The collectives, the writes, the commit and retention
        follow in the background (with ``async_save=False`` this waits for them).

        Args:
            step, metadata, metrics: as for :meth:`ckptstore.CheckpointManager.save`
                (``metadata`` and ``metrics``: the coordinator's are stored).
            state: this rank's part, merged with the other ranks' by dict key.
            force: save even if ``step`` is off the interval.
            full: write every leaf and reference no earlier step (as for
                :meth:`ckptstore.CheckpointManager.save`; ``full_every`` makes some saves
                full too).
            persist: with a local tier, as for :meth:`ckptstore.CheckpointManager.save`
                (the coordinator's decides).

        Returns:
            Whether a save was started.

        Raises:
            CommitConflictError: ``step`` is not after the newest step committed (or being
                saved), as for :meth:`ckptstore.CheckpointManager.save`; on every rank.
            Exception: the error of an earlier background save not yet reported, on every
                rank (its own error on a rank that failed; on the others a
                ``CkptStoreError`` naming that rank). Nothing of this step is saved then.
            UnsupportedLeafError, TypeError: a leaf of this rank's part that cannot be
                stored (the other ranks' saves of this step then fail, naming this rank).
        """
        self._check_open()
        tiers = self._tiers
        if tiers is None and persist is not None:
            raise ValueError("persist= needs a local tier (CheckpointManager(local=...))")
        if tiers is not None:
            tiers.replicator.raise_errors()
        if self._watch is not None:
            notice = self._agreed_notice()
            if notice is not None:  # on every rank, at the same step
                self._save_and_stop(step, state, metadata, metrics, notice)
        if not (force or self.should_save(step)):
            self._saver.raise_errors()
            return False
        self._check_after_newest(step)
        meta: dict[str, Any] = {"time": self._clock(), "metrics": metrics}
        if tiers is not None:
            self._mark_persist(meta, step, force, persist)
        document = self._document(meta, metadata)
        every = self.full_every
        full = full or (every is not None and self._saves % every == 0)
        self._saves += 1

        fences: list[Callable[[], None]] = []

        def stage() -> StagedState:
            try:
                check_step(step)
                staged = save_path.stage(
                    self._stager, state, lazy=self.snapshot == "lazy", start=False
                )
                self._fence.track(staged)
            except Exception as exc:
                # The other ranks' background saves wait for this rank's part: tell them.
                told = self._thread.submit(self._share_failure, step, exc)
                self._saver.track(step, told)
                raise
            # Copies still landing (CUDA sources) are waited for in the manager's thread,
            # where a failure is shared with the other ranks like any other.
            fences[:], staged.fences = staged.fences, []
            return staged

        async def write(staged: StagedState) -> CommitInfo:
            run = asyncio.get_running_loop().run_in_executor
            return await run(
                self._thread, self._commit_everywhere, staged, fences, step, document, meta, full
            )

        async def retain() -> None:  # once committed: the handle does not wait for it
            await asyncio.get_running_loop().run_in_executor(self._thread, self._retain_after, step)

        began = time.monotonic()
        self.last_handle = handle = self._saver.submit(step, stage, write, retain)
        if self._watch is not None:  # how long a save takes, for save_before's margin
            handle._future.add_done_callback(
                lambda _: self._save_seconds.append(time.monotonic() - began)
            )
        if not self.async_save:
            self.wait_until_finished()
        return True

    def _agreed_notice(self) -> Notice | None:
        """Whether any rank was told to stop (a signal, or ``save_before`` close), agreed on
        by every rank in one small collective per :meth:`save` call, on collectives of their
        own so it never waits for a save in flight."""
        assert self._watch is not None
        assert self._flags is not None
        mine = self._watch.notice(save_margin(self._save_seconds))
        said = self._flags.all_gather(None if mine is None else (mine.reason, mine.status))
        for rank, told in enumerate(said):
            if told is not None:
                reason, status = told
                return mine or Notice(f"{reason} on rank {rank}", int(status))
        return None

    def _commit_everywhere(
        self,
        staged: StagedState,
        fences: list[Callable[[], None]],
        step: int,
        document: dict[str, Any],
        meta: dict[str, Any],
        full: bool,
    ) -> CommitInfo:
        """The background half of a save up to its commit, in the manager's thread: the
        staged copies' ``fences``, then the multi-rank protocol (:meth:`_retain_after`
        follows it)."""
        if self._tiers is not None:
            return self._commit_locally(staged, fences, step, document, meta, full)
        flat: FlatState | None = None
        error: Exception | None = None
        try:
            for fence in fences:
                fence()
            flat = staged.flat()
        except Exception as exc:
            error = exc
        info = commit_parts(
            self._comm, self._store, flat, error, step, document, self.coordinator, full=full
        )
        self._committed(step)  # on every rank: commit_parts returned, so the step is committed
        if self.rank == self.coordinator:  # what retention ranks it by, and marks with
            self._info[step] = (meta["time"], meta["metrics"])
            self._remember_uses(info)
        return info

    def _retain_after(self, step: int) -> None:
        """What follows the commit of ``step``, in the manager's thread on every rank: the
        retention of the coordinator, or with a local tier each rank's local retention."""
        tiers = self._tiers
        if tiers is None:
            self._on_coordinator(self._retain, f"step {step} is committed; retention after it")
            return
        everywhere(
            self._comm,
            lambda: background.run(tiers.retain_local()),
            f"step {step} is committed; the local tier's retention after it",
            tiers.local.url,
        )

    def _commit_locally(
        self,
        staged: StagedState,
        fences: list[Callable[[], None]],
        step: int,
        document: dict[str, Any],
        meta: dict[str, Any],
        full: bool,
    ) -> CommitInfo:
        """The background half of a save with a local tier: this rank commits its part on
        its own local tier, every rank learns how every rank's went (a step is on the local
        tier only if it is on every rank's), then the copy to the persistent tier is queued
        (the coordinator's ``persist`` decides); each rank's local retention follows
        (:meth:`_retain_after`)."""
        tiers = self._tiers
        assert tiers is not None
        info: CommitInfo | None = None

        def commit() -> tuple[bool, bool]:
            nonlocal info
            for fence in fences:
                fence()
            info = background.run(
                save_path.save_staged(tiers.local, staged, step=step, metadata=document, full=full)
            )
            return bool(meta.get("persist")), bool(meta.get("persist_forced"))

        try:
            said = everywhere(self._comm, commit, _LOCAL_SAVE.format(step=step), tiers.local.url)
        except BaseException:
            if info is not None:  # not on every rank's local tier: this part alone is no step
                background.run(_delete_quietly(tiers.local, step))
            raise
        assert info is not None
        self._committed(step)
        if self.rank == self.coordinator:
            self._info[step] = (meta["time"], meta["metrics"])
        persist, forced = said[self.coordinator]
        if persist:  # pending from here: local retention keeps it
            tiers.replicator.submit(step, forced=forced)
        return info

    def _check_after_newest(self, step: int) -> None:
        # Every rank must refuse the same saves: decide with no save of this rank in flight
        # (the next save waits for that anyway), so every rank knows the same commits.
        self._saver.wait_for_fewer_than(1)
        self._saver.raise_errors()
        super()._check_after_newest(step)

    def _share_failure(self, step: int, error: Exception) -> None:
        """Take part in the collectives of a save this rank could not stage, so the others
        fail naming it; ``error`` was raised to this rank's caller already."""
        try:
            if self._tiers is not None:
                everywhere(
                    self._comm,
                    _raiser(error),
                    _LOCAL_SAVE.format(step=step),
                    self._tiers.local.url,
                )
            else:
                commit_parts(self._comm, self._store, None, error, step, None, self.coordinator)
        except Exception as raised:
            if raised is not error:
                raise

    def _on_coordinator(self, work: Callable[[], Coroutine[Any, Any, Any]], what: str) -> None:
        """Run ``work`` on the coordinator; every rank raises if it failed (the coordinator
        its own error, the others a ``CkptStoreError`` naming it)."""
        failure: _Failure | None = None
        error: Exception | None = None
        if self.rank == self.coordinator:
            try:
                background.run(work())
            except Exception as exc:
                error, failure = exc, _Failure.of(self.rank, exc)
        try:
            failure = self._comm.broadcast(failure, self.coordinator)
        except Exception as exc:
            raise CkptStoreError(
                f"{self._store.url}: {what}: hearing whether it succeeded from the coordinator "
                f"failed ({type(exc).__name__}: {exc})"
            ) from exc
        if error is not None:
            raise error
        if failure is not None:
            raise CkptStoreError(f"{self._store.url}: {what} failed on {failure.describe()}")

    # ------------------------------------------------------------------ reading, deleting

    def restore(
        self,
        step: int | None = None,
        target: Any = None,
        keys: Any = None,
        broadcast: bool | None = None,
        shared_memory: bool = True,
        *,
        rollback: bool = False,
        stream: bool | str | Iterable[str] = False,
    ) -> Any:
        """Read what this rank needs of a committed step, verifying every byte; every rank
        calls it.

        It is :func:`ckptstore.distributed.load <ckptstore.manager.distributed.load>` on
        the manager's collectives, once the saves in flight have finished (their
        collectives run on the same group): with ``step=None`` the coordinator picks the
        newest committed step and every rank reads that one, and a leaf several ranks ask
        for is read from the store once and sent to the others (through shared memory
        to ranks of the reader's host unless ``shared_memory`` is false), unless
        ``broadcast`` is false (``None``: as the collectives prefer, see ``load``). Args
        and raises otherwise as :meth:`ckptstore.CheckpointManager.restore`; with
        ``rollback``, the coordinator sets the newer steps aside once every rank has read
        its part, and every rank raises if that failed. With ``stream``, the first part is
        loaded this way and the rest each rank reads in the background (see ``load``).
        """
        self._check_open()
        self.wait_until_finished()
        if self._tiers is not None:
            state = self._restore_tiered(step, target, keys, broadcast, shared_memory, stream)
        else:
            state = load(
                self._store,
                step,
                keys=keys,
                target=target,
                comm=self._comm,
                coordinator=self.coordinator,
                broadcast=broadcast,
                shared_memory=shared_memory,
                stream=stream,
            )
        if rollback:
            if step is None:  # the newest: nothing above it to set aside
                return state
            self._roll_back_everywhere(step)
        return state

    def _roll_back_everywhere(self, step: int) -> None:
        aside: list[int] = []

        async def set_aside_after() -> None:
            aside.extend(await set_aside(self._store, step))

        self._on_coordinator(set_aside_after, f"setting aside the steps after {step}")
        found = set(self._comm.broadcast(aside, self.coordinator))
        if self._tiers is not None:
            local = self._tiers.local
            said = everywhere(
                self._comm,
                lambda: background.run(set_aside(local, step)),
                f"setting aside the steps after {step} on the local tiers",
                local.url,
            )
            found.update(*said)
        self.set_aside = sorted(found)
        for gone in self.set_aside:
            self._info.pop(gone, None)
        self._newest, self._newest_known = step, True

    def _restore_tiered(
        self,
        step: int | None,
        target: Any,
        keys: Any,
        broadcast: bool | None,
        shared_memory: bool,
        stream: bool | str | Iterable[str],
    ) -> Any:
        """Restore with a local tier (see :mod:`ckptstore.manager.rank_tiers`): the step
        from every rank's own local part when every rank can read its request there, else
        from the persistent tier on every rank."""
        tiers = self._tiers
        assert tiers is not None
        asked = request(keys, target, stream)
        coordinator, persistent = self.coordinator, self._store

        def listing() -> tuple[list[int], list[int] | None]:
            mine = background.run(committed_steps(tiers.local))
            if self.rank != coordinator:
                return mine, None
            return mine, background.run(committed_steps(persistent))

        said = everywhere(self._comm, listing, "listing the tiers' steps", tiers.local.url)
        on_every_local = set(said[0][0]).intersection(*(set(s[0]) for s in said[1:]))
        on_persistent = set(said[coordinator][1])
        if step is None:
            step = max(on_every_local | on_persistent, default=None)
            if step is None:
                raise NotFoundError(
                    f"{tiers.local.url} (every rank's) and {persistent.url}: no committed "
                    "checkpoint to restore"
                )
        elif step not in on_every_local | on_persistent:
            raise NotFoundError(
                f"no step {step} on every rank's local tier ({tiers.local.url} here) nor on "
                f"the persistent tier {persistent.url}"
            )
        fallback = f"step {step} is not on every rank's local tier"
        if step in on_every_local:
            reasons, mine = self._local_parts_serve(step, asked)
            spread = bool(reasons)  # the leaves asked for are not all in each rank's part
            if not reasons:
                info = RestoreInfo(step, "local", tiers.local.url)
                state: Any = None
                why: str | None = None
                try:  # read and rebuild here, so that no rank raises alone (a target's shape)
                    selection: Selection = background.run(
                        read(tiers.local, step, asked, manifest=mine)
                    )
                    later = read_later_nearest(tiers.local, persistent, selection, info)
                    state = rebuild(selection, store=persistent, reader=later)
                except Exception as exc:
                    why = f"{type(exc).__name__}: {exc}"
                told = self._comm.all_gather(why)
                reasons = [f"rank {r}: {w}" for r, w in enumerate(told) if w is not None]
                if not reasons:
                    self.last_restore = info
                    return state
            fallback = "; ".join(reasons)
            if step not in on_persistent:
                where = f"step {step} is on every rank's local tier ({tiers.local.url} here)"
                if spread:
                    raise NotFoundError(
                        f"{where} but not on the persistent tier {persistent.url}, and not "
                        f"every rank's part holds what its restore asks for ({fallback}): "
                        "restore each rank's own part (target= that part), or the step once "
                        "its copy to the persistent tier is committed"
                    )
                raise CorruptCheckpointError(
                    f"{where} but not every rank could read its request there ({fallback}), "
                    f"and the persistent tier {persistent.url} does not have it"
                )
            _log.warning(
                "step %d: %s; restoring it from the persistent tier %s",
                step,
                fallback,
                persistent.url,
            )
        state = load(
            persistent,
            step,
            keys=keys,
            target=target,
            comm=self._comm,
            coordinator=self.coordinator,
            broadcast=broadcast,
            shared_memory=shared_memory,
            stream=stream,
        )
        self.last_restore = RestoreInfo(step, "persistent", persistent.url, fallback)
        return state

    def _local_parts_serve(self, step: int, asked: Request) -> tuple[list[str], Manifest | None]:
        """Whether every rank's local part of ``step`` holds what its request names, decided
        on every rank from every rank's manifest: why not, by rank (empty: they do), and this
        rank's manifest (read once: the restore reads its leaves with it).

        A request with a target names its own leaves; one without asks for the merged step
        (under ``keys``), which a rank's part holds only if no other rank's part has a leaf
        it lacks."""
        assert self._tiers is not None
        why: str | None = None
        paths: list[str] = []
        manifest: Manifest | None = None
        try:
            manifest = background.run(read_manifest(self._tiers.local, step))
            paths = sorted(manifest.all_paths())
            if asked.like is not None:
                lacking = missing_keys(paths, asked.keys or ())
                if lacking:
                    why = f"its part has no leaf {lacking[0]!r}"
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
        told = self._comm.all_gather((why, paths))
        reasons = [f"rank {r}: {w}" for r, (w, _) in enumerate(told) if w is not None]
        if reasons or asked.like is not None:
            return reasons, manifest
        union = set().union(*(set(p) for _, p in told))
        accept = select_paths(asked.keys if asked.keys is not None else [""])
        wanted = {p for p in union if accept(p)}
        for rank, (_, held) in enumerate(told):
            lacking = sorted(wanted - set(held))
            if lacking:
                reasons.append(
                    f"rank {rank}: its part lacks {len(lacking)} of the {len(wanted)} leaves "
                    f"asked for ({lacking[0]!r}...), which other ranks saved"
                )
        return reasons, manifest

    def delete(self, step: int) -> None:
        """Delete a committed step, on the coordinator (its manifest first, so it is never
        half visible); with a local tier, every rank's part there too. Every rank calls it
        and raises if the deletion failed.

        Raises:
            NotFoundError: no tier holds ``step`` (with a local tier: on any rank).
        """
        self._check_open()
        self.wait_until_finished()
        tiers = self._tiers
        if tiers is None:

            async def remove() -> None:
                await delete_step(self._store, step)

            self._on_coordinator(remove, f"deleting step {step}")
        else:

            async def remove_part() -> bool:
                stores = [tiers.local] + ([self._store] if self.rank == self.coordinator else [])
                found = False
                for store in stores:
                    with contextlib.suppress(NotFoundError):
                        await delete_step(store, step)
                        found = True
                return found

            found = everywhere(
                self._comm,
                lambda: background.run(remove_part()),
                f"deleting step {step}",
                tiers.local.url,
            )
            if not any(found):
                raise NotFoundError(
                    f"no step {step} to delete on any rank's local tier ({tiers.local.url} "
                    f"here) or on the persistent tier {self._store.url}"
                )
        self._info.pop(step, None)
        self._newest_known = False  # the newest step may be the one deleted

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """As :meth:`ckptstore.CheckpointManager.close`, then stop the manager's thread and
        destroy the process group it created."""
        if self._closed:
            return
        background.forget_at_exit(self._finish_at_exit)
        try:
            super().close()
        finally:
            self._thread.shutdown(wait=True)
            if isinstance(self._tiers, RankTiers):
                self._tiers.replicator.shutdown()
            self._destroy_group()

    def _destroy_group(self) -> None:
        groups = (self._own_group, self._flags_group, self._tier_group)
        self._own_group = self._flags_group = self._tier_group = None
        for group in groups:
            if group is not None:
                import torch.distributed as dist

                if dist.is_initialized():
                    dist.destroy_process_group(group)

    def __repr__(self) -> str:
        return (
            f"ckptstore.distributed.CheckpointManager({self._store.url!r}, "
            f"rank={self.rank}, world={self._comm.world})"
        )


def _raiser(error: Exception) -> Callable[[], None]:
    def fail() -> None:
        raise error

    return fail


async def _delete_quietly(store: Store, step: int) -> None:
    """Delete this rank's part of a step that is not on every rank, if it is there."""
    with contextlib.suppress(NotFoundError):
        await delete_step(store, step)


class _FinishSaves:
    """What a multi-rank manager left open does when the main thread ends: wait for the
    saves it accepted (every rank accepted the same ones, so their collectives pair), and
    nothing else; a failure is printed, naming the rank's error. A rank whose peer is gone
    waits at most the group's ``timeout``. Then it destroys the gloo groups the manager made:
    left to the interpreter's teardown, gloo's threads may still hold work whose tensors
    need the GIL, and the process aborts ("terminate called without an active exception")
    instead of exiting 0."""

    def __init__(self, manager: CheckpointManager) -> None:
        self.manager = manager

    def close(self) -> None:
        try:
            try:
                self.manager._saver.wait_until_finished()
            finally:  # the copies every rank queued pair up as the saves do
                if self.manager._tiers is not None:
                    self.manager._tiers.replicator.wait_until_finished()
        finally:
            self.manager._destroy_group()

    def __repr__(self) -> str:
        return repr(self.manager)


def _group_of_its_own(group: Any, timeout: float | None) -> tuple[Collectives, Any]:
    """A gloo group over ``group``'s ranks (the world's by default), and its collectives."""
    try:
        TorchCollectives(group)  # refuses an uninitialised torch.distributed
    except (ImportError, RuntimeError) as exc:
        raise RuntimeError(
            "ckptstore.distributed.CheckpointManager runs its collectives on a group of its "
            "own: it needs torch.distributed initialised (dist.init_process_group), or, in a "
            "jax.distributed job, collectives of a name of its own passed as "
            'comm=ckptstore.distributed.JaxCollectives("manager")'
        ) from exc
    import torch.distributed as dist

    ranks = None if group is None else dist.get_process_group_ranks(group)
    options: dict[str, Any] = {}
    if timeout is not None:
        options["timeout"] = datetime.timedelta(seconds=timeout)
    own = dist.new_group(ranks, backend="gloo", **options)
    return TorchCollectives(own), own
