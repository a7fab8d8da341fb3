"""Hugging Face ``Trainer`` checkpoints on any ckptstore URL.

The Trainer keeps writing its checkpoints where it always does (``output_dir/checkpoint-N``,
local and fast); :class:`StoreCallback` uploads each one, once the Trainer has finished
writing it, as step ``N`` of a ckptstore root, in the background, with ckptstore's commit:
on S3 or GCS a step is visible only once every file of it is there and checksummed. To
resume, :func:`resume_from_store` downloads a committed step into a local directory,
verified, and returns the path the Trainer's ``resume_from_checkpoint`` takes::

    from ckptstore.integrations.transformers import StoreCallback, resume_from_store

    trainer = Trainer(..., callbacks=[StoreCallback("s3://bucket/run")])
    trainer.train(resume_from_checkpoint=resume_from_store("s3://bucket/run", args.output_dir))

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

    Args:
        root: where the steps go: a URL, a path or an open Store.
        store_options: store options, as on every face.
    """

    def __init__(self, root: Root, **store_options: Any) -> None:
        self.mirror = TreeMirror(root, **store_options)

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
