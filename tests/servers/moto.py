"""moto's S3 server on 127.0.0.1, for the S3 backend's conformance tests.

One ``ThreadedMotoServer`` per test session (it runs in a thread of the test process, on a
free port); every test that asks for ``moto_s3`` gets its state reset through moto's reset API
and a fresh bucket, and the ``AWS_*`` variables the S3 client reads are set only for that test.
moto is pure Python and CPU-bound: it is for correctness, not for speed.
"""

from __future__ import annotations

import logging
import threading
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

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


def _atomic_conditional_writes(app: Callable[..., Any]) -> Callable[..., Any]:
    """``app`` with its conditional writes made one at a time, as on S3.

    moto 5.2.1 answers ``If-None-Match: *`` on PutObject and CompleteMultipartUpload by
    looking the key up and then writing it (``s3/responses.py``), each request on its own
    server thread: two racing creators can both pass the check. A full run saw 2 winners
    of 8 racing ``put(mode="create")``; with ``sys.setswitchinterval(1e-6)`` 1 round in 60
    did. S3 itself decides such requests atomically, and so must the server our tests of
    the commit protocol run against: requests that carry a condition run under one lock.
    """
    lock = threading.Lock()

    def serve(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        conditional = environ.get("REQUEST_METHOD") in ("PUT", "POST") and (
            "HTTP_IF_NONE_MATCH" in environ or "HTTP_IF_MATCH" in environ
        )
        if not conditional:
            return app(environ, start_response)
        with lock:
            return list(app(environ, start_response))

    return serve


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoS3]:
    """A moto S3 server for the whole session."""
    pytest.importorskip("moto", reason="moto[server] is in the test extra")
    from moto.server import DomainDispatcherApplication, ThreadedMotoServer, create_backend_app
    from werkzeug.serving import make_server

    class AtomicMotoServer(ThreadedMotoServer):
        def _server_entry(self) -> None:  # ThreadedMotoServer's, with the app wrapped
            app = _atomic_conditional_writes(DomainDispatcherApplication(create_backend_app))
            self._server = make_server(self._ip_address, self._port, app, True)
            self._server_ready_event.set()
            self._server.serve_forever()

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = AtomicMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
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
