from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import fsspec
import numpy as np
import pytest

from ckptstore import open_store
from ckptstore.errors import AlreadyExistsError, DeadlineExceededError, NotSupportedError
from ckptstore.manager.functions import alist_steps, asave
from ckptstore.store.fsspec import FsspecStore
from ckptstore.testing import CheckpointTests, StoreTests
from tests.servers.fakegcs import FakeGCS


class TestFsspecMemory(StoreTests):
    """fsspec's own memory filesystem through the fallback, committing as a single writer."""

    @pytest.fixture
    async def store(self) -> AsyncIterator[FsspecStore]:
        store = open_store(f"fsspec+memory://ckpt-{uuid.uuid4().hex[:8]}/run", single_writer=True)
        assert isinstance(store, FsspecStore)
        async with store:
            yield store


class TestFsspecLocalRoute(StoreTests):
    """``local://`` has no dedicated backend, so the registry sends it to fsspec."""

    racers = 8

    @pytest.fixture
    async def store(self, tmp_path: Path) -> AsyncIterator[FsspecStore]:
        store = open_store(f"local://{tmp_path}/root", single_writer="true")
        assert isinstance(store, FsspecStore)
        assert not store._async  # a blocking filesystem, driven from the thread pool
        async with store:
            yield store


@pytest.mark.gcs
# gcsfs hands aiohttp bodies over 1 MiB as bytes, which aiohttp warns about (not our code path)
@pytest.mark.filterwarnings("ignore:Sending a large body:ResourceWarning")
class TestFsspecOverGcsfs(StoreTests):
    """An async filesystem with a real atomic create (gcsfs's ``ifGenerationMatch=0``),
    driven natively on the loop, no ``single_writer`` needed."""

    multipart_size = 6 << 20

    @pytest.fixture
    async def store(self, request: pytest.FixtureRequest) -> AsyncIterator[FsspecStore]:
        if request.node.originalname == "test_multi_gib_sparse_round_trip":
            # the emulator's memory backend holds fewer copies of a 2 GiB resumable upload
            server: FakeGCS = request.getfixturevalue("fake_gcs_in_memory")
            bucket = server.create_bucket(f"ckptstore-huge-{uuid.uuid4().hex[:8]}")
        else:
            server, bucket = (
                request.getfixturevalue("fake_gcs"),
                request.getfixturevalue("gcs_bucket"),
            )
        store = open_store(
            f"fsspec+gs://{bucket}/fs-{uuid.uuid4().hex[:8]}",
            endpoint_url=server.endpoint,
            token="anon",
        )
        assert isinstance(store, FsspecStore)
        assert store._async
        assert store.capabilities.atomic_create
        async with store:
            yield store


async def test_create_refused_without_atomic_create() -> None:
    store = open_store(f"fsspec+memory://refuse-{uuid.uuid4().hex[:8]}")
    assert isinstance(store, FsspecStore)
    assert not store.capabilities.atomic_create
    with pytest.raises(NotSupportedError, match=r"memory:// has no atomic create") as info:
        await store.put("manifest.json", b"{}", mode="create")
    assert "single_writer=True" in str(info.value)
    assert isinstance(info.value, NotImplementedError)
    with pytest.raises(NotSupportedError, match="memory://"):
        await store.create_multipart("manifest.json", mode="create")
    assert not await store.exists("manifest.json")
    await store.put("data", b"overwrite mode needs no atomicity")
    assert await store.get("data") == b"overwrite mode needs no atomicity"


async def test_fsspec_memory_is_not_ckptstore_memory() -> None:
    name = f"shared-{uuid.uuid4().hex[:8]}"
    ours = open_store(f"memory://{name}")
    theirs = open_store(f"fsspec+memory://{name}")
    await theirs.put("k", b"in fsspec's memory filesystem")
    assert fsspec.filesystem("memory").cat_file(f"/{name}/k") == b"in fsspec's memory filesystem"
    assert not await ours.exists("k")


async def test_storage_options_reach_the_filesystem(tmp_path: Path) -> None:
    # LocalFileSystem(auto_mkdir=...) is a storage option; both spellings get there
    a = open_store(f"local://{tmp_path}/a", auto_mkdir=True)
    b = open_store(f"local://{tmp_path}/b", storage_options={"auto_mkdir": True})
    assert isinstance(a, FsspecStore)
    assert isinstance(b, FsspecStore)
    assert a.fs.auto_mkdir is True
    assert b.fs.auto_mkdir is True
    c = open_store(f"local://{tmp_path}/c", part_size="1MiB", auto_mkdir=False)
    assert isinstance(c, FsspecStore)
    assert c.settings.transport.part_size == 1 << 20  # ckptstore settings are split off first
    assert c.fs.auto_mkdir is False


async def test_single_writer_serializes_creates_in_one_store() -> None:
    store = open_store(f"fsspec+memory://sw-{uuid.uuid4().hex[:8]}", single_writer=True)

    async def attempt(i: int) -> bool:
        try:
            await store.put("m", str(i).encode(), mode="create")
        except AlreadyExistsError:
            return False
        return True

    results = await asyncio.gather(*(attempt(i) for i in range(20)))
    assert results.count(True) == 1


async def test_unknown_protocol_is_refused() -> None:
    from ckptstore.errors import InvalidURLError

    with pytest.raises(InvalidURLError, match="no backend"):
        open_store("nosuchproto://x/y")


async def test_url_reopens_the_same_store(tmp_path: Path) -> None:
    name = f"url-{uuid.uuid4().hex[:8]}"
    cases = {
        f"fsspec+memory://{name}/run": f"fsspec+memory://{name}/run",
        # fsspec's local filesystem calls itself file://, which is ckptstore's LocalStore
        f"local://{tmp_path}/run": f"fsspec+file://{tmp_path}/run",
    }
    for url, expected in cases.items():
        store = open_store(url)
        assert store.url == expected
        await store.put("k", url.encode())
        again = open_store(store.url)
        assert isinstance(again, FsspecStore)
        assert await again.get("k") == url.encode()


class TestFsspecMemoryCheckpoints(CheckpointTests):
    """Checkpoint round trips on fsspec's memory filesystem through the fallback."""

    @pytest.fixture
    async def store(self) -> AsyncIterator[FsspecStore]:
        store = open_store(f"fsspec+memory://cp-{uuid.uuid4().hex[:8]}/run", single_writer=True)
        assert isinstance(store, FsspecStore)
        async with store:
            yield store


async def test_checkpoint_save_refused_without_single_writer() -> None:
    store = open_store(f"fsspec+memory://nosw-{uuid.uuid4().hex[:8]}")
    with pytest.raises(NotSupportedError, match="memory://"):
        await asave(store, {"x": np.ones(3)}, step=1)
    assert await alist_steps(store) == []


def _slow_store(root: Path, deadline: float) -> FsspecStore:
    """A local fsspec store whose pipe_file takes 0.8 s longer, parts of 1 MiB."""
    store = open_store(
        f"local://{root}",
        single_writer=True,
        request_deadline=deadline,
        part_size="1MiB",
        retry_attempts=1,
    )
    assert isinstance(store, FsspecStore)
    pipe_file = store.fs.pipe_file

    def slow_pipe_file(*args: object, **kwargs: object) -> object:
        time.sleep(0.8)
        return pipe_file(*args, **kwargs)

    store.fs.pipe_file = slow_pipe_file  # type: ignore[method-assign]
    return store


async def test_a_put_in_one_request_gets_a_deadline_per_part(tmp_path: Path) -> None:
    """fsspec writes an object in one pipe_file, so a deadline meant for one part would fail
    every large put on a slow link: the deadline counts once per ``part_size`` of the body."""
    body = np.arange(1 << 20, dtype=np.float32)  # 4 MiB: four parts
    async with _slow_store(tmp_path / "a", 0.5) as store:  # 0.8 s: over one deadline
        await store.put("big", body)  # under four
        assert await store.get("big") == body.tobytes()
        with pytest.raises(DeadlineExceededError) as raised:
            await store.put("small", np.zeros(1 << 18, np.float32))  # 1 MiB: one part
        assert "request deadline of 0.5 s (Settings.request_deadline) after" in str(raised.value)
    async with _slow_store(tmp_path / "b", 0.1) as store:  # four parts: 0.4 s
        with pytest.raises(DeadlineExceededError) as raised:
            await store.put("big", body)
    assert (
        "request deadline of 0.4 s (Settings.request_deadline, 0.1 s per part_size of its "
        "4,194,304-byte body)" in str(raised.value)
    )
