"""Incremental saves (ckptstore.testing.IncrementalTests) on memory, local, moto and
SeaweedFS stores, plus what only one backend needs: the CLI's view of references."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import ckptstore
from ckptstore.cli.main import main
from ckptstore.store.local import LocalStore
from ckptstore.store.memory import MemoryStore
from ckptstore.store.s3 import S3Store
from ckptstore.testing.incremental_tests import FineTuning, IncrementalTests
from ckptstore.testing.servers import SeaweedFS
from tests.servers.moto import MotoS3


class TestMemoryIncremental(IncrementalTests):
    @pytest.fixture
    async def store(self) -> AsyncIterator[MemoryStore]:
        async with MemoryStore() as store:
            yield store


class TestLocalIncremental(IncrementalTests):
    @pytest.fixture
    async def store(self, tmp_path: Path) -> AsyncIterator[LocalStore]:
        async with LocalStore(tmp_path / "ckpt") as store:
            yield store


@pytest.mark.s3
class TestMotoIncremental(IncrementalTests):
    @pytest.fixture
    async def store(self, moto_s3: MotoS3) -> AsyncIterator[S3Store]:
        async with S3Store(moto_s3.bucket, "ckpt", **moto_s3.options()) as store:
            yield store


@pytest.mark.s3
class TestSeaweedFSIncremental(IncrementalTests):
    @pytest.fixture
    async def store(self, seaweedfs: SeaweedFS) -> AsyncIterator[S3Store]:
        seaweedfs.create_bucket("incremental")
        async with S3Store(
            "incremental",
            f"t-{uuid.uuid4().hex[:12]}",
            endpoint_url=seaweedfs.s3_endpoint,
            anonymous=True,
        ) as store:
            yield store
            await store.delete(await store.list_keys())


def test_show_reports_own_and_referenced_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = FineTuning()
    ckptstore.save(tmp_path, run.state, step=1)
    run.train_step()
    info = ckptstore.save(tmp_path, run.state, step=2)
    assert main(["show", str(tmp_path), "2", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["own_bytes"] == info.nbytes
    assert shown["referenced_bytes"] == info.referenced_bytes > 0
    referenced = [o for o in shown["objects"] if o["referenced"]]
    assert referenced
    assert all(o["key"].startswith("1/") for o in referenced)
    assert main(["show", str(tmp_path), "2"]) == 0
    assert "referenced" in capsys.readouterr().out
