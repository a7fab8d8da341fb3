"""The SeaweedFS test servers do what the other tests rely on."""

from __future__ import annotations

import os
import ssl
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from ckptstore.testing.servers import FuseMount, SeaweedFS, free_ports, process_is


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


@pytest.mark.s3
def test_seaweedfs_binds_loopback_only(seaweedfs: SeaweedFS) -> None:
    assert process_is(seaweedfs.pid, "weed")
    listening = Path("/proc/net/tcp").read_text().splitlines()[1:]
    ours = {int(p) for p in seaweedfs.ports.values()}
    bound = {}
    for line in listening:
        local, state = line.split()[1], line.split()[3]
        host, port = local.split(":")
        if state == "0A" and int(port, 16) in ours:  # LISTEN
            bound[int(port, 16)] = host
    assert set(bound) == ours
    assert set(bound.values()) == {"0100007F"}  # 127.0.0.1
    assert not (
        Path("/proc/net/tcp6").exists()
        and any(
            int(line.split()[1].split(":")[1], 16) in ours
            for line in Path("/proc/net/tcp6").read_text().splitlines()[1:]
        )
    )


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
    assert not process_is(pid, "weed")


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
    (mount.path / "written-through-extra").write_bytes(b"x")
    mount.stop()
    assert not os.path.ismount(tmp_path / "extra-mnt")
    assert not process_is(pid, "weed")
    assert os.listdir(tmp_path / "extra-mnt") == []
