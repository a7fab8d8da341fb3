"""Staging numpy arrays (and numpy scalars) to host buffers.

A numpy array is already in host memory, but the training loop may change it after ``save``
returns, so an async save copies it like any other leaf; a synchronous save may let it through
uncopied (``Stager.stage(copy=False)``).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ckptstore.stage.stager import ArrayKind, CopyTask, LeafSpec, contiguous_chunks

__all__ = ["NumpyKind", "check_dtype"]


def check_dtype(dtype: np.dtype[Any]) -> None:
    """Raise ``TypeError`` unless ``dtype``'s bytes are its values: numbers, bools, and the
    ``ml_dtypes`` types (bfloat16, float8, int4...); not objects, strings or records."""
    if dtype.kind in "biufc":
        return
    if dtype.fields is None and not dtype.hasobject and dtype.type.__module__ == "ml_dtypes":
        return
    raise TypeError(f"numpy dtype {dtype} cannot be stored as raw bytes")


def _copy(dst: NDArray[Any], src: NDArray[Any]) -> None:
    np.copyto(dst, src, casting="no")


class NumpyKind(ArrayKind):
    """numpy ``ndarray`` and scalar leaves."""

    name = "numpy"

    def owns(self, leaf: Any) -> bool:
        return isinstance(leaf, np.ndarray | np.generic)

    def spec(self, leaf: Any) -> LeafSpec:
        if type(leaf) is np.ndarray:
            # The common leaf, on a path that runs for every leaf of every save. No attrs:
            # restore takes a leaf without a framework for numpy, and {"framework": "numpy"}
            # on each of 20,000 small leaves cost about a microsecond a leaf to encode, and as
            # much again to parse, check and dispatch on load.
            check_dtype(leaf.dtype)
            return LeafSpec(leaf.dtype, leaf.shape, None)
        array = np.asarray(leaf)
        check_dtype(array.dtype)
        attrs: dict[str, Any] = {"framework": self.name}
        if isinstance(leaf, np.generic):
            attrs["scalar"] = True
        return LeafSpec(array.dtype, array.shape, attrs)

    def copies(self, leaf: Any, dst: NDArray[Any], chunk_bytes: int) -> list[CopyTask]:
        src = np.asarray(leaf)
        if not src.flags.c_contiguous or src.ndim == 0:
            return [(src.nbytes, functools.partial(_copy, dst, src))]
        flat_src, flat_dst = src.reshape(-1), dst.reshape(-1)
        tasks: list[CopyTask] = []
        for start, stop in contiguous_chunks(src.nbytes, src.itemsize, chunk_bytes):
            a, b = flat_src[start:stop], flat_dst[start:stop]
            tasks.append((a.nbytes, functools.partial(_copy, b, a)))
        return tasks

    def host_address(self, leaf: Any) -> int | None:
        # docstring inherited; asked about arrays of extension dtypes (bfloat16, which export no
        # buffer) and of ndarray's subclasses
        if isinstance(leaf, np.ndarray) and leaf.flags.c_contiguous:
            return int(leaf.ctypes.data)
        return None

    def host_view(self, leaf: Any) -> NDArray[Any] | None:
        # Not np.ascontiguousarray: it turns a 0-d array into shape (1,).
        return np.asarray(leaf, order="C")

    def rebuild(self, array: NDArray[Any], attrs: dict[str, Any], like: Any | None) -> Any:
        if like is not None:
            like_array = np.asarray(like)
            if like_array.dtype != array.dtype:
                array = array.astype(like_array.dtype)
            if isinstance(like, np.generic):
                return array[()]
            return array
        if attrs.get("framework") == self.name and attrs.get("scalar"):
            return array[()]
        return array
