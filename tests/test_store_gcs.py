from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from ckptstore.store.gcs import GCSStore
from ckptstore.testing import StoreTests
from tests.servers.fakegcs import FakeGCS

pytestmark = pytest.mark.gcs


def open_gcs(fake_gcs: FakeGCS, bucket: str, **options: object) -> GCSStore:
    return GCSStore(
        bucket,
        f"t-{uuid.uuid4().hex[:12]}",
        endpoint_url=fake_gcs.endpoint,
        token="anon",
        retry_delay=0.01,
        **options,  # type: ignore[arg-type]
    )


class TestGCSStore(StoreTests):
    multipart_size = 6 << 20
    huge_size = (2 << 30) + 4097

    @pytest.fixture
    async def store(self, fake_gcs: FakeGCS, gcs_bucket: str) -> AsyncIterator[GCSStore]:
        async with open_gcs(fake_gcs, gcs_bucket) as store:
            yield store

    @pytest.mark.xfail(
        reason="fake-gcs-server ignores ifGenerationMatch=0 on compose (it honours it on "
        "uploads); test_compose_create_carries_precondition checks the request instead",
        strict=True,
    )
    async def test_multipart_create_refuses_existing(self, store: GCSStore) -> None:
        await super().test_multipart_create_refuses_existing(store)
