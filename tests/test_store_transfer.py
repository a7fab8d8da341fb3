"""Streaming copies between stores, and the crc32c combination they rely on."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import google_crc32c
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptstore.errors import AlreadyExistsError, NotFoundError, StoreError
from ckptstore.store import open_store
from ckptstore.store.base import Store
from ckptstore.store.buffers import host_buffers
from ckptstore.store.checksum import crc32c, crc32c_combine
from ckptstore.store.memory import MemoryStore
from ckptstore.store.transfer import copy_object
from ckptstore.store.wrappers import CountingStore, Fault, FaultStore, StoreWrapper


@given(st.binary(max_size=2000), st.binary(max_size=2000))
def test_combine_equals_crc_of_concatenation(a: bytes, b: bytes) -> None:
    combined = crc32c_combine(crc32c(a), crc32c(b), len(b))
    assert combined == google_crc32c.value(a + b)


def test_combine_of_large_lengths() -> None:
    a, b = os.urandom(100), bytes(5 << 20)
    assert crc32c_combine(crc32c(a), crc32c(b), len(b)) == google_crc32c.value(a + b)


def test_digests_equal_the_two_hashes_of_the_whole_buffer() -> None:
    """One pass, block by block, gives what each hash gives of the whole bytes: at the block
    edges, for a dtype without a buffer format (bfloat16), and through leaf_digests for a
    strided leaf (its C-order bytes, as it is written)."""
    import ml_dtypes
    import numpy as np
    import xxhash

    from ckptstore.layout.incremental import leaf_digests, leaf_hashes
    from ckptstore.store.checksum import DIGEST_BLOCK, digests

    rng = np.random.default_rng(7)
    for n in (0, 1, DIGEST_BLOCK - 1, DIGEST_BLOCK, DIGEST_BLOCK + 1, 3 * DIGEST_BLOCK + 7):
        data = rng.integers(0, 256, n, dtype=np.uint8)
        assert digests(data) == (xxhash.xxh3_128_hexdigest(data.tobytes()), crc32c(data)), n
    bf16 = rng.standard_normal(DIGEST_BLOCK).astype(ml_dtypes.bfloat16)
    assert digests(bf16) == (xxhash.xxh3_128_hexdigest(bf16.tobytes()), crc32c(bf16.tobytes()))
    strided = rng.standard_normal((600, 400)).T
    arrays = [strided, bf16, np.arange(10)]
    hashes, crcs = leaf_digests(arrays, [True, True, False])
    assert hashes == leaf_hashes(arrays)
    assert crcs == [crc32c(strided.tobytes()), crc32c(bf16.tobytes()), None]


def _stores(tmp_path: Path, part: int) -> tuple[MemoryStore, CountingStore]:
    src = MemoryStore()
    dst = CountingStore(
        open_store(str(tmp_path), part_size=part, multipart_threshold=part, max_concurrency=3)
    )
    return src, dst


async def test_large_object_streams_in_parts(tmp_path: Path) -> None:
    part = 64 << 10
    data = os.urandom(10 * part + 123)
    src, dst = _stores(tmp_path, part)
    await src.put("a/obj", data)
    seen: list[int] = []
    crc = await copy_object(src, dst, "a/obj", len(data), progress=seen.append)
    assert crc == google_crc32c.value(data)
    assert await dst.get("a/obj") == data
    assert dst.requests["put_part"] == 11
    assert dst.requests["complete_multipart"] == 1
    assert sum(seen) == len(data)


async def test_small_object_is_one_put(tmp_path: Path) -> None:
    src, dst = _stores(tmp_path, 64 << 10)
    await src.put("small", b"hello")
    crc = await copy_object(src, dst, "small", 5, dst_key="renamed/small")
    assert crc == google_crc32c.value(b"hello")
    assert await dst.get("renamed/small") == b"hello"
    assert dst.requests["put"] == 1


async def test_create_mode_refuses_an_existing_destination(tmp_path: Path) -> None:
    src, dst = _stores(tmp_path, 64 << 10)
    await src.put("k", b"new")
    await dst.put("k", b"old")
    with pytest.raises(AlreadyExistsError):
        await copy_object(src, dst, "k", 3, mode="create")
    assert await dst.get("k") == b"old"


async def test_missing_source_is_not_found(tmp_path: Path) -> None:
    src, dst = _stores(tmp_path, 64 << 10)
    with pytest.raises(NotFoundError):
        await copy_object(src, dst, "nothing", 0)
    with pytest.raises(NotFoundError):
        await copy_object(src, dst, "nothing", 1 << 20)
    assert await dst.list_keys() == []


async def test_failed_part_aborts_and_leaves_nothing(tmp_path: Path) -> None:
    part = 64 << 10
    data = os.urandom(8 * part)
    src = FaultStore(
        MemoryStore(), [Fault(frozenset({"read"}), error=StoreError("injected"), after=5, times=1)]
    )
    await src.put("obj", data)
    dst = open_store(str(tmp_path), part_size=part, multipart_threshold=part)
    with pytest.raises(StoreError, match="injected"):
        await copy_object(src, dst, "obj", len(data))
    assert await dst.list_keys() == []
    assert [files for _, _, files in os.walk(tmp_path) if files] == []  # no temp file left


class _ThreadRead(StoreWrapper):
    """Reads run in a thread that waits for ``go`` and that cancelling the caller does not
    stop, as a local store's reads do."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.started = threading.Event()
        self.go = threading.Event()
        self.done = threading.Event()

    async def _read_into(self, key: str, start: int, out: memoryview) -> None:
        def fill() -> None:
            self.started.set()
            self.go.wait(30)
            out[:] = b"\xee" * len(out)  # the bytes "arrive" after the caller has gone
            self.done.set()

        await asyncio.wrap_future(_READERS.submit(fill))


_READERS = concurrent.futures.ThreadPoolExecutor(1)


async def _cancel_while_reading(src: _ThreadRead, work: Awaitable[Any], nbytes: int) -> None:
    """Cancel ``work`` once its read is running, lend a buffer of ``nbytes`` to the next
    user, let the stale read end, and check that it did not write into that buffer."""
    host_buffers.clear()  # the only idle buffer afterwards would be the cancelled work's
    running = asyncio.ensure_future(work)
    assert await asyncio.to_thread(src.started.wait, 30)
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    nxt = host_buffers.acquire(nbytes)
    try:
        nxt.data[:] = 0
        src.go.set()
        assert await asyncio.to_thread(src.done.wait, 30)
        assert not nxt.data.any(), "a stale read wrote into a buffer lent to someone else"
    finally:
        nxt.release()


@pytest.mark.parametrize("size", [1 << 20, 12 << 20], ids=["one put", "parts"])
async def test_a_cancelled_copy_never_lends_out_a_buffer_a_read_still_fills(
    tmp_path: Path, size: int
) -> None:
    """A copy cancelled while a read runs in a thread discards that read's pooled buffer:
    released, the next user (a save's pack) would get memory the stale read overwrites."""
    src = _ThreadRead(MemoryStore())
    await src.inner.put("k", bytes(size))
    dst = open_store(str(tmp_path), part_size=4 << 20, multipart_threshold=8 << 20)
    try:
        await _cancel_while_reading(src, copy_object(src, dst, "k", size), min(size, 4 << 20))
    finally:
        await dst.close()


async def test_a_cancelled_verify_never_lends_out_a_buffer_a_read_still_fills() -> None:
    import numpy as np

    import ckptstore
    from ckptstore.pipeline.maintenance import verify_manifest
    from ckptstore.pipeline.steps import read_manifest

    inner = MemoryStore()
    await ckptstore.asave(inner, {"w": np.ones(1 << 18, np.float32)}, step=1)
    src = _ThreadRead(inner)
    manifest = await read_manifest(src, 1)
    await _cancel_while_reading(src, verify_manifest(src, manifest), 1 << 20)
