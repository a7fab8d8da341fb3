"""Running many requests of one operation at once, and failing as one.

``asyncio.gather`` raises the first failure but leaves the other requests running, which a
store cannot afford: a multipart upload would be completed or aborted under requests still
sending its parts, and a failed save could not know which of its objects exist. Every layer
that fans requests out (parallel parts and ranged reads in ``store/``, the objects of a
save, the reads of a restore, ``copy`` and ``verify``) uses :func:`gather_all` instead.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Iterable
from typing import Any

__all__ = ["gather_all"]


async def gather_all(aws: Iterable[Awaitable[Any]], *, cancel: bool = True) -> list[Any]:
    """Run awaitables concurrently; return their results in order or raise the first failure.

    With ``cancel=True`` the others are cancelled on the first failure, and waited for until
    they have stopped; with ``cancel=False`` they run to completion first. Writes use the
    latter: a local write runs in a thread that cancellation cannot stop, so only after every
    write has finished can a failed attempt's objects all be found and removed.
    """
    tasks = [asyncio.ensure_future(a) for a in aws]
    if not tasks:
        return []
    if not cancel:
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return list(results)
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*tasks, return_exceptions=True)
        raise
