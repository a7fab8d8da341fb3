"""The dtypes a checkpoint may hold, and their names in a manifest.

The manifest names a dtype by a string from a fixed allow-list, never by anything a reader
would have to evaluate or unpickle. numpy's own numeric dtypes use ``dtype.str``, which keeps
the byte order (``"<f4"``, ``">i8"``, ``"|b1"``), so big-endian arrays round-trip as they
are. The ml_dtypes extension types (bfloat16, the float8/float6/float4 families, int4...)
have no meaningful ``dtype.str`` (``"<V2"``) and are named by ``dtype.name``; they exist in
native byte order only.
"""

from __future__ import annotations

import numpy as np

__all__ = ["dtype_from_name", "dtype_name", "known_dtype_names"]

# Every numpy numeric type code: bool, signed and unsigned ints, floats, complex, including
# float16 and the platform's long double.
_NUMPY_CODES = "?bBhHiIlLqQefdgFDG"
# numpy numbers user-registered dtypes (ml_dtypes' among them) from this value up.
_USER_DTYPE_NUM = 256


def _build() -> tuple[dict[str, np.dtype[np.generic]], dict[np.dtype[np.generic], str]]:
    by_name: dict[str, np.dtype[np.generic]] = {}
    for code in _NUMPY_CODES:
        for order in ("<", ">"):
            dt = np.dtype(code).newbyteorder(order)
            by_name.setdefault(dt.str, dt)  # "l" before "q": int64, not longlong
    extension: dict[np.dtype[np.generic], str] = {}
    try:
        import ml_dtypes
    except ImportError:  # pragma: no cover - ml_dtypes is a hard dependency
        return by_name, extension
    for attr in dir(ml_dtypes):
        candidate = getattr(ml_dtypes, attr)
        if not isinstance(candidate, type) or not issubclass(candidate, np.generic):
            continue
        dt = np.dtype(candidate)
        if dt.num < _USER_DTYPE_NUM:  # a numpy builtin re-exported, not an extension type
            continue
        by_name[dt.name] = dt
        extension[dt] = dt.name
    return by_name, extension


_BY_NAME, _EXTENSION = _build()


def dtype_name(dtype: np.dtype[np.generic]) -> str | None:
    """The manifest name of ``dtype``, or ``None`` if checkpoints cannot hold it."""
    if dtype.num >= _USER_DTYPE_NUM:
        return _EXTENSION.get(dtype)
    if dtype.kind in "biufc":
        name = dtype.str
        return name if name in _BY_NAME else None
    return None


def dtype_from_name(name: str) -> np.dtype[np.generic] | None:
    """The dtype a manifest name stands for, or ``None`` if the name is not allowed."""
    return _BY_NAME.get(name)


def known_dtype_names() -> frozenset[str]:
    """Every dtype name a manifest may carry."""
    return frozenset(_BY_NAME)
