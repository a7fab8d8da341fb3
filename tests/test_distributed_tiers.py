"""Tiers on the multi-rank CheckpointManager (issue 28, item 6), with ranks as threads of one
process: each rank commits its part on a local tier of its own, chosen steps are committed
once on the persistent tier with every rank's part, restore reads each rank's own part
locally when every rank can, and a crash's leftovers are cleaned at the next start.

tests/test_distributed_manager_ranks.py runs the same on gloo processes, with a rank
SIGKILLed during a copy.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import ckptstore
import ckptstore.distributed
from ckptstore import background
from ckptstore.errors import NotFoundError
from ckptstore.manager.rank_tiers import rank_root
from ckptstore.store.base import Store
from ckptstore.store.registry import open_store
from tests.gated_store import HELD_FOR, Gate
from tests.multirank import outcome_of
from tests.test_distributed_manager import assert_equal_trees, merged, part

Body = Callable[[int, ckptstore.distributed.Collectives, ckptstore.distributed.Collectives], Any]


def run_tiered(world: int, body: Body) -> list[Any]:
    """Run ``body(rank, comm, tier_comm)`` on ``world`` threads, each with the manager's
    collectives and the copies' own; what each returned, by rank (an exception raised is
    returned too, and fails the test)."""
    saves = ckptstore.distributed.LocalGroup(world, timeout=60)
    copies = ckptstore.distributed.LocalGroup(world, timeout=60)

    def one(rank: int) -> Any:
        return body(rank, saves.member(rank), copies.member(rank))

    with ThreadPoolExecutor(world) as pool:
        return list(pool.map(one, range(world)))


@pytest.fixture
def shared(tmp_path: Path) -> Store:
    """The persistent tier every rank copies to (a local directory)."""
    store = open_store(str(tmp_path / "persistent"))
    yield store
    background.run(store.close())


def steps_of(root: str | Store) -> list[int]:
    return ckptstore.list_steps(root)


def test_rank_root_keeps_ranks_and_worlds_apart() -> None:
    assert rank_root("/nvme/run", 3, 8) == os.path.join("/nvme/run", "rank3-of-8")
    assert rank_root("memory://run", 0, 2) == "memory://run/rank0-of-2"
    assert rank_root("s3://b/run/?endpoint_url=http://x", 1, 2) == (
        "s3://b/run/rank1-of-2?endpoint_url=http://x"
    )


@pytest.mark.parametrize("world", [2, 4])
def test_tiered_saves_commit_on_every_rank_locally_and_chosen_steps_once_persistently(
    shared: Store, tmp_path: Path, world: int
) -> None:
    local = tmp_path / "local"

    def body(rank: int, comm: Any, tier_comm: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        with ckptstore.distributed.CheckpointManager(
            shared,
            local=local,
            persistent_every=2,
            local_max_to_keep=2,
            max_to_keep=2,
            comm=comm,
            tier_comm=tier_comm,
        ) as mgr:
            for step in range(1, 7):
                mgr.save(step, part(rank, step))
            mgr.wait_until_finished()
            listing = mgr.tiers()
            out["local"], out["persistent"] = listing.local, listing.persistent
            out["pending"] = listing.pending
            assert_equal_trees(mgr.restore(target=part(rank, 0)), part(rank, 6))
            out["newest from"] = mgr.last_restore
            assert_equal_trees(mgr.restore(5, target=part(rank, 0)), part(rank, 5))
            out["5 from"] = mgr.last_restore
            assert_equal_trees(mgr.restore(4, target=part(rank, 0)), part(rank, 4))
            out["4 from"] = mgr.last_restore
            # without a target a rank asks for the merged step, which no rank's part holds
            assert_equal_trees(mgr.restore(), merged(world, 6))
            out["merged from"] = mgr.last_restore
            mgr.delete(6)
            out["after delete"] = mgr.all_steps()
        return out

    results = run_tiered(world, body)
    for out in results:
        assert out["local"] == [5, 6]  # local_max_to_keep=2: every copy is done
        assert out["persistent"] == [4, 6]  # every 2nd step, max_to_keep=2
        assert out["pending"] == []
        assert out["newest from"].tier == "local"
        assert out["5 from"].tier == "local"  # on the local tiers only
        assert (out["4 from"].tier, out["4 from"].fallback) == (
            "persistent",
            "step 4 is not on every rank's local tier",
        )
        assert out["merged from"].tier == "persistent"
        assert "lacks" in out["merged from"].fallback
        assert out["after delete"] == [4, 5]
    # one multi-rank step on the persistent tier, holding every rank's part
    assert steps_of(shared) == [4]
    assert_equal_trees(ckptstore.load(shared, 4), merged(world, 4))
    keys = background.run(shared.list_keys())
    writers = {k.split("/")[-1].split("-")[0] for k in keys if k.startswith("4/") and "/r" in k}
    assert writers == {f"r{rank}" for rank in range(world)}
    # each rank's part is a step of its own root under local=
    for rank in range(world):
        assert steps_of(rank_root(local, rank, world)) == [5]


def test_a_step_not_on_every_local_tier_is_cleaned_at_start_and_restored_from_persistent(
    shared: Store, tmp_path: Path
) -> None:
    """What a crash between the ranks' local commits leaves (one rank's part of step 2 and
    not the other's) is deleted when the next job starts; the step comes back from the
    persistent tier, and the job saves on."""
    local = tmp_path / "local"

    def first(rank: int, comm: Any, tier_comm: Any) -> None:
        with ckptstore.distributed.CheckpointManager(
            shared, local=local, persistent_every=2, comm=comm, tier_comm=tier_comm
        ) as mgr:
            for step in (1, 2):
                mgr.save(step, part(rank, step))

    run_tiered(2, first)
    assert steps_of(shared) == [2]
    ckptstore.delete_step(rank_root(local, 1, 2), 2)  # rank 1's part of step 2 is gone

    def second(rank: int, comm: Any, tier_comm: Any) -> dict[str, Any]:
        with ckptstore.distributed.CheckpointManager(
            shared, local=local, persistent_every=2, comm=comm, tier_comm=tier_comm
        ) as mgr:
            local_steps = mgr.tiers().local
            state = mgr.restore(target=part(rank, 0))
            assert_equal_trees(state, part(rank, 2))
            mgr.save(3, part(rank, 3))
            mgr.wait_until_finished()
            return {"local": local_steps, "from": mgr.last_restore, "steps": mgr.all_steps()}

    for out in run_tiered(2, second):
        assert out["local"] == [1]  # rank 0's part of step 2 was deleted at the start
        assert out["from"].tier == "persistent"
        assert out["steps"] == [1, 2, 3]


def test_a_local_step_of_parts_spread_over_ranks_without_a_persistent_copy_says_how(
    shared: Store, tmp_path: Path
) -> None:
    def body(rank: int, comm: Any, tier_comm: Any) -> str:
        with ckptstore.distributed.CheckpointManager(
            shared, local=tmp_path / "local", persistent_every=10, comm=comm, tier_comm=tier_comm
        ) as mgr:
            mgr.save(1, part(rank, 1))
            mgr.wait_until_finished()
            with pytest.raises(NotFoundError, match="restore each rank's own part") as caught:
                mgr.restore()
            assert_equal_trees(mgr.restore(target=part(rank, 0)), part(rank, 1))
            return str(caught.value)

    for message in run_tiered(2, body):
        assert "not on the persistent tier" in message


def test_the_coordinator_decides_which_copies_the_backlog_skips_on_every_rank(
    shared: Store, tmp_path: Path
) -> None:
    """Copies held at the persistent tier while four more steps are saved: with
    ``copy_backlog=1`` the coordinator skips the middle ones, and every rank skips the same,
    copies the same, and keeps its parts of the skipped steps no longer."""

    def body(rank: int, comm: Any, tier_comm: Any) -> dict[str, Any]:
        gate = Gate(shared)
        gate.hold()
        with ckptstore.distributed.CheckpointManager(
            gate,
            local=tmp_path / "local",
            copy_backlog=1,
            local_max_to_keep=1,
            comm=comm,
            tier_comm=tier_comm,
        ) as mgr:
            mgr.save(1, part(rank, 1))
            if rank == 0:  # the coordinator's first write of the copy of step 1 waits
                assert gate.held.wait(HELD_FOR)
            for step in range(2, 6):
                mgr.save(step, part(rank, step))
            mgr._saver.wait_until_finished()
            gate.release()
            mgr.wait_until_finished()
            listing = mgr.tiers()
            return {"persistent": listing.persistent, "skipped": listing.skipped}

    results = run_tiered(2, body)
    assert results[0] == results[1]
    assert results[0]["persistent"] == [1, 5]
    assert results[0]["skipped"] == [2, 3, 4]
    assert_equal_trees(ckptstore.load(shared, 5), merged(2, 5))


def test_a_rank_whose_staging_fails_fails_the_step_on_every_rank_and_no_part_stays(
    shared: Store, tmp_path: Path
) -> None:
    local = tmp_path / "local"

    def body(rank: int, comm: Any, tier_comm: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        with ckptstore.distributed.CheckpointManager(
            shared, local=local, comm=comm, tier_comm=tier_comm
        ) as mgr:
            state = part(rank, 1)
            if rank == 1:
                state["bad"] = object()  # not storable: rank 1's save raises at once
                with pytest.raises(TypeError):
                    mgr.save(1, state)
            else:
                mgr.save(1, state)
            out["wait"] = outcome_of(mgr.wait_until_finished)
            out["local"] = mgr.tiers().local
            mgr.save(2, part(rank, 2))
            mgr.wait_until_finished()
            out["steps"] = mgr.all_steps()
        return out

    results = run_tiered(2, body)
    assert "rank 1" in results[0]["wait"], results[0]
    for out in results:
        assert out["local"] == []
        assert out["steps"] == [2]
    assert steps_of(shared) == [2]


def test_local_must_be_a_url_and_comm_needs_tier_comm(shared: Store, tmp_path: Path) -> None:
    group = ckptstore.distributed.LocalGroup(1)
    with pytest.raises(TypeError, match="not an open Store"):
        ckptstore.distributed.CheckpointManager(shared, local=shared, comm=group.member(0))
    with pytest.raises(ValueError, match="tier_comm"):
        ckptstore.distributed.CheckpointManager(shared, local=tmp_path / "l", comm=group.member(0))


def test_rollback_sets_the_newer_steps_aside_on_both_tiers_of_every_rank(
    shared: Store, tmp_path: Path
) -> None:
    local = tmp_path / "local"

    def body(rank: int, comm: Any, tier_comm: Any) -> dict[str, Any]:
        with ckptstore.distributed.CheckpointManager(
            shared,
            local=local,
            persistent_every=2,
            local_max_to_keep=None,
            comm=comm,
            tier_comm=tier_comm,
        ) as mgr:
            for step in range(1, 5):
                mgr.save(step, part(rank, step))
            state = mgr.restore(2, target=part(rank, 0), rollback=True)
            assert_equal_trees(state, part(rank, 2))
            out = {"aside": mgr.set_aside, "from": mgr.last_restore.tier}
            out["listing"] = mgr.tiers()
            mgr.save(3, part(rank, 33))  # the steps after 2 are saved again
            mgr.wait_until_finished()
            assert_equal_trees(mgr.restore(target=part(rank, 0)), part(rank, 33))
            return out

    for out in run_tiered(2, body):
        assert out["aside"] == [3, 4]  # 4 on both tiers, 3 on the local ones
        assert out["from"] == "local"
        assert (out["listing"].local, out["listing"].persistent) == ([1, 2], [2])


def test_a_start_that_fails_raises_its_own_error(
    shared: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copies a crash left pending are listed at the start; when that fails, the manager
    closes what it opened and the caller sees that failure, not one of the closing."""
    from ckptstore.manager.rank_tiers import RankTiers

    def fail(self: RankTiers) -> list[int]:
        raise RuntimeError("listing the local tiers failed")

    monkeypatch.setattr(RankTiers, "resume", fail)

    def body(rank: int, comm: Any, tier_comm: Any) -> str:
        with pytest.raises(RuntimeError, match="listing the local tiers failed") as caught:
            ckptstore.distributed.CheckpointManager(
                shared, local=tmp_path / "local", comm=comm, tier_comm=tier_comm
            )
        return type(caught.value).__name__

    assert run_tiered(2, body) == ["RuntimeError"] * 2


def test_a_target_one_rank_gets_wrong_fails_the_local_restore_on_every_rank(
    shared: Store, tmp_path: Path
) -> None:
    """Rank 1 asks for its shard in the wrong shape: no rank returns alone (the others would
    go on to collectives rank 1 never joins); every rank raises, naming rank 1's error."""
    import numpy as np

    def body(rank: int, comm: Any, tier_comm: Any) -> str:
        with ckptstore.distributed.CheckpointManager(
            shared, local=tmp_path / "local", persistent_every=10, comm=comm, tier_comm=tier_comm
        ) as mgr:
            mgr.save(1, part(rank, 1))
            mgr.wait_until_finished()
            like = part(rank, 0)
            if rank == 1:
                like["model"]["shard1"] = np.zeros(3, np.float32)
            with pytest.raises(ckptstore.CkptStoreError) as caught:
                mgr.restore(target=like)
            return str(caught.value)

    for message in run_tiered(2, body):
        assert "rank 1: ValueError" in message, message


def test_a_local_restore_reads_each_rank_manifest_once(
    shared: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deciding whether the local parts serve a restore reads each rank's manifest; the
    restore then reads its leaves with that manifest instead of reading it again."""
    local = tmp_path / "local"
    reads: list[str] = []
    get = Store.get

    async def counting_get(self: Store, key: str) -> bytes:
        if key.endswith("manifest.json"):
            reads.append(self.url)
        return await get(self, key)

    def body(rank: int, comm: Any, tier_comm: Any) -> None:
        with ckptstore.distributed.CheckpointManager(
            shared, local=local, persistent_every=2, comm=comm, tier_comm=tier_comm
        ) as mgr:
            mgr.save(1, part(rank, 1))
            mgr.wait_until_finished()
            comm.all_gather(None)
            if rank == 0:
                monkeypatch.setattr(Store, "get", counting_get)
            comm.all_gather(None)
            assert_equal_trees(mgr.restore(1, target=part(rank, 0)), part(rank, 1))
            assert mgr.last_restore.tier == "local"
            comm.all_gather(None)

    run_tiered(2, body)
    assert sorted(reads) == sorted("file://" + rank_root(local, rank, 2) for rank in range(2))
