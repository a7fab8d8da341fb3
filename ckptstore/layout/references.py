"""References to earlier steps' objects, and the rule that keeps them alive.

An incremental save (:mod:`ckptstore.layout.incremental`) writes only what changed and makes
its manifest reference the objects of earlier committed attempts for the rest
(docs/format.md, "Incremental saves"). This module holds the three things that make that
safe:

* **The committed record of an attempt.** A reference may only point at a committed
  attempt: one that ``<step>/manifest.json`` names, or, once that step was deleted while
  later steps still reference its objects, one that holds ``<step>/<attempt>/committed.json``
  (the step's manifest, copied there by :func:`delete_step` before the manifest goes).
  :func:`check_references` refuses any reference whose object its attempt's record does not
  list with the same length and crc32c.
* **The deleter's side** (:func:`reclaim`): an attempt's objects are deleted only when no
  committed manifest references them and no unexpired lease names them, decided with a
  marker so that a save beginning to reference them meanwhile either sees the marker or is
  seen by the deleter. The argument is in docs/format.md ("The gc rule").
* **The saver's side** (:func:`hold_references`): name the attempts in the lease, then
  look for markers, then for the records, in that order.
"""

from __future__ import annotations

import contextlib
import hashlib
import secrets
import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from ckptstore.errors import BrokenReferenceError, CorruptCheckpointError, NotFoundError
from ckptstore.layout.commit import committed_steps, gather_all, is_own_key, read_manifest
from ckptstore.layout.keys import (
    ATTEMPT_RE,
    attempt_prefix,
    check_step,
    manifest_key,
    parse_step,
    step_prefix,
)
from ckptstore.layout.lease import LEASE_NAME, SaveLease, read_lease
from ckptstore.layout.manifest import Manifest
from ckptstore.store.base import Store

_Found = TypeVar("_Found")

__all__ = [
    "MARKER_PREFIX",
    "RECORD_NAME",
    "RECORD_TABLES",
    "ObjectTable",
    "RecordTables",
    "ReclaimReport",
    "attempt_objects",
    "attempt_record",
    "check_references",
    "delete_step",
    "delete_steps",
    "hold_references",
    "reclaim",
]

#: The copy of a deleted step's manifest inside its attempt, kept while others reference it.
RECORD_NAME = "committed.json"
#: A deleter's marker inside an attempt it is about to reclaim: ``reclaim-<random>.json``.
MARKER_PREFIX = "reclaim-"


def _split(prefix: str) -> tuple[int, str]:
    """``(step, attempt)`` of an attempt prefix ``<step>/<attempt>/``."""
    step, attempt = prefix.rstrip("/").split("/")
    parsed = parse_step(step)
    assert parsed is not None  # from a validated manifest
    assert ATTEMPT_RE.fullmatch(attempt)
    return parsed, attempt


async def attempt_record(store: Store, step: int, attempt: str) -> Manifest | None:
    """The manifest that commits ``<step>/<attempt>/``: the step's manifest when it names
    that attempt, else the attempt's ``committed.json``; ``None`` when neither exists. It is
    shared (:meth:`Manifest.parse_shared`): nothing may change it.

    Raises:
        CorruptCheckpointError: the record found fails validation.
    """

    def parse(data: bytes, cap: int, source: str) -> tuple[str, Manifest]:
        manifest = Manifest.parse_shared(data, step=step, max_bytes=cap, source=source)
        return manifest.attempt, manifest

    return await _find_record(store, step, attempt, parse)


#: An attempt's own objects as its committed record lists them: key -> (length, crc32c).
ObjectTable = dict[str, tuple[int, int]]


async def attempt_objects(store: Store, step: int, attempt: str) -> ObjectTable | None:
    """The objects of ``<step>/<attempt>/`` as the record that commits it lists them
    (:func:`attempt_record`), by key: ``(length, crc32c)``; ``None`` when no record exists.
    The record is read each time; its parse is spared when :data:`RECORD_TABLES` saw the
    same bytes. The table is shared with later callers: nothing may change it.

    Raises:
        CorruptCheckpointError: the record found fails validation.
    """

    def parse(data: bytes, cap: int, source: str) -> tuple[str, ObjectTable]:
        return RECORD_TABLES.table(data, step, cap, source)

    return await _find_record(store, step, attempt, parse)


async def _find_record(
    store: Store,
    step: int,
    attempt: str,
    parse: Callable[[bytes, int, str], tuple[str, _Found]],
) -> _Found | None:
    """What ``parse`` (of a record's bytes, the size cap and their URL, giving the attempt
    the record commits and the rest) makes of the record of ``<step>/<attempt>/``: the
    step's manifest if it names that attempt, else the attempt's ``committed.json``."""
    cap = store.settings.layout.manifest_max_bytes
    for key in (manifest_key(step), attempt_prefix(step, attempt) + RECORD_NAME):
        try:
            if (await store.head(key)).size > cap:
                raise CorruptCheckpointError(
                    f"{store.url}/{key}: over the {cap}-byte cap (Settings.manifest_max_bytes); "
                    "not reading it"
                )
            data = await store.get(key)
        except NotFoundError:
            continue
        named, found = parse(data, cap, f"{store.url}/{key}")
        if named == attempt:
            return found
        if key.endswith(RECORD_NAME):
            raise CorruptCheckpointError(
                f"{store.url}/{key}: the record names attempt {named}, not {attempt}"
            )
    return None


class RecordTables:
    """The object tables of the committed records :func:`attempt_objects` parsed lately, by
    step and the SHA-256 of the record's exact bytes: at most ``entries`` tables and
    ``objects`` objects in all, the least recently used dropped first. Thread-safe: the
    event loops of several managers may share it.

    Every incremental save checks the record of each attempt it references before it writes
    (:func:`hold_references`), as every restore of such a step does. Parsed each time, a
    20,000-leaf record was ~30 ms of the loop's thread per referenced attempt, and a root
    whose saves change a few leaves each references more attempts with every step (ten
    parses a save after ten steps). :data:`~ckptstore.layout.manifest.SHARED_MANIFESTS`
    holds whole manifests (about five times their bytes): four of that size. A table holds
    only the record's own objects (a few dozen where leaves are packed; one per large
    leaf); the digest costs ~0.7 ms a MB. The bytes are always read: only the parse and
    validation of bytes seen before are spared."""

    def __init__(self, entries: int = 1024, objects: int = 1 << 16) -> None:
        self.entries, self.objects = entries, objects
        self._held: OrderedDict[tuple[int, bytes], tuple[str, ObjectTable]] = OrderedDict()
        self._count = 0  # objects in the tables held
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._held)

    def table(self, data: bytes, step: int, max_bytes: int, source: str) -> tuple[str, ObjectTable]:
        """The attempt the record ``data`` (read for ``step``) commits and its objects.

        Raises:
            CorruptCheckpointError: as :meth:`Manifest.parse` (a failed parse is never held).
        """
        key = (step, hashlib.sha256(data).digest())
        with self._lock:
            held = self._held.get(key)
            if held is not None:
                self._held.move_to_end(key)
                return held
        # shared: the newest record is the base an incremental save has just read
        record = Manifest.parse_shared(data, step=step, max_bytes=max_bytes, source=source)
        own = {
            record.object_keys[i]: (record.object_lengths[i], record.object_crcs[i])
            for i in range(len(record.object_keys))
            if record.object_step(i) == step
        }
        found = (record.attempt, own)
        with self._lock:
            if key not in self._held:
                self._held[key] = found
                self._count += len(own)
            while len(self._held) > self.entries or self._count > self.objects:
                _, (_, dropped) = self._held.popitem(last=False)
                self._count -= len(dropped)
        return found


#: The process's :class:`RecordTables`.
RECORD_TABLES = RecordTables()


async def _has_marker(store: Store, prefix: str) -> bool:
    return any(
        key[len(prefix) :].startswith(MARKER_PREFIX) for key in await store.list_keys(prefix)
    )


async def check_references(store: Store, manifest: Manifest, *, markers: bool = False) -> None:
    """Raise unless every object ``manifest`` references is a committed object of its
    attempt, with the length and crc32c that attempt's own record gives it.

    One record read per referenced attempt (all in flight at once). With ``markers``, an
    attempt a deleter has marked for reclaiming is refused too, and the marker is looked for
    before the record (the order :func:`hold_references` relies on).

    Raises:
        BrokenReferenceError: naming the first bad object and why.
    """
    by_attempt: dict[str, list[int]] = defaultdict(list)
    for index in manifest.references():
        by_attempt[manifest.object_key(index).rsplit("/", 1)[0] + "/"].append(index)

    async def check(prefix: str, objects: list[int]) -> None:
        step, attempt = _split(prefix)
        first = manifest.object_key(objects[0])

        def broken(why: str) -> BrokenReferenceError:
            return BrokenReferenceError(
                f"{store.url}: step {manifest.step} references {first!r}, but {why}"
            )

        if markers and await _has_marker(store, prefix):
            raise broken(f"{prefix} is being reclaimed")
        try:
            own = await attempt_objects(store, step, attempt)
        except CorruptCheckpointError as exc:
            raise broken(f"the record of {prefix} is invalid ({exc})") from None
        if own is None:
            raise broken(
                f"{prefix} is not a committed attempt (step {step} does not name it and it "
                f"holds no {RECORD_NAME})"
            )
        for index in objects:
            entry = own.get(manifest.object_keys[index])
            wanted = (manifest.object_lengths[index], manifest.object_crcs[index])
            if entry != wanted:
                key = manifest.object_key(index)
                why = "it is not an object of" if entry is None else "it differs from the one in"
                raise BrokenReferenceError(
                    f"{store.url}: step {manifest.step} references {key!r}, but {why} the "
                    f"committed record of {prefix} (recorded {entry}, referenced {wanted})"
                )

    await gather_all(check(prefix, objects) for prefix, objects in by_attempt.items())


async def hold_references(store: Store, lease: SaveLease, manifest: Manifest) -> None:
    """The saver's side of the gc rule, before any data of an incremental save is written:
    name the attempts ``manifest`` references in the save's lease, then check them
    (:func:`check_references` with markers).

    Raises:
        BrokenReferenceError: an attempt is being reclaimed or no longer committed; the
            caller saves those leaves again instead.
        StoreError: the lease could not be written.
    """
    await lease.hold(sorted(manifest.referenced_attempts()))
    await check_references(store, manifest, markers=True)


# --------------------------------------------------------------------------- deleting


@dataclass(slots=True)
class ReclaimReport:
    """What :func:`reclaim` did.

    Attributes:
        removed: attempt prefixes whose objects were deleted.
        removed_objects: objects deleted under them.
        kept_referenced: attempt prefixes kept because a committed manifest or a running
            save references them.
        invalid_steps: steps whose manifest fails validation; while there are any, nothing
            is reclaimed (what they reference cannot be known).
    """

    removed: list[str] = field(default_factory=list)
    removed_objects: int = 0
    kept_referenced: list[str] = field(default_factory=list)
    invalid_steps: list[int] = field(default_factory=list)


async def _referenced(store: Store, report: ReclaimReport) -> set[str] | None:
    """Attempt prefixes every committed manifest names or references; ``None`` (and the
    steps in ``report.invalid_steps``) when a manifest fails validation."""
    steps = await committed_steps(store)

    async def one(step: int) -> Manifest | None:
        try:
            return await read_manifest(store, step, shared=True)
        except NotFoundError:
            return None  # deleted meanwhile
        except CorruptCheckpointError:
            report.invalid_steps.append(step)
            return None

    manifests = await gather_all(one(step) for step in steps)
    if report.invalid_steps:
        return None
    used: set[str] = set()
    for manifest in manifests:
        if manifest is not None:
            used.add(attempt_prefix(manifest.step, manifest.attempt))
            used |= manifest.referenced_attempts()
    return used


async def _leased(store: Store, now: float) -> set[str] | None:
    """Attempt prefixes unexpired leases name; ``None`` when one cannot be read as a lease
    (then it may name anything)."""
    named: set[str] = set()
    # one listing of attempt prefixes per step and one read per attempt, rather than a
    # listing of every object of the root
    steps = [p for p in await store.list_prefixes("") if parse_step(p) is not None]
    lease_keys = [
        attempt + LEASE_NAME
        for attempts in await gather_all(store.list_prefixes(step) for step in steps)
        for attempt in attempts
        if ATTEMPT_RE.fullmatch(attempt.rstrip("/").rsplit("/", 1)[-1])
    ]
    for body in await gather_all(read_lease(store, key) for key in lease_keys):
        if body is None or body.expires <= now:
            continue
        if body.refs is None:
            return None
        named.update(body.refs)
    return named


async def reclaim(
    store: Store, candidates: list[str], *, used: Collection[str] | None = None
) -> ReclaimReport:
    """Delete the objects of the attempt prefixes in ``candidates`` that nothing uses: no
    committed manifest names or references them and no unexpired lease names them. See
    docs/format.md ("The gc rule") for why a save that commits meanwhile never loses a byte.

    Order: read every manifest; mark each unreferenced candidate; read every lease; read
    every manifest again; delete a candidate neither names (its ``committed.json`` first,
    then its objects, then the markers); unmark the others.

    Args:
        store: the checkpoint root.
        candidates: attempt prefixes (``<step>/<attempt>/``) to delete if nothing uses them.
        used: attempt prefixes the caller already knows committed manifests name or
            reference (a CheckpointManager remembers its steps'); given, it replaces the
            first read of every manifest. It only spares used attempts a marker: the read
            after marking alone decides what is deleted, so a stale ``used`` never costs a
            referenced byte (at worst an attempt it wrongly names waits for the next
            reclaim, such as the next gc).
    """
    report = ReclaimReport()
    if used is None:
        used = await _referenced(store, report)
        if used is None:
            return report
    doomed = [c for c in dict.fromkeys(candidates) if c not in used]
    report.kept_referenced += [c for c in candidates if c in used]
    if not doomed:
        return report
    marker = f"{MARKER_PREFIX}{secrets.token_hex(8)}.json"
    await gather_all(store.put(prefix + marker, b"{}") for prefix in doomed)
    try:
        leased = await _leased(store, time.time())
        confirmed = await _referenced(store, report)
        if leased is None or confirmed is None:
            report.kept_referenced += doomed
            return report
        for prefix in doomed:
            if prefix in leased or prefix in confirmed:
                report.kept_referenced.append(prefix)
                continue
            keys = await store.list_keys(prefix)
            record = prefix + RECORD_NAME
            if record in keys:
                await store.delete([record])  # no longer committed: never referenced again
            markers = [k for k in keys if k[len(prefix) :].startswith(MARKER_PREFIX)]
            data = [k for k in keys if k != record and k not in markers and k != prefix + marker]
            await store.delete(data)
            await store.delete([*markers, prefix + marker])
            if data or record in keys:  # else another deleter got there first
                report.removed.append(prefix)
                report.removed_objects += len(data)
    finally:
        with contextlib.suppress(Exception):
            await store.delete(
                [p + marker for p in doomed if p not in report.removed]  # kept ones
            )
    return report


async def delete_step(store: Store, step: int) -> ReclaimReport:
    """Delete a step: it is invisible from the moment its manifest goes, and every object of
    it that no other committed manifest references (nor a running save) is deleted.

    The step's manifest is first copied to ``<step>/<attempt>/committed.json``, so the
    objects later steps reference stay objects of a committed attempt; then the manifest is
    deleted; then :func:`reclaim` runs on every attempt of the step and every attempt it
    referenced. Keys under the step
    that ckptstore did not write are left alone.

    Do not delete a step while a save of that same step is running: its objects would be
    deleted under it and the save would fail, or commit a manifest naming deleted objects
    (which a load then reports as missing, never as wrong data). Callers that can race, like
    the Lightning plugin, serialise the two.

    Raises:
        NotFoundError: there is nothing of ``step`` to delete.
    """
    return await delete_steps(store, [step])


async def delete_steps(
    store: Store,
    steps: Sequence[int],
    *,
    used: Collection[str] | None = None,
    manifests: Mapping[int, Manifest] | None = None,
) -> ReclaimReport:
    """:func:`delete_step` for several steps with one :func:`reclaim`, so the manifests of
    the steps kept are read once for all of them, not once per step deleted (retention).

    Args:
        store: the checkpoint root.
        steps: the steps to delete.
        used: what the caller knows the kept steps use (see :func:`reclaim`).
        manifests: manifests of ``steps`` the caller has just read (to decide what to
            delete); each becomes its attempt's committed record without being read again.

    Raises:
        NotFoundError: there is nothing of one of ``steps`` to delete (the steps before it
            are deleted, their attempts not yet reclaimed; the next reclaim, such as the
            next gc, finishes them).
    """
    attempts: list[str] = []
    for step in steps:
        attempts += await _retire(store, step, (manifests or {}).get(step))
    return await reclaim(store, attempts, used=used)


async def _retire(store: Store, step: int, known: Manifest | None = None) -> list[str]:
    """The first half of deleting ``step``: keep its manifest as its attempt's committed
    record and delete the manifest. Returns the attempt prefixes to reclaim: the step's own
    and those its manifest referenced.

    Raises:
        NotFoundError: there is nothing of ``step`` to delete.
    """
    check_step(step)
    keys = [k for k in await store.list_keys(step_prefix(step)) if is_own_key(k)]
    if not keys:
        raise NotFoundError(f"{store.url}: no step {step} to delete")
    mkey = manifest_key(step)
    attempts = sorted({k.rsplit("/", 1)[0] + "/" for k in keys if k.count("/") >= 2})
    if mkey in keys:
        manifest: Manifest | None = known
        data = b"" if known is None else known.encode()
        if known is None:
            with contextlib.suppress(NotFoundError, CorruptCheckpointError):
                # nothing can reference an attempt of a manifest that is not valid
                data = await store.get(mkey)
                manifest = Manifest.parse_shared(
                    data, step=step, max_bytes=store.settings.layout.manifest_max_bytes, source=mkey
                )
        if manifest is not None:
            await store.put(attempt_prefix(step, manifest.attempt) + RECORD_NAME, data)
            # what only this step still referenced may be unreferenced from now on
            attempts += sorted(manifest.referenced_attempts())
        await store.delete([mkey])
    return attempts
