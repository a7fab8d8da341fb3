"""The lease a running save keeps on its attempt, so garbage collection never takes its data.

Garbage collection (:mod:`ckptstore.layout.gc`) removes an uncommitted attempt once it has
been idle longer than a grace period. The grace is the collector's own, though: ``ckptstore
gc --grace 60`` run by an operator in another process knows nothing of a save that has been
writing a large object for ten minutes (a multipart upload is invisible to a listing until it
completes, so the attempt looks idle), and could delete the parts it already wrote; the save
would then commit a manifest naming deleted objects. The saver's old safeguard (refuse to
commit once older than half of *its own* grace setting) does not help when the collector
uses a shorter one.

So a save holds a lease, and the collector honours it whatever grace it was given:

* Before writing any data, the saver puts ``<step>/<attempt>/lease.json``, holding the wall
  clock time the lease expires (now + ``Settings.save_lease_seconds``), and renews it every
  quarter of that period for as long as it writes and commits. When it is done (committed or
  failed) it deletes the lease.
* The collector counts a lease's expiry as activity of its attempt: an attempt whose lease
  has not expired is never removed, and one whose lease expired is removed only once the grace
  period has passed since. Before it deletes anything it reads the step's manifest again, so
  an attempt that committed (and then dropped its lease) while the collector was looking is
  kept.
* The saver commits only if its lease never lapsed: every renewal landed before the previous
  one expired (measured on the saver's monotonic clock from when each put was issued) and at
  least a quarter of the period is still left. A save whose renewals failed or stalled (a
  suspended process, a store that stopped answering) for a whole period refuses to commit,
  because a collector may have acted in the gap.

Wall clocks of savers and collectors must agree to within a quarter of the lease period (30 s
by default): the collector compares the expiry the saver wrote with its own clock. A crashed
saver's attempt stays protected until its last lease expires, then the grace period applies
as before.

A save that references objects of earlier attempts (an incremental save) also lists those
attempts' prefixes in its lease (``refs``, :meth:`SaveLease.hold`): deleting a step honours
them the way the collector honours the expiry (:mod:`ckptstore.layout.references`).

The lease is the first object of an attempt and an ordinary key under its prefix, so
``delete_step``, a failed save's own clean-up and the collector remove it with the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ckptstore.errors import CkptStoreError
from ckptstore.layout.keys import attempt_prefix
from ckptstore.store.base import Store

__all__ = ["LEASE_NAME", "LeaseBody", "SaveLease", "held_lease", "lease_expiry", "read_lease"]

#: The lease's name inside an attempt prefix.
LEASE_NAME = "lease.json"
#: The largest lease body a collector reads (it holds a few numbers and a host name).
_MAX_LEASE_BYTES = 4096


class SaveLease:
    """A save's lease on its attempt prefix; see the module docstring.

    Take one with :func:`held_lease` (or :meth:`take` and :meth:`release`), call
    :meth:`check` right before the manifest is written.
    """

    def __init__(self, store: Store, step: int, attempt: str) -> None:
        self.store = store
        self.key = attempt_prefix(step, attempt) + LEASE_NAME
        self.period = float(store.settings.gc.save_lease_seconds)
        #: Monotonic time until which the last lease that landed is valid.
        self._valid_until = math.inf
        self._lapse: str | None = None
        self._task: asyncio.Task[None] | None = None
        #: Attempt prefixes (``<step>/<attempt>/``) whose objects this save references.
        self.refs: list[str] = []

    @classmethod
    async def take(cls, store: Store, step: int, attempt: str) -> SaveLease:
        """Write the lease and start renewing it.

        Raises:
            StoreError: the first lease could not be written (so no data is written either).
        """
        lease = cls(store, step, attempt)
        try:
            await lease._renew()
        except BaseException:
            # Interrupted: a local write may still land the lease after this; remove it
            # once the write has ended, so an interrupted save or copy leaves nothing.
            # Cancelled again meanwhile, this stops waiting and the removal goes on alone,
            # so it must not raise: no one would retrieve its error.
            await asyncio.shield(lease._remove())
            raise
        lease._task = asyncio.create_task(lease._keep(), name=f"ckptstore lease {lease.key}")
        return lease

    async def _remove(self) -> None:
        """Delete the lease once the writes in flight have ended. Never raises: a lease that
        stays behind expires, and garbage collection then treats its attempt as any other."""
        with contextlib.suppress(Exception):
            await self.store.settle()
            await self.store.delete([self.key])

    async def _renew(self) -> None:
        issued = time.monotonic()
        body = {
            "expires": time.time() + self.period,
            "period": self.period,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "refs": self.refs,
        }
        await self.store.put(self.key, json.dumps(body).encode())
        landed = time.monotonic()
        if landed > self._valid_until and self._lapse is None:
            self._lapse = f"its lease went {landed - self._valid_until:.0f} s without renewal"
        self._valid_until = issued + self.period

    async def _keep(self) -> None:
        while True:
            await asyncio.sleep(self.period / 4)
            # A failed renewal is tried again at the next tick; check() sees a lapse.
            with contextlib.suppress(Exception):
                await self._renew()

    async def hold(self, refs: list[str]) -> None:
        """Name the attempt prefixes this save is about to reference, and return once the
        lease saying so has landed (every renewal repeats them). Deleting a step leaves an
        attempt named by an unexpired lease alone.

        Raises:
            StoreError: the lease could not be written; the save must not reference them.
        """
        self.refs = sorted(set(self.refs) | set(refs))
        await self._renew()

    def check(self) -> None:
        """Raise unless the lease has been held without a gap and has a quarter of its period
        left, so no collector can have removed the attempt's data or can before the commit.

        Raises:
            CkptStoreError: the lease lapsed; the caller must not commit.
        """
        left = self._valid_until - time.monotonic()
        lapse = self._lapse
        if lapse is None and left < self.period / 4:
            lapse = f"its lease has {max(left, 0.0):.0f} s left, under a quarter of its period"
        if lapse is not None:
            raise CkptStoreError(
                f"{self.store.url}/{self.key}: not committing: {lapse} "
                f"(Settings.save_lease_seconds = {self.period:.0f}), so a concurrent gc may "
                "have removed this attempt's data. Save again; if the store is slow to answer, "
                "raise Settings.save_lease_seconds."
            )

    def stop(self) -> None:
        """Stop renewing (the lease then expires); for an attempt abandoned without
        :meth:`release`. Safe from any thread."""
        task = self._task
        if task is not None and not task.done():
            with contextlib.suppress(RuntimeError):  # its loop is closed: nothing renews
                task.get_loop().call_soon_threadsafe(task.cancel)

    async def release(self) -> None:
        """Stop renewing and delete the lease (best effort: an expired lease is harmless)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        with contextlib.suppress(Exception):
            await self.store.delete([self.key])


@contextlib.asynccontextmanager
async def held_lease(store: Store, step: int, attempt: str) -> AsyncIterator[SaveLease]:
    """Hold a lease on ``<step>/<attempt>/`` for the duration of the block."""
    lease = await SaveLease.take(store, step, attempt)
    try:
        yield lease
    finally:
        await lease.release()


@dataclass(frozen=True, slots=True)
class LeaseBody:
    """What a collector or a deleter reads of a lease.

    Attributes:
        expires: when it expires (seconds since the epoch).
        refs: attempt prefixes its save references; ``None`` when the lease cannot be read
            as one (a deleter then treats it as naming every attempt).
    """

    expires: float
    refs: list[str] | None


async def read_lease(store: Store, key: str) -> LeaseBody | None:
    """The lease at ``key``, for a collector or a deleter; ``None`` when there is no lease
    there (any more).

    A lease that cannot be read as one protects its attempt for one default period from its
    write time as the store reports it, and names every attempt, so damage to it neither
    crashes a collection nor makes it delete early.
    """
    try:
        meta = await store.head(key)
        data = b"" if meta.size > _MAX_LEASE_BYTES else await store.get(key)
    except FileNotFoundError:
        return None
    try:
        body = json.loads(data)
        expires, refs = body["expires"], body.get("refs", [])
        if (
            type(expires) in (int, float)
            and math.isfinite(expires)
            and type(refs) is list
            and all(type(r) is str for r in refs)
        ):
            return LeaseBody(float(expires), refs)
    except (ValueError, TypeError, KeyError, AttributeError):
        pass
    written = meta.last_modified if meta.last_modified is not None else time.time()
    return LeaseBody(written + store.settings.gc.save_lease_seconds, None)


async def lease_expiry(store: Store, key: str) -> float | None:
    """When the lease at ``key`` expires (seconds since the epoch), for a collector; see
    :func:`read_lease`."""
    body = await read_lease(store, key)
    return None if body is None else body.expires
