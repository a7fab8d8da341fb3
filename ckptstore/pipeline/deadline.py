"""Whole-operation deadlines: a save or a restore that has not ended in time fails.

Object-store requests are bounded one by one (``Settings.request_deadline``, in
:mod:`ckptstore.store.transport`); what they cannot bound is a write the kernel never
finishes (a hung NFS server, a dead disk) or a save that makes slow progress through
thousands of requests. :func:`bounded` runs one save or restore as a task and, past its
deadline, cancels it and raises :class:`~ckptstore.errors.DeadlineExceededError` naming the
operation and the setting.

A cancelled save cleans up after itself (its attempt is abandoned once the writes in flight
have ended), and that cleanup may itself wait on what stalled: the caller gets the error after
at most :data:`CLEANUP_GRACE` more seconds either way, and the cleanup goes on in the
background (what it cannot remove, ``gc`` removes once the attempt's lease has expired).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

from ckptstore import errors

__all__ = ["CLEANUP_GRACE", "bounded"]

_T = TypeVar("_T")

#: Seconds a caller waits, past a deadline, for the cancelled operation's own cleanup.
CLEANUP_GRACE = 10.0


async def bounded(work: Awaitable[_T], *, seconds: float, what: str, setting: str) -> _T:
    """Await ``work``, failing it after ``seconds``.

    Args:
        work: the whole operation (a coroutine or a future).
        seconds: its deadline.
        what: the operation as the error names it, e.g. ``"save of step 3 to s3://b/run"``
            (a URL in it is redacted by the error).
        setting: the ``Settings`` field that sets ``seconds``, for the error's advice.

    Raises:
        DeadlineExceededError: ``work`` had not ended after ``seconds``; it is cancelled.
        BaseException: whatever ``work`` raised. A caller cancelled while waiting cancels
            ``work`` and waits for its cleanup.
    """
    task = asyncio.ensure_future(work)
    try:
        done, _ = await asyncio.wait({task}, timeout=seconds)
    except asyncio.CancelledError:
        task.cancel()
        await asyncio.wait({task})  # its own cleanup; a second cancel stops waiting for it
        raise
    if not done:
        task.cancel()
        await asyncio.wait({task}, timeout=CLEANUP_GRACE)
        cause = None
        if not task.done():
            task.add_done_callback(_quietly)
        elif not task.cancelled():
            cause = task.exception()
            if cause is None:
                return task.result()  # it ended in the same moment, and well
        raise errors.DeadlineExceededError(
            f"{what}: not finished within the deadline of {seconds:g} s (Settings.{setting}); "
            "it was cancelled. The storage stalled or is too slow for the state's size: "
            f"check it, or raise {setting} (CKPTSTORE_{setting.upper()})"
        ) from cause
    return task.result()


def _quietly(task: asyncio.Future[Any]) -> None:
    """Retrieve a late task's outcome: it was reported as a deadline already."""
    if not task.cancelled():
        task.exception()
