"""ckptstore's thread pool (``ckptstore.threads.Pool``): what ``ThreadPoolExecutor`` does for
the stores, and what it does not: refuse work while the interpreter exits (that case runs in
a child process: ``test_an_async_dcp_save_never_waited_for_is_committed_at_exit``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from ckptstore.threads import Pool
from tests.children import python_path


def test_runs_work_on_at_most_max_workers_threads_and_reports_errors() -> None:
    pool = Pool(3, "test-pool")
    gate = threading.Event()
    running: set[str] = set()

    def work(i: int) -> int:
        running.add(threading.current_thread().name)
        gate.wait(5)
        if i == 7:
            raise ValueError("seven")
        return i * i

    futures = [pool.submit(work, i) for i in range(10)]
    gate.set()
    assert [f.result() for f in futures if f is not futures[7]] == [
        i * i for i in range(10) if i != 7
    ]
    with pytest.raises(ValueError, match="seven"):
        futures[7].result()
    assert 1 <= len(running) <= 3
    assert all(name.startswith("test-pool_") for name in running)
    assert all(t.daemon for t in threading.enumerate() if t.name.startswith("test-pool_"))
    pool.shutdown()
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(work, 0)


def test_shutdown_can_cancel_what_has_not_started() -> None:
    pool = Pool(1, "test-cancel")
    gate = threading.Event()
    first = pool.submit(gate.wait, 5)
    queued = [pool.submit(int, "1") for _ in range(3)]
    pool.shutdown(wait=False, cancel_futures=True)
    gate.set()
    assert first.result() is True
    assert all(f.cancelled() for f in queued)
    with pytest.raises(ValueError, match="max_workers"):
        Pool(0, "none")


_WAIT = """
import concurrent.futures, signal, sys, threading
signal.signal(signal.SIGINT, signal.default_int_handler)
from ckptstore import threads
threading.Thread(target=threading.Event().wait, daemon=True).start()
# only the other thread can take the SIGINT now, as the loop's or a pool's thread may
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
print("waiting", flush=True)
threads.wait([concurrent.futures.Future()])  # never done
"""


def test_wait_is_interrupted_by_a_sigint_another_thread_took() -> None:
    """``concurrent.futures.wait`` without a timeout never returns to act on the flag a
    signal handled on another thread sets: a saving caller ignored Ctrl-C until the save
    ended (the Ctrl-C tests of test_interrupts.py hung on it)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _WAIT],
        env={**os.environ, "PYTHONPATH": python_path()},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == "waiting\n"
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert "KeyboardInterrupt" in err, err
    assert time.monotonic() - start < 20


def test_in_turns_offers_the_gil_before_each_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's per-leaf loop lets other threads have the GIL every few leaves: each slice
    comes after one offer, and together they are the items, in order."""
    from ckptstore import threads

    offers: list[int] = []
    seen: list[int] = []
    monkeypatch.setattr(threads, "_offer_gil", lambda: offers.append(len(seen)))
    for turn in threads.in_turns(list(range(10)), 4):
        seen += turn
    assert seen == list(range(10))
    assert offers == [0, 4, 8]
    assert list(threads.in_turns([], 4)) == []


def test_leaf_hashes_let_other_threads_run_between_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np

    from ckptstore import threads
    from ckptstore.layout.incremental import leaf_hashes

    offers: list[None] = []
    monkeypatch.setattr(threads, "_offer_gil", lambda: offers.append(None))
    leaves = [np.full(16, i, np.int32) for i in range(threads.LEAVES_PER_OFFER * 3 + 1)]
    hashes = leaf_hashes(leaves)
    assert len(offers) == 4
    assert len(set(hashes)) == len(leaves)
