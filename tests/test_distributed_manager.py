"""The multi-rank CheckpointManager (ckptstore.distributed.CheckpointManager) with ranks as
threads of one process.

``LocalGroup`` carries the manager's collectives between threads, and a gate on each rank's
store holds or fails that rank's background writes on demand, so every path is driven
exactly: the save returning while the writes are held, a mutation after it, a rank whose
writes fail, a rank whose staging fails, retention. tests/test_distributed_ranks.py runs the
manager on real gloo processes, SIGKILL included.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptstore
import ckptstore.distributed
from ckptstore import background
from ckptstore.errors import NotFoundError, StoreError
from ckptstore.stage import StagedState, Stager
from ckptstore.store.base import Store
from ckptstore.store.registry import open_store
from ckptstore.store.wrappers import StoreWrapper
from tests.gated_store import HELD_FOR, Gate
from tests.multirank import outcome_of
from tests.test_distributed import run_ranks

MiB = 1 << 20


def part(rank: int, seed: int) -> dict[str, Any]:
    """Rank ``rank``'s part at ``seed``: a shard of its own, small arrays of its own, an
    array and a value every rank holds."""
    rng = np.random.default_rng(seed * 100 + rank)
    return {
        "model": {
            f"shard{rank}": rng.standard_normal(MiB // 4).astype(np.float32),
            "embed": np.arange(4096, dtype=np.float32) + seed,
        },
        "small": {f"r{rank}-{i}": np.full(8, seed * 1000 + i, np.int64) for i in range(10)},
        "step": seed,
    }


def assert_equal_trees(a: Any, b: Any) -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict)
        assert sorted(a) == sorted(b)
        for key in a:
            assert_equal_trees(a[key], b[key])
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray)
        assert a.dtype == b.dtype
        assert a.shape == b.shape
        assert a.tobytes() == b.tobytes()  # bit-exact
    else:
        assert a == b


def merged(world: int, seed: int) -> dict[str, Any]:
    state: dict[str, Any] = {"model": {}, "small": {}, "step": seed}
    for rank in range(world):
        mine = part(rank, seed)
        state["model"].update(mine["model"])
        state["small"].update(mine["small"])
    return state


@pytest.fixture
def shared(tmp_path: Path) -> Store:
    """The store every rank saves to (a local directory)."""
    store = open_store(str(tmp_path / "ckpts"))
    yield store
    background.run(store.close())


def steps_of(store: Store) -> list[int]:
    return background.run(ckptstore.alist_steps(store))


@pytest.mark.parametrize("world", [2, 4])
def test_save_returns_after_the_copy_and_later_mutation_is_not_written(
    shared: Store, world: int
) -> None:
    def rank_body(rank: int, comm: ckptstore.distributed.Collectives) -> dict[str, Any]:
        gate = Gate(shared)
        gate.hold()
        with ckptstore.distributed.CheckpointManager(gate, comm=comm) as mgr:
            state = part(rank, 1)
            assert mgr.save(1, state) is True
            # The call returned while this rank's writes cannot have happened: every put
            # waits on the gate, so neither this rank's objects nor the commit exist yet.
            assert mgr.last_handle is not None
            assert not mgr.last_handle.done()
            assert 1 not in steps_of(shared)
            # the background reaches a write of this rank while the call has long returned
            assert gate.held.wait(HELD_FOR)
            for leaf in (*state["model"].values(), *state["small"].values()):
                leaf[...] = -7  # changed after the call returned
            state["step"] = -7
            gate.release()
            mgr.wait_until_finished()
            info = mgr.last_handle.result()
            return {"attempt": info.attempt, "steps": mgr.all_steps()}

    results = run_ranks(world, rank_body)
    for result in results:
        assert not isinstance(result, BaseException), repr(result)
    assert len({r["attempt"] for r in results}) == 1  # one commit, reported on every rank
    assert results[0]["steps"] == [1]
    assert_equal_trees(ckptstore.load(shared, 1), merged(world, 1))


def test_failing_rank_surfaces_on_every_rank_at_wait_and_at_the_next_save(
    shared: Store,
) -> None:
    def rank_body(rank: int, comm: ckptstore.distributed.Collectives) -> dict[str, str]:
        gate = Gate(shared)
        seen: dict[str, str] = {}
        with ckptstore.distributed.CheckpointManager(gate, comm=comm) as mgr:
            mgr.save(1, part(rank, 1))
            mgr.wait_until_finished()
            if rank == 1:
                gate.mode = "fail"
            mgr.save(2, part(rank, 2))  # returns: the failure is in the background
            seen["wait"] = outcome_of(mgr.wait_until_finished)
            mgr.save(3, part(rank, 3))  # fails again in the background
            seen["next save"] = outcome_of(lambda: mgr.save(4, part(rank, 4)))
            gate.mode = "pass"
            mgr.save(5, part(rank, 5))
            mgr.wait_until_finished()
            seen["steps"] = str(mgr.all_steps())
        return seen

    results = run_ranks(2, rank_body)
    for rank, seen in enumerate(results):
        assert not isinstance(seen, BaseException), repr(seen)
        for call, step in (("wait", 2), ("next save", 3)):
            if rank == 1:  # its own error, as itself
                assert seen[call].startswith("StoreError: injected failure"), seen[call]
            else:  # the others: which rank failed, and which step was not saved
                assert seen[call].startswith("CkptStoreError"), seen[call]
                assert f"step {step} was not saved" in seen[call], seen[call]
                assert "rank 1: StoreError" in seen[call], seen[call]
        assert seen["steps"] == "[1, 5]"  # 2 and 3 failed, 4 was refused
    assert steps_of(shared) == [1, 5]
    keys = background.run(shared.list_keys())
    assert not [k for k in keys if k.split("/")[0] in ("2", "3", "4")]  # nothing left over
    assert_equal_trees(ckptstore.load(shared, 5), merged(2, 5))


def test_rank_whose_staging_fails_raises_at_once_and_the_others_learn_of_it(
    shared: Store,
) -> None:
    def rank_body(rank: int, comm: ckptstore.distributed.Collectives) -> dict[str, str]:
        seen: dict[str, str] = {}
        with ckptstore.distributed.CheckpointManager(shared, comm=comm) as mgr:
            state = part(rank, 1)
            if rank == 1:
                state["bad"] = object()  # nothing ckptstore can store
            seen["save"] = outcome_of(lambda: mgr.save(1, state))
            seen["wait"] = outcome_of(mgr.wait_until_finished)
            mgr.save(2, part(rank, 2))  # the ranks' collectives are still in step
            mgr.wait_until_finished()
        return seen

    results = run_ranks(3, rank_body)
    for rank, seen in enumerate(results):
        assert not isinstance(seen, BaseException), repr(seen)
        if rank == 1:
            assert "'bad'" in seen["save"], seen["save"]  # the leaf is named, at the call
            assert seen["wait"] == "succeeded"  # its error is not raised twice
        else:
            assert seen["save"] == "succeeded"
            assert seen["wait"].startswith("CkptStoreError"), seen["wait"]
            assert "step 1 was not saved: rank 1:" in seen["wait"], seen["wait"]
    assert steps_of(shared) == [2]


class FailingCopy(Stager):
    """A stager whose copies seem to land later and then fail, as a device-to-host copy
    whose stream failed would."""

    def stage(self, state: Any, *, copy: bool = True, lazy: bool = False) -> StagedState:
        staged = super().stage(state, copy=copy, lazy=lazy)
        staged.fences.append(self.fail)
        return staged

    @staticmethod
    def fail() -> None:
        raise RuntimeError("the device-to-host copy failed")


def test_copy_that_fails_after_the_call_is_shared_with_the_other_ranks(shared: Store) -> None:
    def rank_body(rank: int, comm: ckptstore.distributed.Collectives) -> str:
        stager = FailingCopy() if rank == 1 else None
        with ckptstore.distributed.CheckpointManager(shared, comm=comm, stager=stager) as mgr:
            assert mgr.save(1, part(rank, 1)) is True
            return outcome_of(mgr.wait_until_finished)

    seen = run_ranks(3, rank_body)
    assert seen[1] == "RuntimeError: the device-to-host copy failed"
    for rank in (0, 2):
        assert seen[rank].startswith("CkptStoreError"), seen[rank]
        assert "step 1 was not saved: rank 1: RuntimeError" in seen[rank], seen[rank]
    assert steps_of(shared) == []


def test_retention_restore_and_delete_are_the_single_process_managers(shared: Store) -> None:
    def rank_body(rank: int, comm: ckptstore.distributed.Collectives) -> dict[str, Any]:
        with ckptstore.distributed.CheckpointManager(
            shared, comm=comm, max_to_keep=2, coordinator=1
        ) as mgr:
            for step in range(1, 6):
                mgr.save(step, part(rank, step), metrics={"loss": 1.0 / step})
            latest = mgr.restore()  # waits for the last save; the coordinator's latest
            kept = mgr.all_steps()
            mine = mgr.restore(4, keys=[f"model/shard{rank}"])  # a plain read of one step
            with pytest.raises(NotFoundError):
                mgr.restore(3)  # removed by retention after step 5
            # the coordinator knows what each kept step it committed uses, as the
            # single-process manager does: retention marks without reading their manifests
            uses = sorted(mgr._uses) if rank == 1 else None
            mgr.delete(4)
            return {
                "latest": latest,
                "kept": kept,
                "uses": uses,
                "mine": mine,
                "after delete": mgr.all_steps(),
                "metrics": mgr.metrics(5),
            }

    results = run_ranks(2, rank_body)
    for rank, result in enumerate(results):
        assert not isinstance(result, BaseException), repr(result)
        assert result["kept"] == [4, 5]
        assert result["uses"] == ([4, 5] if rank == 1 else None)
        assert result["after delete"] == [5]
        assert result["metrics"] == {"loss": 0.2}
        assert_equal_trees(result["latest"], merged(2, 5))
        shard = f"shard{rank}"
        assert_equal_trees(result["mine"], {"model": {shard: part(rank, 4)["model"][shard]}})
    assert steps_of(shared) == [5]


class FailingDeletes(StoreWrapper):
    """The coordinator's store, whose deletions fail."""

    async def _hook(self, op: str, key: str, nbytes: int) -> None:
        if op == "delete":
            raise StoreError(f"injected failure of the deletion of {key!r}")


def test_failed_retention_is_raised_on_every_rank_and_the_step_stays_committed(
    shared: Store,
) -> None:
    def rank_body(rank: int, comm: ckptstore.distributed.Collectives) -> str:
        store = FailingDeletes(shared) if rank == 0 else shared
        with ckptstore.distributed.CheckpointManager(store, comm=comm, max_to_keep=1) as mgr:
            mgr.save(1, part(rank, 1))
            mgr.save(2, part(rank, 2))  # retention then deletes step 1, and fails
            return outcome_of(mgr.wait_until_finished)

    seen = run_ranks(2, rank_body)
    assert seen[0].startswith("StoreError: injected failure of the deletion"), seen[0]
    assert seen[1].startswith("CkptStoreError"), seen[1]
    assert "step 2 is committed; retention after it failed on rank 0: StoreError" in seen[1]
    assert steps_of(shared) == [1, 2]  # nothing lost: step 2 committed, step 1 kept
    assert_equal_trees(ckptstore.load(shared, 2), merged(2, 2))


def test_refusals_and_a_group_of_one(shared: Store) -> None:
    group = ckptstore.distributed.LocalGroup(2)
    with pytest.raises(ValueError, match="not both"):
        ckptstore.distributed.CheckpointManager(shared, comm=group.member(0), group=object())
    with pytest.raises(ValueError, match="not both"):
        ckptstore.distributed.CheckpointManager(shared, comm=group.member(0), timeout=5)
    with pytest.raises(ValueError, match="coordinator 2 is outside a group of 2"):
        ckptstore.distributed.CheckpointManager(shared, comm=group.member(0), coordinator=2)
    with ckptstore.distributed.CheckpointManager(
        shared, comm=ckptstore.distributed.LocalGroup(1).member(0)
    ) as mgr:
        with pytest.raises(ValueError, match="local tier"):
            mgr.save(1, part(0, 1), persist=True)
        assert mgr.save(1, part(0, 1)) is True  # a group of one is a plain async manager
        mgr.wait_until_finished()
        assert "rank=0, world=1" in repr(mgr)
    with ckptstore.distributed.CheckpointManager(
        shared, comm=ckptstore.distributed.LocalGroup(1).member(0), async_save=False
    ) as mgr:
        assert mgr.save(2, part(0, 2)) is True
        assert mgr.last_handle is not None
        assert mgr.last_handle.done()  # async_save=False: committed when the call returns
    assert steps_of(shared) == [1, 2]


def test_without_torch_distributed_initialised_the_fix_is_named(shared: Store) -> None:
    dist = pytest.importorskip("torch.distributed")
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        ckptstore.distributed.CheckpointManager(shared)


def test_without_torch_distributed_the_manager_names_both_ways_to_give_it_collectives(
    tmp_path: Path,
) -> None:
    pytest.importorskip("torch")
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"init_process_group.*JaxCollectives\("):
        ckptstore.distributed.CheckpointManager(str(tmp_path))


def test_preemption_with_collectives_of_ones_own_agrees_on_the_step(shared: Store) -> None:
    """``comm=`` with ``save_before=`` and ``preemption_comm=``: rank 1's time limit comes
    at step 3; both ranks save step 3 and stop with Preempted (status 124) there."""
    import time

    from ckptstore.manager.preemption import Preempted

    flags = ckptstore.distributed.LocalGroup(2, timeout=30)

    def rank_body(rank: int, comm: ckptstore.distributed.Collectives) -> Any:
        with ckptstore.distributed.CheckpointManager(
            shared,
            comm=comm,
            save_interval_steps=10,
            save_before=time.time() + 3600,
            preemption_comm=flags.member(rank),
        ) as mgr:
            for step in range(20):
                if step == 3 and rank == 1:
                    assert mgr._watch is not None
                    mgr._watch.save_before = time.time() + 0.5  # inside the margin
                mgr.save(step, {f"w{rank}": np.full(8, step), "step": step})
        return "never preempted"

    outcomes = run_ranks(2, rank_body)
    for outcome in outcomes:
        assert isinstance(outcome, Preempted), outcome
        assert (outcome.step, outcome.code) == (3, 124)
    assert "save_before" in outcomes[0].notice.reason
    assert "on rank 1" in outcomes[0].notice.reason  # rank 0 was told by rank 1
    assert steps_of(shared) == [0, 3]
    got = background.run(ckptstore.aload(shared, 3))
    assert got["w0"].tolist() == got["w1"].tolist() == [3] * 8


def test_preemption_with_comm_needs_collectives_for_it(shared: Store) -> None:
    group = ckptstore.distributed.LocalGroup(1, timeout=5)
    with pytest.raises(ValueError, match="need preemption_comm="):
        ckptstore.distributed.CheckpointManager(shared, comm=group.member(0), preemption=True)


@pytest.mark.torch
def test_lazy_snapshots_on_ranks_save_the_state_of_the_call(tmp_path: Path) -> None:
    """Issue 28 item 6: ``snapshot="lazy"`` on the multi-rank manager: ``save`` returns before
    the copy, the optimizer step that follows is fenced by the pre-hook (and a change by
    hand by ``fence()``), and what every rank committed is its state at the ``save`` call."""
    torch = pytest.importorskip("torch")
    root = str(tmp_path / "ckpts")

    def train(rank: int, comm: ckptstore.distributed.Collectives) -> Any:
        weight = torch.nn.Parameter(torch.arange(2**18, dtype=torch.float32) + rank)
        weight.grad = torch.ones_like(weight)
        opt = torch.optim.SGD([weight], lr=1.0)
        bias = torch.full((16,), float(rank))
        state = {"model": {f"w{rank}": weight, f"b{rank}": bias}, "step": 1}
        with ckptstore.distributed.CheckpointManager(root, comm=comm, snapshot="lazy") as mgr:
            assert mgr.save(1, state)
            opt.step()  # fenced: the copy ends before the update
            mgr.fence()
            bias.add_(100.0)
            mgr.wait_until_finished()
            return mgr.restore(1, target="torch")

    results = run_ranks(2, train)
    for result in results:
        assert not isinstance(result, BaseException), result
        for rank in range(2):
            want = torch.arange(2**18, dtype=torch.float32) + rank
            assert torch.equal(result["model"][f"w{rank}"], want)
            assert torch.equal(result["model"][f"b{rank}"], torch.full((16,), float(rank)))


@pytest.mark.torch
def test_a_lazy_copy_torn_on_one_rank_fails_the_save_on_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 changes a leaf by hand while its lazy copy is held before that leaf: rank 1's
    wait raises ``TornSnapshotError`` naming it, rank 0's an error naming rank 1, and no step
    is committed. (An eager save would never reach the held copy: the test proves the save
    is lazy.)"""
    torch = pytest.importorskip("torch")
    from ckptstore.errors import TornSnapshotError
    from tests.test_lazy_snapshot import Hold

    root = str(tmp_path / "ckpts")
    hold = Hold(monkeypatch, "model/b1")

    def train(rank: int, comm: ckptstore.distributed.Collectives) -> Any:
        bias = torch.full((16,), float(rank))
        state = {"model": {f"b{rank}": bias}, "step": 1}
        with ckptstore.distributed.CheckpointManager(root, comm=comm, snapshot="lazy") as mgr:
            mgr.save(1, state)
            if rank == 1:
                hold.wait_reached()
                bias.mul_(2)  # without the fence: the contract broken
                hold.release()
            outcome = outcome_of(mgr.wait_until_finished)
            return outcome, mgr.all_steps()

    (first, steps0), (second, steps1) = run_ranks(2, train)
    assert second.startswith(TornSnapshotError.__name__), second
    assert "'model/b1' was modified in place" in second, second
    assert first.startswith("CkptStoreError"), first
    assert "rank 1" in first, first
    assert steps0 == steps1 == []
    assert ckptstore.list_steps(root) == []


def test_full_every_and_full_on_ranks(tmp_path: Path) -> None:
    """``full_every=2``: the first save and every second one reference nothing; the others
    reference the step before; ``save(..., full=True)`` is full whatever the count."""
    root = str(tmp_path / "ckpts")
    frozen = np.arange(MiB // 4, dtype=np.float32)

    def train(rank: int, comm: ckptstore.distributed.Collectives) -> Any:
        with ckptstore.distributed.CheckpointManager(root, comm=comm, full_every=2) as mgr:
            for step in (1, 2, 3, 4):
                state = {"frozen": {f"r{rank}": frozen + rank}, "step": step}
                mgr.save(step, state, full=step == 4)
                mgr.wait_until_finished()
        return None

    assert run_ranks(2, train) == [None, None]
    refs = {s: ckptstore.read_manifest(root, s).references() for s in (1, 2, 3, 4)}
    assert [s for s, r in refs.items() if r] == [2]
