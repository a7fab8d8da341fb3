"""The import path ``ckptstore.distributed``, kept for scripts that use it.

The module is :mod:`ckptstore.manager.distributed`.
"""

from __future__ import annotations

from ckptstore.manager.distributed import Collectives, LocalGroup, TorchCollectives, load, save
from ckptstore.manager.distributed_manager import CheckpointManager

__all__ = ["CheckpointManager", "Collectives", "LocalGroup", "TorchCollectives", "load", "save"]
