"""crc32c of buffers, without copying them and without stalling the event loop.

The one place ckptstore hashes bytes: the backends (request checksums), the transfer and
maintenance code (copies) and the checkpoint layout (every object and leaf in a manifest) all
call it, so every layer hashes the same way and a fix lands everywhere.

google-crc32c takes numpy arrays (not memoryviews) without a copy, but holds the GIL while
it hashes anything that is not ``bytes``. So a large buffer is hashed in a worker thread in
slices of :data:`CHUNK` bytes, letting other Python threads (the event loop among them) run
between slices while the I/O threads, which release the GIL, keep writing.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import google_crc32c
import numpy as np

__all__ = ["CHUNK", "OFFLOAD_THRESHOLD", "acrc32c", "as_uint8", "crc32c", "crc32c_b64"]

#: Bytes hashed per call while the GIL is held.
CHUNK = 4 << 20
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
    view = as_uint8(data)
    size = len(view)
    if size <= CHUNK:
        return int(google_crc32c.extend(crc, view))
    for start in range(0, size, CHUNK):
        crc = google_crc32c.extend(crc, view[start : start + CHUNK])
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
