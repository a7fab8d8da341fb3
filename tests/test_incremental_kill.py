"""SIGKILL during incremental saves, retention and gc never costs a committed step a byte.

A child process runs a fine-tuning loop with a CheckpointManager (incremental saves,
retention keeping two steps, a full save every fourth) and a gc with no grace period after
every save, printing a line before each phase. The test kills it right after a randomly
chosen line, so the kill lands inside a save, inside retention or inside gc, then checks
that every committed step restores bit-exact and verifies, and starts the next child on the
same root, so the leftovers of every crash (markers, records, half-reclaimed attempts)
meet the next run. On local disk, moto and SeaweedFS (the ``target`` fixture of
tests/multirank.py; the child reaches the S3 servers through the URL's query and, for moto,
the ``AWS_*`` variables it inherits). 30 trials, each an interpreter, per store in the full
matrix; 5 by default.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import textwrap
import urllib.parse
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptstore
from ckptstore import background
from ckptstore.layout.maintenance import verify_step
from ckptstore.store.registry import open_store
from ckptstore.testing.incremental_tests import FineTuning
from tests.matrix import trials
from tests.multirank import SOAK_TARGETS, Target

ROOT = Path(__file__).resolve().parent.parent
TRIALS = trials(full=30, quick=3)
#: A child is killed after at most this many of its lines, one ``save`` and one ``gc`` a step.
MAX_LINES = 8

CHILD = textwrap.dedent(
    """
    import sys
    import ckptstore
    from ckptstore.testing.incremental_tests import FineTuning

    root, start = sys.argv[1], int(sys.argv[2])
    run = FineTuning()
    for _ in range(start):
        run.train_step()
    with ckptstore.CheckpointManager(root, max_to_keep=2, async_save=False, full_every=4) as m:
        for step in range(start + 1, start + 50):
            run.train_step()
            print("save", step, flush=True)
            m.save(step, run.state)
            print("gc", step, flush=True)
            ckptstore.gc(root, grace=0)
    """
)


def _expected(steps: int) -> dict[int, Any]:
    run = FineTuning()
    out = {}
    for step in range(1, steps + 1):
        run.train_step()
        out[step] = run.snapshot()
    return out


def _same(actual: Any, expected: Any) -> bool:
    if isinstance(expected, dict):
        return list(actual) == list(expected) and all(
            _same(actual[k], v) for k, v in expected.items()
        )
    if isinstance(expected, np.ndarray):
        return bool(actual.tobytes() == expected.tobytes())
    return bool(actual == expected)


# every store in the default run too: the kills are few there, not the stores
@pytest.mark.parametrize("target", SOAK_TARGETS, indirect=True)
def test_sigkill_during_save_retention_and_gc(target: Target) -> None:
    query = urllib.parse.urlencode(target.options)
    url = f"{target.base}?{query}" if query else target.base
    rng = random.Random(21)
    # every trial commits at most MAX_LINES / 2 new steps: the states of all of them
    expected = _expected(TRIALS * MAX_LINES // 2 + 1)
    kills = 0
    for _ in range(TRIALS):
        latest = max(ckptstore.list_steps(url), default=0)
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, url, str(latest)],
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        assert child.stdout is not None
        lines = rng.randint(1, MAX_LINES)
        for _ in range(lines):
            line = child.stdout.readline()
            assert line, f"the child ended early (exit {child.wait()})"
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
        kills += child.returncode == -signal.SIGKILL
        for step in ckptstore.list_steps(url):
            assert _same(ckptstore.load(url, step), expected[step]), step

            async def check(step: int = step) -> bool:
                async with open_store(url) as store:
                    return (await verify_step(store, step)).ok

            assert background.run(check()), f"step {step} fails verification"
    assert kills == TRIALS
