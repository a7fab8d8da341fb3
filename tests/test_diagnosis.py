"""Every failure names its cause (issue 30): an endpoint that is not S3 is named as such
within 2 s, and a missing bucket is "does not exist" on every command and in the API.

SeaweedFS runs every role of a cluster on its own port; pointing ``endpoint_url`` at the
wrong one is the mistake this catches: its filer and master ports answered a listing with a
bare 404 (reported as a missing bucket that exists), its gRPC port with HTTP/2 frames
(retried 10 times over 15 s, then a raw ``Bad status line``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import numpy as np
import pytest

import ckptstore
from ckptstore.cli.main import EXIT_ERROR
from ckptstore.errors import NotFoundError, StoreError
from ckptstore.store.registry import open_store
from tests.test_cli import assert_one_line_error, run

pytestmark = pytest.mark.s3

WRONG_PORTS = {
    "filer": "answered HTTP 404 without an S3 error document",
    "master": "answered HTTP 404 without an S3 error document",
    "s3_grpc": "does not answer in HTTP/1.1",
}


@pytest.fixture(scope="module")
def bucket(seaweedfs: Any) -> str:
    name = f"diag-{uuid.uuid4().hex[:8]}"
    seaweedfs.create_bucket(name)
    return name


@pytest.mark.parametrize("port", list(WRONG_PORTS))
def test_a_port_that_is_not_s3_is_named_within_2_s_by_the_api_and_the_cli(
    seaweedfs: Any, bucket: str, port: str, capsys: pytest.CaptureFixture[str]
) -> None:
    endpoint = f"http://127.0.0.1:{seaweedfs.ports[port]}"
    began = time.monotonic()
    with pytest.raises(StoreError) as raised:
        ckptstore.save(
            f"s3://{bucket}/run", {"w": np.ones(4)}, step=1, endpoint_url=endpoint, anonymous=True
        )
    assert time.monotonic() - began <= 2.0
    assert not isinstance(raised.value, NotFoundError)  # the bucket exists
    message = str(raised.value)
    assert WRONG_PORTS[port] in message
    assert endpoint in message
    assert "check endpoint_url" in message

    options = ["-o", f"endpoint_url={endpoint}", "-o", "anonymous=true"]
    for command in (["ls"], ["gc"]):
        began = time.monotonic()
        status, out, err = run(capsys, *command, f"s3://{bucket}/run", *options)
        assert time.monotonic() - began <= 2.0
        assert status == EXIT_ERROR
        assert out == ""
        assert_one_line_error(err, WRONG_PORTS[port], "check endpoint_url")


def test_a_put_answered_with_a_body_that_is_not_s3s_names_the_endpoint(
    seaweedfs: Any, bucket: str
) -> None:
    """SeaweedFS's filer port answers a PutObject with its own JSON: botocore's parse error
    is no botocore error, and it reached the caller raw. It is now a StoreError that names
    the endpoint and the likely mistake, at once."""
    endpoint = f"http://127.0.0.1:{seaweedfs.ports['filer']}"

    async def put() -> None:
        store = open_store(f"s3://{bucket}/run", endpoint_url=endpoint, anonymous=True)
        try:
            await store.put("probe/object", b"{}")
        finally:
            await store.close()

    began = time.monotonic()
    with pytest.raises(StoreError) as raised:
        asyncio.run(put())
    assert time.monotonic() - began <= 2.0
    message = str(raised.value)
    assert "is not an S3 response" in message
    assert endpoint in message
    assert "check endpoint_url" in message


def test_a_missing_bucket_does_not_exist_on_every_command_and_in_the_api(
    seaweedfs: Any, bucket: str, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    options = {"endpoint_url": seaweedfs.s3_endpoint, "anonymous": True}
    missing = f"s3://no-such-{uuid.uuid4().hex[:8]}/run"
    for call in (
        lambda: ckptstore.save(missing, {"w": np.ones(4)}, step=1, **options),
        lambda: ckptstore.load(missing, **options),
        lambda: ckptstore.list_steps(missing, **options),
        lambda: ckptstore.gc(missing, **options),
    ):
        with pytest.raises(NotFoundError, match="does not exist"):
            call()
    ckptstore.save(tmp_path / "src", {"w": np.ones(4)}, step=1)
    flags = ["-o", f"endpoint_url={seaweedfs.s3_endpoint}", "-o", "anonymous=true"]
    dst_flags = [f.replace("-o", "--dst-option") for f in flags]
    for argv in (
        ["ls", missing, *flags],
        ["show", missing, "1", *flags],
        ["verify", missing, "--all", *flags],
        ["gc", missing, *flags],
        ["rm", missing, "1", *flags],
        ["cp", str(tmp_path / "src"), missing, *dst_flags],
    ):
        status, _, err = run(capsys, *argv)
        assert status == EXIT_ERROR, argv
        assert_one_line_error(err, "does not exist")
