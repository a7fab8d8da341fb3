from __future__ import annotations

import asyncio
import errno
import os
import stat
import threading
import time
import tracemalloc
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptstore import Settings
from ckptstore.errors import InvalidRangeError
from ckptstore.store import local
from ckptstore.store.base import TEMP_PREFIX, PutMode
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


async def test_small_objects_are_read_and_hashed_in_one_call_to_the_io_threads(
    tmp_path: Path,
) -> None:
    """What a copy of many small objects asks for: one hand-over to the io threads for all
    of those under a part, and parallel ranges for a larger one."""
    from ckptstore.store.checksum import crc32c

    settings = Settings(part_size=1 << 20, durable=False)
    rng = np.random.default_rng(0)
    bodies = [rng.bytes(100_000 + i) for i in range(20)] + [rng.bytes(3 << 20)]
    async with LocalStore(tmp_path, settings=settings) as store:
        for i, body in enumerate(bodies):
            await store.put(f"o/{i}", body)
        calls: list[str] = []
        run = store._run

        async def counted(fn: Callable[..., Any], *args: Any) -> Any:
            calls.append(fn.__name__)
            return await run(fn, *args)

        store._run = counted  # type: ignore[method-assign]
        outs = [bytearray(len(body)) for body in bodies]
        crcs = await store.read_objects_crc32c([(f"o/{i}", o) for i, o in enumerate(outs)])
    assert [bytes(o) for o in outs] == bodies
    assert crcs == [crc32c(body) for body in bodies]
    assert sorted(calls) == ["_read_objects_crc32c"] + ["_read_range"] * 3


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


@dataclass(frozen=True, slots=True)
class _Step:
    """One durability-relevant system call a put made, in the order it made them."""

    call: str  # "fsync-file", "fsync-dir", "link", "replace" or "rename"
    path: str  # what was fsynced (resolved), or the source of a link/rename
    target: str = ""  # the destination of a link/rename
    size: int = -1  # for an fsynced file: its size at that moment
    inode: int = -1  # for an fsynced file: its inode


def _spy_durability(monkeypatch: pytest.MonkeyPatch) -> list[_Step]:
    """Record every fsync (with the path of the descriptor, read from /proc) and every
    link, replace and rename, in order."""
    steps: list[_Step] = []
    real_fsync, real_link = os.fsync, os.link
    real_replace, real_rename = os.replace, os.rename

    def fsync(fd: int) -> None:
        st = os.fstat(fd)
        path = os.readlink(f"/proc/self/fd/{fd}")
        if stat.S_ISDIR(st.st_mode):
            steps.append(_Step("fsync-dir", path))
        else:
            steps.append(_Step("fsync-file", path, size=st.st_size, inode=st.st_ino))
        real_fsync(fd)

    def link(src: str, dst: str) -> None:
        steps.append(_Step("link", src, dst))
        real_link(src, dst)

    def replace(src: str, dst: str) -> None:
        steps.append(_Step("replace", src, dst))
        real_replace(src, dst)

    def rename(src: str, dst: str) -> None:
        steps.append(_Step("rename", src, dst))
        real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "link", link)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "rename", rename)
    return steps


def _real(path: Path) -> str:
    """``path`` as /proc/self/fd shows it: symlinks resolved."""
    return os.path.realpath(path)


# Small parts so the multipart path (create_multipart, parts, complete) runs on small data.
_MULTIPART = Settings(part_size=4096, multipart_threshold=8192, max_inflight_bytes=1 << 20)


@pytest.mark.parametrize("mode", ["create", "overwrite"])
@pytest.mark.parametrize("size", [5000, 30000], ids=["single-write", "multipart"])
async def test_durable_put_fsyncs_the_file_before_publishing_then_every_changed_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: PutMode, size: int
) -> None:
    root = tmp_path / "root"  # missing: the first put creates it and three levels below it
    final = root / "a" / "b" / "c" / "obj"
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    steps = _spy_durability(monkeypatch)
    async with LocalStore(root, settings=_MULTIPART) as store:
        await store.put("a/b/c/obj", data, mode=mode)
        assert final.read_bytes() == data

        # 1. the temp file beside the final name, fully written, is fsynced first...
        synced, published, *dirs = steps
        assert synced.call == "fsync-file"
        assert os.path.dirname(synced.path) == _real(final.parent)
        assert os.path.basename(synced.path).startswith(TEMP_PREFIX)
        assert synced.size == size
        # 2. ...then published: create links it (never renames), overwrite renames it over
        assert published == _Step(
            "link" if mode == "create" else "replace",
            os.path.join(final.parent, os.path.basename(synced.path)),
            str(final),
        )
        assert os.stat(final).st_ino == synced.inode  # the fsynced file is what readers see
        # 3. ...then the directory holding the name and the parent of every directory the
        # put created, up to the one above the store root, each once
        assert {d.call for d in dirs} == {"fsync-dir"}
        assert sorted(d.path for d in dirs) == sorted(
            _real(p) for p in (final.parent, root / "a" / "b", root / "a", root, tmp_path)
        )

        # Replacing an existing object: the new file is fsynced while readers still see the
        # old one, and only its directory is fsynced (no directory was created)
        steps.clear()
        old_inode = os.stat(final).st_ino
        await store.put("a/b/c/obj", data[::-1], mode="overwrite")
        assert final.read_bytes() == data[::-1]
        synced, published, *dirs = steps
        assert synced.call == "fsync-file"
        assert synced.size == size
        assert synced.inode != old_inode
        assert published.call == "replace"
        assert published.target == str(final)
        assert os.stat(final).st_ino == synced.inode
        assert dirs == [_Step("fsync-dir", _real(final.parent))]


def _wait_until(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.001)


def test_writers_into_one_directory_share_its_fsyncs() -> None:
    """Eight writers publish while the first one's directory fsync is in flight: that fsync
    cannot cover them (it started before their names existed), so one more does, and every
    writer returns only after an fsync that started after its own publish."""
    syncs = local._DirectorySyncs()
    release = threading.Event()
    started: list[int] = []  # the publish count each fsync began at

    def fsync(path: str) -> None:
        started.append(syncs._dirs[path].published)
        if len(started) == 1:
            assert release.wait(30)

    returned: list[int] = []

    def writer(ticket: int) -> None:
        syncs.published("/d", fsync)
        returned.append(ticket)

    first = threading.Thread(target=writer, args=(1,))
    first.start()
    _wait_until(lambda: len(started) == 1, "the first fsync")
    rest = [threading.Thread(target=writer, args=(n,)) for n in range(2, 9)]
    for thread in rest:
        thread.start()
    _wait_until(lambda: syncs._dirs["/d"].published == 8, "seven more publishes")
    assert returned == []  # nobody is durable yet: the fsync in flight predates them
    release.set()
    for thread in [first, *rest]:
        thread.join(30)
    assert sorted(returned) == list(range(1, 9))
    assert started == [1, 8]  # two fsyncs for eight names; the second began after all eight
    assert syncs._dirs == {}  # nothing kept once no writer waits


def test_a_failed_directory_fsync_is_not_taken_for_a_durable_name() -> None:
    syncs = local._DirectorySyncs()
    calls: list[str] = []

    def failing(path: str) -> None:
        calls.append(path)
        raise OSError(errno.EIO, "disk gone")

    with pytest.raises(OSError, match="disk gone"):
        syncs.published("/d", failing)
    syncs.published("/d", calls.append)  # the next writer fsyncs again, it does not skip
    assert calls == ["/d", "/d"]


async def test_concurrent_puts_into_one_directory_share_its_fsyncs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = str(tmp_path / "attempt")
    synced: list[str] = []
    real = LocalStore._sync_dir

    async with LocalStore(tmp_path) as store:
        await store.put("attempt/first", b"x")  # creates the directory

        def held(self: LocalStore, path: str) -> None:
            synced.append(path)
            if len(synced) == 1:  # the first fsync waits until all four names are there
                _wait_until(
                    lambda: store._dir_syncs._dirs[directory].published == 4, "four publishes"
                )
            real(self, path)

        monkeypatch.setattr(LocalStore, "_sync_dir", held)
        await asyncio.gather(*(store.put(f"attempt/o{i}", b"y" * 100) for i in range(4)))
        for i in range(4):
            assert await store.get(f"attempt/o{i}") == b"y" * 100
    assert synced == [directory, directory]  # four puts, two directory fsyncs


@pytest.mark.parametrize("mode", ["create", "overwrite"])
@pytest.mark.parametrize("size", [5000, 30000], ids=["single-write", "multipart"])
async def test_put_with_durability_off_fsyncs_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: PutMode, size: int
) -> None:
    steps = _spy_durability(monkeypatch)
    data = bytes(range(256)) * (size // 256)
    async with LocalStore(tmp_path / "root", settings=_MULTIPART.replace(durable=False)) as store:
        await store.put("a/b/obj", data, mode=mode)
        assert await store.get("a/b/obj") == data
    assert [s.call for s in steps] == ["link" if mode == "create" else "replace"]


class TestLocalStoreBuffered(StoreTests):
    """The conformance suite with direct I/O off: every write through the page cache."""

    @pytest.fixture
    async def store(self, tmp_path: Path) -> AsyncIterator[LocalStore]:
        async with LocalStore(tmp_path / "root", settings=Settings(direct_io=False)) as store:
            yield store


def _spy_direct(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, bool]]:
    """Record (file offset, length, buffer page-aligned) of every O_DIRECT span written."""
    calls: list[tuple[int, int, bool]] = []
    real = local._write_direct

    def spy(fd: int, data: memoryview, offset: int) -> None:
        calls.append((offset, len(data), local._address(data) % local._ALIGN == 0))
        real(fd, data, offset)

    monkeypatch.setattr(local, "_write_direct", spy)
    return calls


def _refuse_o_direct(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make opens with O_DIRECT fail as on a filesystem that does not support it."""
    real_open = os.open

    def refusing(path: str, flags: int, *args: int) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(local.os, "open", refusing)


def _page_aligned(nbytes: int) -> np.ndarray:
    raw = np.empty(nbytes + local._ALIGN, np.uint8)
    start = -raw.ctypes.data % local._ALIGN
    return raw[start : start + nbytes]


@pytest.mark.parametrize(
    "size",
    [local.DIRECT_MIN + 4099, 3 << 20, (9 << 20) + 5],
    ids=["unaligned-tail", "aligned", "over-one-bounce-buffer"],
)
@pytest.mark.parametrize("aligned", [True, False], ids=["page-aligned", "unaligned-buffer"])
async def test_direct_writes_are_exact_and_bypass_the_cache_for_the_aligned_body(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int, aligned: bool
) -> None:
    calls = _spy_direct(monkeypatch)
    data = np.random.default_rng(size).integers(0, 256, size + 1, dtype=np.uint8)
    buf = _page_aligned(size) if aligned else data[1:]  # numpy's own alignment is 64 at best
    buf[:] = data[1:]
    assert (buf.ctypes.data % local._ALIGN == 0) is aligned
    async with LocalStore(tmp_path) as store:
        await store.put("obj", buf)
        assert await store.get("obj") == buf.tobytes()
    body = size // local._ALIGN * local._ALIGN
    assert calls == [(0, body, aligned)]


async def test_direct_multipart_with_unaligned_parts_is_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _spy_direct(monkeypatch)
    part = (1 << 20) + 1000  # parts start off page boundaries: heads and tails go cached
    settings = Settings(part_size=part, multipart_threshold=2 * part, max_inflight_bytes=8 * part)
    data = np.random.default_rng(1).integers(0, 256, 5 * part + 77, dtype=np.uint8)
    async with LocalStore(tmp_path, settings=settings) as store:
        await store.put("obj", data)
        assert await store.get("obj") == data.tobytes()
    assert len(calls) >= 4
    for offset, length, _ in calls:
        assert offset % local._ALIGN == 0
        assert length % local._ALIGN == 0
    assert sum(length for _, length, _ in calls) > 4 * (1 << 20)


async def test_a_filesystem_that_refuses_o_direct_gets_plain_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _spy_direct(monkeypatch)
    _refuse_o_direct(monkeypatch)
    data = np.arange(1 << 20, dtype=np.uint32)
    async with LocalStore(tmp_path) as store:
        await store.put("a", data)
        await store.put("b", data)
        assert await store.get("a") == await store.get("b") == data.tobytes()
        assert store._direct_ok is False
    assert calls == []


async def test_a_refused_direct_write_is_redone_through_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refused: list[int] = []

    def refuse(fd: int, data: memoryview, offset: int) -> None:
        refused.append(len(data))
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(local, "_write_direct", refuse)
    data = np.random.default_rng(2).integers(0, 256, (2 << 20) + 3, dtype=np.uint8)
    async with LocalStore(tmp_path) as store:
        await store.put("obj", data)
        assert await store.get("obj") == data.tobytes()
    assert refused == [2 << 20]
    assert not list(temp_files(tmp_path))


async def test_direct_io_off_never_opens_o_direct(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _spy_direct(monkeypatch)
    async with LocalStore(tmp_path, settings=Settings(direct_io=False)) as store:
        await store.put("obj", np.zeros(4 << 20, np.uint8))
    assert calls == []


@pytest.mark.parametrize("matching", [True, False], ids=["buffer-matches-file", "mismatched"])
@pytest.mark.parametrize(
    ("start", "length"),
    [(0, 3 << 20), (5, (2 << 20) + 4093), (4096 * 3 + 1, (9 << 20) + 17)],
    ids=["aligned", "unaligned-start-and-end", "large"],
)
async def test_direct_reads_are_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, matching: bool, start: int, length: int
) -> None:
    """O_DIRECT reads the body of a range when the buffer sits on a page where the file does
    (as restore's fresh arrays do); any other buffer is read through the page cache."""
    calls: list[int] = []
    real = local._read_direct

    def spy(fd: int, out: memoryview, offset: int) -> int:
        assert offset % local._ALIGN == 0
        assert len(out) % local._ALIGN == 0
        assert local._address(out) % local._ALIGN == 0
        calls.append(len(out))
        return real(fd, out, offset)

    monkeypatch.setattr(local, "_read_direct", spy)
    data = np.random.default_rng(length).integers(0, 256, 12 << 20, dtype=np.uint8)
    async with LocalStore(tmp_path) as store:
        await store.put("obj", data)
        out = _page_aligned(length + local._ALIGN + 1)
        shift = start % local._ALIGN + (0 if matching else 1)
        view = out[shift : shift + length]
        await store.read_into("obj", start, view)
        assert view.tobytes() == data[start : start + length].tobytes()
        head = -start % local._ALIGN
        assert calls == ([(length - head) // local._ALIGN * local._ALIGN] if matching else [])
        with pytest.raises(InvalidRangeError):  # past the end: a short direct read is noticed
            await store.read_into("obj", (12 << 20) - (1 << 20), _page_aligned(2 << 20))
    assert len(calls) == (2 if matching else 1)


async def test_reads_fall_back_when_o_direct_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = np.random.default_rng(3).integers(0, 256, 3 << 20, dtype=np.uint8)
    async with LocalStore(tmp_path) as store:
        await store.put("obj", data)
        _refuse_o_direct(monkeypatch)
        out = _page_aligned(len(data))
        await store.read_into("obj", 0, out)
        assert out.tobytes() == data.tobytes()
        assert store._direct_ok is False
