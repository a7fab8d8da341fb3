"""Tensors as store objects, shared by the DCP and Lightning integrations.

* :func:`host_bytes` and :func:`host_array` give a tensor's memory as numpy, without a copy
  where the tensor is already a contiguous CPU tensor, with the dtype of the one torch<->numpy
  table (:func:`ckptstore.stage.torch.dtype_table`), so the integrations store exactly the
  dtypes the manager does. Their bytes are packed, written and committed by the one save
  pipeline (:mod:`ckptstore.pipeline.save`).
* :class:`StoreHandle` holds a URL and opens its store on first use; it pickles without the
  open store, so an integration object can be sent to another process.
* :class:`CheckpointTarget` maps a DCP or Lightning path onto a checkpoint root and a step.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

from ckptstore import background
from ckptstore.errors import CorruptCheckpointError
from ckptstore.pipeline.steps import check_step, parse_step
from ckptstore.pipeline.tensors import numpy_dtype
from ckptstore.pipeline.tensors import torch_dtype as _torch_dtype
from ckptstore.store.base import Store
from ckptstore.store.registry import open_store, registered_schemes

__all__ = [
    "CheckpointTarget",
    "StoreHandle",
    "host_array",
    "host_bytes",
    "numpy_dtype",
    "served",
    "torch_dtype",
]


def host_bytes(tensor: torch.Tensor) -> tuple[torch.Tensor, NDArray[np.uint8]]:
    """A CPU, contiguous version of ``tensor`` (the same tensor if it already is one) and a
    flat ``uint8`` view of its memory; the tensor owns that memory, so keep it alive."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    tensor = tensor.resolve_conj().resolve_neg().contiguous()
    if tensor.numel() == 0:
        return tensor, np.empty(0, np.uint8)
    return tensor, tensor.reshape(-1).view(torch.uint8).numpy()


def host_array(tensor: torch.Tensor) -> NDArray[Any]:
    """``tensor``'s values as a numpy array of the table's dtype (bfloat16, float8 and
    complex32 included), sharing the memory of a contiguous CPU tensor.

    Raises:
        TypeError: a dtype outside the table.
    """
    dtype = numpy_dtype(tensor.dtype)
    kept, raw = host_bytes(tensor)
    return raw.view(dtype).reshape(tuple(kept.shape))


def torch_dtype(dtype: np.dtype[Any], where: str) -> torch.dtype:
    """The torch dtype of a stored leaf's numpy dtype, or CorruptCheckpointError naming
    ``where``: a checkpoint written by these integrations holds only the table's dtypes."""
    try:
        return _torch_dtype(dtype)
    except TypeError:
        raise CorruptCheckpointError(f"{where}: dtype {dtype} has no torch equivalent") from None


def served(url: str | os.PathLike[str]) -> bool:
    """Whether a ckptstore backend serves ``url``'s scheme (without importing it)."""
    text = os.fspath(url)
    if not isinstance(text, str) or not text:
        return False
    scheme = text.split("://", 1)[0].lower() if "://" in text else "file"
    return scheme in registered_schemes()


class StoreHandle:
    """A URL, its store options, and the store opened on first use; pickles without the
    store, which the unpickled copy reopens by URL."""

    def __init__(self, url: str | os.PathLike[str] | Store, options: dict[str, Any]) -> None:
        if isinstance(url, Store):
            if options:
                raise TypeError("store options cannot be given with an open Store")
            self.url, self.options = url.url, options
            self._store: Store | None = url
            self._owned = False
            return
        self.url = os.fspath(url)
        self.options = options
        self._store = None
        self._owned = True

    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = open_store(self.url, **self.options)
        return self._store

    def reopen(self, url: str | os.PathLike[str]) -> None:
        """Point at ``url``, closing the store if it was open on another one."""
        new = os.fspath(url)
        if new != self.url:
            self.close()
            self.url = new

    def close(self) -> None:
        """Close the store, also one the caller passed in."""
        if self._store is not None:
            store, self._store = self._store, None
            self._owned = True  # reopened by URL from now on
            background.run(store.close())

    def release(self) -> None:
        """Close the store if this handle opened it (a caller's Store stays open); the next
        use reopens it. Called at the end of each save or load, so no client outlives it."""
        if self._owned:
            self.close()

    async def arelease(self) -> None:
        """:meth:`release`, from a coroutine on the background loop."""
        if self._owned and self._store is not None:
            store, self._store = self._store, None
            await store.close()

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "options": self.options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.url = state["url"]
        self.options = state["options"]
        self._store = None
        self._owned = True


class CheckpointTarget:
    """Where one DCP checkpoint lives: a run root (URL or Store) and a step under it.

    A URL whose last segment is a step number (``s3://b/run/100``) is step 100 of the root
    ``s3://b/run``, exactly as :func:`ckptstore.save` would store it; any other URL is the root
    of a checkpoint stored as step 0, unless ``step`` is given. Pickles without its store.
    """

    def __init__(
        self, target: str | os.PathLike[str] | Store, step: int | None, options: dict[str, Any]
    ) -> None:
        if isinstance(target, Store):
            self.url = f"{target.url}/{step or 0}"
            self.handle = StoreHandle(target, options)
            self.step = check_step(step or 0)
            return
        self.options = options
        self.url = os.fspath(target)
        root, self.step = _split(self.url, step)
        self.handle = StoreHandle(root, options)

    @property
    def store(self) -> Store:
        return self.handle.store

    def point_at(self, checkpoint_id: str | os.PathLike[str]) -> None:
        """Follow a ``checkpoint_id`` that DCP passes to ``reset``."""
        url = os.fspath(checkpoint_id)
        if url == self.url:
            return
        root, self.step = _split(url, None)
        self.url = url
        self.handle.reopen(root)


def _split(url: str, step: int | None) -> tuple[str, int]:
    """The root and step of a checkpoint URL. The step is the last segment of the path, never
    of a query (``s3://b/run/3?endpoint_url=http://host:9000`` is step 3 of ``s3://b/run``
    with the same query)."""
    if step is not None:
        return url, check_step(step)
    path, mark, query = url.partition("?")
    trimmed = path.rstrip("/")
    parent, _, last = trimmed.rpartition("/")
    number = parse_step(last)
    if number is None or not parent or parent.endswith(":/") or parent.endswith(":"):
        return url, 0
    return parent + mark + query, number
