from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from ckptstore.store.local import LocalStore
from ckptstore.testing import StoreTests


class TestLocalStore(StoreTests):
    @pytest.fixture
    async def store(self, tmp_path: Path) -> AsyncIterator[LocalStore]:
        async with LocalStore(tmp_path / "root") as store:
            yield store
