"""The faces conformance suite (ckptstore.testing.FaceTests, issue 28 item 7) on every face
that saves and every face that restores, on local disk, with the credential checks on a real
S3 server (moto).

The default run takes every saver into ``load`` and every loader from ``save``, and each
check that needs one face on every face; ``--full`` runs the whole saver x loader matrix.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("lightning")

from ckptstore.testing.face_tests import FaceTests, S3Place
from ckptstore.testing.faces import LOADERS, SAVERS, Face
from tests import matrix
from tests.servers.moto import MotoS3

pytestmark = [
    pytest.mark.torch,
    pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning"),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),  # lightning vs torch 2.13
]


def _pairs() -> list[Any]:
    """saver x loader: all of them under --full; by default the ones that meet `save` or
    `load`, and each face with itself."""
    out = []
    for saver in SAVERS:
        for loader in LOADERS:
            meets = saver.name in ("save", loader.name) or loader.name in ("load", saver.name)
            if matrix.FULL or meets:
                out.append(pytest.param(saver, loader, id=f"{saver.name}-to-{loader.name}"))
    return out


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    names = metafunc.fixturenames
    if "saver" in names and "loader" in names:
        metafunc.parametrize(("saver", "loader"), _pairs())
    elif "saver" in names:
        metafunc.parametrize("saver", SAVERS, ids=[f.name for f in SAVERS])
    elif "loader" in names:
        metafunc.parametrize("loader", LOADERS, ids=[f.name for f in LOADERS])


@pytest.fixture
def s3(moto_s3: MotoS3) -> S3Place:
    """A fresh prefix of the moto bucket; the secret is a marker no test used before (moto
    takes any key pair)."""
    secret = f"SECRET{uuid.uuid4().hex}"
    options = {
        **moto_s3.options(),
        "access_key_id": f"AKID{uuid.uuid4().hex[:12]}",
        "secret_access_key": secret,
    }

    def objects() -> list[tuple[str, bytes]]:
        client: Any = moto_s3.client()
        try:
            listed = client.list_objects_v2(Bucket=moto_s3.bucket).get("Contents", [])
            return [
                (o["Key"], client.get_object(Bucket=moto_s3.bucket, Key=o["Key"])["Body"].read())
                for o in listed
            ]
        finally:
            client.close()

    return S3Place(f"s3://{moto_s3.bucket}/run-{uuid.uuid4().hex[:8]}", options, secret, objects)


class TestFaces(FaceTests):
    pass


def test_the_suite_covers_at_least_eight_faces() -> None:
    assert len(SAVERS) >= 8
    assert len(LOADERS) >= 8
    assert all(isinstance(f, Face) for f in SAVERS + LOADERS)
