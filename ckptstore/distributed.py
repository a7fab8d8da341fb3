"""The import path ``ckptstore.distributed``, kept for scripts that use it.

The modules are :mod:`ckptstore.manager.distributed` (``save``, ``load``, the collectives)
and :mod:`ckptstore.manager.distributed_manager` (the multi-rank ``CheckpointManager``).
"""

from __future__ import annotations

from ckptstore.manager.distributed import Collectives, LocalGroup, TorchCollectives, load, save
from ckptstore.manager.distributed_manager import CheckpointManager

__all__ = ["CheckpointManager", "Collectives", "LocalGroup", "TorchCollectives", "load", "save"]
