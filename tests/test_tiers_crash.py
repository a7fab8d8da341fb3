"""A tiered training job SIGKILLed at random moments: during local saves, copies to the
persistent tier and retention on either tier; local disk + moto and local disk + SeaweedFS.

After each kill, every step visible on either tier is complete (it loads, verified, bit-exact),
no step whose copy had committed on the persistent tier is lost there (beyond what retention
removes), and a restarted manager copies whatever the crash left pending; once the killed
job's leases expire, gc leaves only committed data on both tiers.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.parse
import uuid
from pathlib import Path

import pytest

import ckptstore
from ckptstore.config import default_settings
from ckptstore.layout.commit import is_own_key
from ckptstore.layout.gc import GCReport, collect_garbage
from ckptstore.store.base import TEMP_PREFIX
from ckptstore.store.registry import open_store
from ckptstore.testing import assert_same_state
from tests import tier_child
from tests.children import python_path
from tests.matrix import trials

pytestmark = pytest.mark.s3

ROOT = Path(__file__).resolve().parent.parent
#: Kills at random moments: 30 in the full matrix, 3 by default; either way more follow, up to
#: MAX_TRIALS, until the kills have landed in every phase (a loaded machine shifts the phases
#: against the first job's timing).
TRIALS = trials(full=30, quick=3)
MAX_TRIALS = 3 * TRIALS + 8
STEPS = 6
SEAWEED_BUCKET = "ckptstore-tier-crash"
#: A line of the job saying that a copy committed on the persistent tier.
COPIED = re.compile(r"^step (\d+) (?:\(\d+ bytes\) copied to|was already on) the persistent tier")


def _start(local: Path, url: str) -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.tier_child", str(local), url, str(STEPS)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": python_path()},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    line = child.stdout.readline().strip()
    assert line == "ready", (line, child.stderr.read() if child.stderr else "")
    return child


def _run_to_the_end(local: Path, url: str) -> float:
    """One job that is not killed; returns how long it ran after ``ready``."""
    child = _start(local, url)
    started = time.monotonic()
    out, err = child.communicate(timeout=300)
    assert child.returncode == 0, err
    assert out.split()[-1] == "done", out
    return time.monotonic() - started


def _run_and_kill(local: Path, url: str, delay: float) -> list[int]:
    """Start the job, SIGKILL it ``delay`` seconds after ``ready``; the steps it said were
    committed on the persistent tier before it died."""
    child = _start(local, url)
    try:
        time.sleep(delay)  # a random moment of the job, not a wait for a condition
        os.kill(child.pid, signal.SIGKILL)
        out, _err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return [int(m[1]) for line in out.splitlines() if (m := COPIED.match(line))]


def _check_visible_steps(url: str, what: str) -> list[int]:
    steps = ckptstore.list_steps(url)
    for step in steps:
        try:
            assert_same_state(ckptstore.load(url, step), tier_child.state(step))
        except (AssertionError, ckptstore.CkptStoreError) as exc:
            raise AssertionError(f"{what}: step {step} at {url}") from exc
    return steps


def _only_committed_data_after_gc(url: str) -> bool:
    """gc as it runs once the killed job's leases expired: what remains is committed.
    Returns whether gc found anything a killed save or copy left (so the kill hit one)."""
    later = time.time() + default_settings().gc.save_lease_seconds + 1

    async def collect() -> tuple[GCReport, list[str]]:
        async with open_store(url) as store:
            report = await collect_garbage(store, grace=0, now=later)
            return report, await store.list_keys()

    report, keys = asyncio.run(collect())
    committed = {s: ckptstore.read_manifest(url, s).attempt for s in ckptstore.list_steps(url)}
    for key in keys:
        assert is_own_key(key), key
        step, rest = key.split("/", 1)
        assert int(step) in committed, f"{key}: data of an uncommitted step"
        assert rest == "manifest.json" or rest.startswith(committed[int(step)] + "/"), key
        assert TEMP_PREFIX not in key, key
    return bool(report.removed or report.stale_writes)


@pytest.mark.parametrize(
    "server", [pytest.param("moto", marks=pytest.mark.slow), "seaweedfs"]
)  # moto's run (about 40 s) adds no S3 behaviour SeaweedFS's lacks: --full runs it
def test_sigkill_at_random_points_of_saves_copies_and_retention(
    request: pytest.FixtureRequest, tmp_path: Path, server: str
) -> None:
    if server == "moto":
        moto = request.getfixturevalue("moto_s3")  # AWS_* set for the test and its children
        bucket, options = moto.bucket, moto.options()
    else:
        seaweed = request.getfixturevalue("seaweedfs")
        seaweed.create_bucket(SEAWEED_BUCKET)
        bucket, options = SEAWEED_BUCKET, {"endpoint_url": seaweed.s3_endpoint, "anonymous": "true"}
    query = urllib.parse.urlencode(options)

    def fresh(name: str) -> tuple[Path, str]:
        return tmp_path / name / "local", f"s3://{bucket}/{uuid.uuid4().hex[:10]}?{query}"

    # One job run to its end: how long a job takes, and what it leaves when nothing fails.
    local, url = fresh("whole")
    duration = _run_to_the_end(local, url)
    saved = [s for s in range(STEPS) if s % tier_child.PERSISTENT_EVERY == 0]
    assert ckptstore.list_steps(url) == saved[-tier_child.MAX_TO_KEEP :]
    assert ckptstore.list_steps(local) == [STEPS - 1]

    rng = random.Random(20)
    # How many kills landed in each phase, as the stores show afterwards: inside a local
    # save or a copy (gc finds what it left), between a local commit and its copy's commit
    # (the next start finds the step pending).
    hit = {"local save": 0, "copy": 0, "pending": 0}
    trial = 0
    while trial < TRIALS or (not all(hit.values()) and trial < MAX_TRIALS):
        local, url = fresh(f"trial{trial}")
        if trial >= TRIALS and not hit["local save"]:
            # A local save of this small state is a short part of the run, and random kills
            # can miss it many times over: aim at the first one, right after "ready".
            delay = rng.uniform(0, duration / STEPS)
        else:  # spread over the job: each of TRIALS kills in its own slice of the run
            delay = duration * ((trial % TRIALS) + rng.random()) / TRIALS
        trial += 1
        copied = _run_and_kill(local, url, delay)
        what = f"trial {trial}, killed {delay:.2f} s in, copies committed: {copied}"

        local_steps = _check_visible_steps(str(local), what) if local.exists() else []
        persistent_steps = _check_visible_steps(url, what)
        for step in copied:  # a committed copy is still there, or retention let it go
            newer = [s for s in persistent_steps if s > step]
            assert step in persistent_steps or len(newer) >= tier_child.MAX_TO_KEEP, what

        # The next start copies what the crash left pending, then goes on.
        with tier_child.manager(str(local), url) as mgr:
            hit["pending"] += bool(mgr.tiers().pending)
            mgr.wait_until_finished()
            listing = mgr.tiers()
            assert listing.pending == [], what
            marked = [s for s in local_steps if s % tier_child.PERSISTENT_EVERY == 0]
            for step in marked:
                newer = [s for s in listing.persistent if s > step]
                assert step in listing.persistent or len(newer) >= tier_child.MAX_TO_KEEP, what
            if listing.steps:
                assert_same_state(mgr.restore(), tier_child.state(listing.steps[-1]))
        _check_visible_steps(url, what)
        if local.exists():
            hit["local save"] += _only_committed_data_after_gc(str(local))
        hit["copy"] += _only_committed_data_after_gc(url)
    assert all(hit.values()), (hit, trial)  # the random kills reached every phase
