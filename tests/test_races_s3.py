"""Racing processes on S3 (moto and SeaweedFS): separate interpreters, each with its own client
and connections, commit the same step, or put-if-absent the same multipart object, at once.

tests/test_store_s3.py races several clients inside one process; here nothing is shared but
the server, as between the hosts of a training job. Exactly one racer wins, every other one
gets a conflict, what the server holds is the winner's, and gc leaves nothing of the losers.
"""

from __future__ import annotations

import urllib.parse
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import ckptstore
from ckptstore import background
from ckptstore.layout.commit import is_own_key
from ckptstore.store.registry import open_store
from ckptstore.testing import assert_same_state
from tests.racers import CREATE_RACER, SAVE_RACER, one_winner, race

pytestmark = pytest.mark.s3

RACERS = 4
SEAWEED_BUCKET = "ckptstore-race-tests"


@dataclass
class Root:
    """A fresh prefix of a bucket, as a URL whose query reaches the server, and a botocore
    client to ask the server directly."""

    url: str
    client: Any
    bucket: str
    prefix: str

    def raw_keys(self) -> list[str]:
        page = self.client.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix + "/")
        return sorted(item["Key"][len(self.prefix) + 1 :] for item in page.get("Contents", []))

    def open_uploads(self) -> list[str]:
        page = self.client.list_multipart_uploads(Bucket=self.bucket, Prefix=self.prefix + "/")
        return [item["Key"] for item in page.get("Uploads", [])]


@pytest.fixture(params=["moto", "seaweedfs"])
def root(request: pytest.FixtureRequest) -> Iterator[Root]:
    prefix = f"race-{uuid.uuid4().hex[:10]}"
    if request.param == "moto":
        moto = request.getfixturevalue("moto_s3")  # AWS_* set for this test and its children
        bucket, options, client = moto.bucket, moto.options(), moto.client()
    else:
        server = request.getfixturevalue("seaweedfs")
        server.create_bucket(SEAWEED_BUCKET)
        bucket, client = SEAWEED_BUCKET, server.s3_client()
        options = {"endpoint_url": server.s3_endpoint, "anonymous": "true"}
    yield Root(f"s3://{bucket}/{prefix}?{urllib.parse.urlencode(options)}", client, bucket, prefix)
    client.close()


def test_racing_savers_in_separate_processes_commit_once(root: Root) -> None:
    outputs = race(SAVE_RACER, [[root.url, str(i)] for i in range(RACERS)])
    who, attempt = one_winner(outputs)
    assert ckptstore.read_manifest(root.url, 7).attempt == attempt
    loaded = ckptstore.load(root.url, step=7)
    assert loaded["who"] == who
    assert_same_state(loaded["data"], np.full(200_000, who, np.int64))

    ckptstore.gc(root.url, grace=0)  # the losers' objects go; the winner's stay
    keys = root.raw_keys()
    assert "7/manifest.json" in keys
    assert all(is_own_key(k) for k in keys), keys
    assert all(k == "7/manifest.json" or k.startswith(f"7/{attempt}/") for k in keys), keys
    assert root.open_uploads() == []
    assert_same_state(ckptstore.load(root.url, step=7)["data"], np.full(200_000, who, np.int64))


def test_racing_multipart_creators_in_separate_processes_have_one_winner(root: Root) -> None:
    # 11 MiB in 5 MiB parts: three-part uploads whose CompleteMultipartUpload the servers
    # check non-atomically, so only the store's create lock keeps the race to one winner
    url = root.url + "&part_size=5MiB&multipart_threshold=6MiB"
    size = 11 << 20
    for _round in range(2):
        outputs = race(CREATE_RACER, [[url, str(i), str(size)] for i in range(RACERS)])
        who, said = one_winner(outputs)
        assert said == str(who)

        async def check(winner: int) -> None:
            async with open_store(url) as store:
                assert await store.get("race/object") == bytes([winner]) * size
                await store.delete(["race/object"])

        background.run(check(who))
        assert root.open_uploads() == []
        assert root.raw_keys() == []  # no create locks or probe objects left behind
