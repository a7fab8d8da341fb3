"""The import path ``ckptstore.distributed``, kept for scripts that use it.

The module is :mod:`ckptstore.manager.distributed`.
"""

from __future__ import annotations

from ckptstore.manager.distributed import Collectives, LocalGroup, TorchCollectives, load, save
from ckptstore.stage.shards import Shard

__all__ = ["Collectives", "LocalGroup", "Shard", "TorchCollectives", "load", "save"]
