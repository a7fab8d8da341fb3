"""A copy verifies without reading back where the destination checks every write (issue 31,
item 4).

``Store.writes_verified()`` says whether a write can become an object only with the bytes
sent: S3 servers that refuse a body failing its ``x-amz-checksum-crc32c`` (SeaweedFS here;
AWS S3), which the S3 store probes once, and GCS, whose store compares the crc32c the server
reports for each stored object with its own. Each claim is proved here with a body damaged on
the way by the fault proxy, against the real servers; moto, which stores such a body, is the
control that the damage is real and that the probe tells the two apart. ``copy_step`` (cp,
the persistent tier) reads its copies back only where the destination does not verify.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import urllib.parse
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptstore
from ckptstore.layout.maintenance import CopyReport, copy_step
from ckptstore.pipeline.steps import read_manifest
from ckptstore.store.base import Store
from ckptstore.store.registry import open_store
from ckptstore.store.wrappers import CountingStore
from ckptstore.testing import assert_same_state
from ckptstore.testing.proxy import FaultProxy, ProxyFault

SEAWEED_BUCKET = "ckptstore-verified-writes"
#: Small parts, so that a few MiB make a multipart upload.
PARTS = {"part_size": "5MiB", "multipart_threshold": "5MiB"}
#: The request of each dialect that carries an object's bytes.
UPLOADS = {"s3": frozenset({"put_object", "upload_part"}), "gcs": frozenset({"upload"})}


def _server(request: pytest.FixtureRequest, kind: str) -> tuple[str, str, str, dict[str, str]]:
    """``(dialect, endpoint, bucket, options)`` of the real server ``kind``."""
    if kind == "moto":
        moto = request.getfixturevalue("moto_s3")
        return "s3", moto.endpoint, moto.bucket, {"region": moto.region}
    if kind == "seaweedfs":
        seaweed = request.getfixturevalue("seaweedfs")
        seaweed.create_bucket(SEAWEED_BUCKET)
        return "s3", seaweed.s3_endpoint, SEAWEED_BUCKET, {"anonymous": "true"}
    fake = request.getfixturevalue("fake_gcs")
    return "gcs", fake.endpoint, request.getfixturevalue("gcs_bucket"), {"token": "anon"}


def _url(dialect: str, endpoint: str, bucket: str, options: dict[str, str]) -> str:
    query = urllib.parse.urlencode({**options, "endpoint_url": endpoint})
    scheme = "s3" if dialect == "s3" else "gs"
    return f"{scheme}://{bucket}/vw-{uuid.uuid4().hex[:10]}?{query}"


SERVERS = [
    pytest.param("moto", marks=pytest.mark.s3),
    pytest.param("seaweedfs", marks=pytest.mark.s3),
    pytest.param("gcs", marks=pytest.mark.gcs),
]
#: What each server does with a body that fails its checksum: refuse it (or, for GCS, let the
#: store see the difference) or store it.
VERIFIES = {"moto": False, "seaweedfs": True, "gcs": True}


@pytest.mark.parametrize("kind", SERVERS)
@pytest.mark.parametrize("size", [1 << 20, 12 << 20], ids=["one request", "multipart"])
def test_a_body_damaged_on_the_way_is_stored_only_where_writes_are_not_verified(
    request: pytest.FixtureRequest, kind: str, size: int
) -> None:
    dialect, endpoint, bucket, options = _server(request, kind)
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    with FaultProxy(endpoint, dialect=dialect) as proxy:
        url = _url(dialect, proxy.endpoint, bucket, {**options, **PARTS})

        async def put_and_read() -> tuple[bool, bytes]:
            async with open_store(url) as store:
                verified = await store.writes_verified()
                proxy.set_faults([ProxyFault("corrupt_request", ops=UPLOADS[dialect], times=1)])
                await store.put("obj", data)
                proxy.set_faults([])
                return verified, await store.get("obj")

        verified, stored = asyncio.run(put_and_read())
        assert proxy.injected["corrupt_request"] == 1
    assert verified is VERIFIES[kind]
    if verified:  # refused (S3) or noticed (GCS), sent again: the object holds what was sent
        assert stored == data
    else:  # moto keeps the damaged body: why a copy to it must read back
        assert len(stored) == len(data)
        assert stored != data


@pytest.mark.parametrize(
    ("url", "verified"), [("memory://vw-{}", False), ("{tmp}/vw-{}", False)], ids=["memory", "dir"]
)
def test_stores_without_a_write_check_say_so(tmp_path: Path, url: str, verified: bool) -> None:
    async def ask() -> bool:
        async with open_store(url.format(uuid.uuid4().hex, tmp=tmp_path)) as store:
            return await store.writes_verified()

    assert asyncio.run(ask()) is verified


def _state(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((1024, 1536), dtype=np.float32),  # 6 MiB: a multipart upload
        "small": [rng.standard_normal(64, dtype=np.float32) for _ in range(8)],
        "step": seed,
    }


async def _copy(src: str, dst: Store) -> tuple[CopyReport, int]:
    """Copy step 1 of ``src`` to ``dst``; the report, and the bytes read back from ``dst``."""
    counting = CountingStore(dst)
    async with open_store(src) as source:
        report = await copy_step(source, counting, 1)
    return report, counting.bytes["read"] + counting.bytes["get"]


@pytest.mark.parametrize("kind", SERVERS)
def test_a_copy_reads_back_only_where_the_destination_does_not_verify_writes(
    request: pytest.FixtureRequest, tmp_path: Path, kind: str
) -> None:
    dialect, endpoint, bucket, options = _server(request, kind)
    url = _url(dialect, endpoint, bucket, {**options, **PARTS})
    ckptstore.save(str(tmp_path), _state(1), step=1)
    nbytes = ckptstore.read_manifest(str(tmp_path), 1).own_bytes

    async def run() -> tuple[CopyReport, int]:
        async with open_store(url) as dst:
            return await _copy(str(tmp_path), dst)

    report, read = asyncio.run(run())
    assert report.read_back is not VERIFIES[kind]
    if report.read_back:
        assert read >= nbytes  # every object copied was read back
    else:
        assert read < 64 << 10  # manifests and the lease only: no object is read back
    assert_same_state(ckptstore.load(url, 1), _state(1))


@pytest.mark.s3
def test_a_copy_through_a_network_that_damages_uploads_commits_intact(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Without the read-back, the destination's refusals are what keep a damaged upload
    out: every third upload is damaged on the way, the copy commits, and loads bit-exact."""
    dialect, endpoint, bucket, options = _server(request, "seaweedfs")
    ckptstore.save(str(tmp_path), _state(1), step=1)
    with FaultProxy(endpoint, dialect=dialect) as proxy:
        url = _url(dialect, proxy.endpoint, bucket, {**options, **PARTS})

        async def run() -> CopyReport:
            async with open_store(url) as dst:
                await dst.writes_verified()  # probed before the damage starts
                proxy.set_faults([ProxyFault("corrupt_request", ops=UPLOADS["s3"], every=3)])
                return (await _copy(str(tmp_path), dst))[0]

        report = asyncio.run(run())
        assert proxy.injected["corrupt_request"] >= 2, proxy.injected
        proxy.set_faults([])
        assert not report.read_back
        assert_same_state(ckptstore.load(url, 1), _state(1))


@pytest.mark.gcs
def test_a_gcs_server_that_does_not_report_the_checksum_is_not_trusted(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """The GCS store's claim rests on the crc32c each upload's answer reports: where an
    answer leaves it out, nothing was compared, so the copy reads back."""
    dialect, endpoint, bucket, options = _server(request, "gcs")
    ckptstore.save(str(tmp_path), _state(1), step=1)
    with FaultProxy(endpoint, dialect=dialect) as proxy:
        url = _url(dialect, proxy.endpoint, bucket, {**options, **PARTS})
        proxy.set_faults([ProxyFault("drop_checksum", ops=UPLOADS["gcs"])])

        async def run() -> tuple[bool, CopyReport, int]:
            async with open_store(url) as dst:
                before = await dst.writes_verified()
                report, read = await _copy(str(tmp_path), dst)
                return before, report, read

        before, report, read = asyncio.run(run())
        assert proxy.injected["drop_checksum"] >= 2
        proxy.set_faults([])
        assert_same_state(ckptstore.load(url, 1), _state(1))
    assert before  # no upload had answered yet
    assert report.read_back
    assert read >= ckptstore.read_manifest(str(tmp_path), 1).own_bytes


# ----------------------------------------------------------------- every byte hashed once


class _Hashed:
    """Counts the bytes ckptstore hashes while it is entered: its calls of the ``crc32c``
    package's one function, which every hashing path of ckptstore ends in (moto's server,
    a thread of this process, hashes what it is sent too; it is not counted). Calls on
    fewer than ``smallest`` bytes are not counted."""

    def __init__(self, smallest: int = 0) -> None:
        self.smallest = smallest
        self.sizes: list[int] = []

    def __enter__(self) -> _Hashed:
        import crc32c

        self._real = real = crc32c.crc32c

        def counting(data: Any, value: int = 0) -> int:
            size = memoryview(data).nbytes
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if size >= self.smallest and caller.startswith("ckptstore."):
                self.sizes.append(size)
            return real(data, value)

        crc32c.crc32c = counting
        return self

    def __exit__(self, *exc: object) -> None:
        import crc32c

        crc32c.crc32c = self._real

    @property
    def total(self) -> int:
        return sum(self.sizes)


@pytest.mark.parametrize("kind", SERVERS)
@pytest.mark.parametrize("size", [1 << 20, 12 << 20], ids=["one request", "multipart"])
@pytest.mark.parametrize("way", ["upload", "download"])
def test_a_copy_hashes_every_byte_once(
    request: pytest.FixtureRequest, tmp_path: Path, kind: str, size: int, way: str
) -> None:
    """The copy's own crc32c and the one the server is sent (or, downloading, the one read
    while the bytes arrive) are one computation: the bytes are hashed once, not twice."""
    import crc32c

    from ckptstore.store.transfer import copy_object

    dialect, endpoint, bucket, options = _server(request, kind)
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()

    async def copy() -> tuple[int, int, bytes]:
        async with (
            open_store(str(tmp_path / "local")) as local,
            open_store(_url(dialect, endpoint, bucket, {**options, **PARTS})) as remote,
        ):
            src, dst = (local, remote) if way == "upload" else (remote, local)
            await src.put("obj", data)
            with _Hashed() as hashed:
                crc = await copy_object(src, dst, "obj", size, dst_key="copy")
            return crc, hashed.total, await dst.get("copy")

    crc, counted, stored = asyncio.run(copy())
    assert crc == crc32c.crc32c(data)
    assert stored == data
    assert counted == size


@pytest.mark.parametrize("kind", SERVERS)
def test_a_save_hashes_each_object_once(request: pytest.FixtureRequest, kind: str) -> None:
    """A pack's crc32c (built with it) and a large leaf's (combined from its parts') are
    the ones sent with the bodies: each object's bytes are hashed once as a whole, besides
    the packed leaves' own checksums."""
    dialect, endpoint, bucket, options = _server(request, kind)
    url = _url(dialect, endpoint, bucket, {**options, **PARTS})
    rng = np.random.default_rng(7)
    state = {
        "big": rng.standard_normal(3 << 20).astype(np.float32),  # 12 MiB: 3 parts
        "small": [rng.standard_normal(1024).astype(np.float32) for _ in range(100)],
    }
    with _Hashed(smallest=64 << 10) as hashed:  # objects and parts, not 4 KiB leaves
        ckptstore.save(url, state, step=1)
    assert_same_state(ckptstore.load(url, 1), state)

    async def lengths() -> list[int]:
        async with open_store(url) as store:
            return list((await read_manifest(store, 1)).object_lengths)

    sizes = asyncio.run(lengths())
    assert len([n for n in sizes if n >= 64 << 10]) == 2  # the big leaf and the pack
    assert hashed.total == sum(n for n in sizes if n >= 64 << 10)


@pytest.mark.parametrize("kind", [k for k in SERVERS if k.values[0] != "moto"])
@pytest.mark.parametrize("size", [1 << 20, 12 << 20], ids=["one request", "multipart"])
def test_a_wrong_crc32c_given_with_a_write_is_refused(
    request: pytest.FixtureRequest, kind: str, size: int
) -> None:
    """A caller's crc32c goes to the server in place of the body's own: where writes are
    verified, one that is not the bytes' fails the write. An S3 server refuses the body;
    the GCS store sees the server's checksum of what it stored differ from the one sent
    (a fake server may keep the object, whose bytes are the ones sent)."""
    import crc32c

    from ckptstore.errors import CkptStoreError, NotFoundError

    dialect, endpoint, bucket, options = _server(request, kind)
    data = np.random.default_rng(3).integers(0, 256, size, dtype=np.uint8).tobytes()

    async def put_wrong(store: Store) -> None:
        if size < 5 << 20:
            await store.put("wrong", data, crc32c=crc32c.crc32c(data) ^ 1)
            return
        async with await store.create_multipart("wrong", part_size=5 << 20) as upload:
            part = data[: 5 << 20]
            await upload.put_part(0, part, crc32c=crc32c.crc32c(part) ^ 1)
            await upload.complete()

    async def attempt() -> None:
        async with open_store(_url(dialect, endpoint, bucket, {**options, **PARTS})) as store:
            await store.put("right", data, crc32c=crc32c.crc32c(data))
            assert await store.get("right") == data
            with pytest.raises(CkptStoreError):
                await put_wrong(store)
            if dialect == "s3":
                with pytest.raises(NotFoundError):
                    await store.head("wrong")
            else:
                with contextlib.suppress(NotFoundError):
                    assert await store.get("wrong") == data[: 5 << 20]

    asyncio.run(attempt())


def test_a_ledger_gives_a_whole_from_the_parts_that_tile_it() -> None:
    import crc32c

    from ckptstore.store.checksum import Ledger

    data = np.random.default_rng(5).integers(0, 256, 10_000, dtype=np.uint8)
    book = Ledger()
    for start in range(0, 10_000, 3_000):
        part = data[start : start + 3_000]
        book.record(part, crc32c.crc32c(part))
    assert book.crc_of(data) == crc32c.crc32c(data)
    assert book.crc_of(data[:6_000]) == crc32c.crc32c(data[:6_000])
    assert book.crc_of(data[:5_000]) is None  # ends inside a part
    assert book.crc_of(data[1:]) is None  # starts inside one
    assert Ledger().crc_of(data) is None
