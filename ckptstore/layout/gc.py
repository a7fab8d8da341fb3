"""Garbage collection of save attempts that never committed (DESIGN.md invariant 7).

A save that crashed, failed or lost the commit race leaves objects under its
``<step>/<attempt-id>/`` prefix that no manifest names. They are invisible (a step is visible
only through its manifest) but hold storage. :func:`collect_garbage` removes such an attempt
prefix when all of these hold:

* its step has no manifest, or the step's manifest names a different attempt;
* the attempt is older than the grace period, by its id's start time *and* by the newest of
  its objects, so a slow save still writing is left alone (and a save refuses to commit once
  its attempt is older than half the grace period; see :mod:`ckptstore.layout.commit`).

It never touches the attempt a valid manifest names (so never the newest committed step),
never a step whose manifest fails validation (it cannot know what that manifest names; the
step is reported instead), and never a key whose shape ckptstore does not write. Finally it
asks the store to drop abandoned in-progress writes older than the grace period
(:meth:`~ckptstore.store.base.Store.remove_stale_writes`: temp files of dead writers on
local and NFS stores; the S3 backend can abort stale multipart uploads there).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ckptstore.errors import CorruptCheckpointError, NotFoundError
from ckptstore.layout.commit import read_manifest
from ckptstore.layout.keys import ATTEMPT_RE, attempt_time, parse_step, step_prefix
from ckptstore.store.base import Store

__all__ = ["GCReport", "collect_garbage"]


@dataclass(slots=True)
class GCReport:
    """What one garbage collection did.

    Attributes:
        removed: attempt prefixes removed (``<step>/<attempt-id>/``).
        removed_objects: objects deleted under them.
        kept_recent: uncommitted attempt prefixes left because they are within the grace
            period (possibly saves in progress).
        invalid_steps: steps whose manifest fails validation, left untouched.
        stale_writes: abandoned in-progress writes the store removed.
    """

    removed: list[str] = field(default_factory=list)
    removed_objects: int = 0
    kept_recent: list[str] = field(default_factory=list)
    invalid_steps: list[int] = field(default_factory=list)
    stale_writes: int = 0


async def collect_garbage(
    store: Store, *, grace: float | None = None, now: float | None = None
) -> GCReport:
    """Remove uncommitted attempts idle for more than ``grace`` seconds.

    Args:
        store: the checkpoint root.
        grace: seconds; default ``Settings.gc_grace_seconds``.
        now: the current time (seconds since the epoch), for tests.
    """
    grace = float(store.settings.gc_grace_seconds if grace is None else grace)
    if grace < 0:
        raise ValueError(f"grace must be >= 0 seconds, got {grace}")
    now = time.time() if now is None else now
    cutoff = now - grace
    report = GCReport()
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
        try:
            keep: str | None = (await read_manifest(store, step)).attempt
        except NotFoundError:
            keep = None
        except CorruptCheckpointError:
            report.invalid_steps.append(step)
            continue
        for attempt_dir in attempts:
            attempt = attempt_dir[len(prefix) :].rstrip("/")
            if attempt == keep:
                continue
            started = attempt_time(attempt)
            assert started is not None  # matched ATTEMPT_RE
            objects = [meta async for meta in store.list(attempt_dir)]
            newest = max(
                [started, *(m.last_modified for m in objects if m.last_modified is not None)]
            )
            if newest > cutoff:
                report.kept_recent.append(attempt_dir)
                continue
            await store.delete(meta.key for meta in objects)
            report.removed.append(attempt_dir)
            report.removed_objects += len(objects)
    report.stale_writes = await store.remove_stale_writes("", older_than=cutoff)
    return report
