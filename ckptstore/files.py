"""``ckptstore.files``: any checkpoint directory (Hugging Face, Accelerate, Orbax, DeepSpeed)
as one committed ckptstore step, and back. See :mod:`ckptstore.integrations.files`."""

from ckptstore.integrations.files import (
    FORMAT,
    TreeInfo,
    TreeMirror,
    adownload,
    aupload,
    download,
    is_tree_step,
    upload,
)

__all__ = [
    "FORMAT",
    "TreeInfo",
    "TreeMirror",
    "adownload",
    "aupload",
    "download",
    "is_tree_step",
    "upload",
]
