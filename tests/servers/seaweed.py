"""Session-scoped SeaweedFS fixtures: one ``weed mini`` (S3 over HTTP and HTTPS, anonymous) per
test session, and its filer mounted over FUSE for the ``nfs://`` backend's tests.

Tests that use them should carry the ``s3`` or ``nfs`` marker. The mount fixture skips, with
the reason, only on machines that cannot FUSE-mount at all; a missing ``weed`` is an error,
since ``pip install -e '.[test]'`` installs it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ckptstore.testing.servers import FuseMount, SeaweedFS, fuse_unavailable_reason


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    """A running SeaweedFS with anonymous S3 on ``s3_endpoint`` and ``s3_https_endpoint``
    (self-signed; verify with ``ca_file``). Buckets are shared by the session: create your own
    with ``create_bucket`` and use unique key prefixes."""
    with SeaweedFS(tmp_path_factory.mktemp("seaweedfs"), tls=True) as server:
        yield server


@pytest.fixture(scope="session")
def seaweedfs_mount(seaweedfs: SeaweedFS) -> Iterator[FuseMount]:
    """The SeaweedFS filer mounted over FUSE; ``.path`` is the mount point. Tests work in
    their own subdirectory of it."""
    reason = fuse_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with seaweedfs.mount(seaweedfs.workdir / "mnt") as mount:
        yield mount


@pytest.fixture(scope="session")
def seaweedfs_second_mount(seaweedfs: SeaweedFS, seaweedfs_mount: FuseMount) -> Iterator[FuseMount]:
    """A second ``weed mount`` of the same filer: another client of the same network
    filesystem, for tests whose processes must not share one client's caches."""
    with seaweedfs.mount(seaweedfs.workdir / "mnt-second") as mount:
        yield mount
