"""ckptstore: fast, safe ML training checkpoints on local disk, NFS, S3 and GCS.

Importing ckptstore imports no heavy dependency: torch, JAX and the cloud clients are imported
by the modules that need them, on first use.
"""

import logging

from ckptstore.config import Settings, default_settings
from ckptstore.errors import (
    AlreadyExistsError,
    BucketNotFoundError,
    CheckpointFormatError,
    CkptStoreError,
    CommitConflictError,
    CorruptCheckpointError,
    DeadlineExceededError,
    InvalidKeyError,
    InvalidRangeError,
    InvalidURLError,
    MissingDependencyError,
    NotFoundError,
    NotSupportedError,
    StoreError,
    TornSnapshotError,
    UnsupportedTreeError,
)
from ckptstore.integrations.safetensors import (
    ExportInfo,
    aexport_safetensors,
    export_safetensors,
)
from ckptstore.manager.checkpoint_manager import CheckpointManager
from ckptstore.manager.functions import (
    CommitInfo,
    GCReport,
    adelete_step,
    agc,
    alist_steps,
    aload,
    aread_manifest,
    arecover_step,
    arollback,
    asave,
    delete_step,
    gc,
    list_steps,
    load,
    read_manifest,
    recover_step,
    rollback,
    save,
)
from ckptstore.pipeline.codec import UnsupportedLeafError
from ckptstore.pipeline.steps import Manifest
from ckptstore.pipeline.streaming import Pending, fence
from ckptstore.store import ObjectMeta, Store, open_store, register_backend

__version__ = "0.1.0"

# ckptstore says what it did on its loggers (docs/reference.md, "Logging"); an application
# that configures none sees nothing, not even logging's last-resort output.
logging.getLogger("ckptstore").addHandler(logging.NullHandler())

__all__ = [
    "AlreadyExistsError",
    "CheckpointManager",
    "CommitInfo",
    "ExportInfo",
    "GCReport",
    "Manifest",
    "Pending",
    "UnsupportedLeafError",
    "adelete_step",
    "aexport_safetensors",
    "agc",
    "alist_steps",
    "aload",
    "aread_manifest",
    "arecover_step",
    "arollback",
    "asave",
    "delete_step",
    "fence",
    "export_safetensors",
    "gc",
    "list_steps",
    "load",
    "read_manifest",
    "recover_step",
    "rollback",
    "save",
    "BucketNotFoundError",
    "CheckpointFormatError",
    "CkptStoreError",
    "CommitConflictError",
    "CorruptCheckpointError",
    "DeadlineExceededError",
    "InvalidKeyError",
    "InvalidRangeError",
    "InvalidURLError",
    "MissingDependencyError",
    "NotFoundError",
    "NotSupportedError",
    "ObjectMeta",
    "Settings",
    "Store",
    "StoreError",
    "TornSnapshotError",
    "UnsupportedTreeError",
    "__version__",
    "default_settings",
    "open_store",
    "register_backend",
]
