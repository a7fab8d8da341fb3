"""crc32c of buffers, without copying them and without stalling other threads.

The ``crc32c`` package hashes any contiguous buffer in place with the CPU's crc32 instruction
and releases the GIL while it hashes more than 32 KiB, so the training thread's Python keeps
running while a background save checksums a gigabyte. (google-crc32c, used before, holds the
GIL on anything but ``bytes``: with it hashing nonstop on the other core, a Python thread here
made 46-48% of its normal progress, against 78-100% with ``crc32c``.) Large buffers are
hashed in a worker thread by :func:`acrc32c` so the event loop keeps moving.

This is the one place ckptstore hashes bytes: the backends (request checksums), the transfer
and maintenance code (copies) and the checkpoint layout (every object and leaf in a manifest)
all call it, so every layer hashes the same way.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import crc32c as _crc32c
import numpy as np

__all__ = [
    "CHUNK",
    "OFFLOAD_THRESHOLD",
    "acrc32c",
    "as_uint8",
    "crc32c",
    "crc32c_b64",
    "crc32c_combine",
]

#: Bytes hashed per call (the GIL is released during each).
CHUNK = 64 << 20
#: Buffers at least this large are hashed in a worker thread by :func:`acrc32c`.
OFFLOAD_THRESHOLD = 1 << 20


def as_uint8(data: Any) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """A flat uint8 view of a contiguous buffer or array (no copy)."""
    if isinstance(data, np.ndarray):
        return data.reshape(-1).view(np.uint8)
    return np.frombuffer(data, dtype=np.uint8)


def crc32c(data: Any, crc: int = 0) -> int:
    """crc32c of a contiguous buffer (bytes, bytearray, memoryview, numpy array), or ``crc``
    extended over it (the crc32c of the earlier bytes followed by ``data``)."""
    view = memoryview(as_uint8(data))  # type: ignore[arg-type]  # ndarray is a Buffer
    for start in range(0, max(len(view), 1), CHUNK):
        crc = _crc32c.crc32c(view[start : start + CHUNK], crc)
    return int(crc)


def crc32c_b64(data: Any) -> str:
    """crc32c of ``data`` as object stores send it in headers: 4 big-endian bytes, base64."""
    return base64.b64encode(crc32c(data).to_bytes(4, "big")).decode("ascii")


async def acrc32c(data: Any) -> int:
    """:func:`crc32c`, in a worker thread when the buffer is large."""
    view = as_uint8(data)
    if len(view) < OFFLOAD_THRESHOLD:
        return crc32c(view)
    return await asyncio.to_thread(crc32c, view)


# The GF(2) polynomial arithmetic of zlib's crc32_combine, for the crc32c polynomial: the
# checksum of a whole from the checksums of its consecutive pieces, so pieces hashed in
# parallel (or as they arrive) need no second pass.
_POLY = 0x82F63B78  # crc32c (Castagnoli), bit-reflected


def _multmodp(a: int, b: int) -> int:
    """``a * b`` modulo the crc32c polynomial (bit-reflected representation)."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    table = [1 << 30]  # x^1
    for _ in range(31):
        table.append(_multmodp(table[-1], table[-1]))
    return table


_X2N = _x2n_table()


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """The crc32c of ``A + B`` from ``crc32c(A)``, ``crc32c(B)`` and ``len(B)``."""
    if len2 < 0:
        raise ValueError(f"length must be >= 0, got {len2}")
    p = 1 << 31  # x^0
    n, k = len2, 3  # x^(8 * len2): 8 bits per byte
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2
