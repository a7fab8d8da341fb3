from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from ckptstore import open_store
from ckptstore.store.memory import MemoryStore
from ckptstore.testing import StoreTests


class TestMemoryStore(StoreTests):
    @pytest.fixture
    async def store(self) -> AsyncIterator[MemoryStore]:
        async with MemoryStore() as store:
            yield store


async def test_named_memory_stores_share_objects() -> None:
    a = open_store("memory://shared-ns/run")
    b = open_store("memory://shared-ns/run")
    other = open_store("memory://shared-ns/other")
    await a.put("k", b"v")
    assert await b.get("k") == b"v"
    assert not await other.exists("k")
    parent = open_store("memory://shared-ns")
    assert await parent.list_keys() == ["run/k"]
    await a.delete(["k"])


async def test_put_copies_so_caller_may_reuse_buffer() -> None:
    store = MemoryStore()
    buf = bytearray(b"abcd")
    await store.put("k", buf)
    buf[:] = b"zzzz"
    assert await store.get("k") == b"abcd"
