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
from typing import Any

import numpy as np
import pytest

from ckptstore.errors import CommitConflictError, StoreError
from ckptstore.layout.commit import Attempt, SaveSession, read_manifest, write_checkpoint
from ckptstore.layout.keys import manifest_key
from ckptstore.layout.lease import LEASE_NAME
from ckptstore.layout.maintenance import copy_step
from ckptstore.layout.tree import flatten
from ckptstore.store.base import Store
from ckptstore.store.memory import MemoryStore
from ckptstore.store.wrappers import CountingStore, Fault, FaultStore, StoreWrapper


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
