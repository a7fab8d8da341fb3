"""The SeaweedFS test servers do what the other tests rely on."""

from __future__ import annotations

import contextlib
import json
import os
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from ckptstore.testing.servers import (
    FuseMount,
    SeaweedFS,
    free_ports,
    fuse_unavailable_reason,
    process_is,
)

ROOT = Path(__file__).resolve().parent.parent


def test_free_ports_are_distinct_loopback_ports() -> None:
    ports = free_ports(12)
    assert len(set(ports)) == 12
    assert all(0 < p < 65536 for p in ports)


@pytest.mark.s3
def test_seaweedfs_serves_s3_over_http_and_https(seaweedfs: SeaweedFS) -> None:
    bucket = "servers-" + uuid.uuid4().hex[:8]
    seaweedfs.create_bucket(bucket)
    seaweedfs.create_bucket(bucket)  # an existing bucket is fine
    http, https = seaweedfs.s3_client(), seaweedfs.s3_client(https=True)
    try:
        http.put_object(Bucket=bucket, Key="a/b", Body=b"over http")
        assert https.get_object(Bucket=bucket, Key="a/b")["Body"].read() == b"over http"
    finally:
        http.close()
        https.close()
    assert seaweedfs.s3_https_endpoint.startswith("https://127.0.0.1:")
    # the certificate verifies against ca_file, and only against it
    context = ssl.create_default_context(cafile=str(seaweedfs.ca_file))
    with urllib.request.urlopen(seaweedfs.s3_https_endpoint + "/", context=context) as response:
        assert response.status == 200
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        urllib.request.urlopen(seaweedfs.s3_https_endpoint + "/", timeout=10)


def _listening_sockets(pid: int) -> list[tuple[str, int]]:
    """(local address in /proc hex, port) of every TCP socket ``pid`` listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            host, port = fields[1].split(":")
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.append((host, int(port, 16)))
    return found


@pytest.mark.s3
def test_seaweedfs_listens_only_on_its_given_loopback_ports(seaweedfs: SeaweedFS) -> None:
    assert process_is(seaweedfs.pid, "weed")
    listening = _listening_sockets(seaweedfs.pid)
    assert {port for _, port in listening} == set(seaweedfs.ports.values())
    assert {host for host, _ in listening} == {"0100007F"}  # 127.0.0.1, nothing else


@pytest.mark.s3
def test_credentials_refuse_anonymous_requests(tmp_path: Path) -> None:
    with SeaweedFS(tmp_path, access_key="ckptstoretest", secret_key="not-a-secret") as server:
        server.create_bucket("creds")
        client = server.s3_client()
        try:
            client.put_object(Bucket="creds", Key="k", Body=b"signed")
        finally:
            client.close()
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(server.s3_endpoint + "/creds/k", timeout=10)
        info.value.close()
        assert info.value.code == 403
        pid = server.pid
        grpc_ports = [port for name, port in server.ports.items() if name.endswith("_grpc")]
    assert not process_is(pid, "weed")
    for port in grpc_ports:  # weed's fixed-path unix sockets are cleaned up too
        assert not list(Path("/tmp").glob(f"seaweedfs-*-grpc-{port}.sock"))


@pytest.mark.nfs
def test_mount_shows_what_s3_wrote(seaweedfs: SeaweedFS, seaweedfs_mount: FuseMount) -> None:
    bucket = "mounted-" + uuid.uuid4().hex[:8]
    seaweedfs.create_bucket(bucket)
    client = seaweedfs.s3_client()
    try:
        client.put_object(Bucket=bucket, Key="dir/obj", Body=b"via s3")
    finally:
        client.close()
    assert os.path.ismount(seaweedfs_mount.path)
    assert (seaweedfs_mount.path / "buckets" / bucket / "dir" / "obj").read_bytes() == b"via s3"


@pytest.mark.nfs
def test_mount_stops_cleanly(seaweedfs: SeaweedFS, tmp_path: Path) -> None:
    mount = seaweedfs.mount(tmp_path / "extra-mnt", filer_path="/")
    pid = mount.pid
    assert _listening_sockets(pid) == []  # the FUSE client opens no server port
    (mount.path / "written-through-extra").write_bytes(b"x")
    mount.stop()
    assert not os.path.ismount(tmp_path / "extra-mnt")
    assert not process_is(pid, "weed")
    assert os.listdir(tmp_path / "extra-mnt") == []


@pytest.mark.nfs
def test_script_starts_reports_and_stops_a_server(tmp_path: Path) -> None:
    if fuse_unavailable_reason() is not None:
        pytest.skip(fuse_unavailable_reason())
    script = [sys.executable, str(ROOT / "scripts" / "seaweedfs.py")]
    workdir, mnt = tmp_path / "sw", tmp_path / "mnt"

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*script, *args, "--dir", str(workdir)],
            capture_output=True,
            text=True,
            timeout=120,
        )

    started = run("start", "--mount", str(mnt), "--tls")
    assert started.returncode == 0, started.stderr
    state = json.loads((workdir / "state.json").read_text())
    try:
        assert process_is(state["pid"], "weed")
        assert process_is(state["mount"]["pid"], "weed")
        assert os.path.ismount(mnt)
        assert state["s3_https_endpoint"].startswith("https://127.0.0.1:")
        assert run("start").returncode == 1  # refuses to start a second one
        status = run("status")
        assert status.returncode == 0
        assert json.loads(status.stdout)["running"] is True
    finally:
        stopped = run("stop")
    assert stopped.returncode == 0, stopped.stderr
    assert not process_is(state["pid"], "weed")
    assert not process_is(state["mount"]["pid"], "weed")
    assert not os.path.ismount(mnt)
    assert run("status").returncode == 1
