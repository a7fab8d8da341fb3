"""Native multi-rank saves (ckptstore.distributed) with ranks as threads of one process.

The merge, ownership, commit and failure logic is the same whatever carries the collectives;
``LocalGroup`` carries them between threads here, so every failure path can be driven
exactly. tests/test_distributed_ranks.py runs the same saves on real gloo processes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptstore
import ckptstore.manager.distributed as cd
from ckptstore import background
from ckptstore.errors import CkptStoreError, CommitConflictError, StoreError
from ckptstore.store.base import Store
from ckptstore.store.registry import open_store
from ckptstore.store.wrappers import CountingStore, Fault, FaultStore, transient_error

MiB = 1 << 20


def run_ranks(world: int, fn: Callable[[int, cd.Collectives], Any]) -> list[Any]:
    """Run ``fn(rank, comm)`` on ``world`` threads; each result or raised exception, by rank."""
    group = cd.LocalGroup(world, timeout=30)

    def one(rank: int) -> Any:
        try:
            return fn(rank, group.member(rank))
        except BaseException as exc:  # collected and checked by the test
            return exc

    with ThreadPoolExecutor(world) as pool:
        return list(pool.map(one, range(world)))


def shard(rank: int, n: int = MiB // 4) -> np.ndarray:
    return np.random.default_rng(rank).standard_normal(n).astype(np.float32)


def part(rank: int) -> dict[str, Any]:
    """Rank ``rank``'s part: a shard of its own, small tensors of its own, and entries every
    rank holds (a large replicated array, a scalar, the step counter)."""
    return {
        "model": {
            f"shard{rank}": shard(rank),
            "embed": np.arange(MiB // 4, dtype=np.float32),  # replicated, 1 MiB
        },
        "small": {f"r{rank}-{i}": np.full(8, rank * 100 + i, np.int64) for i in range(20)},
        "scalar": np.float64(2.5),
        "step": 10,
        "order": [1, 2, "three"],
    }


def merged(world: int) -> dict[str, Any]:
    state: dict[str, Any] = {"model": {}, "small": {}}
    for rank in range(world):
        mine = part(rank)
        state["model"].update(mine["model"])
        state["small"].update(mine["small"])
        state.update({k: mine[k] for k in ("scalar", "step", "order")})
    return state


def assert_same(a: Any, b: Any) -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict)
        assert sorted(map(str, a)) == sorted(map(str, b))
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert type(a) is type(b)
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif isinstance(a, np.ndarray | np.generic):
        assert np.asarray(a).dtype == np.asarray(b).dtype
        np.testing.assert_array_equal(a, b)
    else:
        assert type(a) is type(b)
        assert a == b


@pytest.fixture
def store(tmp_path: Path) -> Any:
    store = open_store(str(tmp_path / "ckpt"))
    yield store
    background.run(store.close())


def keys(store: Store) -> list[str]:
    return background.run(store.list_keys())


def test_four_ranks_commit_one_checkpoint_of_the_merged_state(store: Store) -> None:
    results = run_ranks(4, lambda rank, comm: cd.save(store, part(rank), step=3, comm=comm))
    for result in results:
        assert isinstance(result, ckptstore.CommitInfo), result
    assert len({(r.attempt, r.objects, r.nbytes) for r in results}) == 1  # same on every rank

    assert ckptstore.list_steps(store) == [3]
    assert_same(ckptstore.load(store, 3), merged(4))
    written = [k for k in keys(store) if k != "3/manifest.json"]
    assert {k.split("/")[2].split("-")[0] for k in written} == {"r0", "r1", "r2", "r3"}
    # the replicated 1 MiB array is written once, not four times
    manifest = ckptstore.read_manifest(store, 3)
    assert results[0].nbytes < 4 * MiB + 4 * MiB // 2
    assert manifest.paths.count("model/embed") == 1


def test_replicated_leaves_are_spread_over_their_holders(store: Store) -> None:
    def rank_part(rank: int) -> dict[str, Any]:
        return {f"w{i}": np.full(MiB // 4, i, np.float32) for i in range(8)}  # all replicated

    results = run_ranks(4, lambda rank, comm: cd.save(store, rank_part(rank), step=0, comm=comm))
    assert all(isinstance(r, ckptstore.CommitInfo) for r in results), results
    writers = [k.split("/")[2].split("-")[0] for k in keys(store) if "/attempt-" in k]
    assert sorted(writers) == ["r0", "r0", "r1", "r1", "r2", "r2", "r3", "r3"]
    assert_same(ckptstore.load(store, 0), rank_part(0))


def test_ranks_that_disagree_on_a_shared_entry_fail_alike_and_write_nothing(
    store: Store,
) -> None:
    def clash(rank: int) -> dict[str, Any]:
        return {"w": np.zeros(4 + rank, np.float32), "own": {str(rank): np.ones(3)}}

    results = run_ranks(3, lambda rank, comm: cd.save(store, clash(rank), step=1, comm=comm))
    for result in results:
        assert isinstance(result, ValueError)
        assert "'w'" in str(result)
        assert "rank 0" in str(result)
        assert "rank 1" in str(result)
    assert keys(store) == []

    values = run_ranks(
        2, lambda rank, comm: cd.save(store, {"lr": 0.1 * (rank + 1)}, step=1, comm=comm)
    )
    assert all(isinstance(r, ValueError) and "'lr'" in str(r) for r in values)
    kinds = run_ranks(
        2,
        lambda rank, comm: cd.save(store, {"x": [1] if rank else {"a": 1}}, step=1, comm=comm),
    )
    assert all(isinstance(r, ValueError) and "list" in str(r) for r in kinds)
    assert keys(store) == []


def test_an_unstorable_leaf_on_one_rank_fails_every_rank(store: Store) -> None:
    def mixed(rank: int) -> dict[str, Any]:
        return {"w": np.ones(4), "bad": object()} if rank == 1 else {"w": np.ones(4)}

    results = run_ranks(3, lambda rank, comm: cd.save(store, mixed(rank), step=1, comm=comm))
    assert isinstance(results[1], TypeError)  # its own error, as itself
    for rank in (0, 2):
        assert isinstance(results[rank], CkptStoreError)
        assert "rank 1" in str(results[rank])
        assert "bad" in str(results[rank])
    assert keys(store) == []


def test_a_rank_whose_writes_fail_fails_the_save_and_nothing_is_left(
    store: Store,
) -> None:
    broken = FaultStore(store, [Fault(frozenset({"put", "put_part"}), transient_error, after=1)])
    roots: dict[int, Store] = {0: store, 1: broken, 2: store}

    results = run_ranks(3, lambda rank, comm: cd.save(roots[rank], part(rank), step=5, comm=comm))
    assert isinstance(results[1], StoreError)
    for rank in (0, 2):
        assert isinstance(results[rank], CkptStoreError)
        assert "rank 1" in str(results[rank])
        assert "injected fault" in str(results[rank])
    assert ckptstore.list_steps(store) == []
    assert keys(store) == []  # every rank removed what it had written


class RankDied(Exception):
    """Stands for the death of a rank's process."""


def test_a_rank_that_dies_mid_save_leaves_no_checkpoint(store: Store) -> None:
    group = cd.LocalGroup(3, timeout=30)
    started = threading.Event()

    class Dying(FaultStore):
        """Rank 2's store: its first object lands, then the rank 'dies' (leaves the group)."""

        async def _hook(self, op: str, key: str, nbytes: int) -> Any:
            if started.is_set():
                group.abort()
                raise RankDied("rank 2 died")
            started.set()
            return None

    roots: dict[int, Store] = {0: store, 1: store, 2: Dying(store, [])}

    def one(rank: int) -> Any:
        try:
            return cd.save(roots[rank], part(rank), step=2, comm=group.member(rank))
        except BaseException as exc:
            return exc

    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(one, range(3)))
    assert all(isinstance(r, BaseException) for r in results), results
    # a survivor learns of the death from the collective, and says what was not saved
    assert isinstance(results[0], ckptstore.CkptStoreError), results[0]
    assert "step 2 was not saved" in str(results[0]), results[0]
    assert isinstance(results[0].__cause__, threading.BrokenBarrierError)
    assert ckptstore.list_steps(store) == []
    # the survivors removed their objects; the dead rank's one object is gc's to remove
    assert all("/r2-" in k for k in keys(store))


def test_a_committed_step_is_refused_on_every_rank(store: Store) -> None:
    ckptstore.save(store, {"w": np.ones(3)}, step=4)
    results = run_ranks(2, lambda rank, comm: cd.save(store, part(rank), step=4, comm=comm))
    assert all(isinstance(r, CommitConflictError) for r in results), results
    assert ckptstore.list_steps(store) == [4]


def test_ranks_saving_different_steps_are_refused(store: Store) -> None:
    results = run_ranks(2, lambda rank, comm: cd.save(store, part(rank), step=rank, comm=comm))
    assert all(isinstance(r, ValueError) and "different steps" in str(r) for r in results)
    assert keys(store) == []


def test_load_on_fewer_ranks_reads_only_each_ranks_bytes(store: Store) -> None:
    run_ranks(4, lambda rank, comm: cd.save(store, part(rank), step=8, comm=comm))

    def load(rank: int, comm: cd.Collectives) -> tuple[Any, int]:
        counting = CountingStore(store)
        like = np.empty(MiB // 4, np.float32)
        wanted = {"model": {f"shard{2 * rank + i}": like for i in range(2)}, "step": 0}
        got = cd.load(counting, target=wanted, comm=comm)  # step=None: the coordinator's latest
        return got, counting.bytes["read"]  # ranged reads (the manifest is one whole get)

    for rank, (got, read) in enumerate(run_ranks(2, load)):
        expected = {f"shard{2 * rank + i}": shard(2 * rank + i) for i in range(2)}
        assert_same(got, {"model": expected, "step": 10})
        assert read == 2 * MiB  # its two 1 MiB shards, nothing of the other ranks' data


def test_load_of_a_missing_step_or_root_says_so(store: Store) -> None:
    results = run_ranks(2, lambda rank, comm: cd.load(store, comm=comm))
    assert all(isinstance(r, ckptstore.NotFoundError) for r in results), results


def test_bad_arguments_are_refused_before_any_collective(store: Store) -> None:
    comm = cd.LocalGroup(1).member(0)
    with pytest.raises(ValueError, match="coordinator 3"):
        cd.save(store, {"w": np.ones(2)}, step=1, coordinator=3, comm=comm)
    with pytest.raises(ValueError, match="no leaves"):
        cd.load(store, 1, target={}, comm=comm)
    with pytest.raises(RuntimeError, match="init_process_group"):
        cd.save(store, {"w": np.ones(2)}, step=1)


def test_torch_tensors_round_trip_with_their_dtype_and_grad(store: Store) -> None:
    torch = pytest.importorskip("torch")

    def torch_part(rank: int) -> dict[str, Any]:
        weight = torch.arange(1000, dtype=torch.bfloat16) + rank
        return {f"w{rank}": weight.requires_grad_(True), "shared": torch.ones(5, dtype=torch.bool)}

    results = run_ranks(2, lambda rank, comm: cd.save(store, torch_part(rank), step=1, comm=comm))
    assert all(isinstance(r, ckptstore.CommitInfo) for r in results), results
    got = cd.load(store, 1, keys=["w1", "shared"])
    assert isinstance(got["w1"], torch.Tensor)
    assert got["w1"].dtype == torch.bfloat16
    assert got["w1"].requires_grad
    assert torch.equal(got["w1"].detach(), torch_part(1)["w1"].detach())
    assert torch.equal(got["shared"], torch.ones(5, dtype=torch.bool))
    assert "w0" not in got


def test_objects_a_rank_wrote_elsewhere_are_not_committed(tmp_path: Path) -> None:
    # Rank 1's root is another directory, as a local path is on another host: its objects
    # are durable there, but the coordinator cannot see them, so nothing may commit.
    shared, elsewhere = tmp_path / "shared", tmp_path / "elsewhere"
    roots = {0: str(shared), 1: str(elsewhere)}

    results = run_ranks(2, lambda rank, comm: cd.save(roots[rank], part(rank), step=6, comm=comm))
    for result in results:
        assert isinstance(result, CkptStoreError), result
        assert "not in" in str(result)
        assert "same shared root" in str(result)
        assert "/r1-" in str(result)  # names an object the coordinator could not see
    assert ckptstore.list_steps(str(shared)) == []
    assert ckptstore.list_steps(str(elsewhere)) == []


class LostOutcome:
    """Collectives whose last step, the broadcast of the outcome, fails on every rank."""

    def __init__(self, inner: cd.Collectives) -> None:
        self.inner = inner
        self.rank, self.world = inner.rank, inner.world

    def all_gather(self, obj: Any) -> list[Any]:
        return self.inner.all_gather(obj)

    def gather(self, obj: Any, root: int) -> list[Any] | None:
        return self.inner.gather(obj, root)

    def broadcast(self, obj: Any, root: int) -> Any:
        raise ConnectionError("the transport failed")


def test_a_coordinator_that_committed_reports_success_when_the_outcome_is_lost(
    store: Store,
) -> None:
    results = run_ranks(
        3, lambda rank, comm: cd.save(store, part(rank), step=9, comm=LostOutcome(comm))
    )
    assert isinstance(results[0], ckptstore.CommitInfo), results[0]
    for lost in results[1:]:  # they never learnt the outcome, and say so
        assert isinstance(lost, ckptstore.CkptStoreError), lost
        assert "outcome of step 9 is unknown" in str(lost), lost
        assert isinstance(lost.__cause__, ConnectionError)
    assert ckptstore.list_steps(store) == [9]
    assert_same(ckptstore.load(store, 9), merged(3))  # nobody removed committed objects


def test_store_options_reach_the_store_a_url_opens(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")

    def save(step: int, **options: Any) -> list[Any]:
        return run_ranks(
            2,
            lambda rank, comm: cd.save(
                root, part(rank), step=step, comm=comm, full=True, **options
            ),
        )

    default, small_packs = save(1)[0], save(2, pack_size=256)[0]
    assert isinstance(default, ckptstore.CommitInfo)
    assert isinstance(small_packs, ckptstore.CommitInfo)
    # 20 small arrays of 64 bytes per rank: one pack each by default, many of 256 bytes
    assert small_packs.objects >= default.objects + 2 * 4
    got = run_ranks(2, lambda rank, comm: cd.load(root, comm=comm, pack_size=256))
    assert_same(got[0], merged(2))

    with pytest.raises(TypeError, match="open Store"):
        cd.save(
            CountingStore(open_store(root)),
            {},
            step=3,
            comm=cd.LocalGroup(1).member(0),
            pack_size=256,
        )


def test_a_second_save_writes_only_what_changed_sharded_leaves_included(tmp_path: Path) -> None:
    """Issue 28 item 6: a multi-rank save is incremental like ``ckptstore.save``: each rank
    leaves out its unchanged leaves (the replicated one written once, by its owner) and the
    manifest references step 1's objects; the chunks of a sharded leaf, planned after a
    rank's leaves, are written whole every time. Every step loads bit-exact."""
    from ckptstore.stage.shards import Shard

    root = str(tmp_path / "ckpt")
    table = np.arange(64 * 1024, dtype=np.float32).reshape(256, 256)

    def state(rank: int, step: int) -> dict[str, Any]:
        rows = slice(rank * 128, (rank + 1) * 128)
        return {
            **part(rank),  # unchanged from step to step
            "table": Shard(table[rows] + step, offsets=(rank * 128, 0), global_shape=(256, 256)),
            "step": step,
        }

    infos = []
    for step in (1, 2):
        results = run_ranks(
            2, lambda rank, comm, step=step: cd.save(root, state(rank, step), step=step, comm=comm)
        )
        assert all(isinstance(r, ckptstore.CommitInfo) for r in results), results
        infos.append(results[0])
    first, second = infos
    assert second.referenced_attempts == (f"1/{first.attempt}/",)
    assert second.nbytes < 0.2 * first.nbytes, (second.nbytes, first.nbytes)
    assert second.nbytes >= table.nbytes  # the sharded table changed: written again
    for step in (1, 2):
        got = ckptstore.load(root, step)
        assert np.array_equal(got["table"], table + step)
        assert_same(
            {k: got[k] for k in ("model", "small")}, {k: merged(2)[k] for k in ("model", "small")}
        )
    full = run_ranks(
        2, lambda rank, comm: cd.save(root, state(rank, 3), step=3, comm=comm, full=True)
    )
    assert full[0].referenced_objects == 0
    assert full[0].nbytes >= first.nbytes


def test_without_incremental_saves_ranks_write_everything_and_record_no_hashes(
    tmp_path: Path,
) -> None:
    """``incremental=False`` (a store setting): no hashing, no references, every byte
    written at every step."""
    root = str(tmp_path / "ckpt")
    for step in (1, 2):
        results = run_ranks(
            2,
            lambda rank, comm, step=step: cd.save(
                root, part(rank), step=step, comm=comm, incremental=False
            ),
        )
        assert all(isinstance(r, ckptstore.CommitInfo) for r in results), results
        assert results[0].referenced_objects == 0
    manifest = ckptstore.read_manifest(root, 2)
    assert manifest.leaf_hash is None
    assert manifest.references() == []
    assert_same(ckptstore.load(root, 2), merged(2))
