"""The training-loop faces: what a training script calls to save and restore.

* :mod:`~ckptstore.manager.functions`: ``ckptstore.save``/``load`` and friends, one call per
  checkpoint of a run root.
* :mod:`~ckptstore.manager.checkpoint_manager`: :class:`CheckpointManager`, which decides when
  to save, saves asynchronously, applies retention and restores.
* :mod:`~ckptstore.manager.async_save`: the save handle and the one-save-in-flight rule the
  manager's async saves run under.
* :mod:`~ckptstore.manager.snapshot`: the fence of lazy snapshots (the optimizer step hook,
  ``fence()``).
* :mod:`~ckptstore.manager.distributed`: one checkpoint saved by many ranks, committed once.
* :mod:`~ckptstore.manager.distributed_manager`: the multi-rank ``CheckpointManager``, whose
  saves return after the copy and finish in the background, on a process group of its own.
* :mod:`~ckptstore.manager.tiers`: a manager's local tier, the background copy of chosen
  steps to the persistent tier, and restore from the nearest copy that verifies.

Each face is a thin caller of the save and restore paths below it (``stage/``, ``layout/``);
it keeps only what is its own: scheduling and retention, the handle, the collectives.
"""

from __future__ import annotations

from ckptstore.manager.async_save import SaveHandle, SaveTiming
from ckptstore.manager.checkpoint_manager import CheckpointManager
from ckptstore.manager.tiers import RestoreInfo, TierListing

__all__ = ["CheckpointManager", "RestoreInfo", "SaveHandle", "SaveTiming", "TierListing"]
