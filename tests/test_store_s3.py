"""The S3 backend on moto (and SeaweedFS): conformance, options, errors, faults, races."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from ckptstore.store.s3 import S3Store
from ckptstore.testing import StoreTests
from tests.servers.moto import MotoS3

pytestmark = pytest.mark.s3


class TestS3StoreOnMoto(StoreTests):
    # S3 parts are at least 5 MiB, so multipart needs 4 parts = 20 MiB to kick in
    multipart_size = 22 << 20

    @pytest.fixture
    async def store(self, moto_s3: MotoS3) -> AsyncIterator[S3Store]:
        async with S3Store(moto_s3.bucket, "run", **moto_s3.options()) as store:
            yield store

    @pytest.mark.skip(reason="moto keeps objects in Python memory (2 GiB, 80 s); runs on SeaweedFS")
    async def test_multi_gib_sparse_round_trip(self, store: S3Store) -> None:
        raise AssertionError("skipped")
