"""Garbage collection end to end on the object stores, against real servers.

What a crashed save leaves behind differs by backend, and so does what gc must find:

* S3 (moto and SeaweedFS): objects of the abandoned attempt, a multipart upload that was
  never completed nor aborted (S3 bills its parts until it is aborted), and the create lock of
  a put-if-absent multipart creator that died (which would refuse every later creator).
* GCS (fake-gcs-server): objects of the abandoned attempt, and the part temporaries a writer
  that died before ``compose`` left beside the key (never listed, so only gc finds them).

Each backend runs ``ckptstore.gc()`` on the URL and the ``ckptstore gc`` command in a
subprocess: inside the grace period nothing is touched; with a grace of zero the abandoned
attempt and the dead writer's in-progress writes go, and the committed step, byte for byte,
stays. What is left is asked of the server directly, not through the store under test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

import ckptstore
from ckptstore import background
from ckptstore.layout.keys import new_attempt_id
from ckptstore.store.base import TEMP_PREFIX, Store
from ckptstore.store.registry import open_store
from ckptstore.testing import assert_same_state
from tests.children import python_path

SEAWEED_BUCKET = "ckptstore-gc-tests"


@dataclass
class Backend:
    """A checkpoint root on one server, and how to see what the server really holds.

    Attributes:
        url: the root, with the options that reach the server in its query.
        options: the same options, for ``ckptstore gc -o``.
        raw_names: every object name under the root, scratch objects included.
        open_uploads: keys of multipart uploads still open under the root (S3 only).
        lock_dies_with_writer: whether a multipart put-if-absent leaves a create lock.
        dates_uploads: whether the server says when a multipart upload started. moto (5.x)
            answers ListMultipartUploads with one fixed date in 2010, so there every upload
            looks stale and the grace period cannot be checked against uploads.
    """

    url: str
    options: dict[str, str]
    raw_names: Callable[[], list[str]]
    open_uploads: Callable[[], list[str]] = field(default=lambda: [])
    lock_dies_with_writer: bool = False
    dates_uploads: bool = True

    def store(self) -> Store:
        return open_store(self.url)


def _s3_backend(
    client: Any, bucket: str, options: dict[str, str], *, dates_uploads: bool
) -> Backend:
    prefix = f"gc-{uuid.uuid4().hex[:10]}"

    def raw_names() -> list[str]:
        page = client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/")
        return sorted(item["Key"][len(prefix) + 1 :] for item in page.get("Contents", []))

    def open_uploads() -> list[str]:
        page = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix + "/")
        return sorted(item["Key"][len(prefix) + 1 :] for item in page.get("Uploads", []))

    query = urllib.parse.urlencode(options)
    return Backend(
        f"s3://{bucket}/{prefix}?{query}",
        options,
        raw_names,
        open_uploads,
        lock_dies_with_writer=True,
        dates_uploads=dates_uploads,
    )


@pytest.fixture(
    params=[
        pytest.param("moto", marks=pytest.mark.s3),
        pytest.param("seaweedfs", marks=pytest.mark.s3),
        pytest.param("gcs", marks=pytest.mark.gcs),
    ]
)
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    if request.param == "moto":
        moto = request.getfixturevalue("moto_s3")  # sets AWS_* for this test (and children)
        client = moto.client()
        yield _s3_backend(client, moto.bucket, moto.options(), dates_uploads=False)
        client.close()
    elif request.param == "seaweedfs":
        server = request.getfixturevalue("seaweedfs")
        server.create_bucket(SEAWEED_BUCKET)
        client = server.s3_client()
        options = {"endpoint_url": server.s3_endpoint, "anonymous": "true"}
        yield _s3_backend(client, SEAWEED_BUCKET, options, dates_uploads=True)
        client.close()
    else:
        fake_gcs = request.getfixturevalue("fake_gcs")
        bucket = request.getfixturevalue("gcs_bucket")
        prefix = f"gc-{uuid.uuid4().hex[:10]}"

        def raw_names() -> list[str]:
            query = urllib.parse.urlencode({"prefix": prefix + "/"})
            url = f"{fake_gcs.endpoint}/storage/v1/b/{bucket}/o?{query}"
            with urllib.request.urlopen(url, timeout=30) as response:
                items = json.load(response).get("items", [])
            return sorted(item["name"][len(prefix) + 1 :] for item in items)

        options = {"endpoint_url": fake_gcs.endpoint, "token": "anon"}
        yield Backend(
            f"gs://{bucket}/{prefix}?{urllib.parse.urlencode(options)}", options, raw_names
        )


def _state() -> dict[str, Any]:
    rng = np.random.default_rng(5)
    return {"w": rng.standard_normal(50_000), "small": [np.arange(i + 3) for i in range(20)]}


@dataclass
class Leftovers:
    """What the crashed save of step 2 left: its attempt prefix and the writes it had open."""

    attempt: str  # "2/<attempt-id>/"
    objects: int  # committed objects under it
    open_writes: int  # in-progress writes gc should remove (uploads, locks, temporaries)


async def _crash_a_save(backend: Backend) -> Leftovers:
    """Commit step 1, then leave what a save of step 2 killed mid-way leaves behind."""
    async with backend.store() as store:
        await ckptstore.asave(store, _state(), step=1)
        attempt = f"2/{new_attempt_id(time.time() - 60)}/"
        for name in ("pack-000000", "pack-000001"):
            await store.put(attempt + name, b"objects of a save that never committed")
        part = max(store.capabilities.min_part_size, 1 << 16)
        # the dead writer's uploads: neither completed nor aborted
        upload = await store.create_multipart(attempt + "big-000000", part_size=part)
        await upload.put_part(0, bytes(part))
        await upload.put_part(1, b"tail")
        open_writes = len([n for n in backend.raw_names() if TEMP_PREFIX in n])
        open_writes += len(backend.open_uploads())
        if backend.lock_dies_with_writer:
            locked = await store.create_multipart(
                attempt + "big-000001", mode="create", part_size=part
            )
            await locked.put_part(0, b"never completed")
            open_writes += 2  # the upload and its create lock
        assert open_writes >= 1
    return Leftovers(attempt, 2, open_writes)


def _committed_only(backend: Backend) -> None:
    """The server holds step 1's manifest and objects and nothing else; step 1 loads."""
    attempt = ckptstore.read_manifest(backend.url, 1).attempt
    names = backend.raw_names()
    assert "1/manifest.json" in names
    assert all(n == "1/manifest.json" or n.startswith(f"1/{attempt}/") for n in names), names
    assert backend.open_uploads() == []
    assert ckptstore.list_steps(backend.url) == [1]
    assert_same_state(ckptstore.load(backend.url, 1), _state())


def test_gc_function_removes_a_crashed_save_and_keeps_the_committed_step(
    backend: Backend,
) -> None:
    left = background.run(_crash_a_save(backend))
    before = backend.raw_names(), backend.open_uploads()

    if backend.dates_uploads:
        kept = ckptstore.gc(backend.url, grace=3600)  # the crashed save could still be running
        assert (kept.removed, kept.stale_writes) == ([], 0)
        assert kept.kept_recent == [left.attempt]
        assert (backend.raw_names(), backend.open_uploads()) == before

    report = ckptstore.gc(backend.url, grace=0)
    assert report.removed == [left.attempt]
    assert report.removed_objects == left.objects
    assert report.stale_writes == left.open_writes
    assert report.kept_recent == report.invalid_steps == []
    _committed_only(backend)
    assert ckptstore.gc(backend.url, grace=0).stale_writes == 0  # nothing left to find


def _gc_command(backend: Backend, *args: str) -> dict[str, Any]:
    url = backend.url.split("?", 1)[0]
    options = [arg for key, value in backend.options.items() for arg in ("-o", f"{key}={value}")]
    result = subprocess.run(
        [sys.executable, "-m", "ckptstore", "gc", url, *options, *args, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": python_path()},
        check=False,
    )
    assert result.returncode == 0, result.stderr
    report: dict[str, Any] = json.loads(result.stdout)
    return report


def test_gc_command_removes_a_crashed_save_and_keeps_the_committed_step(
    backend: Backend,
) -> None:
    left = background.run(_crash_a_save(backend))

    if backend.dates_uploads:
        kept = _gc_command(backend)  # the default grace period: everything is too young
        assert (kept["removed"], kept["stale_writes"]) == ([], 0)
        assert kept["kept_recent"] == [left.attempt]

    report = _gc_command(backend, "--grace", "0")
    assert report["removed"] == [left.attempt]
    assert report["removed_objects"] == left.objects
    assert report["stale_writes"] == left.open_writes
    _committed_only(backend)
