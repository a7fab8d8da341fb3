"""ckptstore.distributed on real processes over gloo on 127.0.0.1: 4 ranks save, 2 load; a
rank fails or dies mid-save (by its own hand, and by a SIGKILL from outside), on 2 and on 4
ranks.

Each test starts N copies of tests/native_ranks.py; see tests/multirank.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

import ckptstore
from tests.multirank import (
    TARGETS_AND_WORLDS,
    WITH_4_RANKS,
    Target,
    assert_all_ok,
    assert_stalled_rank_failed_the_others,
    run_and_sigkill,
    run_ranks,
)

pytestmark = pytest.mark.torch

WORKER = Path(__file__).with_name("native_ranks.py")
SHARD_BYTES = 1 << 20  # native_ranks.SHARD float32
FAILING_RANK = 1  # the rank whose writes fail, then which dies, in native_ranks.py


def test_save_on_4_ranks_commits_once_and_2_ranks_load_only_their_shards(
    target: Target, tmp_path: Path
) -> None:
    logs, env = tmp_path / "logs", target.env()
    saved = assert_all_ok(run_ranks(WORKER, 4, "save", target.base, "7", logs=logs, env=env))
    assert len({result["attempt"] for result in saved}) == 1  # every rank reports one commit
    keys = target.keys(target.base)
    assert "7/manifest.json" in keys
    written = [key.split("/") for key in keys if key != "7/manifest.json"]
    assert {name.split("-")[0] for _, _, name in written} == {"r0", "r1", "r2", "r3"}
    assert {attempt for _, attempt, _ in written} == {saved[0]["attempt"]}
    assert target.steps() == [7]

    loaded = assert_all_ok(run_ranks(WORKER, 2, "load", target.base, "7", "4", logs=logs, env=env))
    for result in loaded:
        assert result["exact"] is True
        assert result["shards"] == 2
        # two shards, the 8 KiB replicated weight (packed with small leaves, so the read may
        # take in some bytes around it), never another rank's shard
        assert 2 * SHARD_BYTES <= result["bytes_read"] < 2 * SHARD_BYTES + 64 * 1024


@pytest.mark.parametrize(("target", "world"), WITH_4_RANKS, indirect=["target"])
def test_failing_or_dying_rank_leaves_no_checkpoint_and_previous_loads(
    target: Target, world: int, tmp_path: Path
) -> None:
    if world == 4 and "://" in target.base:
        pytest.skip("4-rank runs use the local target only (CI time); 2 ranks cover S3")
    logs, env = tmp_path / "logs", target.env()
    outcomes = run_ranks(WORKER, world, "failures", target.base, logs=logs, env=env)
    for rank, outcome in enumerate(outcomes):
        if rank == FAILING_RANK:
            assert outcome.returncode == 17, outcome.log[-4000:]  # it really died mid-save
            assert outcome.results[-1]["raise"].startswith("StoreError")
            continue
        # every survivor, coordinator or not, is told which rank failed and does not hang
        assert outcome.returncode == 0, f"rank {rank}:\n{outcome.log[-4000:]}"
        assert outcome.results[-1]["raise"].startswith("CkptStoreError"), f"rank {rank}"
        assert f"rank {FAILING_RANK}:" in outcome.results[-1]["raise"], f"rank {rank}"
        assert outcome.results[-1]["die"] != "succeeded", f"rank {rank}"

    assert target.steps() == [1]  # neither failed save is visible
    keys = target.keys(target.base)
    assert not [k for k in keys if k.startswith("2/")]  # the failed save cleaned up
    # rank 1 had stored data when it died; every survivor removed its own objects of step 3
    assert {k.split("/")[2].split("-")[0] for k in keys if k.startswith("3/")} == {"r1"}

    # the previous step, on the world that saved it: each rank loads its own shard
    loaded = assert_all_ok(
        run_ranks(WORKER, world, "load", target.base, "1", str(world), logs=logs, env=env)
    )
    assert [(result["exact"], result["shards"]) for result in loaded] == [(True, 1)] * world


def _run_and_sigkill(target: Target, world: int, tmp_path: Path) -> list[str]:
    """Run the 'sigkill' scenario, check what must hold whatever the survivors were told,
    and return the error each survivor got."""
    logs, env = tmp_path / "logs", target.env()
    errors = run_and_sigkill(
        WORKER, world, "sigkill", target.base, victim=FAILING_RANK, logs=logs, env=env
    )
    assert target.steps() == [1]  # step 2 never became visible
    keys = target.keys(target.base)
    # the killed rank had stored data; every survivor removed its own objects of step 2
    assert {k.split("/")[2].split("-")[0] for k in keys if k.startswith("2/")} == {"r1"}
    loaded = assert_all_ok(
        run_ranks(WORKER, world, "load", target.base, "1", str(world), logs=logs, env=env)
    )
    assert [(result["exact"], result["shards"]) for result in loaded] == [(True, 1)] * world
    return errors


@pytest.mark.slow
@pytest.mark.parametrize(("target", "world"), TARGETS_AND_WORLDS, indirect=["target"])
def test_rank_sigkilled_from_outside_mid_save_leaves_no_checkpoint(
    target: Target, world: int, tmp_path: Path
) -> None:
    """The test process SIGKILLs rank 1 once it has stored an object of step 2: no step 2
    becomes visible, every survivor returns with an error within run_ranks' timeout and
    removes its own objects, and step 1 still loads on the same world."""
    for error in _run_and_sigkill(target, world, tmp_path):
        # a survivor learns of the death from a collective and says what was not saved
        assert error.startswith("CkptStoreError"), error
        assert "step 2 was not saved" in error, error
        assert "another rank died" in error, error


@pytest.mark.slow
def test_survivors_of_a_sigkilled_rank_get_a_ckptstore_error(tmp_path: Path) -> None:
    # on local disk only: the error does not depend on the store
    for error in _run_and_sigkill(Target(str(tmp_path / "ckpts"), {}), 2, tmp_path):
        assert error.startswith("CkptStoreError"), error
        assert "step 2" in error, error


@pytest.mark.slow
@pytest.mark.parametrize("what", ["save", "load"])
def test_a_stalled_rank_fails_every_other_rank_within_the_collective_deadline(
    tmp_path: Path, what: str
) -> None:
    """Issue 30, for ``distributed.save`` and ``distributed.load``: rank 1 stays alive and
    silent; the other ranks' calls fail within the group's timeout plus 10% (and a second
    for the start of the collectives), saying a rank died or stalled, and nothing of step 2
    is committed."""
    from tests.native_ranks import STALL_TIMEOUT

    root = tmp_path / "ckpts"
    outcomes = run_ranks(WORKER, 3, "stall", str(root), what, logs=tmp_path / "logs", env={})
    assert_stalled_rank_failed_the_others(outcomes, FAILING_RANK, STALL_TIMEOUT)
    assert ckptstore.list_steps(root) == [1]
