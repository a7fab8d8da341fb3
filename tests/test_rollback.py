"""Restart, resume and roll back (issue 29): a save that cannot commit is refused in the
``save()`` call, and rolling back sets newer steps aside, recoverably, instead of crashing
one save later or mixing two runs' steps.

The scenarios run on local disk, moto and SeaweedFS (the ``target`` fixture of
tests/multirank.py); the multi-rank manager's on threads of one process
(tests/test_distributed_manager.py's ``run_ranks``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptstore
import ckptstore.distributed
from ckptstore import CheckpointManager
from ckptstore.errors import CommitConflictError, CorruptCheckpointError, NotFoundError
from ckptstore.layout.rollback import SET_ASIDE_NAME
from tests.children import python_path
from tests.multirank import EVERY_TARGET, Target


def state_at(step: int) -> dict[str, Any]:
    """A state whose ``frozen`` leaf changes only every 10 steps and ``moving`` every step,
    so incremental saves reference earlier steps' objects."""
    return {
        "frozen": np.full(64 << 10, step // 10, np.float32),
        "moving": np.arange(1000, dtype=np.int64) * (step + 1),
        "step": step,
    }


def assert_state(got: dict[str, Any], step: int) -> None:
    want = state_at(step)
    assert got["step"] == step
    for name in ("frozen", "moving"):
        assert got[name].tobytes() == want[name].tobytes(), name


@pytest.mark.parametrize("target", EVERY_TARGET, indirect=True)
def test_a_rerun_in_the_same_root_is_refused_in_its_first_save(target: Target) -> None:
    """The getting-started loop run twice: the second run's save(0) used to be accepted,
    then save(20) died in the background with a conflict on step 15. Now save(0) itself
    refuses, naming the newest step and how to resume, and writes nothing."""
    with CheckpointManager(target.base, max_to_keep=3, **target.options) as mgr:
        for step in range(0, 30, 5):
            mgr.save(step, state_at(step))
    keys_before = sorted(target.keys(target.base))
    with CheckpointManager(target.base, max_to_keep=3, **target.options) as mgr:
        with pytest.raises(CommitConflictError) as raised:
            mgr.save(0, state_at(0))
        message = str(raised.value)
        assert "the newest step of this root is 25" in message
        assert "mgr.restore()" in message
        assert "rollback=True" in message
        assert sorted(target.keys(target.base)) == keys_before  # nothing of step 0 written
        # the resume the message describes works
        assert_state(mgr.restore(), 25)
        assert mgr.save(30, state_at(30))
    assert target.steps() == [20, 25, 30]
    assert set(keys_before) - set(target.keys(target.base)) <= {
        k for k in keys_before if k.startswith("15/")
    }


def test_a_step_not_after_one_in_flight_is_refused_at_once(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(5, state_at(5))
        for step in (5, 4):
            with pytest.raises(CommitConflictError, match="newest step of this root is 5"):
                mgr.save(step, state_at(step))
        mgr.save(6, state_at(6))
    assert ckptstore.list_steps(tmp_path) == [5, 6]


def test_a_step_whose_save_was_refused_or_deleted_can_be_saved(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(TypeError):
            mgr.save(1, {"bad": object()})  # refused in the call: step 1 was never accepted
        mgr.save(1, state_at(1))
        mgr.wait_until_finished()
        mgr.delete(1)  # the newest step, deleted: its number is free again
        mgr.save(1, state_at(1))
    assert ckptstore.list_steps(tmp_path) == [1]


@pytest.mark.parametrize("target", EVERY_TARGET, indirect=True)
def test_roll_back_two_steps_and_continue(target: Target) -> None:
    """Resuming from step 10 while the root holds up to 20: restore(10, rollback=True) sets
    15 and 20 aside, training saves 15 and 20 again with other values, and every face reads
    the new ones; the set-aside ones cannot be recovered over them, and gc removes them."""
    url, options = target.base, target.options
    with CheckpointManager(url, **options) as mgr:
        for step in range(0, 25, 5):
            mgr.save(step, state_at(step))
    with CheckpointManager(url, **options) as mgr:
        assert_state(mgr.restore(10, rollback=True), 10)
        assert mgr.set_aside == [15, 20]
        assert mgr.all_steps() == [0, 5, 10]
        for step in (15, 20):
            mgr.save(step, state_at(step + 1000))  # the new run's values
    assert target.steps() == [0, 5, 10, 15, 20]
    assert_state(ckptstore.load(url, **options), 1020)
    assert_state(ckptstore.load(url, 15, **options), 1015)
    with pytest.raises(CommitConflictError, match="committed again"):
        ckptstore.recover_step(url, 15, **options)
    report = ckptstore.gc(url, grace=0, **options)
    assert sorted(p.split("/")[0] for p in report.removed) == ["15", "20"]
    assert not [k for k in target.keys(url) if k.endswith(SET_ASIDE_NAME)]
    for step in (15, 20):
        assert_state(ckptstore.load(url, step, **options), step + 1000)


@pytest.mark.parametrize("target", EVERY_TARGET, indirect=True)
def test_set_aside_steps_are_recovered_whole_oldest_first(target: Target) -> None:
    """Step 22 references step 21's objects (incremental): recovering 22 first is refused
    (nothing committed), recovering 21 then 22 gives both back bit-exact."""
    url, options = target.base, target.options
    for step in (10, 20, 21, 22):
        ckptstore.save(url, state_at(step), step=step, **options)
    assert ckptstore.rollback(url, 10, **options) == [22, 21, 20]
    assert target.steps() == [10]
    with pytest.raises(CorruptCheckpointError, match="not a committed attempt"):
        ckptstore.recover_step(url, 22, **options)
    assert target.steps() == [10]
    for step in (20, 21, 22):
        ckptstore.recover_step(url, step, **options)
    assert target.steps() == [10, 20, 21, 22]
    for step in (10, 20, 21, 22):
        assert_state(ckptstore.load(url, step, **options), step)
    assert not [k for k in target.keys(url) if k.endswith(SET_ASIDE_NAME)]


def test_recovery_refuses_what_gc_removed_or_never_was(tmp_path: Path) -> None:
    for step in (1, 2):
        ckptstore.save(tmp_path, state_at(step), step=step)
    with pytest.raises(NotFoundError):
        ckptstore.rollback(tmp_path, 7)  # not a committed step: nothing is set aside
    with pytest.raises(NotFoundError, match="no set-aside copy"):
        ckptstore.recover_step(tmp_path, 2)  # committed, never set aside
    assert ckptstore.rollback(tmp_path, 1) == [2]
    assert ckptstore.gc(tmp_path).removed == []  # within the grace period: kept
    ckptstore.gc(tmp_path, grace=0)
    with pytest.raises(NotFoundError, match="no set-aside copy"):
        ckptstore.recover_step(tmp_path, 2)
    assert ckptstore.list_steps(tmp_path) == [1]


def test_a_half_done_roll_back_leaves_a_prefix_and_finishes_when_run_again(
    tmp_path: Path,
) -> None:
    """Steps are set aside newest first: a roll-back stopped after the first one leaves
    steps 0..3 visible (never a hole), and running it again finishes it."""
    for step in range(5):
        ckptstore.save(tmp_path, state_at(step), step=step)
    ckptstore.rollback(tmp_path, 3)  # as if a roll-back to 1 had stopped after step 4
    assert ckptstore.list_steps(tmp_path) == [0, 1, 2, 3]
    assert ckptstore.rollback(tmp_path, 1) == [3, 2]
    assert ckptstore.list_steps(tmp_path) == [0, 1]


def test_the_multi_rank_manager_refuses_and_rolls_back_on_every_rank(tmp_path: Path) -> None:
    from tests.test_distributed import run_ranks

    url = str(tmp_path / "ckpts")

    def rank_body(rank: int, comm: ckptstore.distributed.Collectives) -> dict[str, Any]:
        part = {f"r{rank}": np.full(10, rank, np.int32)}
        with ckptstore.distributed.CheckpointManager(url, comm=comm) as mgr:
            for step in (1, 2, 3):
                mgr.save(step, {**part, "step": step})
            try:
                mgr.save(2, {**part, "step": 2})
                refused = ""
            except CommitConflictError as exc:
                refused = str(exc)
            got = mgr.restore(1, rollback=True)
            aside = mgr.set_aside
            mgr.save(2, {**part, "step": 20})
            return {"refused": refused, "got": got["step"], "aside": aside}

    results = run_ranks(2, rank_body)
    for result in results:
        assert not isinstance(result, BaseException), repr(result)
        assert "newest step of this root is 3" in result["refused"]
        assert result["got"] == 1
        assert result["aside"] == [2, 3]
    assert ckptstore.list_steps(url) == [1, 2]
    assert ckptstore.load(url)["step"] == 20


def test_a_training_script_restarted_resumes_and_a_rolled_back_one_continues(
    tmp_path: Path,
) -> None:
    """The restart recipe of the docs, as a script run three times in one root: from
    scratch, again (resumes after the newest step), and rolled back to step 4."""
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys
            import numpy as np
            from ckptstore import CheckpointManager

            root, end = sys.argv[1], int(sys.argv[2])
            back_to = int(sys.argv[3]) if len(sys.argv) > 3 else None
            mgr = CheckpointManager(root, max_to_keep=3, save_interval_steps=2)
            start, w = 0, np.zeros(4)
            if mgr.latest_step() is not None:
                step = back_to if back_to is not None else mgr.latest_step()
                w = mgr.restore(step, rollback=back_to is not None)["w"]
                start = step + 1
            for step in range(start, end):
                w = w + step
                mgr.save(step, {"w": w})
            mgr.close()
            """
        )
    )

    def run(*args: Any) -> None:
        done = subprocess.run(
            [sys.executable, str(script), str(tmp_path / "ck"), *map(str, args)],
            env={**os.environ, "PYTHONPATH": python_path()},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr
        assert "never awaited" not in done.stderr

    run(10)
    assert ckptstore.list_steps(tmp_path / "ck") == [4, 6, 8]
    run(14)  # resumes from 8
    assert ckptstore.list_steps(tmp_path / "ck") == [8, 10, 12]
    run(14, 10)  # back to 10: 12 is set aside, 12 is saved again from 10's state
    assert ckptstore.list_steps(tmp_path / "ck") == [8, 10, 12]
    uninterrupted = np.zeros(4)
    for step in range(13):
        uninterrupted = uninterrupted + step
    assert ckptstore.load(tmp_path / "ck", 12)["w"].tobytes() == uninterrupted.tobytes()


def test_a_tiered_manager_rolls_back_both_tiers(tmp_path: Path) -> None:
    """With a local tier, the steps above are set aside on the local and the persistent
    tier alike, after the copies in flight have landed, so no copy lands above the step."""
    remote, local = tmp_path / "remote", tmp_path / "local"
    with CheckpointManager(remote, local=local, local_max_to_keep=None) as mgr:
        for step in range(5):
            mgr.save(step, state_at(step))
        assert_state(mgr.restore(2, rollback=True), 2)
        assert mgr.set_aside == [3, 4]
        listing = mgr.tiers()
        mgr.save(3, state_at(103))
        mgr.wait_until_finished()
    assert ckptstore.list_steps(local) == [0, 1, 2, 3]
    assert ckptstore.list_steps(remote) == [0, 1, 2, 3]
    assert_state(ckptstore.load(remote, 3), 103)
    assert listing.local == [0, 1, 2]
    assert listing.persistent == [0, 1, 2]


def test_plain_save_of_a_committed_step_is_refused_before_it_writes(tmp_path: Path) -> None:
    """``ckptstore.save`` of a step the root holds failed only at the commit's put-if-absent,
    after every byte was written (and then removed), naming no way on; it is refused before
    anything is written now, naming the newest step, and saved again after a roll-back."""
    root = tmp_path / "run"
    for step in (1, 2, 3):
        ckptstore.save(root, state_at(step), step=step)
    before = sorted(p.name for p in (root / "2").iterdir())
    with pytest.raises(CommitConflictError, match="newest step of this root is 3") as refused:
        ckptstore.save(root, state_at(5), step=2)
    assert "ckptstore.rollback" in str(refused.value)
    assert sorted(p.name for p in (root / "2").iterdir()) == before  # no attempt was begun
    assert_state(ckptstore.load(root, 2), 2)
    ckptstore.rollback(root, 1)
    ckptstore.save(root, state_at(5), step=2)
    assert_state(ckptstore.load(root, 2), 5)
