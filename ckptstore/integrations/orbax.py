"""Orbax's ``CheckpointManager`` on a local directory, every step mirrored to a ckptstore URL.

Orbax cannot write to ``s3://``. :class:`OrbaxMirror` lets it keep writing where it is fast
(a local directory, asynchronously, with its own atomic rename) and uploads every step Orbax
has finalized as a committed ckptstore step: on S3 or GCS the step is visible only once
every file of it is there and checksummed. A restore of a step that is not on the local
disk (a new node, a deleted directory) downloads it from the store, verified, into Orbax's
directory first::

    import orbax.checkpoint as ocp
    from ckptstore.integrations.orbax import OrbaxMirror

    manager = ocp.CheckpointManager("/nvme/ckpt", options=ocp.CheckpointManagerOptions(...))
    mirror_manager(manager, "s3://bucket/run")        # the manager's own calls from here on
    step = manager.latest_step()                      # the newest here or in the store
    if step is not None:
        state = manager.restore(step, args=ocp.args.StandardRestore(abstract_state))
    ...
    manager.save(step, args=ocp.args.StandardSave(state))
    ...
    manager.wait_until_finished()                     # Orbax's saves and the uploads

``manager.restore(step, ..., rollback=True)`` goes back to an older step: the newer steps
are set aside in the store and their directories moved out of Orbax's, so training saves
them again. A save of a step that is not after the store's newest is refused in
``manager.save`` itself. (:class:`OrbaxMirror` is the same without patching the manager:
``mirror.save``, ``mirror.restore``.)

With ``preemption=True`` (SIGTERM; or signal numbers) or ``save_before=``, a termination
notice makes the next ``manager.save(step, ...)`` save that step whatever the interval
(``force=True``), wait for it and its upload, and raise
:class:`~ckptstore.manager.preemption.Preempted` (exit status 143 for SIGTERM); Orbax's
``manager.reached_preemption(step)`` is then ``True`` too, so Orbax's own idiom, checking it
every step and saving when it is ``True``, works unchanged; so does calling ``manager.save``
every step and letting ``save_interval_steps`` choose. On several hosts, every host must get
the notice.

When is a step finalized? Orbax saves in the background and finalizes a step (renames it
into place) before it starts the next save, and ``wait_until_finished`` finalizes the last
one. So each :meth:`OrbaxMirror.save` queues the uploads of the steps finalized before it,
and :meth:`OrbaxMirror.wait_until_finished` those of the rest: a step reaches the store one
save later than the local disk unless you wait. Only process 0 uploads (Orbax's directory
must be one every process writes to: one host, or a shared filesystem). Only Orbax's public
API is used: each step's directory name is kept in its manifest, so a download lands where
Orbax looks for it. Importing this module imports orbax and JAX.
"""

from __future__ import annotations

import datetime
import functools
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import jax
import orbax.checkpoint as ocp

from ckptstore import background
from ckptstore.errors import NotFoundError
from ckptstore.integrations.files import TreeMirror, download, roll_back
from ckptstore.manager.preemption import Notice, save_margin, stop, watch
from ckptstore.pipeline.root import Root, opened
from ckptstore.pipeline.steps import committed_steps, read_manifest

__all__ = ["OrbaxMirror", "mirror_manager"]

_T = TypeVar("_T")

_ADVICE = (
    "To resume that run, manager.restore(manager.latest_step(), ...) after mirror_manager "
    "continues from its newest step; to go back to an older step and train on from it, "
    "manager.restore(step, ..., rollback=True) sets the newer steps aside"
)


class OrbaxMirror:
    """Mirrors the finalized steps of an Orbax ``CheckpointManager`` to a ckptstore root.

    Args:
        manager: an Orbax ``CheckpointManager`` over a local directory.
        root: where the steps go: a URL, a path or an open Store.
        preemption: the signals that give notice (``True``: SIGTERM), installed now, from
            the main thread: the next :meth:`save` is the last (see the module docstring).
        save_before: notice once less time is left before this wall-clock limit (seconds
            since the epoch, or an aware ``datetime``) than twice the longest :meth:`save`
            call so far.
        store_options: store options, as on every face.
    """

    def __init__(
        self,
        manager: ocp.CheckpointManager,
        root: Root,
        *,
        preemption: bool | int | Iterable[int] = False,
        save_before: float | datetime.datetime | None = None,
        **store_options: Any,
    ) -> None:
        self._watch = watch(preemption, save_before)
        self._save_seconds: list[float] = []
        self.manager = manager
        self.root = root
        self._options = store_options
        self.mirror = TreeMirror(root, resume_advice=_ADVICE, **store_options)
        self._queued: set[int] = set()
        self._waiting: list[int] = []  # saved, not yet known to be finalized
        # the manager's own methods, whether or not mirror_manager replaces them later
        self._save = manager.save
        self._restore = manager.restore
        self._wait = manager.wait_until_finished
        self._all_steps = manager.all_steps
        self._close = manager.close
        # a script that never closes the manager still gets its last step uploaded: that
        # step is queued only once Orbax has finalized it, which wait_until_finished does
        background.close_at_exit(self, "a step Orbax saved was not uploaded to the store")

    def local_directories(self) -> dict[int, Path]:
        """Orbax's finalized step directories on the local disk, by step."""
        found = {}
        for path in ocp.step.checkpoint_steps_paths(self.manager.directory):
            try:
                found[ocp.step.step_from_checkpoint_name(path.name)] = Path(path)
            except ValueError:
                continue  # not a step Orbax names (a file of ours beside them)
        return found

    def save(self, step: int, *args: Any, **kwargs: Any) -> bool:
        """``manager.save(step, ...)``; then queue the uploads of every step it finalized.

        Returns:
            What ``manager.save`` returned (whether Orbax saved this step).

        Raises:
            CommitConflictError: ``step`` is not after the store's newest step (nothing is
                written).
            CkptStoreError, OSError: an earlier upload failed.
            Preempted: after a termination notice, once this step is saved and uploaded.
        """
        notice = self.notice()
        if notice is not None:
            kwargs["force"] = True  # the last save, whatever the interval
        if jax.process_index() == 0:
            self.mirror.check_step(step)
        began = time.monotonic()
        saved: bool = self._save(step, *args, **kwargs)
        self._save_seconds.append(time.monotonic() - began)
        if saved:
            self._waiting.append(step)
        # Orbax finishes a save before it starts the next one: every step but one still in
        # flight is finalized now.
        if not self.manager.is_saving_in_progress():
            self._queue(self._waiting)
        else:
            self._queue(self._waiting[:-1])
        if notice is not None:
            self.wait_until_finished()
            self._close_watch()
            stop(step, notice, self.mirror.where)
        return saved

    def notice(self) -> Notice | None:
        """The termination notice received so far, if any (see ``preemption=``)."""
        return None if self._watch is None else self._watch.notice(save_margin(self._save_seconds))

    @property
    def watching(self) -> bool:
        """Whether ``preemption=`` or ``save_before=`` was given (and no notice acted on)."""
        return self._watch is not None

    def _close_watch(self) -> None:
        if self._watch is not None:
            self._watch.close()
            self._watch = None

    def _queue(self, steps: list[int]) -> None:
        local = self.local_directories() if steps else {}
        for step in list(steps):
            self._waiting.remove(step)
            # Orbax renames a step's directory into place when it finalizes it (asking the
            # manager to re-read its directory instead would reset its retention bookkeeping).
            if step in self._queued or step not in local:
                continue  # not kept by Orbax (already deleted by its retention)
            self._queued.add(step)
            if jax.process_index() == 0:
                self.mirror.submit(local[step], step, metadata=_metadata(local[step]))

    def wait_until_finished(self) -> None:
        """Wait for Orbax's saves, then for the upload of every step saved so far.

        Raises:
            CkptStoreError, OSError: the first upload that failed.
        """
        self._wait()
        self._queue(list(self._waiting))
        self.mirror.wait()

    def all_steps(self, read: bool = False) -> list[int]:
        """Steps on the local disk or committed in the store, ascending."""
        with opened(self.root, self._options) as store:
            remote = background.run(committed_steps(store))
        return sorted(set(self._all_steps(read)) | set(remote))

    def latest_step(self) -> int | None:
        """The newest step on the local disk or committed in the store."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def restore(
        self, step: int | None = None, *args: Any, rollback: bool = False, **kwargs: Any
    ) -> Any:
        """``manager.restore(step, ...)``, downloading the step from the store first when
        the local disk lacks it.

        Args:
            step: the step (``None``: the newest on either side).
            rollback: make ``step`` the newest, so training saves the steps after it again:
                the newer steps are set aside in the store (recoverable with
                :func:`ckptstore.recover_step` until gc) and their directories moved out of
                Orbax's, to ``<directory>/.ckptstore-replaced``.
            args, kwargs: what ``manager.restore`` takes (``args=ocp.args...``).

        Raises:
            ValueError: ``rollback`` without ``step``.
            NotFoundError: neither side holds the step (or any step).
            CorruptCheckpointError: the store's copy fails verification (nothing is left
                in Orbax's directory).
        """
        if rollback and step is None:
            raise ValueError("rollback=True needs the step to go back to: restore(step, ...)")
        if step is None:
            step = self.latest_step()
            if step is None:
                raise NotFoundError(
                    f"no checkpoint in {self.manager.directory}, and none committed in the store"
                )
        if rollback:
            self._roll_back(step)
        local = self.local_directories()
        if step not in local:
            if jax.process_index() == 0:
                self._download(step)
            if jax.process_count() > 1:
                ocp.multihost.sync_global_processes("ckptstore-orbax-download")
            self.manager.reload()
        restored = self._restore(step, *args, **kwargs)
        # a step only this disk holds (killed before its upload): upload it now
        if (
            step in local
            and jax.process_index() == 0
            and self.mirror.adopt(local[step], step, metadata=_metadata(local[step]))
        ):
            self._queued.add(step)
        return restored

    def _roll_back(self, step: int) -> None:
        self.wait_until_finished()  # nothing newer may still be on its way
        if jax.process_index() == 0:

            def newer(after: int) -> list[Path]:
                return [p for s, p in sorted(self.local_directories().items()) if s > after]

            roll_back(self.root, step, newer_copies=newer, **self._options)
        if jax.process_count() > 1:
            ocp.multihost.sync_global_processes("ckptstore-orbax-rollback")
        self.mirror.rolled_back(step)
        self._queued = {s for s in self._queued if s <= step}  # the newer ones upload again
        self.manager.reload()

    def _download(self, step: int) -> None:
        """Download ``step`` into Orbax's directory, under the name it had when uploaded."""
        with opened(self.root, self._options) as store:
            manifest = background.run(read_manifest(store, step))
            user = manifest.metadata.get("user") if isinstance(manifest.metadata, dict) else None
            name = user.get("directory") if isinstance(user, dict) else None
            if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
                name = str(step)  # uploaded before names were kept: Orbax's default format
            download(store, Path(self.manager.directory) / name, step=step)

    def close(self) -> None:
        """Wait for everything (:meth:`wait_until_finished`), then close the uploader (the
        Orbax manager stays open; close it yourself)."""
        background.forget_at_exit(self)
        try:
            self.wait_until_finished()
        finally:
            self._close_watch()
            self.mirror.close()

    def __repr__(self) -> str:
        return f"OrbaxMirror({self.manager.directory}, {self.mirror!r})"


def _metadata(directory: Path) -> dict[str, str]:
    """A step's manifest metadata: Orbax's name for its directory, where a download goes."""
    return {"library": "orbax", "directory": directory.name}


def mirror_manager(
    manager: ocp.CheckpointManager,
    root: Root,
    *,
    preemption: bool | int | Iterable[int] = False,
    save_before: float | datetime.datetime | None = None,
    **store_options: Any,
) -> OrbaxMirror:
    """Mirror an Orbax ``CheckpointManager``'s own calls to a ckptstore root, so a training
    script keeps Orbax's API and gains the store.

    Afterwards, called by the script, ``manager.save``, ``manager.restore`` (with
    ``rollback=``), ``manager.wait_until_finished``, ``manager.all_steps``,
    ``manager.latest_step`` and ``manager.close`` are :class:`OrbaxMirror`'s: a save of an
    old step is refused, a restore downloads a step this disk lacks, the steps count the
    store's too, ``wait_until_finished`` also waits for the uploads, and ``close()`` waits
    for them, then closes the manager (``with CheckpointManager(...) as manager:`` does so
    on leaving the block). Orbax's own methods, calling each other, still get Orbax's: its
    ``save`` waits for its previous save, never for an upload.

    ``preemption=`` and ``save_before=`` are :class:`OrbaxMirror`'s; with them,
    ``manager.reached_preemption(step)`` is also ``True`` once notice is given.

    Returns:
        The mirror (its ``mirror.wait()`` waits for the uploads queued so far).
    """
    mirror = OrbaxMirror(
        manager, root, preemption=preemption, save_before=save_before, **store_options
    )
    inside = threading.local()  # set while one of Orbax's own methods runs

    def orbax_call(method: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        depth = getattr(inside, "depth", 0)
        inside.depth = depth + 1
        try:
            return method(*args, **kwargs)
        finally:
            inside.depth = depth

    def user_or_orbax(ours: Callable[..., _T], theirs: Callable[..., _T]) -> Callable[..., _T]:
        def call(*args: Any, **kwargs: Any) -> _T:
            if getattr(inside, "depth", 0):
                return theirs(*args, **kwargs)
            return ours(*args, **kwargs)

        return call

    mirror._save = functools.partial(orbax_call, mirror._save)
    mirror._restore = functools.partial(orbax_call, mirror._restore)
    delete, latest = manager.delete, manager.latest_step

    def close() -> None:
        try:
            mirror.close()
        finally:
            orbax_call(mirror._close)

    manager.save = mirror.save
    manager.restore = mirror.restore
    manager.delete = functools.partial(orbax_call, delete)
    manager.wait_until_finished = user_or_orbax(mirror.wait_until_finished, mirror._wait)
    manager.all_steps = user_or_orbax(mirror.all_steps, mirror._all_steps)
    manager.latest_step = user_or_orbax(mirror.latest_step, latest)
    manager.close = close
    if mirror.watching:
        reached = manager.reached_preemption

        def reached_preemption(step: int) -> bool:
            return mirror.notice() is not None or bool(reached(step))

        manager.reached_preemption = reached_preemption
    return mirror
