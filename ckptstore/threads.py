"""ckptstore's worker threads: a pool that keeps working while the interpreter exits.

When the main thread ends, Python joins the threads of every ``ThreadPoolExecutor`` and, from
that moment, every such pool refuses new work (``cannot schedule new futures after
interpreter shutdown``), its own and every other one's. A save that a library runs in one of
those pools (``torch.distributed.checkpoint.async_save`` does) is joined there, but its
writes, reads and checksums go through ckptstore's pools: with ``ThreadPoolExecutor`` they
failed, and the script's last save was lost without a word. :class:`Pool` takes work until
it is shut down itself, so work that is still being waited for at exit completes.

Its threads are daemons: they never hold the interpreter open. Work nobody waits for is not
ckptstore's: every save is waited for, by its caller or at exit
(:func:`ckptstore.background.close_at_exit`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

__all__ = ["LEAVES_PER_OFFER", "Pool", "collection_paused", "in_turns", "wait"]

_T = TypeVar("_T")
_Item = tuple[concurrent.futures.Future[Any], Callable[[], Any]]

#: How often a thread waiting in :func:`wait` wakes to act on a signal another thread took.
SIGNAL_CHECK_SECONDS = 0.1

#: Leaves a per-leaf loop in a worker thread handles between two offers of the GIL
#: (:func:`in_turns`): 64 small leaves are about 30 us of holding it.
LEAVES_PER_OFFER = 64

_offer_gil: Callable[[], None] = getattr(os, "sched_yield", lambda: None)


def in_turns(items: Sequence[_T], size: int = LEAVES_PER_OFFER) -> Iterator[Sequence[_T]]:
    """``items`` in slices of ``size``, the GIL offered to other threads before each one.

    A worker thread's Python loop over thousands of small leaves (their hashes, say) keeps
    the GIL, and every other thread of the process waits up to the interpreter's switch
    interval (5 ms) each time it needs it: the event loop, the writes' threads and the
    training loop's own. Measured on 20,000 leaves of 4 KiB, a thread hashing them let the
    main thread run 3 times in 13 ms, ~5 ms each wait. ``os.sched_yield`` lets the GIL go
    (a thread waiting for it takes it) and costs about 1 us where nobody waits: with it
    every 64 leaves the main thread ran 29 times, waiting 0.3 ms at the median, and the
    hashes took no longer (``time.sleep(0)`` does the same at ~80 us a call).
    """
    for start in range(0, len(items), size):
        _offer_gil()
        yield items[start : start + size]


def wait(futures: Iterable[concurrent.futures.Future[Any]]) -> None:
    """Wait until every one of ``futures`` is done, and stay interruptible meanwhile.

    The kernel hands a process's SIGINT to any thread that does not block it (the event
    loop's, a pool's), and Python then only sets a flag that the main thread acts on between
    bytecodes. An untimed wait on a lock never returns to check that flag, so Ctrl-C waited
    for the whole save; this one wakes every :data:`SIGNAL_CHECK_SECONDS`.
    """
    pending = set(futures)
    while pending:
        pending = concurrent.futures.wait(pending, timeout=SIGNAL_CHECK_SECONDS).not_done


class Pool(concurrent.futures.ThreadPoolExecutor):
    """A thread pool of at most ``max_workers`` daemon threads, started as work arrives.

    It is a ``ThreadPoolExecutor`` by type (asyncio takes no other as a loop's default
    executor), with its own queue and threads: none of the base class's machinery runs.

    Args:
        max_workers: the most threads it runs.
        name: the threads' name prefix.
    """

    def __init__(self, max_workers: int, name: str) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        super().__init__(max_workers, name)  # its state only; it never starts a thread here
        self.max_workers = max_workers
        self.name = name
        self._work: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._workers: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def submit(
        self, fn: Callable[..., _T], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[_T]:
        future: concurrent.futures.Future[_T] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: cannot take work after shutdown()")
            self._work.put((future, lambda: fn(*args, **kwargs)))
            if not self._idle.acquire(blocking=False) and len(self._workers) < self.max_workers:
                thread = threading.Thread(
                    target=self._serve, name=f"{self.name}_{len(self._workers)}", daemon=True
                )
                thread.start()
                self._workers.append(thread)
        return future

    def _serve(self) -> None:
        while (item := self._work.get()) is not None:
            future, call = item
            if future.set_running_or_notify_cancel():
                try:
                    result = call()
                except BaseException as exc:
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            del item, future, call  # drop references before waiting for the next one
            self._idle.release()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._closed = True
            threads = list(self._workers)
        if cancel_futures:
            while True:
                try:
                    item = self._work.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
        for _ in threads:
            self._work.put(None)
        if wait:
            for thread in threads:
                if thread is not threading.current_thread():
                    thread.join()


_paused_lock = threading.Lock()
_paused_by = 0  # blocks running with the collector paused
_resume = False  # whether the last of them turns it back on


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for a block of per-leaf work of a save (or of
    a manifest's parse, :meth:`ckptstore.layout.manifest.Manifest.parse`).

    A save makes a few objects per leaf while it stages (specs, slots, copy tasks), plans and
    builds its manifest (plan entries, the manifest's columns and their encoding), and every
    700 allocations the collector runs; every tenth of those passes walks the older objects
    too, and the training process's heap (the state's tensors and containers, the model) is
    all old. On 20,000 leaves of 4 KiB these passes were half of the staging call (36
    against 13-20 us a leaf with the collector off, one process, the same state, runs
    alternating) and 4 ms of each ``ckptstore.save`` (26 passes). What these blocks make
    lives as long as the save anyway, and a cycle among it is found by the first pass after
    the pause. The blocks are short and synchronous (never around a wait for I/O); nested
    and concurrent ones share one pause; a collector the application turned off stays off.
    """
    global _paused_by, _resume
    with _paused_lock:
        if _paused_by == 0:
            _resume = gc.isenabled()
            gc.disable()
        _paused_by += 1
    try:
        yield
    finally:
        with _paused_lock:
            _paused_by -= 1
            if _paused_by == 0 and _resume:
                gc.enable()
