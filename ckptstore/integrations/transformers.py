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

(:func:`resume_from_store` does the same for a step of your choice.)

Only the main process (``state.is_world_process_zero``) uploads, so under several processes
the checkpoint directory it sees must be complete (one node, or a shared filesystem), as
the Trainer's own rotation already assumes. Importing this module imports transformers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from accelerate import PartialState
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ckptstore import background
from ckptstore.integrations.files import TreeMirror, local_copy
from ckptstore.layout.commit import latest_step
from ckptstore.pipeline.root import Root, opened

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

    Args:
        root: where the steps go: a URL, a path or an open Store.
        resume: put the store's newest step in ``output_dir`` when the Trainer is built.
        store_options: store options, as on every face.
    """

    def __init__(self, root: Root, *, resume: bool = False, **store_options: Any) -> None:
        self.mirror = TreeMirror(root, **store_options)
        self.root = root
        self.resume = resume
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
        if self.resume:
            self.last_checkpoint = resume_from_store(
                self.root, args.output_dir or ".", **self._options
            )

    def on_save(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
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
        self.mirror.wait()

    def wait_until_finished(self) -> None:
        """Block until every checkpoint saved so far is committed in the store."""
        self.mirror.wait()


def resume_from_store(
    root: Root,
    local_dir: str | os.PathLike[str],
    *,
    step: int | None = None,
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
        store_options: store options, as on every face.

    Returns:
        The local checkpoint directory, or ``None`` when the store holds no step yet (which
        ``resume_from_checkpoint`` takes as "start from scratch").

    Raises:
        CorruptCheckpointError: a byte fails verification (nothing is left locally).
    """
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
            local_copy(store, target, step=step)
        processes.wait_for_everyone()
        return str(target)
