from __future__ import annotations

import os
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from ckptstore import Settings
from ckptstore.store.base import TEMP_PREFIX
from ckptstore.store.local import LocalStore, temp_files
from ckptstore.testing import StoreTests


class TestLocalStore(StoreTests):
    @pytest.fixture
    async def store(self, tmp_path: Path) -> AsyncIterator[LocalStore]:
        async with LocalStore(tmp_path / "root") as store:
            yield store


@pytest.mark.parametrize("size", [48 << 20, 200 << 20], ids=["single-write", "multipart"])
async def test_put_of_a_large_array_copies_nothing_in_python(tmp_path: Path, size: int) -> None:
    array = np.arange(size // 8, dtype=np.float64)
    settings = Settings(durable=False)
    async with LocalStore(tmp_path / "root", settings=settings) as store:
        await store.put("warm-up", b"x")  # thread pool and imports outside the measurement
        tracemalloc.start()
        try:
            await store.put("weights", array)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < size // 50, f"put allocated {peak} bytes for a {size}-byte array"
        assert (tmp_path / "root" / "weights").stat().st_size == size
        # and reading back into a caller's buffer does not allocate the object either
        out = np.empty_like(array)
        tracemalloc.start()
        try:
            await store.read_into("weights", 0, out)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < size // 50, f"read_into allocated {peak} bytes for {size} bytes"
        assert np.array_equal(out, array)


async def test_temp_files_are_never_listed_and_are_found_for_cleanup(tmp_path: Path) -> None:
    async with LocalStore(tmp_path) as store:
        await store.put("a/obj", b"1")
        upload = await store.create_multipart("a/pending", part_size=4)
        await upload.put_part(0, b"abcd")
        leftovers = list(temp_files(tmp_path))
        assert len(leftovers) == 1
        assert os.path.basename(leftovers[0]).startswith(f"{TEMP_PREFIX}{os.getpid()}.")
        assert await store.list_keys() == ["a/obj"]
        await upload.abort()
        assert list(temp_files(tmp_path)) == []
