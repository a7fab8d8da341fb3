"""Tiered CheckpointManager: saves commit on the local tier, chosen steps are copied to the
persistent tier in the background, retention per tier, restore from the nearest copy that
verifies, replication that resumes after a restart and survives a faulty network.

The persistent tier is a second directory (fast), moto and SeaweedFS (marked ``s3``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import threading
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptstore
from ckptstore import CorruptCheckpointError, NotFoundError, StoreError
from ckptstore.layout.keys import MANIFEST_NAME
from ckptstore.layout.lease import LEASE_NAME
from ckptstore.manager import CheckpointManager
from ckptstore.manager.tiers import RestoreInfo
from ckptstore.store.base import PutMode, Store
from ckptstore.store.local import LocalStore
from ckptstore.store.wrappers import Fault, FaultStore, StoreWrapper, transient_error
from ckptstore.testing import assert_same_state
from ckptstore.testing.proxy import FaultProxy, ProxyFault

SEAWEED_BUCKET = "ckptstore-tier-tests"


def state(step: int) -> dict[str, Any]:
    """The training state of ``step``: one large leaf, small packed ones, plain values."""
    rng = np.random.default_rng(step)
    return {
        "model": {"w": rng.standard_normal((256, 512), dtype=np.float32)},
        "optim": [rng.standard_normal(100).astype(np.float16) for _ in range(20)],
        "step": step,
    }


class Persistent:
    """A persistent tier for one test: its URL (options in the query) and, for S3, the
    upstream endpoint a fault proxy can stand in front of."""

    def __init__(self, url: str, s3: tuple[str, str, dict[str, str]] | None = None) -> None:
        self.url = url
        self.s3 = s3  # (endpoint, bucket/prefix, other options)

    def through(self, proxy: FaultProxy) -> str:
        """The same root reached through ``proxy``."""
        assert self.s3 is not None
        _endpoint, where, options = self.s3
        query = urllib.parse.urlencode({**options, "endpoint_url": proxy.endpoint})
        return f"s3://{where}?{query}"


@pytest.fixture(
    params=[
        "dir",
        pytest.param("moto", marks=pytest.mark.s3),
        pytest.param("seaweedfs", marks=pytest.mark.s3),
    ]
)
def persistent(request: pytest.FixtureRequest, tmp_path: Path) -> Persistent:
    return persistent_tier(request, tmp_path, request.param)


def persistent_tier(request: pytest.FixtureRequest, tmp_path: Path, kind: str) -> Persistent:
    """A fresh persistent root of ``kind``: ``dir``, ``moto`` or ``seaweedfs``."""
    if kind == "dir":
        return Persistent(str(tmp_path / "persistent"))
    prefix = f"tiers-{uuid.uuid4().hex[:10]}"
    if kind == "moto":
        moto = request.getfixturevalue("moto_s3")  # AWS_* set for this test and its children
        where, endpoint, options = f"{moto.bucket}/{prefix}", moto.endpoint, {"region": "us-east-1"}
    else:
        server = request.getfixturevalue("seaweedfs")
        server.create_bucket(SEAWEED_BUCKET)
        where, endpoint, options = f"{SEAWEED_BUCKET}/{prefix}", server.s3_endpoint, {}
        options["anonymous"] = "true"
    query = urllib.parse.urlencode({**options, "endpoint_url": endpoint})
    return Persistent(f"s3://{where}?{query}", (endpoint, where, options))


def step_files(root: Path, step: int) -> list[Path]:
    """The data objects of a committed local step, largest first."""
    files = [
        p
        for p in (root / str(step)).rglob("*")
        if p.is_file() and p.name not in (MANIFEST_NAME, LEASE_NAME)
    ]
    return sorted(files, key=lambda p: p.stat().st_size, reverse=True)


class GatedStore(StoreWrapper):
    """Holds every manifest put until :attr:`gate` is set: copies to it cannot commit."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.gate = threading.Event()

    async def _put(self, key: str, data: memoryview, mode: PutMode) -> None:
        if key.endswith(MANIFEST_NAME):
            await asyncio.to_thread(self.gate.wait)
        await self.inner._put(key, data, mode)


class DeleteGatedStore(StoreWrapper):
    """Holds every delete of a committed step's manifest (retention's) until :attr:`gate`
    is set."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.gate = threading.Event()

    async def _delete(self, keys: list[str]) -> None:
        if any(key.endswith(MANIFEST_NAME) for key in keys):
            await asyncio.to_thread(self.gate.wait)
        await self.inner._delete(keys)


# ----------------------------------------------------------------- saving and replication


def test_saves_commit_locally_and_chosen_steps_reach_the_persistent_tier(
    tmp_path: Path, persistent: Persistent
) -> None:
    local = tmp_path / "local"
    with CheckpointManager(
        persistent.url, local=local, local_every=2, persistent_every=4, local_max_to_keep=None
    ) as mgr:
        for step in range(9):
            mgr.save(step, state(step))
        mgr.wait_until_finished()  # waits for the copies too
        listing = mgr.tiers()
        assert listing.local == [0, 2, 4, 6, 8]
        assert listing.persistent == [0, 4, 8]
        assert listing.pending == []
        assert mgr.all_steps() == [0, 2, 4, 6, 8]
        forced = mgr.save(9, state(9), force=True)  # a forced save is copied too
        kept_local = mgr.save(10, state(10), persist=False)
        assert forced
        assert kept_local
    assert ckptstore.list_steps(persistent.url) == [0, 4, 8, 9]
    assert ckptstore.list_steps(local) == [0, 2, 4, 6, 8, 9, 10]
    for step in (0, 4, 8, 9):  # the persistent copy is the local step, bit-exact
        assert_same_state(ckptstore.load(persistent.url, step), state(step))
        local_manifest = ckptstore.read_manifest(local, step)
        copied = ckptstore.read_manifest(persistent.url, step)
        assert copied.leaf_crc == local_manifest.leaf_crc
        assert copied.metadata == local_manifest.metadata
        assert copied.attempt != local_manifest.attempt  # committed there on its own


def test_persistent_copies_of_incremental_steps_upload_only_what_changed(
    tmp_path: Path, persistent: Persistent
) -> None:
    """A fine-tuning run's local steps are incremental, but each persistent copy uploaded
    every object its step references again (the frozen weights at every step); a copy now
    references the persistent tier's copies of them, and every step loads bit-exact from
    the persistent tier alone."""
    frozen = np.arange(2**20, dtype=np.float32)  # 4 MiB, the same at every step

    def tuned(step: int) -> dict[str, Any]:
        return {"frozen": frozen, "head": np.full(32, step, np.float32), "step": step}

    with CheckpointManager(persistent.url, local=tmp_path / "local") as mgr:
        for step in range(3):
            mgr.save(step, tuned(step))
        mgr.wait_until_finished()  # waits for the copies too
    for step in range(3):
        assert_same_state(ckptstore.load(persistent.url, step), tuned(step))
        copied = ckptstore.read_manifest(persistent.url, step)
        if step == 0:
            assert copied.references() == []
            assert copied.own_bytes >= frozen.nbytes
            continue
        assert copied.own_bytes < 2**16, (step, copied.own_bytes)  # the head, not the frozen
        assert {copied.object_step(i) for i in copied.references()} <= {0}


def test_retention_is_per_tier_and_never_drops_a_step_awaiting_its_copy(tmp_path: Path) -> None:
    local = tmp_path / "local"
    gated = GatedStore(LocalStore(tmp_path / "persistent"))
    mgr = CheckpointManager(
        gated, local=local, local_max_to_keep=1, max_to_keep=2, copy_backlog=None
    )
    try:
        for step in range(4):
            mgr.save(step, state(step))
        mgr._saver.wait_until_finished()  # committed locally; the copies cannot commit yet
        # local_max_to_keep=1, but no step is on the persistent tier yet: all stay local
        assert ckptstore.list_steps(local) == [0, 1, 2, 3]
        assert mgr.tiers().pending == [0, 1, 2, 3]
        gated.gate.set()
        mgr.wait_until_finished()
        assert ckptstore.list_steps(local) == [3]  # the local tier's own rule
        assert ckptstore.list_steps(gated) == [2, 3]  # max_to_keep, on the persistent tier
        assert mgr.tiers().pending == []
    finally:
        gated.gate.set()
        mgr.close()


@pytest.mark.parametrize("tiered", [False, True], ids=["one tier", "local tier"])
def test_a_save_handle_reports_the_commit_not_the_retention_after_it(
    tmp_path: Path, tiered: bool
) -> None:
    """Deleting an old step takes as long as the save itself on a local disk beside a
    copy: the handle resolves at the commit; the next save and ``wait_until_finished``
    wait for the retention."""
    local = DeleteGatedStore(LocalStore(tmp_path / "local"))
    if tiered:
        mgr = CheckpointManager(tmp_path / "persistent", local=local, local_max_to_keep=1)
    else:
        mgr = CheckpointManager(local, max_to_keep=1)
    try:
        mgr.save(0, state(0))
        mgr.wait_until_finished()
        mgr.save(1, state(1))
        assert mgr.last_handle is not None
        mgr.last_handle.result(timeout=30)  # step 0's deletion is held at the gate
        assert ckptstore.list_steps(local) == [0, 1]
        assert mgr._saver.in_flight == 1
        local.gate.set()
        mgr.wait_until_finished()
        assert ckptstore.list_steps(local) == [1]
    finally:
        local.gate.set()
        mgr.close()


def test_copies_that_fall_behind_skip_the_oldest_waiting_never_a_forced_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """copy_backlog=1: step 0's copy is in progress (held at its commit), 1-5 queue behind
    it; each newly queued step skips the oldest waiting copy beyond one, but never step 2's,
    which the user asked for (persist=True), and a skipped step leaves the local tier."""
    local = tmp_path / "local"
    gated = GatedStore(LocalStore(tmp_path / "persistent"))
    mgr = CheckpointManager(gated, local=local, local_max_to_keep=1, copy_backlog=1)
    try:
        with caplog.at_level(logging.WARNING, logger="ckptstore.tiers"):
            for step in range(6):
                mgr.save(step, state(step), persist=True if step == 2 else None)
            mgr._saver.wait_until_finished()
        assert mgr.tiers().pending == [0, 2, 5]
        assert mgr.tiers().forced == [2]
        assert ckptstore.list_steps(local) == [0, 2, 5]  # 1, 3, 4: not pending any more
        assert "fall behind the saves: the copy of step(s) [1] is skipped" in caplog.text
        gated.gate.set()
        mgr.wait_until_finished()
        assert ckptstore.list_steps(gated) == [0, 2, 5]
        assert mgr.tiers().pending == []
        assert mgr.tiers().skipped == [1, 3, 4]
    finally:
        gated.gate.set()
        mgr.close()
    for step in (0, 2, 5):
        assert_same_state(ckptstore.load(gated, step), state(step))


class SlowStore(StoreWrapper):
    """Every put takes ``seconds`` longer: a persistent tier slower than the saves."""

    def __init__(self, inner: Store, seconds: float) -> None:
        super().__init__(inner)
        self.seconds = seconds

    async def _put(self, key: str, data: memoryview, mode: PutMode) -> None:
        await asyncio.sleep(self.seconds)
        await self.inner._put(key, data, mode)


@pytest.mark.parametrize("backlog", [1, 2])
def test_the_backlog_stays_bounded_when_saves_outpace_the_copies(
    tmp_path: Path, backlog: int
) -> None:
    """A loop of 30 saves, each far faster than its copy: the copies pending never exceed
    the one in progress, ``backlog`` waiting and the forced ones; the local tier holds no
    more; the newest step and every forced one reach the persistent tier."""
    local = tmp_path / "local"
    slow = SlowStore(LocalStore(tmp_path / "persistent"), 0.05)
    forced = {7, 19}
    with CheckpointManager(
        slow, local=local, local_max_to_keep=1, max_to_keep=None, copy_backlog=backlog
    ) as mgr:
        most = 0
        for step in range(30):
            mgr.save(step, state(step), force=step in forced)
            mgr._saver.wait_until_finished()  # the save committed locally; its copy queued
            pending = mgr.tiers().pending
            most = max(most, len(pending))
            assert len(pending) <= 1 + backlog + len(forced & set(pending)), (step, pending)
            assert len(ckptstore.list_steps(local)) <= 1 + len(pending), step
        mgr.wait_until_finished()
        skipped = mgr.tiers().skipped
    persistent = ckptstore.list_steps(slow)
    assert 29 in persistent
    assert forced <= set(persistent)
    assert skipped, "the copies never fell behind: the test did not test the bound"
    assert set(persistent) | set(skipped) == set(range(30))
    assert most >= 1 + backlog  # the bound was reached, not just respected


def test_wait_until_finished_and_close_wait_for_the_copies(tmp_path: Path) -> None:
    gated = GatedStore(LocalStore(tmp_path / "persistent"))
    mgr = CheckpointManager(gated, local=tmp_path / "local")
    mgr.save(1, state(1))
    mgr._saver.wait_until_finished()
    assert ckptstore.list_steps(tmp_path / "local") == [1]
    assert mgr.tiers().pending == [1]
    closing = threading.Thread(target=mgr.close)
    closing.start()
    closing.join(timeout=0.5)
    assert closing.is_alive()  # close() waits: the copy cannot commit yet
    gated.gate.set()
    closing.join(timeout=60)
    assert not closing.is_alive()
    assert ckptstore.list_steps(tmp_path / "persistent") == [1]


def _copies_ended(mgr: CheckpointManager, timeout: float = 60.0) -> None:
    """Poll until no copy to the persistent tier is queued or running."""
    tiers = mgr._tiers
    assert tiers is not None
    mgr._saver.wait_until_finished()  # a save queues its copy once it has committed
    deadline = time.monotonic() + timeout
    while tiers.replicator.in_flight:
        assert time.monotonic() < deadline, "the copies did not end"
        time.sleep(0.01)


def test_a_failed_copy_surfaces_like_a_failed_save_and_resumes_on_the_next_start(
    tmp_path: Path,
) -> None:
    local, target = tmp_path / "local", tmp_path / "persistent"
    failing = FaultStore(
        LocalStore(target), [Fault(ops=frozenset({"put"}), error=transient_error, key="manifest")]
    )
    mgr = CheckpointManager(failing, local=local)
    mgr.save(1, state(1))
    with pytest.raises(StoreError, match="injected fault") as raised:
        mgr.wait_until_finished()
    assert "copy of step 1 to the persistent tier" in "".join(raised.value.__notes__)
    mgr.save(2, state(2))  # the error was reported once; the next copy fails too
    _copies_ended(mgr)
    with pytest.raises(StoreError, match="injected fault"):
        mgr.save(3, state(3))  # ... and is raised by the next save, before it stages
    mgr.close()  # every error was reported; step 3 was never staged
    assert ckptstore.list_steps(local) == [1, 2]  # kept: their copies are pending
    assert ckptstore.list_steps(target) == []

    with CheckpointManager(target, local=local, local_max_to_keep=1) as mgr:
        assert mgr.tiers().pending in ([1, 2], [2], [])  # copies queued on start
        mgr.wait_until_finished()
        assert mgr.tiers().pending == []
        mgr.save(3, state(3))
    assert ckptstore.list_steps(target) == [1, 2, 3]
    assert ckptstore.list_steps(local) == [3]
    for step in (1, 2, 3):
        assert_same_state(ckptstore.load(target, step), state(step))


def test_a_restart_never_skips_a_pending_copy_the_user_forced(tmp_path: Path) -> None:
    """Copies of steps 1-5 fail (step 2 saved with persist=True); the next start finds all
    five pending and queues them behind a slow persistent tier with copy_backlog=1: it skips
    waiting copies, but not step 2's, which its manifest marks as asked for."""
    local, target = tmp_path / "local", tmp_path / "persistent"
    failing = FaultStore(
        LocalStore(target), [Fault(ops=frozenset({"put"}), error=transient_error, key="manifest")]
    )
    mgr = CheckpointManager(failing, local=local, copy_backlog=None)
    for step in range(1, 6):
        for _ in range(2):  # a save first raises the failure of an earlier copy, then saves
            try:
                mgr.save(step, state(step), persist=True if step == 2 else None)
                break
            except StoreError:
                continue
        _copies_ended(mgr)
    with contextlib.suppress(StoreError):
        mgr.close()
    assert ckptstore.list_steps(local) == [1, 2, 3, 4, 5]
    assert ckptstore.list_steps(target) == []

    slow = SlowStore(LocalStore(target), 0.2)
    with CheckpointManager(slow, local=local, copy_backlog=1) as mgr:
        assert mgr.tiers().forced == [2]
        mgr.wait_until_finished()
        skipped = mgr.tiers().skipped
    persistent = ckptstore.list_steps(target)
    assert {2, 5} <= set(persistent)
    assert skipped, "the copies never waited: the test did not test the bound"
    assert 2 not in skipped, skipped
    assert set(persistent) | set(skipped) == {1, 2, 3, 4, 5}


def test_steps_not_meant_for_the_persistent_tier_are_not_pending(tmp_path: Path) -> None:
    local, target = tmp_path / "local", tmp_path / "persistent"
    ckptstore.save(local, state(5), step=5)  # not a manager's save: nothing says persist
    with CheckpointManager(target, local=local, persistent_every=2) as mgr:
        mgr.save(7, state(7))  # off persistent_every
        mgr.wait_until_finished()
        assert mgr.tiers().pending == []
    assert ckptstore.list_steps(target) == []


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"local_every": 2}, "need local="),
        ({"local": "L", "local_every": 3, "persistent_every": 5}, "multiple of local_every"),
        ({"local": "L", "local_every": 2, "save_interval_steps": 4}, "not both"),
        ({"local": "L", "local_every": 0}, "local_every must be >= 1"),
        ({"local": "L", "local_max_to_keep": 0}, "local_max_to_keep"),
        ({"local": "L", "copy_backlog": 0}, "copy_backlog must be an int >= 1 or None, got 0"),
        ({"local": "L", "copy_backlog": 1.5}, "copy_backlog must be an int >= 1 or None, got 1.5"),
    ],
)
def test_bad_tier_options_are_refused(tmp_path: Path, options: dict[str, Any], match: str) -> None:
    if options.get("local") == "L":
        options["local"] = tmp_path / "local"
    with pytest.raises(ValueError, match=match):
        CheckpointManager(tmp_path / "persistent", **options)


def test_a_manager_without_tiers_says_so(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(ValueError, match="no local tier"):
            mgr.tiers()
        with pytest.raises(ValueError, match="persist= needs a local tier"):
            mgr.save(1, state(1), persist=True)
        assert mgr.all_steps() == []


def test_the_local_tier_cannot_be_the_persistent_root(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="same root"):
        CheckpointManager(tmp_path / "run", local=f"file://{tmp_path / 'run'}")


def test_an_unreachable_persistent_tier_fails_the_start(
    tmp_path: Path,
) -> None:
    down = FaultStore(
        LocalStore(tmp_path / "persistent"),
        [Fault(ops=frozenset({"list"}), error=transient_error)],
    )
    local = LocalStore(tmp_path / "local")
    with pytest.raises(StoreError, match="injected fault"):
        CheckpointManager(down, local=local)


# ----------------------------------------------------------------- restore


def _damage(local: Path, step: int, how: str) -> None:
    if how == "deleted":
        shutil.rmtree(local / str(step))
    elif how == "object-missing":
        step_files(local, step)[0].unlink()
    elif how == "truncated":
        largest = step_files(local, step)[0]
        with largest.open("r+b") as f:
            f.truncate(largest.stat().st_size // 2)
    elif how == "corrupted":
        largest = step_files(local, step)[0]
        with largest.open("r+b") as f:
            f.seek(1000)
            byte = f.read(1)
            f.seek(1000)
            f.write(bytes([byte[0] ^ 0x01]))
    elif how == "manifest-corrupted":
        manifest = local / str(step) / MANIFEST_NAME
        manifest.write_bytes(manifest.read_bytes()[:-10])
    else:
        raise AssertionError(how)


def test_restore_prefers_the_local_copy(
    tmp_path: Path, persistent: Persistent, caplog: pytest.LogCaptureFixture
) -> None:
    with CheckpointManager(persistent.url, local=tmp_path / "local") as mgr:
        for step in (1, 2):
            mgr.save(step, state(step))
        mgr.wait_until_finished()
        with caplog.at_level(logging.INFO, logger="ckptstore.tiers"):
            restored = mgr.restore()
        assert_same_state(restored, state(2))
        assert mgr.last_restore == RestoreInfo(2, "local", mgr.local_store.url)  # type: ignore[union-attr]
        assert "step 2 restored from the local tier" in caplog.text
        assert_same_state(mgr.restore(1, keys=["model"]), {"model": state(1)["model"]})
        assert mgr.last_restore is not None
        assert mgr.last_restore.tier == "local"


@pytest.mark.parametrize(
    "how", ["deleted", "object-missing", "truncated", "corrupted", "manifest-corrupted"]
)
def test_restore_falls_back_to_the_persistent_tier(
    tmp_path: Path, persistent: Persistent, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    local = tmp_path / "local"
    with CheckpointManager(persistent.url, local=local) as mgr:
        mgr.save(3, state(3))
        mgr.wait_until_finished()
        _damage(local, 3, how)
        with caplog.at_level(logging.INFO, logger="ckptstore.tiers"):
            restored = mgr.restore()
        assert_same_state(restored, state(3))
        info = mgr.last_restore
        assert info is not None
        assert (info.step, info.tier, info.url) == (3, "persistent", mgr.store.url)
        assert info.fallback is not None
        assert "restored from the persistent tier" in caplog.text
        if how == "deleted":
            assert "not on the local tier" in info.fallback
        else:
            assert "local copy" in info.fallback
            assert any(r.levelno == logging.WARNING for r in caplog.records)


def test_restore_raises_when_every_copy_is_damaged(tmp_path: Path) -> None:
    local, target = tmp_path / "local", tmp_path / "persistent"
    with CheckpointManager(target, local=local) as mgr:
        mgr.save(3, state(3))
        mgr.wait_until_finished()
        _damage(local, 3, "corrupted")
        _damage(target, 3, "corrupted")
        with pytest.raises(CorruptCheckpointError) as raised:
            mgr.restore()
        assert "tried first: the local copy" in "".join(raised.value.__notes__)
        with pytest.raises(NotFoundError, match="no leaf 'nothing'"):
            mgr.restore(3, keys=["nothing"])  # a typo is not a damaged copy


def test_a_new_node_with_an_empty_local_tier_restores_from_the_persistent_tier(
    tmp_path: Path, persistent: Persistent
) -> None:
    with CheckpointManager(persistent.url, local=tmp_path / "node-a") as mgr:
        for step in (10, 20):
            mgr.save(step, state(step))
    with CheckpointManager(persistent.url, local=tmp_path / "node-b") as mgr:
        assert mgr.tiers().local == []
        assert mgr.latest_step() == 20
        assert_same_state(mgr.restore(), state(20))
        assert mgr.last_restore is not None
        assert mgr.last_restore.tier == "persistent"
        assert mgr.metadata(20) is None
        mgr.save(30, state(30))  # and carries on from there
    assert ckptstore.list_steps(persistent.url) == [10, 20, 30]


def test_restore_takes_the_newest_step_of_either_tier(tmp_path: Path) -> None:
    local, target = tmp_path / "local", tmp_path / "persistent"
    with CheckpointManager(target, local=local, local_every=1, persistent_every=2) as mgr:
        for step in (2, 3):
            mgr.save(step, state(step))
        mgr.wait_until_finished()
        assert mgr.tiers().persistent == [2]
        assert_same_state(mgr.restore(), state(3))  # only on the local tier
        assert mgr.last_restore is not None
        assert mgr.last_restore.tier == "local"
        mgr.delete(3)
        mgr.delete(2)  # from both tiers
        assert mgr.all_steps() == []
        with pytest.raises(NotFoundError, match="no committed checkpoint"):
            mgr.restore()


def test_memory_local_tier(tmp_path: Path) -> None:
    local = f"memory://tiers-{uuid.uuid4().hex}"
    with CheckpointManager(tmp_path / "persistent", local=local, local_max_to_keep=1) as mgr:
        for step in range(3):
            mgr.save(step, state(step))
        mgr.wait_until_finished()
        assert mgr.tiers().local == [2]
        assert_same_state(mgr.restore(), state(2))
    assert ckptstore.list_steps(tmp_path / "persistent") == [0, 1, 2]


# ----------------------------------------------------------------- faults between the tiers


@pytest.fixture
def s3_persistent(request: pytest.FixtureRequest, tmp_path: Path) -> Persistent:
    return persistent_tier(request, tmp_path, request.param)


@pytest.mark.s3
@pytest.mark.parametrize("s3_persistent", ["moto", "seaweedfs"], indirect=True)
def test_replication_through_a_faulty_network_finishes_bit_exact(
    tmp_path: Path, s3_persistent: Persistent
) -> None:
    assert s3_persistent.s3 is not None
    with FaultProxy(s3_persistent.s3[0]) as proxy:
        proxy.set_faults(
            [
                ProxyFault("503", every=15),
                ProxyFault("500", every=20),
                ProxyFault("reset", every=20, nbytes=1000),
                ProxyFault("truncate", every=6, ops=frozenset({"get"})),
            ],
        )
        url = s3_persistent.through(proxy) + "&part_size=5MiB&multipart_threshold=10MiB"
        big = {"w": np.random.default_rng(7).standard_normal(3 << 20, dtype=np.float32)}
        with CheckpointManager(
            url, local=tmp_path / "local", local_max_to_keep=1, copy_backlog=None
        ) as mgr:  # every step's copy, however far behind the saves
            for step in range(4):
                mgr.save(step, {**state(step), "big": big} if step == 3 else state(step))
            mgr.wait_until_finished()
            assert mgr.tiers().pending == []
        named = ("503", "500", "reset", "truncate")
        share = sum(proxy.injected[kind] for kind in named) / sum(proxy.requests.values())
        assert 0.10 <= share <= 0.20, (proxy.injected, proxy.requests)
    assert ckptstore.list_steps(s3_persistent.url) == [0, 1, 2, 3]
    for step in range(3):
        assert_same_state(ckptstore.load(s3_persistent.url, step), state(step))
    assert_same_state(ckptstore.load(s3_persistent.url, 3), {**state(3), "big": big})
    report = ckptstore.background.run(_verify_all(s3_persistent.url))
    assert report == [True] * 4


async def _verify_all(url: str) -> list[bool]:
    from ckptstore.layout.maintenance import verify_step

    async with ckptstore.open_store(url) as store:
        steps = await ckptstore.alist_steps(store)
        return [(await verify_step(store, step)).ok for step in steps]


# ----------------------------------------------------------------- ckptstore ls --local


def test_ls_shows_each_steps_tiers_and_pending_copies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ckptstore import cli

    local, target = tmp_path / "local", tmp_path / "persistent"
    failing = FaultStore(
        LocalStore(target),
        [Fault(ops=frozenset({"put"}), error=transient_error, key="^4/manifest")],
    )
    mgr = CheckpointManager(failing, local=local, persistent_every=2, local_max_to_keep=1)
    for step in range(5):  # 0, 2 copied; 4's copy fails; 1, 3 were never meant for it
        mgr.save(step, state(step))
    with pytest.raises(StoreError):
        mgr.close()

    assert cli.main(["ls", str(target), "--local", str(local), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["local"] == f"file://{local}"
    assert report["url"] == f"file://{target}"
    assert report["pending"] == [4]
    where = {row["step"]: (row["tiers"], row["replication"]) for row in report["steps"]}
    assert where == {
        0: (["persistent"], None),
        2: (["persistent"], None),
        4: (["local"], "pending"),
    }

    assert cli.main(["ls", str(target), "--local", str(local)]) == 0
    text = capsys.readouterr().out
    header, *lines = text.splitlines()
    assert header.split()[-2:] == ["tiers", "replication"]
    assert lines[2].split()[0] == "4"
    assert lines[2].split()[-2:] == ["local", "pending"]
    assert "step 4 committed on the local tier but not yet on the persistent tier" in text

    # the next start copies it; ls then says so
    with CheckpointManager(target, local=local) as mgr:
        mgr.wait_until_finished()
    assert cli.main(["ls", str(target), "--local", str(local), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["pending"] == []
    assert report["steps"][-1]["tiers"] == ["local", "persistent"]
    assert report["steps"][-1]["replication"] == "done"


def test_ls_of_tiers_with_a_missing_local_directory_is_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ckptstore import cli

    ckptstore.save(tmp_path / "persistent", state(1), step=1)
    status = cli.main(["ls", str(tmp_path / "persistent"), "--local", str(tmp_path / "nope")])
    err = capsys.readouterr().err
    assert status == 1
    assert err.count("\n") == 1
    assert "no such directory" in err
