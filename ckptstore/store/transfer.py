"""Copy objects from one store to another, streaming, in parallel parts.

:func:`copy_object` never holds a whole large object in memory: it reads one part-sized range
of the source into a pooled buffer and uploads that buffer as one part of a multipart upload
at the destination, with up to ``max_concurrency`` parts in flight (so at most that many
buffers of ``part_size`` bytes exist). Any failure aborts the upload, so nothing half-copied
becomes visible.

The crc32c of the bytes copied is computed on the way, part by part, and the parts' checksums
are combined (:func:`~ckptstore.store.checksum.crc32c_combine`), so a caller can check the
copy against a recorded checksum without reading anything twice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ckptstore.store.base import PutMode, Store, gather_all
from ckptstore.store.checksum import acrc32c, crc32c_combine

__all__ = ["BufferPool", "copy_object"]


class BufferPool:
    """At most ``limit`` buffers of ``size`` bytes, made only when needed and reused.

    Callers ``acquire`` a buffer (waiting while all ``limit`` are in use) and ``release`` it;
    memory stays at ``limit * size`` however many pieces pass through, and a small job
    allocates only what it uses.
    """

    def __init__(self, size: int, limit: int) -> None:
        if size <= 0 or limit <= 0:
            raise ValueError(f"size and limit must be > 0, got {size} and {limit}")
        self.size = size
        self.limit = limit
        self.made = 0
        self._free: asyncio.Queue[bytearray] = asyncio.Queue()

    async def acquire(self) -> bytearray:
        if self._free.empty() and self.made < self.limit:
            self.made += 1
            return bytearray(self.size)
        return await self._free.get()

    def release(self, buf: bytearray) -> None:
        self._free.put_nowait(buf)


async def copy_object(
    src: Store,
    dst: Store,
    key: str,
    size: int,
    *,
    dst_key: str | None = None,
    mode: PutMode = "overwrite",
    progress: Callable[[int], None] | None = None,
) -> int:
    """Copy ``size`` bytes of ``key`` from ``src`` to ``dst_key`` (default ``key``) on ``dst``.

    Objects below ``dst.settings.multipart_threshold`` (or any object, if ``dst`` has no
    multipart upload) are read whole and written with one put. Larger ones stream in
    ``dst.part_size_for(size)`` parts, ``dst.settings.max_concurrency`` at a time.

    Args:
        src: the store to read from.
        dst: the store to write to.
        key: the object's key on ``src``.
        size: its length (from the manifest or ``head``); a source object shorter than this
            fails the copy.
        dst_key: the key on ``dst``.
        mode: ``"create"`` makes the destination write a put-if-absent.
        progress: called with the byte count of each piece copied.

    Returns:
        the crc32c of the bytes copied.
    """
    target = key if dst_key is None else dst_key
    caps = dst.capabilities
    if size == 0 or not caps.multipart or size < dst.settings.multipart_threshold:
        buf = bytearray(size)
        if size:
            await src.read_into(key, 0, buf)
        else:
            await src.head(key)  # a missing source is an error, even when empty
        crc = await acrc32c(buf)
        await dst.put(target, buf, mode=mode)
        if progress is not None:
            progress(size)
        return crc

    part = dst.part_size_for(size)
    count = -(-size // part)
    pool = BufferPool(part, min(dst.settings.max_concurrency, count))
    crcs: list[int] = [0] * count

    upload = await dst.create_multipart(target, mode=mode, part_size=part)
    async with upload:

        async def copy_part(index: int) -> None:
            start = index * part
            length = min(part, size - start)
            buf = await pool.acquire()
            try:
                view = memoryview(buf)[:length]
                await src.read_into(key, start, view)
                crcs[index] = await acrc32c(view)
                await upload.put_part(index, view)
            finally:
                pool.release(buf)
            if progress is not None:
                progress(length)

        await gather_all(copy_part(i) for i in range(count))
        await upload.complete()

    crc = crcs[0]
    for index in range(1, count):
        crc = crc32c_combine(crc, crcs[index], min(part, size - index * part))
    return crc
