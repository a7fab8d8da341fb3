"""ckptstore's thread pool (``ckptstore.threads.Pool``): what ``ThreadPoolExecutor`` does for
the stores, and what it does not: refuse work while the interpreter exits (that case runs in
a child process: ``test_an_async_dcp_save_never_waited_for_is_committed_at_exit``)."""

from __future__ import annotations

import threading

import pytest

from ckptstore.threads import Pool


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
