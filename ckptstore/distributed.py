"""The import path ``ckptstore.distributed``, kept for scripts that use it.

The modules are :mod:`ckptstore.manager.distributed` (``save``, ``load``, the collectives),
:mod:`ckptstore.manager.jax_collectives` (the collectives of a ``jax.distributed`` job) and
:mod:`ckptstore.manager.distributed_manager` (the multi-rank ``CheckpointManager``).
"""

from __future__ import annotations

from ckptstore.manager.distributed import Collectives, LocalGroup, TorchCollectives, load, save
from ckptstore.manager.distributed_manager import CheckpointManager
from ckptstore.manager.jax_collectives import JaxCollectives
from ckptstore.pipeline.sharding import Shard

__all__ = [
    "CheckpointManager",
    "Collectives",
    "JaxCollectives",
    "LocalGroup",
    "Shard",
    "TorchCollectives",
    "load",
    "save",
]
