"""``ckptstore.dcp.Writer`` and ``ckptstore.dcp.Reader``: any ckptstore URL as the storage of
``torch.distributed.checkpoint``. Importing this module imports torch; ``import ckptstore``
does not. See :mod:`ckptstore.integrations.dcp`."""

from ckptstore.integrations.dcp import Reader, Writer

__all__ = ["Reader", "Writer"]
