"""The save session (``ckptstore.layout.commit.SaveSession``): every save's one lifecycle.

A session begins (committed step refused, attempt drawn, lease taken), holds what it will
reference, has its objects written under its prefix, and ends in one of three ways: committed,
abandoned (its objects and lease gone), or, when the manifest put itself failed, with its data
left in place because the step may be committed. These tests pin each ending, on the session
itself and on the copy of a step, which became a session of its own at the destination.
"""

from __future__ import annotations

import asyncio
import pickle
import threading
from typing import Any

import numpy as np
import pytest

from ckptstore.errors import CommitConflictError, StoreError
from ckptstore.layout.commit import Attempt, SaveSession, read_manifest, write_checkpoint
from ckptstore.layout.keys import manifest_key
from ckptstore.layout.lease import LEASE_NAME
from ckptstore.layout.maintenance import copy_step
from ckptstore.layout.plan import PackPlan
from ckptstore.layout.tree import flatten
from ckptstore.manager.functions import aload
from ckptstore.store.base import Store
from ckptstore.store.memory import MemoryStore
from ckptstore.store.wrappers import CountingStore, Fault, FaultStore, StoreWrapper
from ckptstore.testing import assert_same_state


def _store() -> MemoryStore:
    return MemoryStore()


async def _keys(store: Store, prefix: str = "") -> list[str]:
    return sorted(await store.list_keys(prefix))


async def _commit_one(session: SaveSession, payload: bytes = b"x" * 100) -> None:
    """Write one object under ``session`` and commit a manifest of it, as a face does."""
    crc = await session.store.put_crc32c(session.prefix + "blob", memoryview(payload))
    draft = session.draft(["blob"], ["|u1"], [[len(payload)]], [len(payload)])
    first = draft.add_objects([f"{session.attempt.id}/blob"], [len(payload)], [crc])
    draft.place(0, first, 0, crc)
    await session.commit(draft.build(tree={"d": ["blob"], "c": [0]}))


async def test_a_committed_session_leaves_its_objects_and_no_lease() -> None:
    store = _store()
    session = await SaveSession.begin(store, 4, {"note": "hi"})
    assert await store.exists(session.prefix + LEASE_NAME)
    async with session:
        await _commit_one(session)
    keys = await _keys(store)
    assert keys == sorted([manifest_key(4), session.prefix + "blob"])
    assert (await read_manifest(store, 4)).attempt == session.attempt.id


async def test_a_session_left_by_an_error_before_its_commit_is_abandoned() -> None:
    store = _store()
    session = await SaveSession.begin(store, 1)

    async def failing_face() -> None:
        async with session:
            await store.put(session.prefix + "pack-0", b"data")
            raise RuntimeError("the face failed")

    with pytest.raises(RuntimeError, match="the face failed"):
        await failing_face()
    assert await _keys(store) == []  # the object and the lease are gone


async def test_a_cancelled_session_is_abandoned_once_its_writes_settled() -> None:
    store = _store()
    started = asyncio.Event()

    async def save() -> None:
        async with await SaveSession.begin(store, 2) as session:
            await store.put(session.prefix + "pack-0", b"data")
            started.set()
            await asyncio.Event().wait()  # a write that never ends

    task = asyncio.ensure_future(save())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await _keys(store) == []


async def test_a_failed_manifest_put_leaves_the_data_for_a_later_check() -> None:
    """The put may have landed with only its answer lost: nothing may be removed."""
    inner = _store()
    store = FaultStore(
        inner, [Fault(frozenset({"put"}), error=StoreError("lost"), key="manifest.json")]
    )
    session = await SaveSession.begin(store, 5)
    with pytest.raises(StoreError, match="lost"):
        async with session:
            await _commit_one(session)
    assert await _keys(inner) == [session.prefix + "blob"]  # data kept, lease released


async def test_a_session_on_a_committed_step_is_refused_before_any_write() -> None:
    store = _store()
    async with await SaveSession.begin(store, 3) as session:
        await _commit_one(session)
    before = await _keys(store)
    with pytest.raises(CommitConflictError, match="step 3 is already committed"):
        await SaveSession.begin(store, 3)
    assert await _keys(store) == before


async def test_a_sessions_ticket_is_its_attempt_without_the_lease() -> None:
    store = _store()
    session = await SaveSession.begin(store, 7)
    try:
        ticket = pickle.loads(pickle.dumps(session.ticket))
        assert isinstance(ticket, Attempt)
        assert (ticket.step, ticket.id, ticket.prefix) == (7, session.attempt.id, session.prefix)
        assert ticket.lease is None
        assert session.attempt.lease is not None
    finally:
        await session.abandon()
    assert await _keys(store) == []


async def test_hold_base_keeps_only_a_base_the_face_accepts() -> None:
    store = _store()
    await write_checkpoint(store, flatten({"w": np.arange(8.0)}), step=1)
    session = await SaveSession.begin(store, 2)
    try:
        assert await session.hold_base(accept=lambda base: False) is None
        assert session.base is None
        base = await session.hold_base()
        assert base is not None
        assert base.step == 1
        assert session.base is base
    finally:
        await session.abandon()


class _Racer(StoreWrapper):
    """A destination where another saver commits ``step`` just before the copy's manifest
    put: the copy loses the step."""

    def __init__(self, inner: Store, step: int) -> None:
        super().__init__(inner)
        self.step = step
        self.raced = False

    async def _hook(self, op: str, key: str, nbytes: int) -> Any:
        if op == "put" and key == manifest_key(self.step) and not self.raced:
            self.raced = True
            await write_checkpoint(self.inner, flatten({"other": np.ones(3)}), step=self.step)


async def test_a_copy_that_loses_the_step_removes_what_it_copied() -> None:
    src = _store()
    await write_checkpoint(src, flatten({"w": np.arange(64.0), "b": np.zeros(3)}), step=9)
    inner = _store()
    dst = _Racer(inner, 9)
    with pytest.raises(CommitConflictError, match="step 9 was committed by attempt"):
        await copy_step(src, dst, 9)
    assert dst.raced
    winner = (await read_manifest(inner, 9)).attempt
    attempts = {key.split("/")[1] for key in await _keys(inner, "9/") if key.count("/") > 1}
    assert attempts == {winner}  # nothing of the losing copy is left, its lease included


async def test_releasing_a_committed_session_sends_nothing() -> None:
    """The commit released the lease; a face that releases again at its end (the multi-rank
    coordinator does, committed or not) costs the store no request."""
    store = CountingStore(_store())
    session = await SaveSession.begin(store, 6)
    await _commit_one(session)
    store.reset()
    await session.release()
    await session.abandon()  # over already: removes nothing of a committed step
    assert store.total_requests == 0, store.requests
    assert (await read_manifest(store, 6)).attempt == session.attempt.id


async def test_a_save_whose_manifest_is_over_the_cap_leaves_nothing() -> None:
    """The manifest is encoded and checked against ``Settings.manifest_max_bytes`` before
    the session commits: an oversized one is refused and the session abandoned, so no object
    and no lease outlive the refusal (they were left for garbage collection before)."""
    from ckptstore.config import Settings

    store = MemoryStore(settings=Settings(manifest_max_bytes=4096))
    flat = flatten({f"w{i}": np.full(3, i) for i in range(200)})
    with pytest.raises(ValueError, match=r"over Settings\.manifest_max_bytes"):
        await write_checkpoint(store, flat, step=1)
    assert await _keys(store) == []


class _GatedStore(StoreWrapper):
    """Holds the put of one data object until :attr:`gate` opens (or 10 s pass, then
    records the timeout), and records the order of puts and their ends."""

    def __init__(self, inner: Store, held: str) -> None:
        super().__init__(inner)
        self.held = held
        self.gate = asyncio.Event()
        self.holding = asyncio.Event()  # the held put is waiting
        self.timed_out = False
        self.events: list[str] = []
        self.pending = 0

    async def _put(self, key: str, data: memoryview, mode: Any) -> None:
        data_object = "/attempt-" in key and not key.endswith(LEASE_NAME)
        if data_object:
            self.pending += 1
        try:
            if key.endswith(self.held):
                self.holding.set()
                try:
                    await asyncio.wait_for(self.gate.wait(), 10)
                except TimeoutError:
                    self.timed_out = True
            self.events.append(f"put {key.rsplit('/', 1)[-1]}")
            await self.inner._put(key, data, mode)
        finally:
            if data_object:
                self.pending -= 1
                self.events.append(f"done {key.rsplit('/', 1)[-1]}")


def _small_leaves(count: int = 40) -> dict[str, Any]:
    rng = np.random.default_rng(7)
    return {f"w{i:03d}": rng.standard_normal(100).astype(np.float32) for i in range(count)}


async def test_the_manifest_is_encoded_while_the_last_write_is_in_flight_then_put_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``write_checkpoint`` builds and encodes the manifest once every object's checksums
    are known (each pack's when it is built), so that Python overlaps the last writes; the
    manifest is still put only after every data put returned (invariant 3)."""
    from ckptstore.config import Settings
    from ckptstore.layout import commit

    settings = Settings(pack_size=1024, pack_threshold=512)
    store = _GatedStore(MemoryStore(settings=settings), "pack-000003")
    real_encode = commit.encode_checked
    pending_at_encode: list[int] = []

    def encode(manifest: Any, max_bytes: int) -> bytes:
        pending_at_encode.append(store.pending)
        store.gate.set()  # the held write may end only once the manifest is encoded
        return real_encode(manifest, max_bytes)

    monkeypatch.setattr(commit, "encode_checked", encode)
    state = _small_leaves()
    info = await write_checkpoint(store, flatten(state), step=1)
    assert not store.timed_out, "the manifest waited for the last write to end"
    assert pending_at_encode == [1]  # only the held pack was still being written
    manifest_put = store.events.index("put manifest.json")
    assert "done pack-000003" in store.events[:manifest_put]
    assert all(not e.startswith("done") for e in store.events[manifest_put:])
    assert info.objects == len((await read_manifest(store, 1)).object_keys) > 3
    got = await aload(store, 1)
    for key, value in state.items():
        np.testing.assert_array_equal(got[key], value)


@pytest.mark.parametrize("failing", ["pack-000001", "leaf-"])
async def test_a_failed_data_write_ends_the_save_with_nothing_left(failing: str) -> None:
    """A write that fails before or after its object's checksums were known: the save
    raises the write's error (it does not wait for checksums that never come) and leaves
    no object and no lease behind."""
    from ckptstore.config import Settings

    inner = MemoryStore(settings=Settings(pack_size=1024, pack_threshold=512))
    fault = Fault(frozenset({"put"}), error=StoreError("disk gone"), key=failing)
    store = FaultStore(inner, [fault])
    state = {**_small_leaves(), "big": np.arange(1000, dtype=np.float32)}
    with pytest.raises(StoreError, match="disk gone"):
        await asyncio.wait_for(write_checkpoint(store, flatten(state), step=2), 10)
    assert await _keys(inner) == []


async def test_a_save_cancelled_while_a_write_is_in_flight_leaves_nothing() -> None:
    from ckptstore.config import Settings

    inner = MemoryStore(settings=Settings(pack_size=1024, pack_threshold=512))
    store = _GatedStore(inner, "pack-000002")
    task = asyncio.ensure_future(write_checkpoint(store, flatten(_small_leaves()), step=3))
    await asyncio.wait_for(store.holding.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await _keys(inner) == []
    assert not await inner.exists(manifest_key(3))


async def test_a_save_of_a_committed_step_is_refused_and_leaves_that_step_as_it_was() -> None:
    store = _store()
    await write_checkpoint(store, flatten(_small_leaves()), step=1)
    before = await _keys(store)
    with pytest.raises(CommitConflictError):
        await write_checkpoint(store, flatten(_small_leaves(8)), step=1)
    assert await _keys(store) == before


async def test_a_save_cancelled_while_its_lease_is_put_leaves_nothing() -> None:
    inner = _store()
    store = _GatedStore(inner, LEASE_NAME)
    task = asyncio.ensure_future(write_checkpoint(store, flatten(_small_leaves()), step=3))
    await asyncio.wait_for(store.holding.wait(), 10)
    task.cancel()
    store.gate.set()  # the lease's put ends after the cancellation
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not store.timed_out
    assert await _keys(inner) == []


async def test_the_packs_are_built_while_the_lease_is_put_and_written_once_it_landed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A save's session begins (the lease put, the step looked for) while its first packs
    are built, not before: on local disk the lease's fsynced write took 3-4 ms of the path
    to the first write. No data object is put before the lease has landed."""
    built = threading.Event()  # set on the hashing thread that builds the packs
    for name in ("fill", "fill_digests"):
        original = getattr(PackPlan, name)

        def recording(self: PackPlan, *args: Any, _original: Any = original) -> Any:
            built.set()
            return _original(self, *args)

        monkeypatch.setattr(PackPlan, name, recording)
    inner = _store()
    store = _GatedStore(inner, LEASE_NAME)
    task = asyncio.ensure_future(write_checkpoint(store, flatten(_small_leaves()), step=3))
    await asyncio.wait_for(store.holding.wait(), 10)
    for _ in range(500):  # poll, for 10 s at most
        if built.is_set():
            break
        await asyncio.sleep(0.02)
    assert built.is_set(), "no pack was built while the lease was being put"
    assert store.events == []  # nothing put yet: the data waits for the lease
    store.gate.set()
    await task
    assert not store.timed_out
    assert store.events[0] == f"put {LEASE_NAME}"
    assert "put pack-000000" in store.events
    assert_same_state(await aload(inner), _small_leaves())


class _Together(StoreWrapper):
    """Holds each request of ``held`` (an op and a key fragment) until one of ``awaited``
    has started, or 10 s pass (recorded in :attr:`timed_out`): a request that can only
    end once another began shows the two in flight together."""

    def __init__(self, inner: Store, held: tuple[str, str], awaited: tuple[str, str]) -> None:
        super().__init__(inner)
        self.held, self.awaited = held, awaited
        self.started = asyncio.Event()
        self.timed_out: list[str] = []

    async def _hook(self, op: str, key: str, nbytes: int) -> None:
        if op == self.awaited[0] and self.awaited[1] in key:
            self.started.set()
        if op == self.held[0] and self.held[1] in key:
            try:
                await asyncio.wait_for(self.started.wait(), 10)
            except TimeoutError:
                self.timed_out.append(f"{op} {key}")


async def test_a_session_looks_for_its_step_while_it_puts_its_lease() -> None:
    """Before its first write a save looks for its step and takes its lease: on an object
    store each is a round trip, and one after the other they were two (a 20 ms round trip:
    146 ms for a small save, 126 ms with the two together). The look-up must be in flight
    while the lease is put."""
    inner = _store()
    store = _Together(inner, ("head", "manifest.json"), ("put", LEASE_NAME))
    await write_checkpoint(store, flatten(_small_leaves()), step=2)
    assert not store.timed_out, f"{store.timed_out} waited for the lease's put to start"
    assert not [k for k in await _keys(inner) if k.endswith(LEASE_NAME)]
    assert (await read_manifest(inner, 2)).step == 2


async def test_a_failed_look_up_of_the_step_removes_the_lease_put_meanwhile() -> None:
    inner = _store()
    counted = CountingStore(inner)
    # slow, so the lease is surely put before the look-up fails
    fault = Fault(frozenset({"head"}), StoreError("head refused"), latency=0.2)
    store = FaultStore(counted, [fault])
    with pytest.raises(StoreError, match="head refused"):
        await asyncio.wait_for(SaveSession.begin(store, 2), 10)
    assert counted.requests["put"] == 1  # the lease
    assert await _keys(inner) == []  # and it is gone


async def test_a_begin_cancelled_twice_while_its_lease_is_put_still_releases_the_lease() -> None:
    """A cancelled begin waits for its lease's put to end, then releases the lease; cancelled
    again while it waits, it stops waiting, but the lease the put lands is still released,
    not left renewing for the life of the process."""
    inner = _store()
    counted = CountingStore(inner)
    store = _GatedStore(counted, LEASE_NAME)
    task = asyncio.ensure_future(SaveSession.begin(store, 5))
    await asyncio.wait_for(store.holding.wait(), 10)
    task.cancel()
    await asyncio.sleep(0.05)  # the first cancellation reaches the begin, which now waits
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    store.gate.set()  # the lease's put lands after both cancellations
    for _ in range(500):  # poll, for 10 s at most: the put lands, then the release ends
        if counted.requests["delete"] and not await _keys(inner):
            break
        await asyncio.sleep(0.02)
    assert not store.timed_out
    assert counted.requests["put"] == 1  # the lease landed...
    assert counted.requests["delete"] == 1  # ...and was released
    assert await _keys(inner) == []
