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

__all__ = ["FakeGCS", "fake_gcs", "fault_proxy", "gcs_bucket"]


@pytest.fixture(scope="session")
def fake_gcs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeGCS]:
    """A running fake-gcs-server; its endpoint is ``fake_gcs.endpoint``."""
    with FakeGCS.start(tmp_path_factory.mktemp("fake-gcs")) as server:
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
