"""moto's S3 server on 127.0.0.1, for the S3 backend's conformance tests.

One ``ThreadedMotoServer`` per test session (it runs in a thread of the test process, on a
free port); every test that asks for ``moto_s3`` gets its state reset through moto's reset API
and a fresh bucket, and the ``AWS_*`` variables the S3 client reads are set only for that test.
moto is pure Python and CPU-bound: it is for correctness, not for speed.
"""

from __future__ import annotations

import logging
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

__all__ = ["MotoS3", "moto_s3", "moto_server"]

BUCKET = "ckptstore-test"


@dataclass(frozen=True)
class MotoS3:
    """Where the moto server listens and which bucket a test may use."""

    endpoint: str
    bucket: str = BUCKET
    access_key: str = "moto-access-key"
    secret_key: str = "moto-secret-key"
    region: str = "us-east-1"

    def options(self) -> dict[str, str]:
        """The ``open_store``/``S3Store`` options that reach this server."""
        return {"endpoint_url": self.endpoint, "region": self.region}

    def reset(self) -> None:
        request = urllib.request.Request(self.endpoint + "/moto-api/reset", method="POST")
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()

    def client(self) -> object:
        """A synchronous botocore client (checks in tests)."""
        import botocore.session

        return botocore.session.get_session().create_client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=self.region,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
        )


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoS3]:
    """A moto S3 server for the whole session."""
    pytest.importorskip("moto", reason="moto[server] is in the test extra")
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield MotoS3(endpoint=f"http://{host}:{port}")
    finally:
        server.stop()


@pytest.fixture
def moto_s3(moto_server: MotoS3, monkeypatch: pytest.MonkeyPatch) -> MotoS3:
    """The session's moto server, reset, with an empty bucket and AWS_* set for this test."""
    moto_server.reset()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", moto_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", moto_server.secret_key)
    monkeypatch.setenv("AWS_DEFAULT_REGION", moto_server.region)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    client = moto_server.client()
    client.create_bucket(Bucket=moto_server.bucket)  # type: ignore[attr-defined]
    client.close()  # type: ignore[attr-defined]
    return moto_server
