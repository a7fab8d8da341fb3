"""ckptstore.distributed.CheckpointManager on real processes over gloo on 127.0.0.1: the
save returns after the copy while the training's collectives go on, a change after the call
is not written, retention keeps ``max_to_keep``, and a rank that fails or is SIGKILLed
during the background write leaves no step and a clear error on the others; on 2, 4 and 8
ranks, on local disk and SeaweedFS.

Each test starts N copies of tests/manager_ranks.py; see tests/multirank.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

import ckptstore
from tests.multirank import (
    Target,
    assert_all_ok,
    assert_stalled_rank_failed_the_others,
    run_and_sigkill,
    run_ranks,
)

pytestmark = pytest.mark.torch

WORKER = Path(__file__).with_name("manager_ranks.py")
LOADER = Path(__file__).with_name("native_ranks.py")
FAILING_RANK = 1  # manager_ranks.FAILING_RANK
SHARD = 256 * 1024  # native_ranks.SHARD: float32 elements, 1 MiB

_ON_S3 = [pytest.mark.s3, pytest.mark.slow]
#: ``(target, world)``: local disk on 2 ranks by default, on 4 and 8 in the slow suite;
#: SeaweedFS on 2 (each object store run adds a server and minutes).
TARGETS_AND_WORLDS = [
    pytest.param("local", 2, id="local-2"),
    pytest.param("local", 4, marks=pytest.mark.slow, id="local-4"),
    pytest.param("local", 8, marks=pytest.mark.slow, id="local-8"),
    pytest.param("seaweedfs", 2, marks=_ON_S3, id="seaweedfs-2"),
]
#: the same for the SIGKILL test, whose runs take longer (a second world loads step 1):
#: 2 local ranks by default, the rest in the slow suite
SIGKILL_TARGETS_AND_WORLDS = [
    pytest.param("local", 2, id="local-2"),
    pytest.param("local", 4, marks=pytest.mark.slow, id="local-4"),
    pytest.param("local", 8, marks=pytest.mark.slow, id="local-8"),
    pytest.param("seaweedfs", 2, marks=_ON_S3, id="seaweedfs-2"),
]


#: the tiers tests: as TARGETS_AND_WORLDS, and SeaweedFS on 4 ranks too
TIER_TARGETS_AND_WORLDS = [
    *TARGETS_AND_WORLDS,
    pytest.param("seaweedfs", 4, marks=_ON_S3, id="seaweedfs-4"),
]
TIER_SIGKILL_TARGETS_AND_WORLDS = [
    *SIGKILL_TARGETS_AND_WORLDS,
    pytest.param("seaweedfs", 4, marks=_ON_S3, id="seaweedfs-4"),
]


def step_dirs(target: Target) -> dict[str, set[str]]:
    """Which ranks' objects each step holds (``r0``, ``r1``...), by step."""
    found: dict[str, set[str]] = {}
    for key in target.keys(target.base):
        step, *rest = key.split("/")
        if len(rest) == 2:
            found.setdefault(step, set()).add(rest[1].split("-")[0])
    return found


@pytest.mark.parametrize(("target", "world"), TARGETS_AND_WORLDS, indirect=["target"])
def test_async_save_on_ranks_returns_after_the_copy_retains_and_reports_failures(
    target: Target, world: int, tmp_path: Path
) -> None:
    results = assert_all_ok(
        run_ranks(WORKER, world, "manager", target.base, logs=tmp_path / "logs", env=target.env())
    )
    for rank, out in enumerate(results):
        # the call returned with the rank's own writes still held, the training all-reduce
        # ran meanwhile, and the state changed after the call is not what was written
        assert out["in flight at return"] is True, f"rank {rank}"
        assert out["all_reduce"] is True, f"rank {rank}"
        assert out["exact"] is True, f"rank {rank}"
        assert out["kept"] == [3, 4], f"rank {rank}"  # max_to_keep=2 after steps 1-4
        for call, step in (("wait", 5), ("next save", 6)):
            if rank == FAILING_RANK:
                assert out[call].startswith("StoreError: injected failure"), out[call]
            else:
                assert out[call].startswith("CkptStoreError"), out[call]
                assert f"step {step} was not saved: rank {FAILING_RANK}:" in out[call], out[call]
        assert out["steps"] == [4, 8], f"rank {rank}"  # 5, 6 failed; 7 was refused
        assert out["exact 8"] is True, f"rank {rank}"
    assert target.steps() == [4, 8]
    held = step_dirs(target)
    assert sorted(held) == ["4", "8"]  # nothing left of the failed, refused, retired steps
    assert held["8"] == {f"r{rank}" for rank in range(world)}  # every rank wrote its shard


@pytest.mark.parametrize(("target", "world"), SIGKILL_TARGETS_AND_WORLDS, indirect=["target"])
def test_rank_sigkilled_during_the_background_write_leaves_no_step(
    target: Target, world: int, tmp_path: Path
) -> None:
    """The test process SIGKILLs rank 1 while its background write of step 2 runs: every
    rank had returned from ``save``; no step 2 becomes visible; every survivor's
    ``wait_until_finished`` raises an error that says so within the group timeout, its own
    objects are removed, and step 1 still loads on the same world."""
    logs, env = tmp_path / "logs", target.env()
    errors = run_and_sigkill(
        WORKER, world, "sigkill", target.base, victim=FAILING_RANK, logs=logs, env=env
    )
    for error in errors:
        assert error.startswith("CkptStoreError"), error
        assert "step 2 was not saved" in error, error
        assert "another rank died" in error, error
    assert target.steps() == [1]
    assert step_dirs(target).get("2", set()) <= {f"r{FAILING_RANK}"}
    loaded = assert_all_ok(
        run_ranks(LOADER, world, "load", target.base, "1", str(world), logs=logs, env=env)
    )
    assert [(result["exact"], result["shards"]) for result in loaded] == [(True, 1)] * world


@pytest.mark.parametrize(("target", "world"), TARGETS_AND_WORLDS, indirect=["target"])
def test_incremental_saves_on_ranks_write_only_what_changed(
    target: Target, world: int, tmp_path: Path
) -> None:
    """Issue 28 item 6: each rank hashes the leaves it writes and leaves out those unchanged
    since the newest step; the step references the earlier objects, survives the earlier
    step's retirement, and ``full=True`` writes everything again."""
    from tests.manager_ranks import frozen_exact

    logs, env = tmp_path / "logs", target.env()
    results = assert_all_ok(
        run_ranks(WORKER, world, "incremental", target.base, logs=logs, env=env)
    )
    for rank, out in enumerate(results):
        assert out["steps after 2"] == [2], f"rank {rank}"  # step 1 retired (max_to_keep=1)
        assert out["exact 2"] is True, f"rank {rank}"
        assert out["exact 3"] is True, f"rank {rank}"
    assert target.steps() == [3]
    step3 = ckptstore.read_manifest(target.base, 3, **target.options)
    assert step3.references() == []  # full: every byte its own
    assert step3.own_bytes >= world * 4 * SHARD  # every rank's 1 MiB frozen shard again
    got = ckptstore.load(target.base, 3, target="torch", **target.options)
    assert all(frozen_exact(got, rank, 3) for rank in range(world))


@pytest.mark.parametrize(("target", "world"), TARGETS_AND_WORLDS, indirect=["target"])
def test_an_incremental_step_references_its_base_and_loads_after_the_base_is_retired(
    target: Target, world: int, tmp_path: Path
) -> None:
    """The same state through ``ckptstore.distributed.save`` on every rank (tests/
    native_ranks.py's ``frozen`` scenario): step 2 writes under a tenth of step 1's bytes,
    its manifest references step 1's objects, and it loads bit-exact with step 1 deleted and
    garbage collected."""
    from tests.manager_ranks import frozen_exact

    logs, env = tmp_path / "logs", target.env()
    for step in ("1", "2"):
        assert_all_ok(run_ranks(LOADER, world, "frozen", target.base, step, logs=logs, env=env))
    first, second = (ckptstore.read_manifest(target.base, s, **target.options) for s in (1, 2))
    assert second.own_bytes < 0.1 * first.own_bytes, (second.own_bytes, first.own_bytes)
    assert {second.object_step(i) for i in second.references()} == {1}
    assert len(second.leaf_hash or []) == len(second.paths)
    ckptstore.delete_step(target.base, 1, **target.options)
    report = ckptstore.gc(target.base, grace=0, **target.options)  # keeps what 2 references
    assert report.kept_referenced, report
    got = ckptstore.load(target.base, 2, target="torch", **target.options)
    assert all(frozen_exact(got, rank, 2) for rank in range(world))


@pytest.mark.parametrize(("target", "world"), TARGETS_AND_WORLDS, indirect=["target"])
def test_lazy_snapshots_on_ranks_commit_the_state_of_each_save_call(
    target: Target, world: int, tmp_path: Path
) -> None:
    """Issue 28 item 6: ``snapshot="lazy"`` in a training loop on gloo ranks: the optimizer
    step after each save is fenced, and every step holds the weights of its call."""
    results = assert_all_ok(
        run_ranks(WORKER, world, "lazy", target.base, logs=tmp_path / "logs", env=target.env())
    )
    assert results == [{"1": True, "2": True, "3": True}] * world


@pytest.mark.parametrize(("target", "world"), SIGKILL_TARGETS_AND_WORLDS, indirect=["target"])
def test_rank_sigkilled_during_an_incremental_save_leaves_no_step_and_the_next_save_works(
    target: Target, world: int, tmp_path: Path
) -> None:
    """A rank SIGKILLed while it writes its changed leaves of incremental step 2 (a lazy
    snapshot): no step 2,
    a clear error on the survivors, step 1 intact; a new world then saves step 2 again over
    step 1 and it loads bit-exact."""
    from tests.manager_ranks import frozen_exact

    logs, env = tmp_path / "logs", target.env()
    errors = run_and_sigkill(
        WORKER, world, "incremental_sigkill", target.base, victim=FAILING_RANK, logs=logs, env=env
    )
    for error in errors:
        assert "step 2 was not saved" in error, error
    assert target.steps() == [1]
    again = assert_all_ok(
        run_ranks(WORKER, world, "incremental_again", target.base, logs=logs, env=env)
    )
    assert [out["exact 2"] for out in again] == [True] * world
    second = ckptstore.read_manifest(target.base, 2, **target.options)
    assert {second.object_step(i) for i in second.references()} == {1}
    got = ckptstore.load(target.base, 2, target="torch", **target.options)
    assert all(frozen_exact(got, rank, 2) for rank in range(world))


def test_a_stalled_rank_fails_every_other_rank_within_the_collective_deadline(
    tmp_path: Path,
) -> None:
    """Issue 30: rank 1 stays alive and silent; every other rank's background save of step
    2 fails within the manager's collective timeout plus 10% (and a second for staging and
    the start of the collectives), with an error, and nothing of step 2 is committed."""
    from tests.manager_ranks import STALL_TIMEOUT

    root = tmp_path / "ckpts"
    outcomes = run_ranks(WORKER, 3, "stall", str(root), logs=tmp_path / "logs", env={})
    assert_stalled_rank_failed_the_others(outcomes, FAILING_RANK, STALL_TIMEOUT)
    assert ckptstore.list_steps(root) == [1]


@pytest.mark.parametrize("how", ["signal", "deadline"])
def test_preemption_on_one_rank_makes_every_rank_save_that_step_and_stop(
    tmp_path: Path, how: str
) -> None:
    """Issue 29: SIGTERM to one rank of 3 (or one rank's clock past ``save_before``) at step
    13 of a loop that saves every 5 steps: every rank agrees at its next save() call, step 13
    is saved by all of them, durable, and every rank leaves with Preempted's status (143 for
    the signal, 124 for the time limit). The step loads bit-exact."""
    from tests.manager_ranks import INTERVAL, PREEMPT_AT, exact

    root = tmp_path / "ckpts"
    outcomes = run_ranks(WORKER, 3, "preempt", str(root), how, logs=tmp_path / "logs", env={})
    status = 143 if how == "signal" else 124
    for rank, outcome in enumerate(outcomes):
        assert outcome.returncode == status, f"rank {rank}:\n{outcome.log[-4000:]}"
        assert outcome.results[-1] == {"step": PREEMPT_AT}, outcome.results[-3:]
        assert f"step {PREEMPT_AT} is durable; stopping on" in outcome.log, outcome.log[-2000:]
    assert ckptstore.list_steps(root) == [*range(0, PREEMPT_AT, INTERVAL), PREEMPT_AT]
    got = ckptstore.load(root, PREEMPT_AT, target="torch")
    assert all(exact(got, rank, PREEMPT_AT) for rank in range(3))


def test_a_manager_left_open_commits_and_destroys_its_groups_at_exit(tmp_path: Path) -> None:
    results = assert_all_ok(
        run_ranks(WORKER, 2, "left_open", str(tmp_path / "ckpts"), logs=tmp_path / "logs")
    )
    for out in results:
        assert out == {"groups": 2, "left": 0, "steps": [1]}


@pytest.mark.parametrize(("target", "world"), TIER_TARGETS_AND_WORLDS, indirect=["target"])
def test_tiers_on_ranks_commit_each_part_locally_and_each_chosen_step_once_persistently(
    target: Target, world: int, tmp_path: Path
) -> None:
    """Issue 28 item 6: a local tier per rank (one directory, a root per rank under it) and
    the persistent tier committed once per chosen step, incrementally, with every rank's
    part; restores read the nearest tier holding every rank's part."""
    logs, env, local = tmp_path / "logs", target.env(), str(tmp_path / "local")
    results = assert_all_ok(
        run_ranks(WORKER, world, "tiers", target.base, local, logs=logs, env=env)
    )
    for rank, out in enumerate(results):
        assert (out["local"], out["persistent"]) == ([3, 4], [2, 4]), f"rank {rank}"
        assert [out[f"exact {s}"] for s in (4, 3, 2)] == [True] * 3, f"rank {rank}"
        assert [out[f"tier {s}"] for s in (4, 3, 2)] == ["local", "local", "persistent"]
    assert target.steps() == [2, 4]
    assert step_dirs(target)["4"] == {f"r{rank}" for rank in range(world)}
    second, fourth = (ckptstore.read_manifest(target.base, s, **target.options) for s in (2, 4))
    assert fourth.own_bytes < 0.1 * second.own_bytes, (fourth.own_bytes, second.own_bytes)
    assert {fourth.object_step(i) for i in fourth.references()} == {2}
    from tests.manager_ranks import frozen_exact

    got = ckptstore.load(target.base, 4, target="torch", **target.options)
    assert all(frozen_exact(got, rank, 4) for rank in range(world))


@pytest.mark.parametrize(("target", "world"), TIER_SIGKILL_TARGETS_AND_WORLDS, indirect=["target"])
def test_rank_sigkilled_during_a_copy_to_the_persistent_tier_and_the_next_start_copies_it(
    target: Target, world: int, tmp_path: Path
) -> None:
    """A rank SIGKILLed while it copies its part of step 2 (committed on every rank's local
    tier) to the persistent tier: no step 2 there, a clear error on the survivors; the next
    world on the same local directory copies step 2 at its start and restores it from the
    local tier, bit-exact."""
    from tests.manager_ranks import frozen_exact

    logs, env, local = tmp_path / "logs", target.env(), str(tmp_path / "local")
    errors = run_and_sigkill(
        WORKER, world, "tiers_sigkill", target.base, local, victim=FAILING_RANK, logs=logs, env=env
    )
    for error in errors:
        assert "step 2 was not saved" in error, error
        assert "another rank died" in error, error
    assert target.steps() == [1]
    again = assert_all_ok(
        run_ranks(WORKER, world, "tiers_again", target.base, local, logs=logs, env=env)
    )
    assert [(out["exact 2"], out["tier"], out["persistent"]) for out in again] == [
        (True, "local", [1, 2])
    ] * world
    got = ckptstore.load(target.base, 2, target="torch", **target.options)
    assert all(frozen_exact(got, rank, 2) for rank in range(world))
