"""Read once, broadcast (ckptstore.manager.broadcast) with ranks as threads of one process.

``LocalGroup`` carries the collectives and the byte transfers between threads, so what is
read from the store can be counted per rank and every failure placed exactly.
tests/test_broadcast_ranks.py runs the same loads on real gloo processes.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptstore
import ckptstore.manager.distributed as cd
from ckptstore import background
from ckptstore.errors import CkptStoreError, CorruptCheckpointError, NotFoundError, StoreError
from ckptstore.manager import segments
from ckptstore.manager.broadcast import plan_reads
from ckptstore.store.base import Store
from ckptstore.store.registry import open_store
from ckptstore.store.wrappers import CountingStore, Fault, FaultStore, transient_error
from tests.children import python_path
from tests.test_distributed import assert_same, run_ranks

KiB, MiB = 1 << 10, 1 << 20
#: the operations a load reads data with
READS = frozenset({"get", "read"})


def replicated() -> dict[str, Any]:
    """A model every rank loads whole: leaves of several sizes, packed and alone."""
    rng = np.random.default_rng(5)
    return {
        "embed": rng.standard_normal(MiB // 4).astype(np.float32),  # 1 MiB
        "layers": [rng.standard_normal(64 * KiB).astype(np.float16) for _ in range(6)],
        "norms": {f"n{i}": np.full(256, i, np.float32) for i in range(40)},  # packed
        "empty": np.zeros((0, 3), np.int32),
        "scale": np.float64(0.5),
        "step": 12,
    }


def array_bytes(state: Any) -> int:
    if isinstance(state, dict):
        return sum(array_bytes(v) for v in state.values())
    if isinstance(state, list):
        return sum(array_bytes(v) for v in state)
    return int(state.nbytes) if isinstance(state, np.ndarray | np.generic) else 0


@pytest.fixture(autouse=True)
def segment_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory of the memory filesystem of the test's own for the ranks' segments
    (``CKPTSTORE_SHM_DIR``), so what a test leaves there is its own."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm on this platform")
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="ckptstore-test-") as path:
        monkeypatch.setenv("CKPTSTORE_SHM_DIR", path)
        yield Path(path)


class CountingExchange:
    """A rank's collectives that count the bytes it receives through exchange()."""

    def __init__(self, inner: cd.Collectives) -> None:
        self.inner, self.rank, self.world = inner, inner.rank, inner.world
        self.received = 0

    def all_gather(self, obj: Any) -> list[Any]:
        return self.inner.all_gather(obj)

    def gather(self, obj: Any, root: int) -> list[Any] | None:
        return self.inner.gather(obj, root)

    def broadcast(self, obj: Any, root: int) -> Any:
        return self.inner.broadcast(obj, root)

    def exchange(self, sends: list[cd.Message], receives: list[cd.Message]) -> None:
        self.inner.exchange(sends, receives)
        self.received += sum(buffer.nbytes for _, _, buffer in receives)


@pytest.fixture
def store(tmp_path: Path) -> Any:
    store = open_store(str(tmp_path / "ckpt"))
    yield store
    background.run(store.close())


def counted_load(store: Store, **kwargs: Any) -> Any:
    """``fn(rank, comm)`` for run_ranks: the rank's load and the bytes it read."""

    def load(rank: int, comm: cd.Collectives) -> tuple[Any, int]:
        counting = CountingStore(store)
        got = cd.load(counting, comm=comm, **kwargs)
        return got, counting.bytes["read"]

    return load


@pytest.mark.parametrize("world", [2, 4])
def test_a_replicated_state_is_read_once_and_spread_over_the_ranks(
    store: Store, world: int
) -> None:
    state = replicated()
    ckptstore.save(store, state, step=1)
    total = array_bytes(state)

    results = run_ranks(world, counted_load(store, step=1))
    for got, _ in results:
        assert_same(got, state)
    reads = [read for _, read in results]
    # every byte once over all ranks together (and the padding between packed leaves)
    assert total <= sum(reads) < total + 64 * KiB
    assert max(reads) < total  # more than one rank read
    assert max(reads) - min(reads) <= MiB  # no rank reads far more than another (by bytes)

    everyone = run_ranks(world, counted_load(store, step=1, broadcast=False))
    for got, read in everyone:
        assert_same(got, state)
        assert read >= total  # each rank read it all


def test_only_leaves_several_ranks_select_are_shared(store: Store) -> None:
    state = {
        # 1 MiB each, an object each: a ranged read of one takes in nothing of another
        "shard": {str(r): np.full(MiB // 4, r, np.float32) for r in range(4)},
        "tp": {str(t): np.full(MiB // 4, 10 + t, np.float32) for t in range(2)},
        "step": 3,
    }
    ckptstore.save(store, state, step=3)

    def load(rank: int, comm: cd.Collectives) -> tuple[Any, int]:
        # each rank its own data-parallel shard, and the tensor-parallel half its pair shares
        like = {
            "shard": {str(rank): np.empty(MiB // 4, np.float32)},
            "tp": {str(rank % 2): np.empty(MiB // 4, np.float32)},
        }
        counting = CountingStore(store)
        return cd.load(counting, 3, target=like, comm=comm), counting.bytes["read"]

    results = run_ranks(4, load)
    for rank, (got, _) in enumerate(results):
        expected = {"shard": {str(rank): state["shard"][str(rank)]}}
        expected["tp"] = {str(rank % 2): state["tp"][str(rank % 2)]}
        assert_same(got, expected)
    reads = [read for _, read in results]
    # the 4 own shards once each, each tensor-parallel half once (not twice)
    assert sum(reads) == 4 * MiB + 2 * MiB
    assert sorted(reads) == [MiB, MiB, 2 * MiB, 2 * MiB]  # each pair's half read by one of it


def test_plan_balances_shared_bytes_over_the_ranks_that_need_them() -> None:
    lengths = [100, 400, 300, 200, 0, 50]
    objects = [0, 1, 2, 3, -1, 4]  # each leaf alone in an object
    plan = plan_reads([[0, 1, 2, 3, 4], [1, 2, 3, 4, 5], [1, 2, 4]], lengths, objects)
    # leaf 0 is rank 0's alone, leaf 5 rank 1's; leaf 4 is empty: each reads it (no bytes)
    # 1 (400) -> rank 2 (0 so far); 2 (300) -> rank 1 (50); 3 (200) -> rank 0 (100)
    assert plan.reads == ((0, 4, 3), (4, 5, 2), (4, 1))
    assert plan.store_bytes(lengths) == [300, 350, 400]
    assert [(t.reader, t.receivers, t.leaves) for t in plan.transfers] == [
        (2, (0, 1), (1,)),
        (1, (0, 2), (2,)),
        (0, (1,), (3,)),
    ]
    two = plan_reads([[0, 1], [0, 1]], [10, 10], [0, 1])
    assert two.reads == ((0,), (1,))  # two equal leaves, one each


def test_plan_keeps_a_packs_shared_leaves_with_one_reader() -> None:
    # leaves 1-4 share pack 1: split leaf by leaf they would go to alternate ranks
    plan = plan_reads([[0, 1, 2, 3, 4]] * 2, [100, 30, 20, 20, 10], [0, 1, 1, 1, 1])
    assert plan.reads == ((0,), (1, 2, 3, 4))
    (big, pack) = plan.transfers
    assert (big.reader, big.receivers, big.leaves) == (0, (1,), (0,))
    assert (pack.reader, pack.receivers, pack.leaves) == (1, (0,), (1, 2, 3, 4))
    assert pack.offsets == (0, 64, 128, 192)  # each aligned for any dtype
    assert pack.nbytes == 202


def test_a_corrupt_shared_object_fails_every_rank(
    store: Store, tmp_path: Path, segment_dir: Path
) -> None:
    state = replicated()
    ckptstore.save(store, state, step=1)
    manifest = ckptstore.read_manifest(store, 1)
    embed = manifest.paths.index("embed")
    key = manifest.object_key(manifest.leaf_object[embed])
    damaged = tmp_path / "ckpt" / key
    raw = bytearray(damaged.read_bytes())
    raw[100] ^= 0xFF
    damaged.write_bytes(bytes(raw))

    results = run_ranks(4, counted_load(store, step=1))
    assert all(isinstance(r, CorruptCheckpointError) for r in results), results
    own = [r for r in results if "another rank" not in str(r)]
    assert len(own) == 1  # the embedding was read from the store by one rank only
    assert "'embed'" in str(own[0])
    reader = results.index(own[0])
    for other in results:
        if other is not own[0]:
            assert f"rank {reader}: CorruptCheckpointError" in str(other)
            assert "'embed'" in str(other)
    assert list(segment_dir.iterdir()) == []  # what the ranks read for others: removed


def test_a_store_error_on_the_rank_reading_a_shared_leaf_fails_every_rank(
    store: Store, segment_dir: Path
) -> None:
    ckptstore.save(store, replicated(), step=1)
    manifest = ckptstore.read_manifest(store, 1)
    embed = manifest.object_key(manifest.leaf_object[manifest.paths.index("embed")])
    # every rank's store fails reads of the embedding's object; only its reader gets there
    failing = FaultStore(store, [Fault(READS, transient_error, key=re.escape(embed))])

    results = run_ranks(3, lambda rank, comm: cd.load(failing, 1, comm=comm))
    assert sum(isinstance(r, StoreError) for r in results) == 1, results
    reader = next(rank for rank, r in enumerate(results) if isinstance(r, StoreError))
    for rank, other in enumerate(results):
        if rank != reader:
            assert isinstance(other, CkptStoreError), other
            assert f"rank {reader}: StoreError" in str(other)
            assert "injected fault" in str(other)
    assert list(segment_dir.iterdir()) == []


def test_collectives_without_exchange_are_refused_before_any_collective(store: Store) -> None:
    ckptstore.save(store, {"w": np.ones(4)}, step=1)

    class Old:
        """Collectives written before exchange() existed."""

        rank, world = 0, 2

        def all_gather(self, obj: Any) -> list[Any]:
            raise AssertionError("no collective may run")

    with pytest.raises(TypeError, match="exchange"):
        cd.load(store, 1, comm=Old())  # type: ignore[arg-type]
    got = cd.load(store, 1, comm=Old(), broadcast=False)  # type: ignore[arg-type]
    assert_same(got, {"w": np.ones(4)})


def test_a_key_one_rank_lacks_fails_every_rank(store: Store) -> None:
    ckptstore.save(store, replicated(), step=1)

    def load(rank: int, comm: cd.Collectives) -> Any:
        return cd.load(store, 1, keys=["embed", "nope"] if rank == 1 else ["embed"], comm=comm)

    results = run_ranks(3, load)
    assert all(isinstance(r, NotFoundError) for r in results), results
    assert "'nope'" in str(results[1])
    assert "rank 1" in str(results[0])
    assert "rank 1" in str(results[2])


def test_ranks_loading_different_steps_are_refused_unless_broadcast_is_off(
    store: Store,
) -> None:
    ckptstore.save(store, {"w": np.ones(8)}, step=1)
    ckptstore.save(store, {"w": np.zeros(8)}, step=2)

    results = run_ranks(2, lambda rank, comm: cd.load(store, rank + 1, comm=comm))
    assert all(isinstance(r, ValueError) and "different" in str(r) for r in results), results

    apart = run_ranks(2, lambda rank, comm: cd.load(store, rank + 1, comm=comm, broadcast=False))
    assert_same(apart, [{"w": np.ones(8)}, {"w": np.zeros(8)}])


def test_the_latest_step_is_loaded_with_shared_reads(store: Store) -> None:
    state = replicated()
    ckptstore.save(store, state, step=4)
    results = run_ranks(3, counted_load(store))  # step=None: the coordinator's latest
    for got, _ in results:
        assert_same(got, state)
    assert array_bytes(state) <= sum(read for _, read in results) < array_bytes(state) + 64 * KiB


def test_a_rank_that_leaves_the_group_fails_the_others_without_a_hang(store: Store) -> None:
    ckptstore.save(store, replicated(), step=1)
    group = cd.LocalGroup(3, timeout=30)

    class Leaves:
        """Rank 2's collectives: it leaves the group when the shared leaves are sent."""

        def __init__(self, inner: cd.Collectives) -> None:
            self.inner, self.rank, self.world = inner, inner.rank, inner.world

        def all_gather(self, obj: Any) -> list[Any]:
            return self.inner.all_gather(obj)

        def exchange(self, sends: list[cd.Message], receives: list[cd.Message]) -> None:
            group.abort()
            raise ConnectionError("rank 2 left")

    def load(rank: int) -> Any:
        comm = group.member(rank)
        try:
            return cd.load(store, 1, comm=Leaves(comm) if rank == 2 else comm)  # type: ignore[arg-type]
        except BaseException as exc:
            return exc

    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(load, range(3)))
    for survivor in results[:2]:
        assert isinstance(survivor, CkptStoreError), survivor
        # in the transfer, or in the collective before it that the departure broke first
        message = str(survivor)
        assert "step 1 was not loaded" in message or "loading step 1 failed" in message, message
        assert "another rank died" in str(survivor), survivor


# ------------------------------------------------------------------ shared memory


def saved(store: Store) -> tuple[dict[str, Any], int]:
    """:func:`replicated` saved as step 1, and its array bytes."""
    state = replicated()
    ckptstore.save(store, state, step=1)
    return state, array_bytes(state)


def exchanged_load(
    store: Store, fill: bool = True, **kwargs: Any
) -> Callable[[int, cd.Collectives], tuple[Any, int, int, bool]]:
    """``fn(rank, comm)`` for run_ranks: the rank's load, the bytes it read from the store
    and received over the group, and (``fill``) whether its arrays are its own: each rank
    overwrites its ``embed`` with its rank and, once all have, finds its own value there."""
    written = threading.Barrier(kwargs.pop("world"))

    def load(rank: int, comm: cd.Collectives) -> tuple[Any, int, int, bool]:
        counting, counted = CountingStore(store), CountingExchange(comm)
        got = cd.load(counting, 1, comm=counted, **kwargs)  # type: ignore[arg-type]
        exact = got["embed"].copy()
        own = True
        if fill:
            got["embed"][...] = rank
            written.wait()
            own = bool((got["embed"] == rank).all())
            got["embed"][...] = exact
        return got, counting.bytes["read"], counted.received, own

    return load


def test_ranks_of_one_host_map_the_shared_leaves_and_remove_the_segments(
    store: Store, segment_dir: Path
) -> None:
    state, total = saved(store)
    results = run_ranks(4, exchanged_load(store, world=4))
    for got, _, received, own in results:
        assert_same(got, state)
        assert received == 0  # nothing over the group
        assert own  # writable, and a rank's writes stay its own
    assert total <= sum(read for _, read, _, _ in results) < total + 64 * KiB
    # the segments are gone, the arrays over them still valid (checked above)
    assert list(segment_dir.iterdir()) == []


def test_ranks_on_other_hosts_get_the_shared_leaves_over_the_group(
    store: Store, segment_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ranks 0 and 2 on one host, 1 and 3 on another: each rank gets over the group the
    leaves ranks of the other host read for it, through shared memory the rest."""
    state, total = saved(store)
    where = threading.local()
    real = segments.host_identity
    monkeypatch.setattr(segments, "host_identity", lambda: f"{real()} half {where.half}")
    inner = exchanged_load(store, world=4)

    def load(rank: int, comm: cd.Collectives) -> tuple[Any, int, int, bool]:
        where.half = rank % 2
        return inner(rank, comm)

    results = run_ranks(4, load)
    for got, _, received, own in results:
        assert_same(got, state)
        assert own
        assert 0 < received < total
    # a rank read for each other one some of what it got: some came by memory, some not
    assert sum(read for _, read, _, _ in results) + sum(r for _, _, r, _ in results) < 4 * total
    assert total <= sum(read for _, read, _, _ in results) < total + 64 * KiB
    assert list(segment_dir.iterdir()) == []


def test_shared_memory_off_sends_everything_over_the_group(store: Store, segment_dir: Path) -> None:
    state, total = saved(store)
    results = run_ranks(3, exchanged_load(store, world=3, shared_memory=False))
    for got, read, received, own in results:
        assert_same(got, state)
        assert own
        assert read + received >= total  # what it did not read, it received
        assert received > 0


def test_a_memory_filesystem_without_room_sends_over_the_group(
    store: Store, segment_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A segment whose memory cannot be reserved (a full /dev/shm) is not made; its bytes go
    over the group, and nothing is left behind."""
    state, total = saved(store)

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    results = run_ranks(3, exchanged_load(store, world=3))
    for got, read, received, _ in results:
        assert_same(got, state)
        assert read + received >= total
        assert received > 0
    assert list(segment_dir.iterdir()) == []


def test_a_receiver_that_cannot_map_a_segment_gets_its_bytes_over_the_group(
    store: Store, segment_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 cannot map what it is announced (another /dev/shm after all): it gets those
    bytes over the group; the other ranks still map theirs."""
    state, _ = saved(store)
    real = segments.attach
    unable = threading.local()
    monkeypatch.setattr(segments, "attach", lambda name: None if unable.yes else real(name))
    inner = exchanged_load(store, world=3)

    def load(rank: int, comm: cd.Collectives) -> tuple[Any, int, int, bool]:
        unable.yes = rank == 1
        return inner(rank, comm)

    results = run_ranks(3, load)
    for got, _, _, own in results:
        assert_same(got, state)
        assert own
    received = [r for _, _, r, _ in results]
    assert received[1] > 0
    assert received[0] == received[2] == 0
    assert list(segment_dir.iterdir()) == []


def test_orphaned_segments_are_removed_and_live_ones_kept(segment_dir: Path) -> None:
    """A segment whose creator was SIGKILLed is removed; one whose creator lives, an empty
    one just created (its creator may not have locked it yet) and other files are kept."""
    script = (
        "import sys; from ckptstore.manager import segments\n"
        "s = segments.Segment.create(1 << 20, 'killed', 0)\n"
        "print(s.name.path, flush=True); sys.stdin.read()\n"
    )
    with subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": python_path()},
    ) as child:
        try:
            assert child.stdout is not None
            killed = Path(child.stdout.readline().strip())
            assert killed.parent == segment_dir
            live = segments.Segment.create(4096, "live", 0)
            assert live is not None
            assert segments.remove_orphans() == []  # the child is alive: its segment is kept
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
    empty = segment_dir / f"{segments.PREFIX}empty-0"
    empty.touch()
    other = segment_dir / "not-ours"
    other.write_bytes(b"x")

    assert segments.remove_orphans() == [killed.name]
    assert sorted(p.name for p in segment_dir.iterdir()) == sorted(
        [Path(live.name.path).name, empty.name, other.name]
    )
    live.remove()
    assert not Path(live.name.path).exists()
