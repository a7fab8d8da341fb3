"""ckptstore underneath the checkpoint libraries people already use.

* :mod:`ckptstore.integrations.dcp`: ``torch.distributed.checkpoint`` StorageWriter/Reader.
* :mod:`ckptstore.integrations.lightning`: a Lightning ``CheckpointIO``.

Each module imports its framework on import; ``import ckptstore`` imports none of them.
"""
