"""Saves that return once the state is staged, and finish on the background loop.

:class:`AsyncSaver` is the machinery under ``CheckpointManager(async_save=True)``. A save
first waits until fewer than ``max_in_flight`` saves are still writing (one by default, as
Orbax and the torch.distributed.checkpoint tutorial do: a second staging arena would double
host memory, and the store's bandwidth is already in use), then stages the state into pooled
host buffers (the only part that blocks training) and hands the write, commit and whatever
follows to ckptstore's background event loop.
A lazy stage (``CheckpointManager(snapshot="lazy")``) returns before its copy; the write
waits for the copy first (:meth:`StagedState.wait_ready`), so a copy's error, a torn
snapshot included, is that save's error and is reported like any other.

No background error is lost: a failed save is raised by the next ``save`` (before it stages
anything) and by :meth:`AsyncSaver.wait_until_finished`, each error exactly once, in the order
the saves were made.

Why the write runs on threads of this process and not in a writer process: one was built and
measured (staging arenas as memfds the process mapped, the write and commit run there, the
arena released on its answer). On the async benchmark's transformer loop it lost no less
than the threads in three runs of 4-6 rounds alternating the two: 42 against 50, 57 against
50 and 68 against 57 ms a save (a 24-27 ms memcpy); at nice 10 or under SCHED_IDLE it did no
better. A plain writer process with nothing shared with the loop
(``scripts/benchlib/bare_writer.py``) loses as much or more, so the GIL is not what the
background write costs the loop here; memory bandwidth and the kernel's I/O work are.
What the threads did cost the loop was the work per object. In two runs of the async suite's
loop (5 alternating rounds each, 2026-12-06), the transformer state's saves lost 1.44x and
0.88x the bare writer's loss as 128 objects, and 0.71x (a prototype) and 0.58x as 8 runs
cut straight from the staging arena (:meth:`~ckptstore.layout.plan.PackPlan.in_region`),
at about half the CPU a save.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from ckptstore import background, threads
from ckptstore.pipeline.save import StagedState

__all__ = ["AsyncSaver", "BackgroundWork", "SaveHandle", "SaveTiming"]


@dataclass(frozen=True, slots=True)
class SaveTiming:
    """Where one save spent its time, in seconds.

    Attributes:
        waited: blocked on the previous save before staging began.
        staged: blocked copying the state into host buffers.
        nbytes: bytes of array data staged.
    """

    waited: float
    staged: float
    nbytes: int

    @property
    def blocked(self) -> float:
        """Total time the caller was blocked."""
        return self.waited + self.staged


class SaveHandle:
    """One save whose write and commit run in the background.

    Attributes:
        step: the step being saved.
        timing: how long the call that started it blocked.
    """

    def __init__(
        self, step: int, future: concurrent.futures.Future[Any], timing: SaveTiming
    ) -> None:
        self.step = step
        self.timing = timing
        self._future = future
        self._started = time.perf_counter()
        #: Seconds from the end of staging to the end of the write and commit, once done.
        self.write_seconds: float | None = None

    def done(self) -> bool:
        """Whether the write and commit have finished (successfully or not); what follows
        the commit (retention) may still run."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> Any:
        """Wait for the save's commit; return what the write returned or raise its error.
        :meth:`AsyncSaver.wait_until_finished` waits for what follows the commit too."""
        return self._future.result(timeout)

    def __repr__(self) -> str:
        state = "done" if self.done() else "writing"
        return f"SaveHandle(step={self.step}, {state})"


class BackgroundWork:
    """Futures of background work, one per step, whose errors are kept and raised once each,
    in the order the work was started (the rule of async saves, and of a tiered manager's
    copies to its persistent tier).

    Args:
        note: the note added to a raised error, with ``{step}`` for its step.
    """

    def __init__(self, note: str = "(raised by the background save of step {step})") -> None:
        self.note = note
        self._lock = threading.Lock()
        self._in_flight: list[tuple[int, concurrent.futures.Future[Any], Callable[[], None]]] = []
        self._errors: list[tuple[int, BaseException]] = []

    def track(
        self,
        step: int,
        future: concurrent.futures.Future[Any],
        on_end: Callable[[], None] = lambda: None,
    ) -> None:
        """Follow ``future``; ``on_end`` runs once when it has ended and is accounted for."""
        entry = (step, future, on_end)
        with self._lock:
            self._in_flight.append(entry)
        future.add_done_callback(lambda f: self._ended(entry))

    def _ended(self, entry: tuple[int, concurrent.futures.Future[Any], Callable[[], None]]) -> None:
        with self._lock:
            if entry not in self._in_flight:
                return
            self._in_flight.remove(entry)
            step, future, on_end = entry
            on_end()
            error = None if future.cancelled() else future.exception()
            if error is not None:
                self._errors.append((step, error))

    def _sweep(self) -> None:
        """Account for work that has ended but whose done-callback has not run yet."""
        with self._lock:
            ended = [entry for entry in self._in_flight if entry[1].done()]
        for entry in ended:
            self._ended(entry)

    def wait_for_fewer_than(self, limit: int) -> None:
        """Block until fewer than ``limit`` are unaccounted for, waiting on the oldest."""
        while True:
            with self._lock:
                if len(self._in_flight) < limit:
                    return
                oldest = self._in_flight[0]
            threads.wait((oldest[1],))
            self._ended(oldest)

    def raise_errors(self) -> None:
        """Raise the first unreported error (the others stay queued)."""
        self._sweep()
        with self._lock:
            if not self._errors:
                return
            step, error = self._errors.pop(0)
        if hasattr(error, "add_note"):
            error.add_note(self.note.format(step=step))
        raise error

    def wait_until_finished(self) -> None:
        """Block until all work has ended; raise the first unreported error."""
        while True:
            with self._lock:
                pending = list(self._in_flight)
            if not pending:
                break
            threads.wait(future for _, future, _ in pending)
            for entry in pending:
                self._ended(entry)
        self.raise_errors()

    def newest_in_flight(self) -> int | None:
        """The highest step whose work has not ended, or ``None``."""
        with self._lock:
            steps = [step for step, future, _ in self._in_flight if not future.done()]
        return max(steps, default=None)

    @property
    def in_flight(self) -> int:
        """Work not yet ended."""
        with self._lock:
            return sum(1 for _, future, _ in self._in_flight if not future.done())


class AsyncSaver(BackgroundWork):
    """Runs writes of staged states on the background loop, a bounded number at a time.

    Args:
        max_in_flight: saves that may be writing at once; the next one waits.
    """

    def __init__(self, max_in_flight: int = 1) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        super().__init__()
        self.max_in_flight = max_in_flight

    def submit(
        self,
        step: int,
        stage: Callable[[], StagedState],
        write: Callable[[StagedState], Coroutine[Any, Any, Any]],
        after: Callable[[], Coroutine[Any, Any, Any]] | None = None,
    ) -> SaveHandle:
        """Stage a state and write it in the background.

        Args:
            step: the step, for handles and error messages.
            stage: copies the state into host buffers; runs in the caller's thread. A lazy
                stage's copy may be left unstarted (``start=False``): it starts on the
                background loop, as the write's first step.
            write: the coroutine function that writes and commits the staged state; runs on
                the background loop. The staged buffers are released when it finishes, and
                the handle's result is what it returned.
            after: a coroutine function run once ``write`` has succeeded (retention, say):
                part of this save's background work (the next save waits for it, its error
                is raised like a write's) but not of its handle, which reports the commit.

        Raises:
            Exception: the error of an earlier background save not yet reported.
        """
        t0 = time.perf_counter()
        self.wait_for_fewer_than(self.max_in_flight)
        self.raise_errors()
        t1 = time.perf_counter()
        staged = stage()
        t2 = time.perf_counter()
        committed: concurrent.futures.Future[Any] = concurrent.futures.Future()
        future = background.submit(_write_then_release(staged, write, after, committed))
        # whatever ends the work without reaching the commit (cancelled before it ran, say)
        # ends the handle too
        future.add_done_callback(lambda f: _settle(committed, f))
        handle = SaveHandle(step, committed, SaveTiming(t1 - t0, t2 - t1, staged.nbytes))

        def ended(_: concurrent.futures.Future[Any]) -> None:
            handle.write_seconds = time.perf_counter() - handle._started

        committed.add_done_callback(ended)
        self.track(step, future)
        return handle


def _settle(handle: concurrent.futures.Future[Any], work: concurrent.futures.Future[Any]) -> None:
    """End ``handle`` as ``work`` ended, unless it has ended already."""
    if handle.done():
        return
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if work.cancelled():
            handle.cancel()
        elif work.exception() is not None:
            handle.set_exception(work.exception())
        else:
            handle.set_result(work.result())


async def _write_then_release(
    staged: StagedState,
    write: Callable[[StagedState], Coroutine[Any, Any, Any]],
    after: Callable[[], Coroutine[Any, Any, Any]] | None,
    committed: concurrent.futures.Future[Any],
) -> Any:
    import asyncio

    try:
        staged.start()  # a lazy stage's copy: begun here, not beside the save() call
        if staged.fences:
            await asyncio.to_thread(staged.wait_ready)
        result = await write(staged)
    finally:
        staged.release()
    # Committed: the handle says so now. Deleting an old step (retention) took 0.1-0.4 s of
    # the tiers suite's 0.2 s saves (it shares the disk with the copy of the step just
    # committed), which a caller waiting for the commit need not wait for.
    with contextlib.suppress(concurrent.futures.InvalidStateError):  # cancelled meanwhile
        committed.set_result(result)
    if after is not None:
        await after()
    return result
