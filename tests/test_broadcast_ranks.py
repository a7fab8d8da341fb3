"""Read once, broadcast on real processes over gloo on 127.0.0.1, on local disk and
SeaweedFS: N ranks loading a replicated model read it from the store about once in all, not
N times, and get it bit-exact; with ``broadcast=False`` every rank reads it; a corrupt
object read by one rank for the others fails every rank.

Each test starts N copies of tests/broadcast_ranks.py; see tests/multirank.py.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")

import ckptstore
from ckptstore import background
from ckptstore.store.registry import open_store
from tests import broadcast_ranks as worker
from tests.multirank import Target, assert_all_ok, run_ranks

pytestmark = pytest.mark.torch

WORKER = Path(worker.__file__)
_SLOW = [pytest.mark.slow]
_SEAWEED = [pytest.mark.s3, pytest.mark.slow]

#: (target, world): 2 ranks on local disk by default; 4 and 8 ranks, and SeaweedFS, slow
WORLDS = [
    pytest.param("local", 2, id="local-2"),
    pytest.param("local", 4, marks=_SLOW, id="local-4"),
    pytest.param("local", 8, marks=_SLOW, id="local-8"),
    pytest.param("seaweedfs", 2, marks=_SEAWEED, id="seaweedfs-2"),
    pytest.param("seaweedfs", 4, marks=_SEAWEED, id="seaweedfs-4"),
    pytest.param("seaweedfs", 8, marks=_SEAWEED, id="seaweedfs-8"),
]

#: what a rank's ranged reads may take in beyond its leaves: the padding between the small
#: packed leaves of the model, which one rank reads as one range
SLACK = 64 * 1024


@pytest.fixture
def segment_dir() -> Iterator[Path]:
    """A directory of the memory filesystem of its own for the test's segments
    (``CKPTSTORE_SHM_DIR``), so what a test leaves there is its own."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm on this platform")
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="ckptstore-test-") as path:
        yield Path(path)


def _env(target: Target, segments: Path) -> dict[str, str]:
    return {**target.env(), "CKPTSTORE_SHM_DIR": str(segments)}


@pytest.mark.parametrize(("target", "world"), WORLDS, indirect=["target"])
def test_ranks_loading_a_replicated_model_read_it_from_the_store_once(
    target: Target, world: int, tmp_path: Path, segment_dir: Path
) -> None:
    """On one host the shared leaves go through shared memory, nothing over gloo."""
    ckptstore.save(target.base, worker.state(world), step=1, **target.options)
    logs, env = tmp_path / "logs", _env(target, segment_dir)
    model = worker.nbytes(worker.model())
    own = worker.SHARD * 4  # each rank's float32 shard

    shared = assert_all_ok(
        run_ranks(WORKER, world, "load", target.base, "1", "on", logs=logs, env=env)
    )
    assert [result["exact"] for result in shared] == [True] * world
    assert [result["own"] for result in shared] == [True] * world
    reads = [result["bytes_read"] for result in shared]
    # the model once over all ranks, and each rank's own shard
    assert model + world * own <= sum(reads) <= model + world * own + SLACK
    assert max(reads) < model  # the reads are spread: no rank read the whole model
    assert [result["received_over_group"] for result in shared] == [0] * world
    assert list(segment_dir.iterdir()) == []

    alone = assert_all_ok(
        run_ranks(WORKER, world, "load", target.base, "1", "off", logs=logs, env=env)
    )
    assert [result["exact"] for result in alone] == [True] * world
    for result in alone:
        assert result["bytes_read"] >= model + own  # every rank read the model itself


@pytest.mark.parametrize(
    ("target", "world"),
    [
        pytest.param("local", 4, id="local-4"),
        pytest.param("seaweedfs", 4, marks=_SEAWEED, id="seaweedfs-4"),
        pytest.param("local", 8, marks=_SLOW, id="local-8"),
    ],
    indirect=["target"],
)
def test_ranks_on_two_hosts_share_memory_within_a_host_and_use_gloo_between(
    target: Target, world: int, tmp_path: Path, segment_dir: Path
) -> None:
    """Ranks made to believe they run on two hosts (by rank parity): the model still read
    once and loaded bit-exact, part of it received over gloo; and with shared memory off,
    everything the ranks share goes over gloo."""
    ckptstore.save(target.base, worker.state(world), step=1, **target.options)
    logs, env = tmp_path / "logs", _env(target, segment_dir)
    model = worker.nbytes(worker.model())
    own = worker.SHARD * 4
    over_gloo = {}
    for memory in ("split", "net"):
        results = assert_all_ok(
            run_ranks(WORKER, world, "load", target.base, "1", "on", memory, logs=logs, env=env)
        )
        assert [result["exact"] for result in results] == [True] * world, memory
        assert [result["own"] for result in results] == [True] * world, memory
        reads = [result["bytes_read"] for result in results]
        assert model + world * own <= sum(reads) <= model + world * own + SLACK, memory
        over_gloo[memory] = [result["received_over_group"] for result in results]
        assert list(segment_dir.iterdir()) == [], memory
    for result, received in zip(results, over_gloo["net"], strict=True):  # the "net" run
        # without shared memory a rank gets over gloo all of the model it did not read
        assert model <= result["bytes_read"] - own + received <= model + SLACK
    # on two hosts, part of that goes over gloo, the rest through shared memory
    assert 0 < sum(over_gloo["split"]) < sum(over_gloo["net"])


def _damage(target: Target, step: int, path: str) -> None:
    """Flip one byte of the object that holds leaf ``path`` of ``step``."""

    async def run() -> None:
        async with open_store(target.base, **target.options) as store:
            manifest = await ckptstore.aread_manifest(store, step)
            key = manifest.object_key(manifest.leaf_object[manifest.paths.index(path)])
            data = bytearray(await store.get(key))
            data[1000] ^= 0xFF
            await store.put(key, bytes(data))

    background.run(run())


@pytest.mark.parametrize(
    ("target", "world"),
    [
        pytest.param("local", 4, id="local-4"),
        pytest.param("seaweedfs", 4, marks=_SEAWEED, id="seaweedfs-4"),
    ],
    indirect=["target"],
)
def test_a_corrupt_object_read_for_others_fails_every_rank(
    target: Target, world: int, tmp_path: Path, segment_dir: Path
) -> None:
    ckptstore.save(target.base, worker.state(world), step=1, **target.options)
    _damage(target, 1, "model/embed")
    env = _env(target, segment_dir)
    outcomes = assert_all_ok(
        run_ranks(WORKER, world, "corrupt", target.base, "1", logs=tmp_path / "logs", env=env)
    )
    assert list(segment_dir.iterdir()) == []  # what the others read for the ranks: removed
    assert [result["error"] for result in outcomes] == ["CorruptCheckpointError"] * world
    readers = [r for r, result in enumerate(outcomes) if "another rank" not in result["message"]]
    assert len(readers) == 1  # one rank read the embedding for all
    for result in outcomes:
        assert "'model/embed'" in result["message"]
        if "another rank" in result["message"]:
            assert f"rank {readers[0]}: CorruptCheckpointError" in result["message"]


@pytest.mark.parametrize(
    ("when", "failed"),
    [
        # no shared memory: the survivors wait on it in the transfer over gloo
        pytest.param("sending", "sending the shared leaves failed", id="sending"),
        # its share read into shared memory: they wait on it to announce the segments
        pytest.param("announcing", "sharing the reads' outcome failed", id="announcing"),
    ],
)
def test_a_rank_dying_mid_load_fails_the_others_without_a_hang_or_a_leftover_segment(
    when: str, failed: str, tmp_path: Path, segment_dir: Path
) -> None:
    """Rank 1 of 3 reads its share of the model, then dies before handing it over: the
    survivors see its connection close and raise (run_ranks bounds their run, so a hang
    fails the test), and remove the segments it left."""
    root = str(tmp_path / "ckpts")
    ckptstore.save(root, worker.state(3), step=1)
    env = {"CKPTSTORE_SHM_DIR": str(segment_dir)}
    outcomes = run_ranks(WORKER, 3, "die", root, "1", when, logs=tmp_path / "logs", env=env)
    assert outcomes[1].returncode == 17, outcomes[1].log[-4000:]
    for rank in (0, 2):
        assert outcomes[rank].returncode == 0, outcomes[rank].log[-4000:]
        result = outcomes[rank].results[-1]
        assert result["error"] == "CkptStoreError", result
        assert failed in result["message"], result
        assert "another rank died" in result["message"], result
    assert list(segment_dir.iterdir()) == []


def test_a_streaming_load_shares_its_first_part_and_reads_the_rest_per_rank(
    tmp_path: Path, segment_dir: Path
) -> None:
    """Two gloo ranks: the embedding is read once and shared; every rank reads its own rest
    after the load returned, and the loaded state is exact on every rank."""
    target = Target(str(tmp_path / "root"), {})
    world = 2
    ckptstore.save(target.base, worker.state(world), step=1, **target.options)
    results = assert_all_ok(
        run_ranks(
            WORKER,
            world,
            "stream",
            target.base,
            "1",
            logs=tmp_path / "logs",
            env=_env(target, segment_dir),
        )
    )
    assert [result["exact"] for result in results] == [True] * world
    assert [result["background_part"] for result in results] == [1] * world
    embed = 512 * 1024 * 4
    rest = worker.nbytes(worker.model()) - embed + worker.SHARD * 4
    reads = sorted(result["bytes_read"] for result in results)
    # the embedding once over both ranks; each rank its own rest
    assert world * rest + embed <= sum(reads) <= world * rest + embed + SLACK
