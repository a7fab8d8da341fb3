"""``ckptstore.lightning.StoreCheckpointIO``: any ckptstore URL as Lightning's checkpoint
storage. Importing this module imports torch and lightning; ``import ckptstore`` does not.
See :mod:`ckptstore.integrations.lightning`."""

from ckptstore.integrations.lightning import (
    StoreCheckpointIO,
    last_checkpoint,
    load_from_checkpoint,
)

__all__ = ["StoreCheckpointIO", "last_checkpoint", "load_from_checkpoint"]
