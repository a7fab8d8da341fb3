"""Hugging Face ``Trainer`` checkpoints on any ckptstore URL.

The Trainer keeps writing its checkpoints where it always does (``output_dir/checkpoint-N``,
local and fast); :class:`StoreCallback` uploads each one, once the Trainer has finished
writing it, as step ``N`` of a ckptstore root, in the background, with ckptstore's commit:
on S3 or GCS a step is visible only once every file of it is there and checksummed. To
resume, ``StoreCallback(url, resume=True)`` puts the store's newest step in ``output_dir``
when the Trainer is built, verified (or reuses a copy already there), so the Trainer's own
``resume_from_checkpoint=True`` finds it::

    from ckptstore.integrations.transformers import StoreCallback

    store = StoreCallback("s3://bucket/run", resume=True)
    trainer = Trainer(..., callbacks=[store])
    trainer.train(resume_from_checkpoint=store.last_checkpoint)  # None on a first run

(:func:`resume_from_store` does the same for a step of your choice.) To go back to an older
step and train on from it, ``StoreCallback(url, resume=step, rollback=True)``: the newer
steps are set aside in the store and their ``checkpoint-N`` directories in ``output_dir``
moved aside, so the Trainer saves those steps again. A save of a step that is not after
the store's newest is refused before the Trainer writes it, naming the newest step.

With ``preemption=True`` (SIGTERM; or signal numbers) or ``save_before=``, a termination
notice makes the Trainer save at the end of the step it is in and stop; ``train()`` then
waits for that checkpoint's upload and raises
:class:`~ckptstore.manager.preemption.Preempted` (exit status 143 for SIGTERM), and the
restart resumes from it. Under several processes they agree at each step (one small
all-reduce) whether any of them had notice, so all save and stop at the same step.

Only the main process (``state.is_world_process_zero``) uploads, so under several processes
the checkpoint directory it sees must be complete (one node, or a shared filesystem), as
the Trainer's own rotation already assumes. Importing this module imports transformers.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from accelerate import PartialState
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ckptstore import background
from ckptstore.integrations.files import TreeMirror, local_copy, numbered_after, roll_back
from ckptstore.manager.preemption import (
    Notice,
    PreemptionWatch,
    notice_elsewhere,
    save_margin,
    signals_of,
    stop,
    watch,
)
from ckptstore.pipeline.root import Root, opened
from ckptstore.pipeline.steps import latest_step

__all__ = ["StoreCallback", "resume_from_store"]


class StoreCallback(TrainerCallback):
    """Uploads every checkpoint the Trainer saves as a committed ckptstore step.

    Each ``on_save`` snapshots ``output_dir/checkpoint-<global_step>`` and queues its upload
    (see :class:`~ckptstore.integrations.files.TreeMirror`), so training goes on while it
    uploads; ``on_train_end`` waits for every upload. A failed upload is raised by the next
    save or at the end of training, never dropped.

    With ``resume=True`` the newest committed step is also put in ``output_dir`` when the
    Trainer is built (a verified copy already there is reused, as by
    :func:`resume_from_store`), so the Trainer's own
    ``trainer.train(resume_from_checkpoint=True)`` resumes from the store on any node;
    :attr:`last_checkpoint` is that directory, or ``None`` when the store holds no step yet
    (``resume_from_checkpoint=callback.last_checkpoint`` then serves the first run too).
    ``resume=<step>`` puts that step there instead, and with ``rollback=True`` makes it the
    newest first (see :func:`resume_from_store`).

    Args:
        root: where the steps go: a URL, a path or an open Store.
        resume: put the store's newest step (``True``) or this step (an int) in
            ``output_dir`` when the Trainer is built.
        rollback: with ``resume=<step>``: set the newer steps aside, so training saves them
            again.
        preemption: on this signal (``True``: SIGTERM; or signal numbers), save at the end
            of the current step, upload it, and raise ``Preempted`` from ``train()``.
            Installed for each ``train()``, which must run in the main thread.
        save_before: the same once less time is left before this wall-clock limit (seconds
            since the epoch, or an aware ``datetime``) than twice the longest save so far.
        store_options: store options, as on every face.

    Raises:
        ValueError: ``rollback`` without a step to go back to.
    """

    def __init__(
        self,
        root: Root,
        *,
        resume: bool | int = False,
        rollback: bool = False,
        preemption: bool | int | Iterable[int] = False,
        save_before: float | datetime.datetime | None = None,
        **store_options: Any,
    ) -> None:
        if rollback and (resume is True or resume is False):
            raise ValueError(
                "rollback=True needs the step to go back to: StoreCallback(url, resume=<step>, "
                "rollback=True)"
            )
        PreemptionWatch.check(signals_of(preemption), save_before)  # installed by train()
        self._preemption, self._save_before = preemption, save_before
        self._watch: PreemptionWatch | None = None
        #: the step saved on a notice, and the notice
        self._preempted: tuple[int, Notice] | None = None
        self._save_began: float | None = None
        self._save_seconds: list[float] = []
        self.mirror = TreeMirror(root, resume_advice=_RESUME_ADVICE, **store_options)
        self.root = root
        self.resume = resume
        self.rollback = rollback
        self._options = store_options
        #: With ``resume=True``: the local copy of the newest step, once the Trainer is built.
        self.last_checkpoint: str | None = None

    def on_init_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        if self.resume is False:
            return
        step = None if self.resume is True else self.resume
        self.last_checkpoint = resume_from_store(
            self.root, args.output_dir or ".", step=step, rollback=self.rollback, **self._options
        )
        if self.rollback and step is not None:
            self.mirror.rolled_back(step)

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        self._watch = watch(self._preemption, self._save_before)
        self._preempted = None
        # resumed from a checkpoint only this node holds (killed before its upload): upload it
        step = state.global_step
        directory = Path(args.output_dir or ".") / f"{PREFIX_CHECKPOINT_DIR}-{step}"
        if step > 0 and state.is_world_process_zero and directory.is_dir():
            self.mirror.adopt(directory, step, metadata={"library": "transformers"})

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        if self._watch is not None and self._preempted is None:
            notice = self._watch.notice(save_margin(self._save_seconds))
            if _anywhere(notice is not None):  # the last step: saved, then training stops
                control.should_save = True
                control.should_training_stop = True
                self._preempted = (state.global_step, notice or notice_elsewhere(self._preemption))
        # the Trainer is about to write checkpoint-<global_step>: refuse an old step before
        # it writes anything (on_save would refuse it only after)
        if control.should_save:
            self._save_began = time.monotonic()
            if state.is_world_process_zero:
                self.mirror.check_step(state.global_step)

    def on_save(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        if self._save_began is not None:
            self._save_seconds.append(time.monotonic() - self._save_began)
            self._save_began = None
        if state.is_world_process_zero:
            step = state.global_step
            directory = Path(args.output_dir or ".") / f"{PREFIX_CHECKPOINT_DIR}-{step}"
            self.mirror.submit(directory, step, metadata={"library": "transformers"})

    def on_train_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        try:
            self.mirror.wait()
        finally:
            if self._watch is not None:
                self._watch.close()
                self._watch = None
        if self._preempted is not None:
            stop(*self._preempted, self.mirror.where)

    def wait_until_finished(self) -> None:
        """Block until every checkpoint saved so far is committed in the store."""
        self.mirror.wait()


def _anywhere(flag: bool) -> bool:
    """Whether ``flag`` holds on any process of the run (one all-reduce under several): a
    signal reaches the processes at slightly different times, and a process that saved a
    step the others did not would wait for them in the Trainer's collectives."""
    processes = PartialState()
    if processes.num_processes == 1:
        return flag
    import torch
    import torch.distributed as dist

    told = torch.tensor(int(flag), device=processes.device)
    dist.all_reduce(told, op=dist.ReduceOp.MAX)
    return bool(told.item())


_RESUME_ADVICE = (
    "To resume that run, StoreCallback(url, resume=True) and "
    "trainer.train(resume_from_checkpoint=True) continue from its newest step; to go back to "
    "an older step and train on from it, StoreCallback(url, resume=<step>, rollback=True) "
    "sets the newer steps aside"
)


def resume_from_store(
    root: Root,
    local_dir: str | os.PathLike[str],
    *,
    step: int | None = None,
    rollback: bool = False,
    **store_options: Any,
) -> str | None:
    """Download a committed checkpoint for ``Trainer.train(resume_from_checkpoint=...)``.

    Call it on every process (the main one downloads, the others wait for it).

    Args:
        root: where :class:`StoreCallback` uploaded the steps.
        local_dir: where to put it (the Trainer's ``output_dir`` is the natural choice); the
            step becomes ``local_dir/checkpoint-<step>``. A copy already there that holds
            the step exactly (a restart on the same node) is reused; anything else there is
            moved aside, never overwritten, and the step downloaded
            (:func:`~ckptstore.integrations.files.local_copy`).
        step: the step (``None``: the newest committed one).
        rollback: make ``step`` the newest, so training can save the steps after it again:
            the newer steps are set aside in the store (recoverable with
            :func:`ckptstore.recover_step` until gc removes them) and the newer
            ``checkpoint-N`` directories in ``local_dir`` are moved to
            ``local_dir/.ckptstore-replaced``, so neither the Trainer's
            ``resume_from_checkpoint=True`` nor its rotation takes them for this run's.
        store_options: store options, as on every face.

    Returns:
        The local checkpoint directory, or ``None`` when the store holds no step yet (which
        ``resume_from_checkpoint`` takes as "start from scratch").

    Raises:
        ValueError: ``rollback`` without ``step``.
        NotFoundError: ``step`` is not committed (nothing is set aside or moved).
        CorruptCheckpointError: a byte fails verification (nothing is left locally).
    """
    if rollback and step is None:
        raise ValueError("rollback=True needs the step to go back to (step=...)")
    with opened(root, store_options) as store:
        if step is None:
            step = background.run(latest_step(store))
            if step is None:
                return None
        target = Path(local_dir) / f"{PREFIX_CHECKPOINT_DIR}-{step}"
        # Under several processes the main one downloads and the others wait for it: the
        # Trainer has every process read the same resume_from_checkpoint directory.
        processes = PartialState()
        if processes.is_main_process:
            if rollback:
                roll_back(
                    store, step, newer_copies=numbered_after(local_dir, f"{PREFIX_CHECKPOINT_DIR}-")
                )
            local_copy(store, target, step=step)
        processes.wait_for_everyone()
        return str(target)
