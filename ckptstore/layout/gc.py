"""Garbage collection of save attempts that never committed (DESIGN.md invariant 7).

A save that crashed, failed or lost the commit race leaves objects under its
``<step>/<attempt-id>/`` prefix that no manifest names. They are invisible (a step is visible
only through its manifest) but hold storage. :func:`collect_garbage` removes such an attempt
prefix when all of these hold:

* its step has no manifest, or the step's manifest names a different attempt (read again
  right before deleting, so an attempt that committed meanwhile is kept);
* it has been idle for longer than the grace period: its id's start time, the newest of its
  objects and the expiry of its save's lease (:mod:`ckptstore.layout.lease`) are all older;
  or its owner is gone: it holds a lease that expired (by more than a quarter of a lease
  period, for clocks that disagree) and was never released, as a killed save's or copy's
  is. A running save renews its lease, so its attempt is never removed, whatever grace
  period the collector was given, and a save whose lease lapsed refuses to commit; so an
  attempt whose lease expired can never commit, and nothing is gained by waiting for the
  grace period (an interrupted ``ckptstore cp`` of 300 MiB used to stay for 6 hours).

An attempt that holds ``committed.json`` is a committed attempt whose step was deleted while
later steps referenced its objects (:mod:`ckptstore.layout.references`); no grace period
applies to it: it is removed exactly when nothing references it any more, by the same
:func:`~ckptstore.layout.references.reclaim` that deleting a step uses.

It never touches the attempt a valid manifest names (so never the newest committed step),
never a step whose manifest fails validation (it cannot know what that manifest names; the
step is reported instead), and never a key whose shape ckptstore does not write. Finally it
asks the store to drop abandoned in-progress writes older than the grace period
(:meth:`~ckptstore.store.base.Store.remove_stale_writes`: temp files of dead writers on
local and NFS stores; the S3 backend can abort stale multipart uploads there), except writes
begun after the oldest attempt it kept began, which may belong to that running save.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from ckptstore.errors import CorruptCheckpointError, NotFoundError
from ckptstore.layout.commit import read_manifest
from ckptstore.layout.keys import ATTEMPT_RE, attempt_time, parse_step, step_prefix
from ckptstore.layout.lease import LEASE_NAME, lease_expiry
from ckptstore.layout.references import RECORD_NAME, reclaim
from ckptstore.store.base import Store
from ckptstore.store.transport import store_logger

__all__ = ["GCReport", "collect_garbage"]

#: One INFO record per gc (docs/reference.md, "Logging"), redacted like every record.
_log = store_logger("ckptstore.gc")


@dataclass(slots=True)
class GCReport:
    """What one garbage collection did.

    Attributes:
        removed: attempt prefixes whose objects were deleted (``<step>/<attempt-id>/``); an
            attempt with nothing left to delete (a failed save removed its own objects, and
            at most temp files of a dead writer remain, counted in ``stale_writes``) is not
            listed.
        removed_objects: objects deleted under them.
        kept_recent: uncommitted attempt prefixes left because they are within the grace
            period or their save's lease has not expired (saves in progress).
        invalid_steps: steps whose manifest fails validation, left untouched.
        stale_writes: abandoned in-progress writes the store removed.
        reclaimed: attempts of deleted steps that nothing references any more, removed.
        kept_referenced: attempts of deleted steps kept because later steps (or a running
            save) reference them.
    """

    removed: list[str] = field(default_factory=list)
    removed_objects: int = 0
    kept_recent: list[str] = field(default_factory=list)
    invalid_steps: list[int] = field(default_factory=list)
    stale_writes: int = 0
    reclaimed: list[str] = field(default_factory=list)
    kept_referenced: list[str] = field(default_factory=list)


async def collect_garbage(
    store: Store, *, grace: float | None = None, now: float | None = None
) -> GCReport:
    """Remove uncommitted attempts idle for more than ``grace`` seconds.

    Args:
        store: the checkpoint root.
        grace: seconds; default ``Settings.gc_grace_seconds``.
        now: the current time (seconds since the epoch), for tests.
    """
    grace = float(store.settings.gc.gc_grace_seconds if grace is None else grace)
    if grace < 0:
        raise ValueError(f"grace must be >= 0 seconds, got {grace}")
    now = time.time() if now is None else now
    cutoff = now - grace
    report = GCReport()
    oldest_kept = math.inf  # start of the oldest attempt kept, as a save in progress
    retired: list[str] = []  # committed attempts of deleted steps
    steps = sorted(s for s in map(parse_step, await store.list_prefixes("")) if s is not None)
    for step in steps:
        prefix = step_prefix(step)
        attempts = [
            p
            for p in await store.list_prefixes(prefix)
            if ATTEMPT_RE.fullmatch(p[len(prefix) :].rstrip("/"))
        ]
        if not attempts:
            continue
        doomed: dict[str, list[str]] = {}
        keep = await _committed_attempt(store, step)
        if keep is not _INVALID:
            doomed, kept_start = await _idle_attempts(
                store, prefix, attempts, keep, cutoff, now, report, retired
            )
            oldest_kept = min(oldest_kept, kept_start)
            if doomed:
                # A save that committed while its attempt was looked at has dropped its lease
                # by now, and its manifest is in place: read it again so its data stays.
                keep = await _committed_attempt(store, step)
        if keep is _INVALID:
            report.invalid_steps.append(step)
            continue
        for attempt_dir, keys in doomed.items():
            if keep == attempt_dir[len(prefix) :].rstrip("/"):
                continue
            await store.delete(keys)
            report.removed.append(attempt_dir)
            report.removed_objects += len(keys)
    if retired:
        reclaimed = await reclaim(store, retired)
        report.reclaimed = reclaimed.removed
        report.removed_objects += reclaimed.removed_objects
        report.kept_referenced = reclaimed.kept_referenced
        report.invalid_steps = sorted({*report.invalid_steps, *reclaimed.invalid_steps})
    # In-progress writes of kept attempts (an S3 multipart upload of a running save, say)
    # began after their attempt did: leave everything that young alone, with a quarter of a
    # lease period for clocks that disagree (see ckptstore.layout.lease).
    margin = store.settings.gc.save_lease_seconds / 4
    older_than = min(cutoff, oldest_kept - margin)
    report.stale_writes = await store.remove_stale_writes("", older_than=older_than)
    _log.info(
        "gc of %s (grace %g s): removed %d abandoned attempts (%d objects) and %d stale "
        "writes, reclaimed %d attempts of deleted steps; kept %d recent, %d referenced; "
        "%d invalid steps left alone",
        store.url,
        grace,
        len(report.removed),
        report.removed_objects,
        report.stale_writes,
        len(report.reclaimed),
        len(report.kept_recent),
        len(report.kept_referenced),
        len(report.invalid_steps),
    )
    return report


async def _idle_attempts(
    store: Store,
    prefix: str,
    attempts: list[str],
    keep: str | None,
    cutoff: float,
    now: float,
    report: GCReport,
    retired: list[str],
) -> tuple[dict[str, list[str]], float]:
    """The attempts under the step ``prefix`` idle since before ``cutoff``, with the keys to
    delete of each, and the start of the oldest attempt kept as a possible save in progress
    (those are added to ``report.kept_recent``). Committed attempts of a deleted step go to
    ``retired`` instead."""
    doomed: dict[str, list[str]] = {}
    oldest_kept = math.inf
    for attempt_dir in attempts:
        attempt = attempt_dir[len(prefix) :].rstrip("/")
        if attempt == keep:
            continue
        started = attempt_time(attempt)
        assert started is not None  # matched ATTEMPT_RE
        objects = [meta async for meta in store.list(attempt_dir)]
        if not objects:
            continue  # nothing to delete: see GCReport.removed
        if any(meta.key == attempt_dir + RECORD_NAME for meta in objects):
            retired.append(attempt_dir)
            continue
        signs = [started, *(m.last_modified for m in objects if m.last_modified is not None)]
        lease_key = attempt_dir + LEASE_NAME
        owner_gone = False
        if any(meta.key == lease_key for meta in objects):
            expires = await lease_expiry(store, lease_key)
            signs += [] if expires is None else [expires]
            skew = store.settings.gc.save_lease_seconds / 4
            owner_gone = expires is not None and expires + skew < now
        if max(signs) > cutoff and not owner_gone:
            report.kept_recent.append(attempt_dir)
            oldest_kept = min(oldest_kept, started)
            continue
        doomed[attempt_dir] = [meta.key for meta in objects]
    return doomed, oldest_kept


#: :func:`_committed_attempt` of a step whose manifest fails validation.
_INVALID = "<invalid manifest>"


async def _committed_attempt(store: Store, step: int) -> str | None:
    """The attempt the step's manifest names; ``None`` if there is none, :data:`_INVALID` if
    it fails validation (then nothing of the step may be touched)."""
    try:
        return (await read_manifest(store, step)).attempt
    except NotFoundError:
        return None
    except CorruptCheckpointError:
        return _INVALID
