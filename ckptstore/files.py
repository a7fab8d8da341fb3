"""``ckptstore.files``: any checkpoint directory (Hugging Face, Accelerate, Orbax, DeepSpeed)
as one committed ckptstore step, and back. See :mod:`ckptstore.integrations.files`."""

from ckptstore.integrations import files as _files
from ckptstore.integrations.files import *  # noqa: F403  (the public names, listed once)

__all__ = _files.__all__
