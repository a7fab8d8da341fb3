"""Real processes: a saver SIGKILLed at each phase of a save or of garbage collection, and
racing savers of one step. On the local store (files, fsync, link), since a crash must be
survived by what is on disk, and on a network filesystem (SeaweedFS over FUSE,
the ``nfs://`` backend), where the racers' put-if-absent is a ``link()`` the server decides."""

from __future__ import annotations

import asyncio
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptstore
from ckptstore.config import default_settings
from ckptstore.layout.commit import is_own_key
from ckptstore.layout.gc import GCReport, collect_garbage
from ckptstore.store.base import TEMP_PREFIX
from ckptstore.store.local import LocalStore
from ckptstore.store.nfs import NFSStore
from ckptstore.testing import assert_same_state
from ckptstore.testing.servers import FuseMount
from tests.children import python_path
from tests.racers import SAVE_RACER, one_winner, race

# The child saves step 2 (or collects garbage) and, at the phase named on its command line,
# creates the marker file and blocks until the parent kills it.
CHILD = textwrap.dedent(
    """
    import asyncio, os, sys, threading
    import numpy as np
    import ckptstore
    import ckptstore.store.local as local
    from ckptstore.store.local import LocalStore
    from ckptstore.store.nfs import NFSStore
    from ckptstore.store.wrappers import StoreWrapper

    root, phase, backend = sys.argv[1:4]
    lock = threading.Lock()
    count = {"data": 0, "delete": 0}

    def signal_and_block():
        print("stopped", flush=True)
        threading.Event().wait()  # until SIGKILL

    real_write_all = local._write_all

    def write_all(fd, data, offset):
        is_manifest = bytes(data[:22]) == b'{"format":"ckptstore",'
        if phase == "mid-data" and not is_manifest:
            with lock:
                count["data"] += 1
                nth = count["data"]
            if nth == 3:  # two data writes done; this one stops halfway
                real_write_all(fd, data[: len(data) // 2], offset)
                os.fsync(fd)
                signal_and_block()
        if phase == "during-manifest" and is_manifest:
            real_write_all(fd, data[: len(data) // 2], offset)
            os.fsync(fd)
            signal_and_block()
        real_write_all(fd, data, offset)

    local._write_all = write_all

    class Phases(StoreWrapper):
        async def _put(self, key, data, mode):
            if key.endswith("manifest.json") and phase == "before-manifest":
                signal_and_block()
            await self.inner._put(key, data, mode)
            if key.endswith("manifest.json") and phase == "after-manifest":
                signal_and_block()

        async def _delete(self, keys):
            count["delete"] += 1
            if phase == "during-gc" and count["delete"] == 2:
                signal_and_block()
            await self.inner._delete(keys)

    def state(seed):
        rng = np.random.default_rng(seed)
        out = {f"big{i}": rng.standard_normal(300_000) for i in range(4)}
        out["small"] = [rng.standard_normal(64).astype(np.float32) for _ in range(50)]
        return out

    store = Phases({"local": LocalStore, "nfs": NFSStore}[backend](root))
    if phase == "during-gc":
        ckptstore.gc(store, grace=0)
    else:
        ckptstore.save(store, state(2), step=2)
    print("finished without being stopped", flush=True)
    """
)


@dataclass(frozen=True)
class Where:
    """A checkpoint root on one backend: a directory on local disk or on the FUSE mount."""

    backend: str  # "local" or "nfs"
    path: Path
    #: the same root seen through other clients of the filesystem (another FUSE mount)
    elsewhere: tuple[Path, ...] = ()

    @property
    def url(self) -> str:
        return str(self.path) if self.backend == "local" else f"nfs://{self.path}"

    def client_urls(self) -> list[str]:
        """The root's URL through each client: this one, then the others."""
        return [self.url, *(f"nfs://{path}" for path in self.elsewhere)]

    def store(self) -> LocalStore:
        return NFSStore(self.path) if self.backend == "nfs" else LocalStore(self.path)


@pytest.fixture(params=["local", pytest.param("nfs", marks=pytest.mark.nfs)])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> Where:
    """A fresh checkpoint root on each backend."""
    if request.param == "local":
        return Where("local", tmp_path / "ckpt")
    mount: FuseMount = request.getfixturevalue("seaweedfs_mount")
    second: FuseMount = request.getfixturevalue("seaweedfs_second_mount")
    relative = Path("process-tests") / tmp_path.name / "ckpt"
    (mount.path / relative).parent.mkdir(parents=True)
    return Where("nfs", mount.path / relative, elsewhere=(second.path / relative,))


def _gc_once_leases_expired(where: Where) -> GCReport:
    """``gc --grace 0`` as it runs once every lease a killed saver left has expired."""
    later = time.time() + default_settings().gc.save_lease_seconds + 1

    async def collect() -> GCReport:
        async with where.store() as store:
            return await collect_garbage(store, grace=0, now=later)

    return asyncio.run(collect())


def _state(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {f"big{i}": rng.standard_normal(300_000) for i in range(4)}
    out["small"] = [rng.standard_normal(64).astype(np.float32) for _ in range(50)]
    return out


def _run_until_stopped(where: Where, phase: str) -> None:
    """Run the child until it reports that it reached ``phase``, then SIGKILL it."""
    env = {**os.environ, "PYTHONPATH": python_path()}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(where.path), phase, where.backend],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        ready, _w, _x = select.select([child.stdout], [], [], 120)
        assert ready, f"child never reached {phase}"
        line = child.stdout.readline().strip()
        assert line == "stopped", f"child did not stop at {phase}: {line!r}"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        if child.poll() is None:
            child.kill()
        _out, err = child.communicate()
    assert child.returncode == -signal.SIGKILL, err


def _abandon_attempts(where: Where) -> None:
    """Leave abandoned attempts behind: two killed saves of steps 2 and 3."""
    store = where.store()
    for step in (2, 3):
        for i in range(3):
            key = f"{step}/attempt-000000000001-{step:08x}{i:08x}/pack-000000"
            ckptstore.background.run(store.put(key, b"x" * 1000))


def _only_committed_keys_remain(where: Where) -> None:
    keys = ckptstore.background.run(where.store().list_keys())
    root = where.url
    committed = {
        step: ckptstore.read_manifest(root, step).attempt for step in ckptstore.list_steps(root)
    }
    for key in keys:
        assert is_own_key(key), key
        step_segment, rest = key.split("/", 1)
        step = int(step_segment)
        assert step in committed, f"{key} belongs to an uncommitted step"
        assert rest == "manifest.json" or rest.startswith(committed[step] + "/"), key
    temp = [n for _d, _s, files in os.walk(where.path) for n in files if TEMP_PREFIX in n]
    assert temp == [], temp


@pytest.mark.parametrize(
    ("phase", "visible"),
    [
        ("mid-data", [1]),
        ("before-manifest", [1]),
        ("during-manifest", [1]),
        ("after-manifest", [1, 2]),
        ("during-gc", [1]),
    ],
)
def test_sigkill_at_each_phase(where: Where, phase: str, visible: list[int]) -> None:
    root = where.url
    old = _state(1)
    ckptstore.save(root, old, step=1)
    if phase == "during-gc":
        _abandon_attempts(where)
    _run_until_stopped(where, phase)

    assert ckptstore.list_steps(root) == visible
    latest = ckptstore.load(root)
    assert_same_state(latest, _state(visible[-1]))  # previous, or new and complete
    assert_same_state(ckptstore.load(root, step=1), old)

    # The killed saver's lease protects its attempt until it expires; then gc takes it all.
    report = _gc_once_leases_expired(where)
    if phase in ("mid-data", "during-manifest"):
        assert report.stale_writes >= 1  # the killed writer's temp file
    _only_committed_keys_remain(where)
    assert_same_state(ckptstore.load(root), _state(visible[-1]))


def test_racing_processes_one_commits(where: Where) -> None:
    # Racers share one client: put-if-absent is as atomic as the filesystem's LINK, and on
    # SeaweedFS's FUSE mount two mounts of one filer can both win a LINK race (measured, see
    # store/nfs.py), so a race across mounts would test the filesystem, not ckptstore. Every
    # other client must then see the winner, and only the winner.
    root = where.url
    outputs = race(SAVE_RACER, [[root, str(i)] for i in range(4)])
    who, attempt = one_winner(outputs)
    for client in where.client_urls():
        assert ckptstore.read_manifest(client, 7).attempt == attempt
        loaded = ckptstore.load(client, step=7)
        assert loaded["who"] == who
        assert_same_state(loaded["data"], np.full(200_000, who, np.int64))
    ckptstore.gc(root, grace=0)
    _only_committed_keys_remain(where)
