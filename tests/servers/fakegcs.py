"""Session fixtures for fake-gcs-server (see :mod:`ckptstore.testing.fakegcs`), and the fault
proxy in front of it (:mod:`ckptstore.testing.proxy`)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from ckptstore.testing.fakegcs import FakeGCS
from ckptstore.testing.proxy import FaultProxy

# gcsfs's exported class otherwise probes every bucket over gRPC for zonal/HNS features, a
# 60 s timeout per bucket against an emulator. It reads this when gcsfs is first imported.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"

__all__ = ["FakeGCS", "fake_gcs", "fake_gcs_in_memory", "fault_proxy", "gcs_bucket"]


@pytest.fixture(scope="session")
def fake_gcs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeGCS]:
    """A running fake-gcs-server; its endpoint is ``fake_gcs.endpoint``."""
    with FakeGCS.start(tmp_path_factory.mktemp("fake-gcs")) as server:
        yield server


@pytest.fixture(scope="session")
def fake_gcs_in_memory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeGCS]:
    """A second fake-gcs-server that keeps objects in its own memory, started only for the
    test that uploads a 2 GiB object through gcsfs (resumable chunks): with the filesystem
    backend that emulator peaked at 9.4-9.7 GB, holding several copies of the object at
    once; with this one at 6.7 GB (2026-11-27). The store's own uploads (compose of parts) go
    the other way, 6.2 GB on the filesystem backend and 11.1 GB in memory, so they stay on
    :func:`fake_gcs`."""
    with FakeGCS.start(tmp_path_factory.mktemp("fake-gcs-memory"), backend="memory") as server:
        yield server


@pytest.fixture(scope="session")
def gcs_bucket(fake_gcs: FakeGCS) -> str:
    """A bucket shared by the session; tests keep apart by a unique prefix each."""
    return fake_gcs.create_bucket(f"ckptstore-{uuid.uuid4().hex[:8]}")


@pytest.fixture
def fault_proxy(fake_gcs: FakeGCS) -> Iterator[FaultProxy]:
    """A recording, fault-injecting proxy (GCS dialect) in front of the session's
    fake-gcs-server; it starts with no rules."""
    with FaultProxy(fake_gcs.endpoint, dialect="gcs") as proxy:
        yield proxy
