"""``ckptstore.lightning.StoreCheckpointIO``: any ckptstore URL as Lightning's checkpoint
storage, with ``checkpoints``, ``last_checkpoint``, ``roll_back`` and
``load_from_checkpoint``. Importing this module imports torch and lightning;
``import ckptstore`` does not. See :mod:`ckptstore.integrations.lightning`."""

from ckptstore.integrations.lightning import *  # noqa: F403 (the names of its __all__)
from ckptstore.integrations.lightning import __all__ as __all__
