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
    mirror = OrbaxMirror(manager, "s3://bucket/run")
    mirror.save(step, args=ocp.args.StandardSave(state))
    ...
    mirror.wait_until_finished()                      # Orbax's saves and the uploads
    state = mirror.restore(None, args=ocp.args.StandardRestore(abstract_state))

When is a step finalized? Orbax saves in the background and finalizes a step (renames it
into place) before it starts the next save, and ``wait_until_finished`` finalizes the last
one. So each :meth:`OrbaxMirror.save` queues the uploads of the steps finalized before it,
and :meth:`OrbaxMirror.wait_until_finished` those of the rest: a step reaches the store one
save later than the local disk unless you wait. Only process 0 uploads (Orbax's directory
must be one every process writes to: one host, or a shared filesystem). Importing this
module imports orbax and JAX.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from ckptstore import background
from ckptstore.errors import NotFoundError
from ckptstore.integrations.files import TreeMirror, download
from ckptstore.layout.commit import committed_steps
from ckptstore.pipeline.root import Root, opened

__all__ = ["OrbaxMirror"]


class OrbaxMirror:
    """Mirrors the finalized steps of an Orbax ``CheckpointManager`` to a ckptstore root.

    Args:
        manager: an Orbax ``CheckpointManager`` over a local directory.
        root: where the steps go: a URL, a path or an open Store.
        store_options: store options, as on every face.
    """

    def __init__(self, manager: ocp.CheckpointManager, root: Root, **store_options: Any) -> None:
        self.manager = manager
        self.root = root
        self._options = store_options
        self.mirror = TreeMirror(root, **store_options)
        self._queued: set[int] = set()
        self._waiting: list[int] = []  # saved, not yet known to be finalized

    def step_directory(self, step: int) -> Path:
        """Orbax's directory of ``step`` (by its step name format)."""
        options = self.manager._options  # the format Orbax names its steps with
        name_format = options.step_name_format or ocp.step.standard_name_format(
            step_prefix=options.step_prefix,
            step_format_fixed_length=options.step_format_fixed_length,
        )
        return Path(ocp.step.build_step_path(self.manager.directory, name_format, step))

    def save(self, step: int, *args: Any, **kwargs: Any) -> bool:
        """``manager.save(step, ...)``; then queue the uploads of every step it finalized.

        Returns:
            What ``manager.save`` returned (whether Orbax saved this step).

        Raises:
            CkptStoreError, OSError: an earlier upload failed.
        """
        saved: bool = self.manager.save(step, *args, **kwargs)
        if saved:
            self._waiting.append(step)
        # Orbax finishes a save before it starts the next one: every step but one still in
        # flight is finalized now.
        if not self.manager.is_saving_in_progress():
            self._queue(self._waiting)
        else:
            self._queue(self._waiting[:-1])
        return saved

    def _queue(self, steps: list[int]) -> None:
        for step in list(steps):
            self._waiting.remove(step)
            # Orbax renames a step's directory into place when it finalizes it (asking the
            # manager to re-read its directory instead would reset its retention bookkeeping).
            if step in self._queued or not self.step_directory(step).is_dir():
                continue  # not kept by Orbax (already deleted by its retention)
            self._queued.add(step)
            if jax.process_index() == 0:
                self.mirror.submit(self.step_directory(step), step, metadata={"library": "orbax"})

    def wait_until_finished(self) -> None:
        """Wait for Orbax's saves, then for the upload of every step saved so far.

        Raises:
            CkptStoreError, OSError: the first upload that failed.
        """
        self.manager.wait_until_finished()
        self._queue(list(self._waiting))
        self.mirror.wait()

    def all_steps(self) -> list[int]:
        """Steps on the local disk or committed in the store, ascending."""
        with opened(self.root, self._options) as store:
            remote = background.run(committed_steps(store))
        return sorted(set(self.manager.all_steps()) | set(remote))

    def restore(self, step: int | None = None, *args: Any, **kwargs: Any) -> Any:
        """``manager.restore(step, ...)``, downloading the step from the store first when
        the local disk lacks it.

        Args:
            step: the step (``None``: the newest on either side).
            args, kwargs: what ``manager.restore`` takes (``args=ocp.args...``).

        Raises:
            NotFoundError: neither side holds the step (or any step).
            CorruptCheckpointError: the store's copy fails verification (nothing is left
                in Orbax's directory).
        """
        if step is None:
            steps = self.all_steps()
            if not steps:
                raise NotFoundError(
                    f"no checkpoint in {self.manager.directory}, and none committed in the store"
                )
            step = steps[-1]
        if not self.step_directory(step).is_dir():
            if jax.process_index() == 0:
                download(self.root, self.step_directory(step), step=step, **self._options)
            if jax.process_count() > 1:
                ocp.multihost.sync_global_processes("ckptstore-orbax-download")
            self.manager.reload()
        return self.manager.restore(step, *args, **kwargs)

    def close(self) -> None:
        """Wait for everything (:meth:`wait_until_finished`), then close the uploader (the
        Orbax manager stays open; close it yourself)."""
        try:
            self.wait_until_finished()
        finally:
            self.mirror.close()
