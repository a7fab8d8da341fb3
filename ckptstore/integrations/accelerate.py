"""Accelerate's ``save_state``/``load_state`` with every state committed to a ckptstore URL.

``Accelerator.save_state(dir)`` writes the model, optimizer, scheduler, sampler and RNG
states of every process into a local directory. :class:`StoreStates` wraps it: each save goes
to ``local_dir/step-<N>`` as before and is then uploaded in the background as step ``N``
of a ckptstore root (one put-if-absent commit, every file checksummed); a load downloads a
committed step into ``local_dir``, verified, and hands that directory to ``load_state``::

    from ckptstore.integrations.accelerate import StoreStates

    states = StoreStates(accelerator, "s3://bucket/run", "/nvme/states")
    start = states.load_state() or 0      # newest committed step, or None on a fresh run
    for step in range(start + 1, total + 1):
        ...
        if step % 100 == 0:
            states.save_state(step)
    states.wait_until_finished()

Under several processes every process calls both methods (as ``save_state`` requires); the
main process uploads and downloads, so ``local_dir`` must be one directory every process
sees (one node, or a shared filesystem). Leave Accelerate's ``automatic_checkpoint_naming``
off: the step names the directory here. Importing this module imports accelerate.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from ckptstore.errors import NotFoundError
from ckptstore.integrations.files import (
    REPLACED_DIR,
    TreeMirror,
    local_copy,
    numbered_after,
    roll_back,
)
from ckptstore.manager.preemption import (
    Notice,
    notice_elsewhere,
    save_margin,
    stop,
    watch,
)
from ckptstore.pipeline.root import Root

__all__ = ["StoreStates", "mirror_states"]


class StoreStates:
    """An Accelerator's states, saved locally and committed to a ckptstore root.

    Args:
        accelerator: the Accelerator whose states to save and load.
        root: where the steps go: a URL, a path or an open Store.
        local_dir: where ``save_state`` writes (``local_dir/step-<N>``) and where a load
            downloads to.
        store_options: store options, as on every face.
    """

    def __init__(
        self,
        accelerator: Accelerator,
        root: Root,
        local_dir: str | os.PathLike[str],
        **store_options: Any,
    ) -> None:
        self.accelerator = accelerator
        self.root = root
        self.local_dir = Path(local_dir)
        self._options = store_options
        self.mirror = TreeMirror(root, resume_advice=_STATES_ADVICE, **store_options)

    def directory(self, step: int) -> Path:
        """The local directory of ``step``."""
        return self.local_dir / f"step-{step}"

    def save_state(self, step: int, **save_kwargs: Any) -> Path:
        """``accelerator.save_state`` into :meth:`directory`, then queue its upload as step
        ``step`` (the main process, once every process has written its part).

        Raises:
            CkptStoreError, OSError: an earlier upload failed.
        """
        directory = self.directory(step)
        if self.accelerator.is_main_process:
            self.mirror.check_step(step)  # before anything is written
        self.accelerator.save_state(str(directory), **save_kwargs)
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            self.mirror.submit(directory, step, metadata={"library": "accelerate"})
        return directory

    def load_state(
        self, step: int | None = None, *, rollback: bool = False, **load_kwargs: Any
    ) -> int | None:
        """Load step ``step`` (``None``: the newest committed one) into the Accelerator.

        A copy of the step already in ``local_dir`` that holds it exactly (a restart on the
        same node) is loaded from there; otherwise the main process downloads it first,
        verified, and moves whatever else was there aside
        (:func:`~ckptstore.integrations.files.local_copy`).

        Args:
            step: the step (``None``: the newest committed one).
            rollback: make ``step`` the newest, so training saves the steps after it again:
                the newer steps are set aside in the store (recoverable with
                :func:`ckptstore.recover_step` until gc) and their ``step-N`` directories
                moved to ``local_dir/.ckptstore-replaced``.
            load_kwargs: what ``accelerator.load_state`` takes.

        Returns:
            The step loaded, or ``None`` when the store holds no step (nothing is loaded).

        Raises:
            ValueError: ``rollback`` without ``step``.
            NotFoundError: ``step`` is not committed (and not on this node).
        """
        if rollback and step is None:
            raise ValueError("rollback=True needs the step to go back to: load_state(step, ...)")
        if rollback:
            assert step is not None
            if self.accelerator.is_main_process:
                roll_back(
                    self.root,
                    step,
                    newer_copies=numbered_after(self.local_dir, "step-"),
                    **self._options,
                )
            self.mirror.rolled_back(step)
        if step is None:
            step = self.mirror.newest_step()  # read once: the first save checks against it
            if step is None:
                return None
        directory = self.directory(step)
        if self.accelerator.is_main_process:
            try:
                local_copy(self.root, directory, step=step, **self._options)
            except NotFoundError:
                if not directory.is_dir():
                    raise
                # a step only this node holds (its upload never committed): Accelerate's own
                # directory, as it wrote it
        self.accelerator.wait_for_everyone()
        self.accelerator.load_state(str(directory), **load_kwargs)
        return step

    def wait_until_finished(self) -> None:
        """Block until every state saved so far is committed in the store.

        Raises:
            CkptStoreError, OSError: the first upload that failed.
        """
        self.mirror.wait()

    def close(self) -> None:
        """Wait for the uploads, then stop the uploader."""
        self.mirror.close()


def mirror_states(
    accelerator: Accelerator,
    root: Root,
    *,
    preemption: bool | int | Iterable[int] = False,
    save_before: float | datetime.datetime | None = None,
    **store_options: Any,
) -> TreeMirror:
    """Mirror the Accelerator's own ``save_state()`` and ``load_state()`` to a ckptstore root,
    so a training script keeps Accelerate's calls and gains the store.

    The Accelerator must use ``ProjectConfiguration(automatic_checkpoint_naming=True)``:
    ``save_state()`` then writes ``project_dir/checkpoints/checkpoint_<i>``, and ``i`` is the
    step it is committed as. Afterwards:

    * ``accelerator.save_state()`` saves as always, then the main process queues the
      directory's upload (in the background; :class:`~ckptstore.integrations.files.
      TreeMirror`), so Accelerate's ``total_limit`` may delete it meanwhile;
    * ``accelerator.load_state()`` first puts the store's newest step in
      ``project_dir/checkpoints`` (a verified copy already there is reused; another one is
      moved aside: :func:`~ckptstore.integrations.files.local_copy`), loads the newest
      checkpoint there as Accelerate does, and sets the save iteration after it, so the next
      ``save_state()`` does not collide with it (Accelerate leaves that to the user).

    Every process calls both, as Accelerate requires. The returned mirror's ``wait()``
    blocks until the uploads so far are committed; it is closed at exit (or by ``close()``).

    With ``preemption=True`` (SIGTERM; or signal numbers) or ``save_before=`` (a wall-clock
    limit), a termination notice is given through Accelerate's own trigger: call
    ``accelerator.check_trigger()`` every step, and save when it says so. It returns ``True``
    on every process once any process has had notice (one small all-reduce, beside the one
    it already does for ``set_trigger()``), and the next ``accelerator.save_state()`` is the
    last: saved, uploaded, then :class:`~ckptstore.manager.preemption.Preempted` is raised
    (exit status 143 for SIGTERM) on every process::

        for step in range(start + 1, end):
            ...
            if accelerator.check_trigger() or step % 500 == 0:
                accelerator.save_state()

    Args:
        preemption: the signals that give notice (installed now, from the main thread).
        save_before: notice once less time is left before this limit (seconds since the
            epoch, or an aware ``datetime``) than twice the longest ``save_state()`` so far.

    Raises:
        ValueError: automatic checkpoint naming is off; a bad ``preemption``/``save_before``.
    """
    config = accelerator.project_configuration
    if not config.automatic_checkpoint_naming:
        raise ValueError(
            "mirror_states needs Accelerator(project_config=ProjectConfiguration(project_dir="
            "..., automatic_checkpoint_naming=True)): the checkpoint_<i> numbers are the "
            "steps; without it, use StoreStates(accelerator, url, local_dir)"
        )
    project = Path(accelerator.project_dir)
    checkpoints = project / "checkpoints"
    # Accelerate takes every entry of checkpoints/ for a checkpoint (and its total_limit
    # deletes the oldest): the snapshots and what local_copy replaces stay out of it
    mirror = TreeMirror(
        root,
        snapshot_dir=project / ".ckptstore-snapshots",
        resume_advice=_MIRROR_ADVICE,
        **store_options,
    )
    save, load = accelerator.save_state, accelerator.load_state
    notices = watch(preemption, save_before)
    save_seconds: list[float] = []
    #: set by check_trigger() once any process has had notice: the next save is the last
    stopping: list[Notice] = []

    def save_state(output_dir: str | None = None, *args: Any, **kwargs: Any) -> Any:
        began = time.monotonic()
        if output_dir is None and accelerator.is_main_process:
            mirror.check_step(config.iteration)  # before anything is written
        location = save(output_dir, *args, **kwargs)
        accelerator.wait_for_everyone()
        where = Path(location)
        if accelerator.is_main_process:
            mirror.submit(where, _iteration(where), metadata={"library": "accelerate"})
        save_seconds.append(time.monotonic() - began)
        if stopping:
            if accelerator.is_main_process:
                mirror.wait()
            accelerator.wait_for_everyone()
            if notices is not None:
                notices.close()
            stop(_iteration(where), stopping[0], mirror.where)
        return location

    if notices is not None:
        check = accelerator.check_trigger

        def check_trigger() -> bool:
            """Accelerate's, and ``True`` on every process once any has had notice."""
            assert notices is not None
            here = notices.notice(save_margin(save_seconds))
            told = torch.tensor(0 if here is None else 1, device=accelerator.device)
            if not stopping and accelerator.reduce(told, reduction="sum").item() >= 1:
                stopping.append(here or notice_elsewhere(preemption))
            return bool(check()) or bool(stopping)

        accelerator.check_trigger = check_trigger

    def load_state(
        input_dir: str | None = None,
        *args: Any,
        step: int | None = None,
        rollback: bool = False,
        **kwargs: Any,
    ) -> Any:
        if input_dir is not None:
            if step is not None or rollback:
                raise ValueError("load_state: give input_dir or step=, not both")
            return load(input_dir, *args, **kwargs)
        if rollback and step is None:
            raise ValueError("rollback=True needs the step to go back to: load_state(step=...)")
        newest = mirror.newest_step()  # read once: adopt() below asks the same
        wanted = newest if step is None else step
        if wanted is not None and accelerator.is_main_process:
            if rollback:
                roll_back(
                    root,
                    wanted,
                    newer_copies=numbered_after(checkpoints, "checkpoint_"),
                    aside_dir=project / REPLACED_DIR,
                    **store_options,
                )
            local_copy(
                root,
                checkpoints / f"checkpoint_{wanted}",
                step=wanted,
                aside_dir=project / REPLACED_DIR,
                **store_options,
            )
        accelerator.wait_for_everyone()
        if rollback:
            assert wanted is not None
            mirror.rolled_back(wanted)
            newest = wanted
        if step is None:
            loaded = load(None, *args, **kwargs)  # Accelerate's own: the newest in checkpoints/
        else:
            loaded = load(str(checkpoints / f"checkpoint_{step}"), *args, **kwargs)
        numbers = [_iteration(p) for p in numbered_after(checkpoints, "checkpoint_")(-1)]
        if step is None and numbers and accelerator.is_main_process:
            # loaded a checkpoint only this node holds (killed before its upload): upload it
            newest_here = max(numbers)
            where = checkpoints / f"checkpoint_{newest_here}"
            mirror.adopt(where, newest_here, metadata={"library": "accelerate"})
        # the next save_state() is numbered after both this node's checkpoints and the store's
        config.iteration = max([*numbers, -1 if newest is None else newest]) + 1
        return loaded

    accelerator.save_state = save_state
    accelerator.load_state = load_state
    return mirror


_STATES_ADVICE = (
    "To resume that run, states.load_state() loads its newest step; to go back to an older "
    "step and train on from it, states.load_state(step, rollback=True) sets the newer steps "
    "aside"
)

_MIRROR_ADVICE = (
    "To resume that run, accelerator.load_state() loads its newest step (and numbers the "
    "next save after it); to go back to an older step and train on from it, "
    "accelerator.load_state(step=<step>, rollback=True) sets the newer steps aside"
)


def _iteration(directory: Path) -> int:
    """The ``i`` of ``checkpoint_<i>``."""
    name = directory.name
    number = name.removeprefix("checkpoint_")
    if number == name or not number.isdigit():
        raise ValueError(f"{directory}: not a checkpoint_<i> directory of automatic naming")
    return int(number)
