"""Garbage collection against running saves: the save's lease (ckptstore/layout/lease.py).

The end-to-end tests run a real save and ``ckptstore gc --grace 0`` in separate processes, on
a local directory and on S3 (moto): the save is held after its first data object is durable,
the collector runs to completion in its own process, then the save goes on and commits.
Without the lease the collector deletes what the save wrote, and the step the save then
commits names deleted objects.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptstore
from ckptstore import cli
from ckptstore.errors import CkptStoreError
from ckptstore.layout import lease as lease_module
from ckptstore.layout.gc import collect_garbage
from ckptstore.layout.keys import attempt_prefix, manifest_key, new_attempt_id
from ckptstore.layout.lease import LEASE_NAME, SaveLease, held_lease
from ckptstore.layout.manifest import Manifest
from ckptstore.store.base import Store
from ckptstore.store.memory import MemoryStore
from ckptstore.store.registry import open_store
from ckptstore.store.wrappers import Fault, FaultStore, StoreWrapper
from ckptstore.testing import assert_same_state
from tests.children import python_path

# A save that stops after its first data object is durable and goes on when told to.
SAVER = textwrap.dedent(
    """
    import asyncio, json, sys
    import numpy as np
    import ckptstore
    from ckptstore.store.registry import open_store
    from ckptstore.store.wrappers import StoreWrapper

    url, options = sys.argv[1], json.loads(sys.argv[2])

    class HeldMidSave(StoreWrapper):
        held = False

        async def _put(self, key, data, mode):
            await self.inner._put(key, data, mode)
            if "/leaf-" in key and not self.held:
                self.held = True
                print("holding", flush=True)
                await asyncio.to_thread(sys.stdin.readline)

    state = {f"w{i}": np.full(300_000, i, np.float64) for i in range(3)}
    state["small"] = np.arange(10)
    store = HeldMidSave(open_store(url, **options))
    try:
        info = ckptstore.save(store, state, step=3)
    except ckptstore.CkptStoreError as exc:
        print("failed", type(exc).__name__, exc, flush=True)
    else:
        print("committed", info.attempt, flush=True)
    """
)


def _expected() -> dict[str, Any]:
    state: dict[str, Any] = {f"w{i}": np.full(300_000, i, np.float64) for i in range(3)}
    state["small"] = np.arange(10)
    return state


def _gc_in_another_process(url: str, options: dict[str, str]) -> dict[str, Any]:
    flags = [arg for name, value in options.items() for arg in ("-o", f"{name}={value}")]
    done = subprocess.run(
        [sys.executable, "-m", "ckptstore", "gc", url, "--grace", "0", "--json", *flags],
        env={**os.environ, "PYTHONPATH": python_path()},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def _save_while_gc_runs(url: str, options: dict[str, str]) -> tuple[str, dict[str, Any]]:
    saver = subprocess.Popen(
        [sys.executable, "-c", SAVER, url, json.dumps(options)],
        env={**os.environ, "PYTHONPATH": python_path()},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert saver.stdout is not None
        assert saver.stdin is not None
        line = saver.stdout.readline().strip()
        assert line == "holding", (line, saver.stderr.read() if saver.stderr else "")
        report = _gc_in_another_process(url, options)
        saver.stdin.write("go\n")
        saver.stdin.flush()
        out, err = saver.communicate(timeout=120)
    finally:
        if saver.poll() is None:
            saver.kill()
            saver.wait()
    assert saver.returncode == 0, err
    return out.strip(), report


async def _read_back(url: str, options: dict[str, str], prefix: str) -> tuple[Any, list[str]]:
    async with open_store(url, **options) as store:
        return await ckptstore.aload(store, step=3), await store.list_keys(prefix)


def _assert_save_survived(url: str, options: dict[str, str], out: str, report: Any) -> None:
    assert out.startswith("committed "), out
    attempt = out.split()[1]
    kept = f"3/{attempt}/"
    assert report["removed"] == [], report  # the running save's data was left alone
    assert report["kept_recent"] == [kept], report
    loaded, keys = asyncio.run(_read_back(url, options, kept))
    assert_same_state(loaded, _expected())
    assert kept + LEASE_NAME not in keys  # released after the commit
    assert keys  # the data objects


def test_gc_in_another_process_spares_a_running_local_save(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    out, report = _save_while_gc_runs(url, {})
    _assert_save_survived(url, {}, out, report)


@pytest.mark.s3
def test_gc_in_another_process_spares_a_running_s3_save(moto_s3: Any) -> None:
    url = f"s3://{moto_s3.bucket}/run"
    out, report = _save_while_gc_runs(url, moto_s3.options())
    _assert_save_survived(url, moto_s3.options(), out, report)


# ------------------------------------------------------------------------- the lease itself


class Clock:
    """A monotonic clock the test moves (the lease measures lapses with it)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(lease_module.time, "monotonic", fake)
    return fake


def _store(period: int = 8) -> MemoryStore:
    store = MemoryStore()
    store.settings = store.settings.replace(save_lease_seconds=period)
    return store


async def test_a_held_lease_passes_its_check_and_is_gone_after(clock: Clock) -> None:
    store = _store()
    attempt = new_attempt_id()
    key = attempt_prefix(1, attempt) + LEASE_NAME
    async with held_lease(store, 1, attempt) as lease:
        body = json.loads(await store.get(key))
        assert body["expires"] > time.time() + 7
        lease.check()
        clock.now += 7  # 1 s left of 8: under a quarter, too little to commit on
        with pytest.raises(CkptStoreError, match="1 s left, under a quarter"):
            lease.check()
    assert not await store.exists(key)


async def test_renewals_that_fail_for_a_whole_period_forbid_the_commit(clock: Clock) -> None:
    store = _store()
    failing = FaultStore(
        store, [Fault(frozenset({"put"}), error=OSError("down"), key=LEASE_NAME, after=1)]
    )
    lease = await SaveLease.take(failing, 1, new_attempt_id())
    try:
        clock.now += 9
        with pytest.raises(CkptStoreError, match=r"not committing: its lease has 0 s left"):
            lease.check()
    finally:
        await lease.release()


async def test_a_renewal_landing_after_expiry_is_a_lapse_for_good(clock: Clock) -> None:
    """A saver stalled past its lease's expiry renews successfully afterwards; a collector
    may have acted in the gap, so the save still must not commit."""
    lease = await SaveLease.take(_store(), 1, new_attempt_id())
    try:
        clock.now += 9
        await lease._renew()  # lands 1 s after the previous lease expired
        with pytest.raises(CkptStoreError, match="went 1 s without renewal"):
            lease.check()
    finally:
        await lease.release()


async def test_the_lease_is_renewed_while_held() -> None:
    """With a 4 s period the lease is renewed every second; poll for a renewal."""
    store = _store(period=4)
    attempt = new_attempt_id()
    key = attempt_prefix(1, attempt) + LEASE_NAME
    async with held_lease(store, 1, attempt):
        first = json.loads(await store.get(key))["expires"]
        deadline = time.monotonic() + 30
        while json.loads(await store.get(key))["expires"] == first:
            assert time.monotonic() < deadline, "the lease was never renewed"
            await asyncio.sleep(0.05)


# ------------------------------------------------------------------ the collector's side


async def _attempt_with(store: Store, step: int, *, started: float, lease: Any = None) -> str:
    attempt = new_attempt_id(started)
    prefix = attempt_prefix(step, attempt)
    await store.put(prefix + "pack-000000", b"data")
    if lease is not None:
        await store.put(prefix + LEASE_NAME, lease)
    return prefix


async def test_gc_keeps_an_unexpired_lease_whatever_its_grace() -> None:
    store = _store()
    now = time.time()
    live = await _attempt_with(
        store, 1, started=now - 7200, lease=json.dumps({"expires": now + 60}).encode()
    )
    expired = await _attempt_with(
        store, 2, started=now - 7200, lease=json.dumps({"expires": now - 60}).encode()
    )
    report = await collect_garbage(store, grace=0, now=now + 1)
    assert report.kept_recent == [live]
    assert report.removed == [expired]
    report = await collect_garbage(store, grace=0, now=now + 61)
    assert report.removed == [live]


@pytest.mark.parametrize("body", [b"not json", b"[1]", b'{"expires": "soon"}', b"x" * 5000])
async def test_a_damaged_lease_protects_for_one_period_from_its_write(body: bytes) -> None:
    store = _store(period=60)
    prefix = await _attempt_with(store, 1, started=time.time() - 7200, lease=body)
    written = (await store.head(prefix + LEASE_NAME)).last_modified
    assert written is not None
    report = await collect_garbage(store, grace=0, now=written + 59)
    assert report.kept_recent == [prefix]
    report = await collect_garbage(store, grace=0, now=written + 61)
    assert report.removed == [prefix]


class CommitsWhileListed(StoreWrapper):
    """Commits ``attempt`` as step 1 the moment a collector lists that attempt's objects: a
    save that finishes (and drops its lease) while the collector looks at it."""

    def __init__(self, inner: Store, manifest: bytes, prefix: str) -> None:
        super().__init__(inner)
        self.manifest, self.prefix = manifest, prefix

    async def _hook(self, op: str, key: str, nbytes: int) -> None:
        if op == "list" and key == self.prefix and not await self.inner.exists(manifest_key(1)):
            await self.inner.put(manifest_key(1), self.manifest)


async def test_gc_reads_the_manifest_again_before_deleting() -> None:
    store = _store()
    await ckptstore.asave(store, {"a": np.arange(3)}, step=1)
    committed = await ckptstore.aread_manifest(store, 1)
    good = await store.get(manifest_key(1))
    await store.delete([manifest_key(1)])
    prefix = attempt_prefix(1, committed.attempt)
    racing = CommitsWhileListed(store, good, prefix)
    report = await collect_garbage(racing, grace=0, now=time.time() + 3600)
    assert report.removed == []
    assert Manifest.parse(await store.get(manifest_key(1))).attempt == committed.attempt
    assert_same_state(await ckptstore.aload(store, step=1), {"a": np.arange(3)})


class StaleWritesCutoff(StoreWrapper):
    """Records the cutoff gc asks the store to remove in-progress writes before."""

    older_than: float | None = None

    async def remove_stale_writes(self, prefix: str = "", *, older_than: float) -> int:
        self.older_than = older_than
        return 0


async def test_stale_writes_of_a_running_save_are_left_alone() -> None:
    """A kept attempt's in-progress writes (an S3 multipart upload, say) began after it did."""
    store = _store(period=8)
    now = time.time()
    started = now - 7200
    await _attempt_with(store, 1, started=started, lease=json.dumps({"expires": now + 8}).encode())
    recording = StaleWritesCutoff(store)
    await collect_garbage(recording, grace=0, now=now)
    assert recording.older_than is not None
    assert recording.older_than <= started - 2  # a quarter period of margin for clocks


# ------------------------------------------------------------- what gc reports as removed


def test_an_attempt_a_failed_save_already_emptied_is_not_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A failed save removed its objects; a directory (with at most a temp file of its dead
    writer) is all that is left. gc must not report it as an abandoned attempt removed."""
    root = tmp_path / "run"
    ckptstore.save(root, {"a": np.arange(3)}, step=1)
    empty = root / "2" / "attempt-000000000001-0123456789abcdef"
    empty.mkdir(parents=True)
    with_temp = root / "2" / "attempt-000000000002-0123456789abcdef"
    with_temp.mkdir(parents=True)
    (with_temp / ".ckptstore-tmp.999999999.pack-000000").write_bytes(b"half")
    old = time.time() - 7200
    os.utime(with_temp / ".ckptstore-tmp.999999999.pack-000000", (old, old))
    assert cli.main(["gc", str(root), "--grace", "0", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["removed"] == []
    assert report["removed_objects"] == 0
    assert report["stale_writes"] == 1  # the dead writer's temp file, counted as what it is
    assert cli.main(["gc", str(root), "--grace", "0"]) == 0
    assert "removed 0 abandoned attempts (0 objects)" in capsys.readouterr().out


class _StalledLeaseStore(StoreWrapper):
    """Holds the lease's put until cancelled, then its removal (a delete) until :attr:`gate`
    opens, and fails that delete."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.putting = asyncio.Event()
        self.deleting = asyncio.Event()
        self.gate = asyncio.Event()
        self.deletes = 0

    async def _put(self, key: str, data: memoryview, mode: Any) -> None:
        self.putting.set()
        await asyncio.Event().wait()  # until cancelled

    async def _delete(self, keys: list[str]) -> None:
        self.deletes += 1
        self.deleting.set()
        await asyncio.wait_for(self.gate.wait(), 10)
        raise OSError("the store went away")


async def test_a_take_cancelled_twice_removes_its_lease_alone_and_logs_nothing() -> None:
    """A take interrupted while it puts the lease removes it; cancelled again meanwhile, it
    stops waiting, the removal goes on, and its failure is no error left for no one to
    retrieve (asyncio logs those as "Task exception was never retrieved")."""
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        store = _StalledLeaseStore(_store())
        task = asyncio.ensure_future(SaveLease.take(store, 1, new_attempt_id()))
        await asyncio.wait_for(store.putting.wait(), 10)
        task.cancel()
        await asyncio.wait_for(store.deleting.wait(), 10)  # the removal has begun
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        store.gate.set()  # the removal fails after the take has gone
        del task
        for _ in range(50):  # 0.5 s for the failed removal to end and be collected
            await asyncio.sleep(0.01)
            gc.collect()
            if reported:
                break
        assert store.deletes >= 1
        assert [c.get("message") for c in reported] == []
    finally:
        loop.set_exception_handler(None)
