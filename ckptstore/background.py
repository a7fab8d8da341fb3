"""One background event-loop thread that runs store coroutines for synchronous callers.

Synchronous entry points (``ckptstore.save``, the CheckpointManager, the DCP adapter) call
:func:`run` to block on a coroutine or :func:`submit` to get a ``concurrent.futures.Future``.
Every coroutine runs on the same loop, so a store (and its HTTP client) opened there is only
ever used from that loop.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import concurrent.futures.thread  # its exit hook must be registered before ours (below)
import os
import sys
import threading
import weakref
from collections.abc import Coroutine
from typing import Any, Protocol, TypeVar

from ckptstore import threads
from ckptstore.threads import Pool

__all__ = ["close_at_exit", "forget_at_exit", "loop", "on_loop", "run", "submit"]

_T = TypeVar("_T")
_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None


def loop() -> asyncio.AbstractEventLoop:
    """The background loop, started on first use (and again after a fork)."""
    global _loop, _thread
    with _lock:
        if _loop is None or _thread is None or not _thread.is_alive():
            new_loop = asyncio.new_event_loop()
            # asyncio.to_thread's pool, one that keeps working while the interpreter exits
            new_loop.set_default_executor(Pool(min(32, (os.cpu_count() or 1) + 4), "ckptstore"))
            thread = threading.Thread(
                target=new_loop.run_forever, name="ckptstore-loop", daemon=True
            )
            thread.start()
            _loop, _thread = new_loop, thread
        return _loop


#: How long an interrupted :func:`run` waits for its work to clean up before re-raising.
CLEANUP_SECONDS = 30.0


def on_loop() -> bool:
    """Whether the calling thread is the background loop's (where nothing may block)."""
    return _thread is threading.current_thread()


def submit(coro: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
    """Schedule ``coro`` on the background loop; returns its future."""
    return asyncio.run_coroutine_threadsafe(coro, loop())


def run(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run ``coro`` on the background loop and wait for its result.

    Raises:
        RuntimeError: if called from the background loop itself (it would deadlock).
    """
    if _thread is threading.current_thread():
        coro.close()
        raise RuntimeError("ckptstore.background.run called from the background loop")
    ended = threading.Event()

    async def tracked() -> _T:
        try:
            return await coro
        finally:
            ended.set()

    future = submit(tracked())
    try:
        threads.wait((future,))  # not future.result(): Ctrl-C must interrupt it
        return future.result()
    except BaseException:
        # Ctrl-C (or a SystemExit from a signal handler) in the caller: the work would run
        # on, or be stopped half-way by the loop's shutdown at exit. Cancel it instead and
        # give its cleanup (an interrupted save removing its attempt) time to finish.
        if not future.done():
            future.cancel()
            ended.wait(CLEANUP_SECONDS)
        raise


def _stop() -> None:
    if _loop is not None and _thread is not None and _thread.is_alive():
        _loop.call_soon_threadsafe(_loop.stop)
        _thread.join(timeout=5)


atexit.register(_stop)


class _Closable(Protocol):
    def close(self) -> None: ...


#: Objects closed when the main thread ends (a manager, a mirror), by the process that made
#: them, with what a failure of the close means to the user.
_at_exit: weakref.WeakKeyDictionary[_Closable, tuple[int, str]] = weakref.WeakKeyDictionary()


def close_at_exit(obj: _Closable, lost: str) -> None:
    """Close ``obj`` when the main thread ends, unless it is closed before (see
    :func:`forget_at_exit`): a script that never closes a manager or a mirror still gets
    every save or upload it queued. A close that fails then is printed on stderr as
    ``ckptstore: closing <obj> at exit: <lost>: <error>``.

    It runs in ``threading``'s own exit hooks, which run before ``atexit``'s and in reverse
    order of registration, so before the thread pools the work uses refuse new work (this
    module imports their module first). A forked child never closes its parent's objects.
    """
    _at_exit[obj] = (os.getpid(), lost)


def forget_at_exit(obj: _Closable) -> None:
    """``obj`` was closed: nothing to do for it at exit."""
    _at_exit.pop(obj, None)


def _close_all_at_exit() -> None:
    # newest first, as atexit does: an owner made after what it owns (an Orbax mirror and
    # its uploader) closes first, and closes that too
    for obj, (pid, lost) in reversed(list(_at_exit.items())):
        if pid != os.getpid():
            continue
        try:
            obj.close()
        except Exception as exc:  # nothing can catch it now: say what was lost, and go on
            print(f"ckptstore: closing {obj!r} at exit: {lost}: {exc}", file=sys.stderr, flush=True)


threading._register_atexit(_close_all_at_exit)  # type: ignore[attr-defined]
