"""Real processes: a saver SIGKILLed at each phase of a save or of garbage collection, and
racing savers of one step. Local store (files, fsync, link), since a crash must be survived
by what is on disk."""

from __future__ import annotations

import asyncio
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
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
from ckptstore.testing import assert_same_state

ROOT = Path(__file__).resolve().parent.parent

# The child saves step 2 (or collects garbage) and, at the phase named on its command line,
# creates the marker file and blocks until the parent kills it.
CHILD = textwrap.dedent(
    """
    import asyncio, os, sys, threading
    import numpy as np
    import ckptstore
    import ckptstore.store.local as local
    from ckptstore.store.local import LocalStore
    from ckptstore.store.wrappers import StoreWrapper

    root, phase = sys.argv[1:3]
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

    store = Phases(LocalStore(root))
    if phase == "during-gc":
        ckptstore.gc(store, grace=0)
    else:
        ckptstore.save(store, state(2), step=2)
    print("finished without being stopped", flush=True)
    """
)


def _gc_once_leases_expired(root: Path) -> GCReport:
    """``gc --grace 0`` as it runs once every lease a killed saver left has expired."""
    later = time.time() + default_settings().save_lease_seconds + 1

    async def collect() -> GCReport:
        async with LocalStore(root) as store:
            return await collect_garbage(store, grace=0, now=later)

    return asyncio.run(collect())


def _state(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {f"big{i}": rng.standard_normal(300_000) for i in range(4)}
    out["small"] = [rng.standard_normal(64).astype(np.float32) for _ in range(50)]
    return out


def _run_until_stopped(root: Path, phase: str) -> None:
    """Run the child until it reports that it reached ``phase``, then SIGKILL it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(root), phase],
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


def _abandon_attempts(root: Path) -> None:
    """Leave abandoned attempts behind: two killed saves of steps 2 and 3."""
    store = LocalStore(root)
    for step in (2, 3):
        for i in range(3):
            key = f"{step}/attempt-000000000001-{step:08x}{i:08x}/pack-000000"
            ckptstore.background.run(store.put(key, b"x" * 1000))


def _only_committed_keys_remain(root: Path) -> None:
    store = LocalStore(root)
    keys = ckptstore.background.run(store.list_keys())
    committed = {
        step: ckptstore.read_manifest(root, step).attempt for step in ckptstore.list_steps(root)
    }
    for key in keys:
        assert is_own_key(key), key
        step_segment, rest = key.split("/", 1)
        step = int(step_segment)
        assert step in committed, f"{key} belongs to an uncommitted step"
        assert rest == "manifest.json" or rest.startswith(committed[step] + "/"), key
    temp = [name for _d, _s, files in os.walk(root) for name in files if TEMP_PREFIX in name]
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
def test_sigkill_at_each_phase(tmp_path: Path, phase: str, visible: list[int]) -> None:
    root = tmp_path / "ckpt"
    old = _state(1)
    ckptstore.save(root, old, step=1)
    if phase == "during-gc":
        _abandon_attempts(root)
    _run_until_stopped(root, phase)

    assert ckptstore.list_steps(root) == visible
    latest = ckptstore.load(root)
    assert_same_state(latest, _state(visible[-1]))  # previous, or new and complete
    assert_same_state(ckptstore.load(root, step=1), old)

    # The killed saver's lease protects its attempt until it expires; then gc takes it all.
    report = _gc_once_leases_expired(root)
    if phase in ("mid-data", "during-manifest"):
        assert report.stale_writes >= 1  # the killed writer's temp file
    _only_committed_keys_remain(root)
    assert_same_state(ckptstore.load(root), _state(visible[-1]))


RACER = textwrap.dedent(
    """
    import sys
    import numpy as np
    import ckptstore
    root, who = sys.argv[1], int(sys.argv[2])
    state = {"who": who, "data": np.full(200_000, who, np.int64), "small": np.arange(who + 1)}
    print("ready", flush=True)
    sys.stdin.readline()
    try:
        info = ckptstore.save(root, state, step=7)
    except ckptstore.CommitConflictError:
        print("conflict", flush=True)
    else:
        print("ok", info.attempt, flush=True)
    """
)


def test_racing_processes_one_commits(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, str(root), str(i)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(4)
    ]
    try:
        for racer in racers:
            assert racer.stdout is not None
            assert racer.stdout.readline().strip() == "ready"
        for racer in racers:  # release them together
            assert racer.stdin is not None
            racer.stdin.write("go\n")
            racer.stdin.flush()
        outputs = [racer.communicate(timeout=120)[0].split() for racer in racers]
    finally:
        for racer in racers:
            if racer.poll() is None:
                racer.kill()
    winners = [(i, out) for i, out in enumerate(outputs) if out[0] == "ok"]
    assert len(winners) == 1, outputs
    assert sum(out == ["conflict"] for out in outputs) == len(racers) - 1, outputs
    who, (_ok, attempt) = winners[0]
    assert ckptstore.read_manifest(root, 7).attempt == attempt
    loaded = ckptstore.load(root, step=7)
    assert loaded["who"] == who
    assert_same_state(loaded["data"], np.full(200_000, who, np.int64))
    ckptstore.gc(root, grace=0)
    _only_committed_keys_remain(root)
