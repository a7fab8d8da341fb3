"""Preemption (issue 29): SIGTERM, or a wall-clock limit, turns into "save this step, wait
until it is durable, then exit", with a real training script in a child process."""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import ckptstore
from ckptstore import CheckpointManager
from ckptstore.manager.preemption import DEADLINE_STATUS, PreemptionWatch
from tests.children import python_path

TRAIN = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from ckptstore import CheckpointManager

    root, limit = sys.argv[1], sys.argv[2]
    save_before = None if limit == "none" else float(limit)
    with CheckpointManager(
        root, save_interval_steps=1000, preemption=True, save_before=save_before
    ) as mgr:
        w = np.zeros(1 << 16, np.float32)
        for step in range(1, 10**6):
            w = w + 1  # the state after step s is s everywhere
            mgr.save(step, {"w": w, "step": step})
            print("step", step, flush=True)
            time.sleep(0.005)
    """
)


def _train(root: Path, limit: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", TRAIN, str(root), limit],
        env={**os.environ, "PYTHONPATH": python_path()},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_sigterm_saves_the_next_step_durably_and_exits_143(tmp_path: Path) -> None:
    proc = _train(tmp_path / "run", "none")
    assert proc.stdout is not None
    seen = 0
    for line in proc.stdout:  # the loop is running: steps off the 1000-step interval
        seen = int(line.split()[1])
        if seen == 20:
            proc.send_signal(signal.SIGTERM)
            break
    rest, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err
    steps = ckptstore.list_steps(tmp_path / "run")
    assert len(steps) == 1  # no interval step was reached: only the preemption save
    (last,) = steps
    printed = [int(x.split()[1]) for x in rest.split("\n") if x.startswith("step")]
    assert last == max([seen, *printed]) + 1  # the step after the last one completed
    got = ckptstore.load(tmp_path / "run", last)
    assert got["step"] == last
    assert got["w"].tobytes() == np.full(1 << 16, last, np.float32).tobytes()


def test_a_wall_clock_limit_saves_before_it_and_exits_124(tmp_path: Path) -> None:
    # 30 s left and no save timed yet (a minute is assumed): due at the first save
    proc = _train(tmp_path / "run", str(time.time() + 30))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == DEADLINE_STATUS, err
    assert out == ""  # stopped in the first save() call, before the first print
    assert ckptstore.list_steps(tmp_path / "run") == [1]


def test_the_watch_gives_notice_by_the_margin_and_refuses_nonsense() -> None:
    watch = PreemptionWatch(save_before=time.time() + 10)
    assert watch.notice(1.0) is None
    notice = watch.notice(20.0)
    assert notice is not None
    assert notice.status == DEADLINE_STATUS
    assert notice.reason.startswith("save_before=")
    with pytest.raises(ValueError, match="not in the future"):
        PreemptionWatch(save_before=time.time() - 1)
    with pytest.raises(ValueError, match="aware datetime"):
        PreemptionWatch(save_before=datetime.datetime(2099, 1, 1))


def test_handlers_are_the_main_threads_and_are_put_back_at_close(tmp_path: Path) -> None:
    errors: list[BaseException] = []

    def make() -> None:
        try:
            CheckpointManager(tmp_path / "t", preemption=True)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=make)
    thread.start()
    thread.join()
    assert len(errors) == 1
    assert "main thread" in str(errors[0])
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("this worker runs tests outside the main thread")
    before = signal.getsignal(signal.SIGUSR1)
    with CheckpointManager(tmp_path / "m", preemption=[signal.SIGUSR1]):
        assert signal.getsignal(signal.SIGUSR1) != before
    assert signal.getsignal(signal.SIGUSR1) == before
