"""Concurrent cleaners on one root (issue 30): gc loops in other processes beside a manager
whose retention deletes steps, never fail on what another removed and never remove what a
committed step needs.

``ckptstore.gc(root, grace=0)`` in a loop beside ``CheckpointManager(max_to_keep=2)`` used to
fail about once in 50-70 runs with ``NotFoundError: .../reclaim-<id>.json does not exist``:
two cleaners reclaiming one attempt each put a marker in it and each deletes the other's; on
a local disk the loser's put then found its directory pruned while making its name durable.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptstore
from ckptstore import background
from ckptstore.store.local import LocalStore
from tests.children import python_path
from tests.matrix import trials
from tests.multirank import SOAK_TARGETS, Target

ROOT = Path(__file__).resolve().parent.parent

#: Seconds the cleaners and the saver run together: minutes in the full matrix.
SECONDS = trials(120, 6)

#: A gc loop in a process of its own: ``python -c _GC_LOOP ROOT STOP [SKEW]``. With SKEW its
#: wall clock runs SKEW seconds off the saver's, as another host's would.
_GC_LOOP = """
import json, os, sys, time
if len(sys.argv) > 3:
    real, skew = time.time, float(sys.argv[3])
    time.time = lambda: real() + skew
import ckptstore

root, stop = sys.argv[1], sys.argv[2]
options = json.loads(os.environ["CKPTSTORE_TEST_STORE_OPTIONS"])
runs = removed = 0
while not os.path.exists(stop):
    report = ckptstore.gc(root, grace=0, **options)
    runs += 1
    removed += len(report.removed) + len(report.reclaimed)
print(json.dumps({"runs": runs, "removed": removed}), flush=True)
"""


def _summaries(cleaners: list[Any], outputs: list[tuple[str, str]]) -> list[dict[str, int]]:
    """Each gc loop's report, once it has exited cleanly after at least two runs."""
    summaries = []
    for cleaner, (out, err) in zip(cleaners, outputs, strict=True):
        assert cleaner.returncode == 0, err[-4000:]
        summary = json.loads(out.strip().splitlines()[-1])
        assert summary["runs"] >= 2, summary
        summaries.append(summary)
    return summaries


def test_a_put_whose_directory_is_pruned_by_a_concurrent_delete_succeeds(tmp_path: Path) -> None:
    """The exact interleaving: another deleter removes the name just published and prunes
    its directory before the writer makes the name durable. The put took effect (before the
    delete) and returns; the key is gone, as the delete said."""
    store = LocalStore(tmp_path)
    publish = store._publish

    def publish_then_lose_the_race(temp: str, final: str, mode: Any, key: str) -> None:
        publish(temp, final, mode, key)
        store._remove([key])  # prunes 3/attempt-x/ and 3/, now empty

    store._publish = publish_then_lose_the_race  # type: ignore[method-assign]
    key = "3/attempt-000000000000-0000000000000000/reclaim-0123.json"
    background.run(store.put(key, b"{}"))
    assert not (tmp_path / "3").exists()
    background.run(store.close())


@pytest.mark.parametrize("target", SOAK_TARGETS, indirect=True)
def test_gc_loops_beside_retention_never_fail_and_keep_every_step(
    target: Target, tmp_path: Path
) -> None:
    """Two gc processes with no grace period loop for :data:`SECONDS` while a manager with
    ``max_to_keep=2`` saves (incremental saves: retention and gc both reclaim attempts that
    newer steps referenced). No cleaner fails, and every step retention keeps loads
    bit-exact throughout and at the end."""
    url, options = target.base, target.options
    stop = tmp_path / "stop"
    env = {**os.environ, **target.env(), "PYTHONPATH": python_path()}
    cleaners = [
        subprocess.Popen(
            [sys.executable, "-c", _GC_LOOP, url, str(stop)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    rng = np.random.default_rng(0)
    frozen = rng.standard_normal(256 << 10).astype(np.float32)
    saved: dict[int, bytes] = {}
    try:
        deadline = time.monotonic() + SECONDS
        step = 0
        with ckptstore.CheckpointManager(url, max_to_keep=2, **options) as mgr:
            while time.monotonic() < deadline or step < 10:
                if step % 5 == 0:
                    frozen = frozen + 1  # a new base every 5 steps: older ones get reclaimed
                moving = np.full(1000, step, np.int64)
                mgr.save(step, {"frozen": frozen, "moving": moving}, full=step % 7 == 0)
                saved[step] = frozen.tobytes() + moving.tobytes()
                if step % 4 == 3:
                    mgr.wait_until_finished()
                    newest = mgr.all_steps()[-1]
                    got = mgr.restore(newest)
                    assert got["frozen"].tobytes() + got["moving"].tobytes() == saved[newest]
                step += 1
            mgr.wait_until_finished()
            kept = mgr.all_steps()
    finally:
        stop.touch()
        outputs = [cleaner.communicate(timeout=120) for cleaner in cleaners]
    _summaries(cleaners, outputs)
    assert kept == sorted(saved)[-2:]
    for step in kept:
        got = ckptstore.load(url, step, **options)
        assert got["frozen"].tobytes() + got["moving"].tobytes() == saved[step]


#: the lease period of the mixed test: short, so renewals and expiries happen during it
LEASE = 8


@pytest.mark.parametrize(
    "target",
    ["local", pytest.param("seaweedfs", marks=[pytest.mark.s3, pytest.mark.slow])],
    indirect=True,
)
def test_gc_rollback_retention_and_tier_cleanup_together_never_fail(
    target: Target, tmp_path: Path
) -> None:
    """Every kind of cleaner at once on one run: a tiered manager's retention on both tiers
    and its copies, a rollback every 9 saves (newer steps set aside on both tiers, then
    saved again), and three gc loops with no grace period: two on the persistent root from
    "other hosts" whose clocks are 1.5 s ahead and behind, one on the local tier. Nothing
    fails; every step listed at the end loads bit-exact as last saved."""
    url = target.base
    options = {**target.options, "save_lease_seconds": LEASE}
    local = tmp_path / "local-tier"
    stop = tmp_path / "stop"
    env = {
        **os.environ,
        **target.env(),
        "PYTHONPATH": python_path(),
        "CKPTSTORE_SAVE_LEASE_SECONDS": str(LEASE),
    }
    local.mkdir()
    runs = [(url, "1.5"), (url, "-1.5"), (str(local), "0")]
    cleaners = [
        subprocess.Popen(
            [sys.executable, "-c", _GC_LOOP, root, str(stop), skew],
            env={
                **env,
                "CKPTSTORE_TEST_STORE_OPTIONS": json.dumps(target.options if root == url else {}),
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for root, skew in runs
    ]
    rng = np.random.default_rng(1)
    frozen = rng.standard_normal(128 << 10).astype(np.float32)
    saved: dict[int, bytes] = {}
    rollbacks = saves = 0
    try:
        deadline = time.monotonic() + SECONDS
        step = 0
        with ckptstore.CheckpointManager(
            url,
            local=str(local),
            local_options={"save_lease_seconds": LEASE},
            max_to_keep=3,
            local_max_to_keep=2,
            persistent_every=2,
            **options,
        ) as mgr:
            while time.monotonic() < deadline or step < 20:
                if step % 5 == 0:
                    frozen = frozen + 1
                moving = np.full(1000, step, np.int64)
                mgr.save(step, {"frozen": frozen, "moving": moving})
                saved[step] = frozen.tobytes() + moving.tobytes()
                saves += 1
                if saves % 9 == 0:  # go back two steps and save them again
                    mgr.wait_until_finished()
                    back = max(s for s in mgr.all_steps() if s <= step - 2)
                    got = mgr.restore(back, rollback=True)
                    assert got["frozen"].tobytes() + got["moving"].tobytes() == saved[back]
                    assert mgr.set_aside, "a rollback with newer steps set none aside"
                    rollbacks += 1
                    frozen = got["frozen"] + 0.5  # the rerun differs from the first run
                    step = back
                step += 1
            mgr.wait_until_finished()
            kept = mgr.all_steps()
            for got_step in kept:
                got = mgr.restore(got_step)
                assert got["frozen"].tobytes() + got["moving"].tobytes() == saved[got_step]
    finally:
        stop.touch()
        outputs = [cleaner.communicate(timeout=120) for cleaner in cleaners]
    removed = sum(summary["removed"] for summary in _summaries(cleaners, outputs))
    assert removed > 0, "the gc loops found nothing to remove: they raced with nothing"
    assert rollbacks >= 2
    assert kept, "no step left"
    for step in ckptstore.list_steps(url, **target.options):
        got = ckptstore.load(url, step, **target.options)
        assert got["frozen"].tobytes() + got["moving"].tobytes() == saved[step]
