"""ckptstore underneath the checkpoint libraries people already use.

* :mod:`ckptstore.integrations.dcp`: ``torch.distributed.checkpoint`` StorageWriter/Reader.
* :mod:`ckptstore.integrations.lightning`: a Lightning ``CheckpointIO``.
* :mod:`ckptstore.integrations.files` (also ``ckptstore.files``): any checkpoint directory as
  one committed step, and back; the base of the three below, which upload each checkpoint
  their library writes in the background:
* :mod:`ckptstore.integrations.transformers`: a Hugging Face ``TrainerCallback``, and
  ``resume_from_store`` for ``resume_from_checkpoint``.
* :mod:`ckptstore.integrations.accelerate`: ``save_state``/``load_state`` around a local directory.
* :mod:`ckptstore.integrations.orbax`: an Orbax ``CheckpointManager`` mirrored to any URL.

Each module imports its framework on import (``files`` imports none); ``import ckptstore``
imports none of them.
"""
