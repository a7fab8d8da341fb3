"""The checkpoint suite (ckptstore.testing.CheckpointTests) on the memory and local stores."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from ckptstore.store.local import LocalStore
from ckptstore.store.memory import MemoryStore
from ckptstore.testing import CheckpointTests


class TestMemoryCheckpoints(CheckpointTests):
    @pytest.fixture
    async def store(self) -> AsyncIterator[MemoryStore]:
        async with MemoryStore() as store:
            yield store


class TestLocalCheckpoints(CheckpointTests):
    @pytest.fixture
    async def store(self, tmp_path: Path) -> AsyncIterator[LocalStore]:
        async with LocalStore(tmp_path / "ckpt") as store:
            yield store
