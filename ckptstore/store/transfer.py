"""Copy objects from one store to another, streaming, in parallel parts.

:func:`copy_object` never holds a whole large object in memory: it reads one part-sized range
of the source into a buffer of the process-wide pool (:data:`~ckptstore.store.buffers.host_buffers`)
and uploads that buffer as one part of a multipart upload at the destination, with up to
``max_concurrency`` parts in flight (so at most that many buffers of ``part_size`` bytes are
lent at once, and the next copy reuses them). Any failure aborts the upload, so nothing
half-copied becomes visible.

The crc32c of the bytes copied is computed on the way, part by part, and the parts' checksums
are combined (:func:`~ckptstore.store.checksum.crc32c_combine`), so a caller can check the
copy against a recorded checksum without reading anything twice. Each piece is hashed once:
as it arrives from a source that hashes while reading (S3, GCS), then handed to the
destination's put; else by the destination for its request where it sends a checksum with
each body (S3, GCS); else after the read.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ckptstore.store.base import PutMode, Store
from ckptstore.store.buffers import host_buffers
from ckptstore.store.checksum import crc32c_combine
from ckptstore.store.fanout import gather_all

__all__ = ["copy_object"]


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

    Objects below ``dst.settings.transport.multipart_threshold`` (or any object, if ``dst`` has no
    multipart upload) are read whole and written with one put. Larger ones stream in
    ``dst.part_size_for(size)`` parts, ``dst.settings.transport.max_concurrency`` at a time.

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
    if size == 0 or not caps.multipart or size < dst.settings.transport.multipart_threshold:
        pooled = host_buffers.acquire(size)
        try:
            buf = memoryview(pooled.data)[:size]  # type: ignore[arg-type]
            if not size:
                await src.head(key)  # a missing source is an error, even when empty
                crc = await dst.put_crc32c(target, buf, mode=mode)
            elif src.hashes_while_reading:
                crc = await src.read_into_crc32c(key, 0, buf)
                await dst.put(target, buf, mode=mode, crc32c=crc)
            else:
                await src.read_into(key, 0, buf)
                crc = await dst.put_crc32c(target, buf, mode=mode)
        except BaseException:
            pooled.discard()  # a cancelled local read's thread may still fill it
            raise
        finally:
            pooled.release()
        if progress is not None:
            progress(size)
        return crc

    part = dst.part_size_for(size)
    count = -(-size // part)
    slots = asyncio.Semaphore(min(dst.settings.transport.max_concurrency, count))
    crcs: list[int] = [0] * count

    upload = await dst.create_multipart(target, mode=mode, part_size=part)
    async with upload:

        async def copy_part(index: int) -> None:
            start = index * part
            length = min(part, size - start)
            async with slots:
                buf = host_buffers.acquire(part)
                try:
                    view = memoryview(buf.data)[:length]  # type: ignore[arg-type]
                    if src.hashes_while_reading:
                        crcs[index] = await src.read_into_crc32c(key, start, view)
                        await upload.put_part(index, view, crc32c=crcs[index])
                    else:
                        await src.read_into(key, start, view)
                        crcs[index] = await upload.put_part_crc32c(index, view)
                except BaseException:
                    buf.discard()  # a cancelled local read's thread may still fill it
                    raise
                finally:
                    buf.release()
            if progress is not None:
                progress(length)

        await gather_all(copy_part(i) for i in range(count))
        await upload.complete()

    crc = crcs[0]
    for index in range(1, count):
        crc = crc32c_combine(crc, crcs[index], min(part, size - index * part))
    return crc
