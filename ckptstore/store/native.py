"""The compiled module, ``ckptstore.store._gather``, loaded in one place.

It is built by ``pip install`` where a C compiler is present (``setup.py``) and holds the pack
kernel (:mod:`ckptstore.store.checksum`) and the staging copy (:mod:`ckptstore.store.buffers`).
Each of those falls back to a Python loop where :data:`compiled` is ``None``: not built, or
turned off with ``CKPTSTORE_NATIVE=0`` (the tests run both ways).
"""

from __future__ import annotations

import os

__all__ = ["compiled", "wanted"]


def wanted() -> bool:
    """Whether ``CKPTSTORE_NATIVE`` (``1``, the default, or ``0``) lets ckptstore use its
    compiled module where it is built.

    Raises:
        ValueError: the variable holds something else.
    """
    value = os.environ.get("CKPTSTORE_NATIVE", "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"environment variable CKPTSTORE_NATIVE: expected 0 or 1, got {value!r}")
    return value == "1"


try:
    from ckptstore.store import _gather as compiled
except ImportError:  # not built (no compiler at install time)
    compiled = None  # type: ignore[assignment]
if not wanted():
    compiled = None  # type: ignore[assignment]
# ``compiled``: ``ckptstore.store._gather`` where it is built and wanted, else ``None``. Each
# user checks for the functions it needs as well: a module built by an older install may lack
# them.
