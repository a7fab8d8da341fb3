"""NFSStore on a real network filesystem: SeaweedFS mounted over FUSE by ``weed mount``: the
store suite, the checkpoint suite, and what only a network filesystem does."""

from __future__ import annotations

import asyncio
import errno
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from ckptstore import open_store
from ckptstore.errors import AlreadyExistsError, InvalidKeyError, InvalidURLError
from ckptstore.store.local import temp_files
from ckptstore.store.nfs import NFSStore
from ckptstore.testing import CheckpointTests, StoreTests
from ckptstore.testing.servers import FuseMount, SeaweedFS

pytestmark = pytest.mark.nfs


@pytest.fixture
def nfs_dir(seaweedfs_mount: FuseMount) -> Path:
    """A fresh directory on the mount for one test."""
    path = seaweedfs_mount.path / "nfs-tests" / uuid.uuid4().hex
    path.mkdir(parents=True)
    return path


class TestNFSStoreOnSeaweedFS(StoreTests):
    @pytest.fixture
    async def store(self, nfs_dir: Path) -> AsyncIterator[NFSStore]:
        async with NFSStore(nfs_dir) as store:
            yield store


class TestNFSCheckpoints(CheckpointTests):
    """Checkpoint round trips on the mount: commit through ``link()`` of a fsynced file."""

    @pytest.fixture
    async def store(self, nfs_dir: Path) -> AsyncIterator[NFSStore]:
        async with NFSStore(nfs_dir) as store:
            yield store


async def test_filesystem_internal_names_are_never_listed(nfs_dir: Path) -> None:
    async with NFSStore(nfs_dir) as store:
        await store.put("step/1/data", b"kept")
        await store.put("step/2/data", b"kept")
        # what NFS silly renames and FUSE hidden files look like, at the top and in a subdir
        (nfs_dir / ".nfs0000000000a1b2c300000001").write_bytes(b"deleted while open")
        (nfs_dir / "step" / "1" / ".fuse_hidden0000000100000002").write_bytes(b"x")
        (nfs_dir / ".fuse_hidden_dir").mkdir()
        (nfs_dir / ".fuse_hidden_dir" / "inner").write_bytes(b"x")
        (nfs_dir / "step" / ".nfsdir").mkdir()
        (nfs_dir / "step" / ".nfsdir" / "obj").write_bytes(b"x")
        assert await store.list_keys() == ["step/1/data", "step/2/data"]
        assert await store.list_keys("step/1/") == ["step/1/data"]
        assert await store.list_prefixes("") == ["step/"]
        assert await store.list_prefixes("step/") == ["step/1/", "step/2/"]


async def test_keys_that_listings_would_hide_are_refused(nfs_dir: Path) -> None:
    async with NFSStore(nfs_dir) as store:
        for key in (".nfs123", "a/.fuse_hidden9/b", "a/.nfsx"):
            with pytest.raises(InvalidKeyError, match="filesystem-internal"):
                await store.put(key, b"x")
            with pytest.raises(InvalidKeyError, match="filesystem-internal"):
                await store.create_multipart(key)
        assert await store.list_keys() == []
        assert list(temp_files(nfs_dir)) == []
        assert os.listdir(nfs_dir) == []


def _link_then_eexist(calls: list[tuple[str, str]]) -> Callable[[str, str], None]:
    """An ``os.link`` that performs the link and then reports EEXIST, as a retransmitted LINK
    does when the server's first reply was lost."""
    real_link = os.link

    def link(src: str, dst: str) -> None:
        real_link(src, dst)
        calls.append((src, dst))
        raise FileExistsError(errno.EEXIST, "File exists (retransmitted LINK)", dst)

    return link


async def test_lost_link_reply_is_recognised_as_our_commit(
    nfs_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[str, str]] = []
    monkeypatch.setattr(os, "link", _link_then_eexist(calls))
    async with NFSStore(nfs_dir) as store:
        await store.put("step/manifest.json", b"our commit", mode="create")
        part = 1 << 16
        async with await store.create_multipart("big", mode="create", part_size=part) as upload:
            await upload.put_part(1, b"tail")
            await upload.put_part(0, bytes(part))
            await upload.complete()
        assert len(calls) == 2  # both commits really went through the faulty link
        assert await store.get("step/manifest.json") == b"our commit"
        assert await store.get("big") == bytes(part) + b"tail"
        assert list(temp_files(nfs_dir)) == []
        # a second creator still loses: EEXIST for a file that is not its own
        with pytest.raises(AlreadyExistsError):
            await store.put("step/manifest.json", b"someone else", mode="create")
        assert await store.get("step/manifest.json") == b"our commit"
        assert list(temp_files(nfs_dir)) == []


async def test_link_check_tells_our_inode_from_theirs(nfs_dir: Path) -> None:
    ours, final, other = nfs_dir / "ours", nfs_dir / "final", nfs_dir / "other"
    ours.write_bytes(b"ours")
    other.write_bytes(b"theirs")
    os.link(other, final)
    assert not NFSStore._link_was_ours(str(ours), str(final))
    os.unlink(final)
    os.link(ours, final)
    assert NFSStore._link_was_ours(str(ours), str(final))
    os.unlink(ours)
    assert not NFSStore._link_was_ours(str(ours), str(final))  # temp gone: cannot prove it


async def test_head_sees_a_write_made_behind_the_store(nfs_dir: Path) -> None:
    async with NFSStore(nfs_dir) as store:
        await store.put("k", b"12345")
        assert (await store.head("k")).size == 5
        # another client replacing the file (here: a write straight to the mount)
        (nfs_dir / "k.new").write_bytes(b"1234567890")
        os.replace(nfs_dir / "k.new", nfs_dir / "k")
        assert (await store.head("k")).size == 10
        assert await store.get("k") == b"1234567890"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("nfs://server/export/ckpts", "takes the path where the filesystem is mounted"),
        ("nfs://localhost/mnt/x", "takes the path where the filesystem is mounted"),
        ("nfs://", "takes the path where the filesystem is mounted"),
        ("nfs:///mnt/x?durable=false", "take no \\?query"),
        ("nfs:///mnt/x#frag", "take no \\?query"),
    ],
)
def test_bad_nfs_urls(url: str, message: str) -> None:
    with pytest.raises(InvalidURLError, match=message):
        open_store(url)


def test_nfs_url_opens_the_mount_path(tmp_path: Path) -> None:
    store = open_store(f"nfs://{tmp_path}/ckpts", part_size="8MiB")
    assert isinstance(store, NFSStore)
    assert store.root == f"{tmp_path}/ckpts"
    assert store.url == f"nfs://{tmp_path}/ckpts"
    assert store.settings.transport.part_size == 8 << 20
    spaced = open_store(f"nfs://{tmp_path}/with%20space")
    assert isinstance(spaced, NFSStore)
    assert spaced.root == f"{tmp_path}/with space"
    with pytest.raises(TypeError, match="unknown options"):
        open_store(f"nfs://{tmp_path}", mount_options="hard")


@pytest.fixture
def second_client(seaweedfs: SeaweedFS, seaweedfs_mount: FuseMount) -> Iterator[FuseMount]:
    """A second ``weed mount`` of the same filer: another client of the same filesystem."""
    mount = seaweedfs.mount(seaweedfs.workdir / f"mnt-{uuid.uuid4().hex[:8]}")
    yield mount
    mount.stop()


async def test_second_client_sees_commits_at_once(
    nfs_dir: Path, seaweedfs_mount: FuseMount, second_client: FuseMount
) -> None:
    other_dir = second_client.path / nfs_dir.relative_to(seaweedfs_mount.path)
    async with NFSStore(nfs_dir) as writer, NFSStore(other_dir) as reader:
        await writer.put("step/1/manifest.json", b"v1", mode="create")
        assert await reader.get("step/1/manifest.json") == b"v1"
        assert await reader.list_keys() == ["step/1/manifest.json"]
        with pytest.raises(AlreadyExistsError):
            await reader.put("step/1/manifest.json", b"late", mode="create")
        await writer.put("step/1/manifest.json", b"version 2")
        # weed mount pushes metadata changes to other clients asynchronously (a few ms here),
        # weaker than NFS close-to-open: poll, with a deadline, for the new version
        deadline = time.monotonic() + 10
        while (await reader.head("step/1/manifest.json")).size != len(b"version 2"):
            assert time.monotonic() < deadline, "the second client never saw the overwrite"
            await asyncio.sleep(0.01)
        assert await reader.get("step/1/manifest.json") == b"version 2"
