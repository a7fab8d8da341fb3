"""Operations an operator runs on whole checkpoints: summarise, verify, copy.

These sit above the layout layer, beside the CheckpointManager, and back the ``ckptstore``
command (``ls``, ``show``, ``verify``, ``cp``); they are plain async functions for scripts too.

**Verify** is a restore into a sink that keeps nothing
(:func:`ckptstore.layout.restore.read_into_sink`, beside the restore's own reads): every byte
of every data object a manifest names is read in part-sized chunks through a bounded pool of
buffers, and checked as a restore checks it (sizes, then the crc32c of every leaf, chunk block
and object). It reports every problem found instead of stopping at the first.

Both read an incremental step's referenced objects like its own: verify checks each
reference against its attempt's committed record, then its bytes; copy writes them under the
new attempt, so the step is self-contained at the destination.

**Copy** streams a committed step from one store to another (any backends) and commits it at
the destination with the commit protocol of :mod:`ckptstore.layout.commit`:

1. the source manifest is read and validated; a destination that already has the step is a
   :class:`~ckptstore.errors.CommitConflictError` unless its checkpoint is identical (same
   leaves, dtypes, shapes and checksums), which makes a repeated copy a no-op;
2. the data objects are copied under a *fresh* attempt prefix at the destination (a copy is a
   new save attempt there, dated now, so the destination's garbage collection treats it like
   any save in progress), each object streamed in parallel parts, its crc32c computed on the
   way and compared with the manifest: damaged source bytes are never committed;
3. the copied objects are read back and verified at the destination;
4. the manifest, drafted from the source's (its leaves as they are, the copy's objects:
   :meth:`~ckptstore.layout.session.ManifestDraft.of_manifest`), is put with put-if-absent.
   Like a save, a copy holds a lease on its attempt from the first object to the commit
   (:mod:`ckptstore.layout.lease`), and does not commit if the lease lapsed.

On any failure before step 4 the new attempt prefix is deleted once every write under it has
ended (or left for gc if the delete fails), so a refused copy leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from ckptstore.errors import (
    BrokenReferenceError,
    CommitConflictError,
    CorruptCheckpointError,
    NotFoundError,
)
from ckptstore.layout.commit import (
    SaveSession,
    committed_steps,
    encode_checked,
    gather_all,
    read_manifest,
)
from ckptstore.layout.keys import (
    ATTEMPT_RE,
    attempt_prefix,
    manifest_key,
    parse_step,
)
from ckptstore.layout.manifest import Manifest
from ckptstore.layout.references import (
    RECORD_NAME,
    attempt_record,
    check_references,
)
from ckptstore.layout.restore import Damage, VerifyReport, read_into_sink
from ckptstore.layout.rollback import SET_ASIDE_NAME
from ckptstore.layout.session import ManifestDraft
from ckptstore.layout.tree import escape_key
from ckptstore.store.base import Store
from ckptstore.store.buffers import HostBuffer, host_buffers
from ckptstore.store.transfer import copy_object
from ckptstore.store.transport import store_logger

#: One INFO record per copy (docs/reference.md, "Logging"), redacted like every record.
_log = store_logger("ckptstore.copy")

__all__ = [
    "CopyReport",
    "Damage",
    "RootTotals",
    "StepSummary",
    "Uncommitted",
    "VerifyReport",
    "copy_step",
    "plain_values",
    "retained_records",
    "summarize_step",
    "total_stored",
    "uncommitted",
    "verify_manifest",
    "verify_step",
]

Progress = Callable[[int], None]


# ----------------------------------------------------------------- summaries


@dataclass(frozen=True, slots=True)
class StepSummary:
    """One committed step as ``ls`` shows it.

    Attributes:
        step: the step number.
        nbytes: bytes over its data objects.
        objects: number of data objects.
        leaves: number of array leaves.
        created: when it was committed (seconds since the epoch).
        attempt: the save attempt whose objects the manifest names.
        own_bytes: bytes over the objects this step's attempt wrote.
        referenced_bytes: bytes over the objects of earlier steps it references (an
            incremental save's); ``nbytes`` is the sum of the two.
    """

    step: int
    nbytes: int
    objects: int
    leaves: int
    created: float
    attempt: str
    own_bytes: int = 0
    referenced_bytes: int = 0


def summarize_step(manifest: Manifest) -> StepSummary:
    """The :class:`StepSummary` of a parsed manifest."""
    return StepSummary(
        step=manifest.step,
        nbytes=manifest.nbytes,
        objects=len(manifest.object_keys),
        leaves=len(manifest.paths),
        created=manifest.created,
        attempt=manifest.attempt,
        own_bytes=manifest.own_bytes,
        referenced_bytes=manifest.referenced_bytes,
    )


@dataclass(frozen=True, slots=True)
class RootTotals:
    """What the committed steps of a root hold in the store, each object counted once.

    Summing the steps' ``nbytes`` would count an object once per step that names it: an
    incremental step's referenced objects are another step's own objects, or objects of a
    deleted step that kept steps still reference.

    Attributes:
        steps: the steps counted.
        nbytes: bytes over every distinct data object the steps keep in the store.
        objects: number of those objects.
        own_bytes: of ``nbytes``, the objects the counted steps' attempts wrote.
        retained_bytes: of ``nbytes``, the objects of the attempts of deleted steps that the
            counted steps reference. Such an attempt is kept whole (under its committed
            record) until nothing references it, its unreferenced objects included.
        steps_nbytes: the sum of the steps' ``nbytes``: what restoring each of them reads.
    """

    steps: int
    nbytes: int
    objects: int
    own_bytes: int
    retained_bytes: int
    steps_nbytes: int


@dataclass(frozen=True, slots=True)
class Uncommitted:
    """What a root holds beside its committed steps: attempts no manifest names (saves and
    copies in progress, interrupted or failed, steps a roll-back set aside).

    Attributes:
        attempts: their prefixes (``<step>/<attempt>/``).
        objects: objects under them.
        nbytes: bytes of those objects.
        set_aside: steps set aside by a roll-back, not committed again.
    """

    attempts: list[str]
    objects: int
    nbytes: int
    set_aside: list[int]


async def uncommitted(
    store: Store, manifests: Sequence[Manifest], *, skip_steps: Collection[int] = ()
) -> Uncommitted:
    """The :class:`Uncommitted` data of a root whose committed steps have ``manifests`` (one
    listing of the root). Attempts of deleted steps kept for their references (they hold
    ``committed.json``) are committed data, not counted; nor are the attempts of
    ``skip_steps`` (steps whose manifest fails validation: what it names is unknown)."""
    named = {attempt_prefix(m.step, m.attempt) for m in manifests}
    sizes: dict[str, list[int]] = defaultdict(list)
    records: set[str] = set()
    aside: set[int] = set()
    async for meta in store.list():
        parts = meta.key.split("/")
        if len(parts) < 3 or parse_step(parts[0]) is None or not ATTEMPT_RE.fullmatch(parts[1]):
            continue
        if int(parts[0]) in skip_steps:
            continue
        prefix = f"{parts[0]}/{parts[1]}/"
        if prefix in named:
            continue
        if parts[2] == RECORD_NAME:
            records.add(prefix)
        if parts[2] == SET_ASIDE_NAME:
            aside.add(int(parts[0]))
        sizes[prefix].append(meta.size)
    attempts = sorted(p for p in sizes if p not in records)
    committed_steps = {m.step for m in manifests}
    return Uncommitted(
        attempts,
        sum(len(sizes[p]) for p in attempts),
        sum(sum(sizes[p]) for p in attempts),
        sorted(aside - committed_steps),
    )


async def retained_records(store: Store, manifests: Sequence[Manifest]) -> list[Manifest]:
    """The committed records of the attempts of deleted steps that ``manifests`` reference
    (one record read per such attempt); an attempt without a valid record is left out
    (``verify`` reports it)."""
    own = {attempt_prefix(manifest.step, manifest.attempt) for manifest in manifests}
    retained = sorted(set().union(*(m.referenced_attempts() for m in manifests)) - own)

    async def record(prefix: str) -> Manifest | None:
        step, attempt = prefix.rstrip("/").split("/")
        with contextlib.suppress(CorruptCheckpointError):
            return await attempt_record(store, int(step), attempt)
        return None

    return [r for r in await gather_all(record(prefix) for prefix in retained) if r is not None]


def total_stored(manifests: Sequence[Manifest], records: Sequence[Manifest] = ()) -> RootTotals:
    """The :class:`RootTotals` of the committed steps whose manifests are ``manifests``,
    with the :func:`retained_records` of the deleted steps they reference."""
    attempts = {attempt_prefix(manifest.step, manifest.attempt) for manifest in manifests}
    lengths: dict[str, int] = {}
    for manifest in manifests:
        for i, length in enumerate(manifest.object_lengths):
            lengths[manifest.object_key(i)] = length
    for record in records:  # a retained attempt is kept whole
        for i, length in enumerate(record.object_lengths):
            if record.object_step(i) == record.step:
                lengths[record.object_key(i)] = length
    own = sum(n for key, n in lengths.items() if key.rsplit("/", 1)[0] + "/" in attempts)
    total = sum(lengths.values())
    return RootTotals(
        steps=len(manifests),
        nbytes=total,
        objects=len(lengths),
        own_bytes=own,
        retained_bytes=total - own,
        steps_nbytes=sum(manifest.nbytes for manifest in manifests),
    )


def plain_values(tree: Any) -> list[tuple[str, Any, str | None]]:
    """``(path, value, kind)`` of every plain (non-array) value in a validated manifest's
    tree, in tree order: ``kind`` is ``None`` for a JSON value, and a typed value's kind
    (``"torch.dtype"``) for a typed value, whose ``value`` is then its name."""
    out: list[tuple[str, Any, str | None]] = []

    def join(path: str, segment: str, depth: int) -> str:
        return segment if depth == 0 else f"{path}/{segment}"  # as the tree's own paths

    def walk(node: Any, path: str, depth: int) -> None:
        if type(node) is not dict:
            return  # an array leaf (its index)
        if "v" in node and len(node) == 1:
            out.append((path, node["v"], None))
        elif "x" in node:
            kind, name = node["x"]
            out.append((path, name, kind))
        elif "d" in node:
            for key, child in zip(node["d"], node["c"], strict=True):
                walk(child, join(path, escape_key(key), depth), depth + 1)
        elif "l" in node or "t" in node:
            for i, child in enumerate(node["l"] if "l" in node else node["t"]):
                walk(child, join(path, str(i), depth), depth + 1)

    walk(tree, "", 0)
    return out


# ----------------------------------------------------------------- verify


async def verify_manifest(
    store: Store,
    manifest: Manifest,
    *,
    progress: Progress | None = None,
    chunk_size: int | None = None,
    objects: Collection[int] | None = None,
    references: bool = False,
) -> VerifyReport:
    """Re-read every data object ``manifest`` names on ``store`` and check every checksum:
    a restore into a sink that keeps nothing (:func:`~ckptstore.layout.restore.read_into_sink`).

    Args:
        store: the checkpoint root holding the objects.
        manifest: a validated manifest (its objects need not be committed yet: copy checks
            its data this way before committing).
        progress: called with the byte count of each chunk checked.
        chunk_size: bytes per read (default ``Settings.part_size``).
        objects: check only these objects (by index) and the leaves in them (a copy checks
            what it wrote, not the earlier steps' objects it references).
        references: also check that each object referenced from an earlier step is a
            committed object of its attempt (:func:`~ckptstore.layout.references.
            check_references`), as a restore does; a broken one is damage.
    """
    return await read_into_sink(
        store,
        manifest,
        chunk_size=chunk_size,
        progress=progress,
        objects=objects,
        references=references,
    )


async def verify_step(store: Store, step: int, *, progress: Progress | None = None) -> VerifyReport:
    """Verify committed ``step``: its manifest, its references (each referenced object must
    be a committed object of its attempt, :func:`~ckptstore.layout.references.
    check_references`), then every byte of its data, referenced objects included.

    A manifest that fails validation is reported as damage (nothing else can be checked).

    Raises:
        NotFoundError: the step is not committed.
    """
    try:
        manifest = await read_manifest(store, step)
    except CorruptCheckpointError as exc:
        return VerifyReport(step, damage=[Damage("manifest", manifest_key(step), str(exc))])
    return await verify_manifest(store, manifest, progress=progress, references=True)


# ----------------------------------------------------------------- copy


@dataclass(frozen=True, slots=True)
class CopyReport:
    """What :func:`copy_step` did.

    Attributes:
        step: the step copied.
        objects: data objects copied.
        nbytes: bytes copied.
        attempt: the attempt id the copy was committed under at the destination.
        skipped: the destination already held an identical checkpoint; nothing was written.
        referenced: objects of earlier steps the copy references at the destination rather
            than copying (the destination's copies of them; see :func:`copy_step`).
        read_back: the copied objects were read back from the destination and checked; False
            where the destination checked each write's crc32c as it stored it instead
            (:meth:`Store.writes_verified <ckptstore.store.base.Store.writes_verified>`).
    """

    step: int
    objects: int
    nbytes: int
    attempt: str
    skipped: bool = False
    referenced: int = 0
    read_back: bool = True


def _same_checkpoint(a: Manifest, b: Manifest) -> bool:
    return (
        a.paths == b.paths
        and a.dtypes == b.dtypes
        and a.shapes == b.shapes
        and a.leaf_crc == b.leaf_crc
        and a.leaf_length == b.leaf_length
        and a.tree == b.tree
        and a.metadata == b.metadata
    )


async def copy_step(
    src: Store,
    dst: Store,
    step: int,
    *,
    progress: Progress | None = None,
) -> CopyReport:
    """Copy committed ``step`` from ``src`` to ``dst``, verified, and commit it there.

    Args:
        src: the source checkpoint root.
        dst: the destination checkpoint root.
        step: the step to copy.
        progress: called with byte counts as data is copied and as it is verified (so the
            total is twice the step's size; the bytes of referenced objects, which are
            neither copied nor read, are counted at once, as are the verification's where
            the destination verifies writes).

    An incremental step references objects of earlier steps. Where the destination holds
    such a step as a copy of the source's (an earlier ``copy_step``: ``ckptstore cp`` of a
    run, the persistent tier), the copy references the destination's objects, held and
    checked before anything is copied, instead of copying their bytes again; elsewhere it
    copies them, so a copy never depends on a step the destination does not hold.

    Every object copied is checked twice: the bytes read from the source against the crc32c
    the source manifest records, and what the destination stored against what was sent.
    The second check reads the copy back, except where the destination checks each write's
    crc32c as it stores it (:meth:`~ckptstore.store.base.Store.writes_verified`: S3 servers
    that refuse a body failing its ``x-amz-checksum-crc32c``, GCS), which makes the
    read-back's work redundant: a damaged body never becomes an object there.

    Raises:
        NotFoundError: ``step`` is not committed at ``src``.
        CorruptCheckpointError: the source manifest or data fails verification (a reference
            included), or the copy fails verification at the destination; nothing is
            committed.
        CommitConflictError: ``dst`` already holds a different checkpoint at ``step``.
        ValueError: the copy's manifest is over the destination's
            ``Settings.manifest_max_bytes``; nothing is copied.
    """
    began = time.monotonic()
    manifest = await read_manifest(src, step)
    try:
        existing: Manifest | None = await read_manifest(dst, step)
    except NotFoundError:
        existing = None
    if existing is not None:
        if _same_checkpoint(existing, manifest):
            return CopyReport(step, 0, 0, existing.attempt, skipped=True)
        raise CommitConflictError(
            f"{dst.url}/{manifest_key(step)}: step {step} already exists at the destination "
            "and differs from the source; remove it first (ckptstore rm)"
        )

    await check_references(src, manifest)
    links = await _destination_links(dst, manifest)
    # A copy is a save session at the destination: the same lease, the same commit.
    session = await SaveSession.begin(dst, step)
    async with session:
        attempt = session.attempt.id
        copied = _copied(manifest, attempt, links)
        if links:
            try:
                # the references are held, and checked, before any byte is copied
                await session.hold(copied)
            except BrokenReferenceError:
                # the destination's copy of the base is being deleted: copy everything
                links = {}
                copied = _copied(manifest, attempt, links)
        own = [i for i in range(len(copied.object_keys)) if i not in links]
        # refused before any byte is copied if over the destination's cap, which a reader
        # there applies (a copy to a store with a smaller Settings.manifest_max_bytes)
        data = encode_checked(copied, dst.settings.layout.manifest_max_bytes)
        if progress is not None and links:  # nothing to copy or check: counted as done
            progress(2 * sum(copied.object_lengths[i] for i in links))
        # Interrupted (Ctrl-C, SIGTERM: a cancellation) or failed, the session is abandoned
        # after the writes still running in threads end (Store.settle), so none of them
        # recreates a file once its objects are gone.
        await _copy_objects(src, dst, manifest, copied, progress, own)
        # asked after the writes: a store may learn from their answers (GCS)
        read_back = not await dst.writes_verified()
        if read_back:
            await _check_copy(dst, copied, progress, own)
        elif progress is not None:  # checked by the destination as it stored them
            progress(sum(copied.object_lengths[i] for i in own))
        await session.commit(copied, encoded=data, log=False)  # the copy's record is below
    seconds = time.monotonic() - began
    nbytes = sum(copied.object_lengths[i] for i in own)
    _log.info(
        "copied step %d from %s to %s: %d objects, %.1f MiB, %s, in %.2f s, %.1f MiB/s; "
        "%d objects of earlier steps referenced at the destination",
        step,
        src.url,
        dst.url,
        len(own),
        nbytes / 2**20,
        "verified" if read_back else "verified by the destination's crc32c checks",
        seconds,
        nbytes / 2**20 / max(seconds, 1e-6),
        len(links),
    )
    return CopyReport(step, len(own), nbytes, attempt, referenced=len(links), read_back=read_back)


def _copied(manifest: Manifest, attempt: str, links: dict[int, tuple[int, str]]) -> Manifest:
    """The copy's manifest: every object under the copy's attempt, except those ``links``
    names, which it references at the destination (step, key)."""
    draft = ManifestDraft.of_manifest(manifest, attempt)
    for i, (length, crc) in enumerate(
        zip(manifest.object_lengths, manifest.object_crcs, strict=True)
    ):
        if i in links:
            step, key = links[i]
            draft.add_objects([key], [length], [crc], step=step)
        else:
            draft.add_objects([_copied_name(manifest, attempt, i)], [length], [crc])
    return draft.build(
        tree=manifest.tree,
        metadata=manifest.metadata,
        chunks=manifest.chunks,
        created=manifest.created,
    )


#: Destination manifests a copy reads at most to find objects it may reference there.
LINK_CANDIDATES = 8


async def _destination_links(dst: Store, manifest: Manifest) -> dict[int, tuple[int, str]]:
    """The objects of ``manifest`` that another step references and that the destination
    already holds, as ``index -> (step, key)`` at the destination.

    An incremental step references objects of earlier steps; the destination holds the
    same bytes when it holds a copy of one of those steps (``ckptstore cp`` of a run, the
    persistent tier). An object there is the same object when its length and crc32c are
    the same and so are the offsets, lengths and xxh3-128 hashes of every leaf in it (the
    test an incremental save uses to reuse a leaf; crc32c alone is too short to decide
    equality). The steps the references name are looked at first, then the newest below
    ``manifest``'s, :data:`LINK_CANDIDATES` in all. Elsewhere the object is copied, so a
    copy never names bytes it cannot vouch for."""
    signatures = _signatures(manifest)
    wanted: dict[tuple[Any, ...], int] = {}
    for i in manifest.references():
        if i in signatures:  # else no hashes recorded (an older save): copied
            wanted[signatures[i]] = i
    if not wanted:
        return {}
    held = [s for s in await committed_steps(dst) if s < manifest.step]
    named = sorted({manifest.object_step(i) for i in manifest.references()} & set(held))
    others = [s for s in reversed(held) if s not in named]
    links: dict[int, tuple[int, str]] = {}
    for step in (named[::-1] + others)[:LINK_CANDIDATES]:
        try:
            ours = await read_manifest(dst, step)
        except (NotFoundError, CorruptCheckpointError):
            continue  # deleted meanwhile, or unreadable: not a place to reference
        for j, signature in _signatures(ours).items():
            found = wanted.get(signature)
            if found is not None and found not in links:
                links[found] = (ours.object_step(j), ours.object_keys[j])
        if len(links) == len(wanted):
            break
    return links


def _signatures(m: Manifest) -> dict[int, tuple[Any, ...]]:
    """What identifies each object's bytes, by object: its length and crc32c, and the
    offset, length and xxh3-128 hash of every leaf in it. Objects holding a leaf whose hash
    is not recorded, a chunk of a sharded leaf, or no leaf have none."""
    if m.leaf_hash is None:
        return {}
    leaves: dict[int, list[tuple[int, int, str]]] = defaultdict(list)
    # chunks of sharded leaves carry no hash: an object holding one has no signature
    unknown: set[int] = set() if m.chunks is None else set(m.chunks.object)
    for j, obj in enumerate(m.leaf_object):
        if obj < 0:
            continue
        digest = m.leaf_hash[j]
        if digest is None:
            unknown.add(obj)
        else:
            leaves[obj].append((m.leaf_offset[j], m.leaf_length[j], digest))
    return {
        obj: (m.object_lengths[obj], m.object_crcs[obj], *sorted(held))
        for obj, held in leaves.items()
        if obj not in unknown
    }


def _copied_name(manifest: Manifest, attempt: str, index: int) -> str:
    """The key of object ``index`` in the copy: under the copy's attempt, a referenced one
    prefixed with its step (two attempts may both have a ``pack-000000``)."""
    name = manifest.object_keys[index].split("/", 1)[1]
    where = manifest.object_step(index)
    return f"{attempt}/{name}" if where == manifest.step else f"{attempt}/s{where}-{name}"


async def _check_copy(
    dst: Store, copied: Manifest, progress: Progress | None, own: Collection[int]
) -> None:
    check = await verify_manifest(dst, copied, progress=progress, objects=own)
    if not check.ok:
        first = check.damage[0]
        raise CorruptCheckpointError(
            f"{dst.url}: the copy of step {copied.step} fails verification at the destination "
            f"({first.name}: {first.problem}); nothing was committed"
        )


#: Bytes of small objects a copy asks the source for at once
#: (:meth:`~ckptstore.store.base.Store.read_objects_crc32c`): one call to the io threads of
#: a local source for about four of a model's 4 MiB packs.
COPY_BATCH_BYTES = 16 << 20


async def _copy_objects(
    src: Store,
    dst: Store,
    manifest: Manifest,
    copied: Manifest,
    progress: Progress | None,
    own: Collection[int],
) -> None:
    multipart = dst.capabilities.multipart
    threshold = dst.settings.transport.multipart_threshold
    large = [i for i in own if multipart and manifest.object_lengths[i] >= threshold]
    small = [i for i in own if not (multipart and manifest.object_lengths[i] >= threshold)]
    await _copy_small(src, dst, manifest, copied, progress, small)
    # Each large one streams its parts in parallel already, so they go one after another, to
    # keep memory at one pool of part buffers.
    for index in large:
        key = manifest.object_key(index)
        crc = await copy_object(
            src,
            dst,
            key,
            manifest.object_lengths[index],
            dst_key=copied.object_key(index),
            progress=progress,
        )
        _check_source(src, manifest, index, crc)


async def _copy_small(
    src: Store,
    dst: Store,
    manifest: Manifest,
    copied: Manifest,
    progress: Progress | None,
    indices: Sequence[int],
) -> None:
    """Copy the objects ``indices`` that go in one put each: read from the source a batch at
    a time (:data:`COPY_BATCH_BYTES`), each object checked against its recorded crc32c and
    put with it, ``max_concurrency`` objects in flight (each in a pooled buffer).

    After a failure the writes in flight run to their end (``cancel=False``) rather than
    being cancelled: a local write runs in a thread that cancellation cannot stop, and would
    create its file after the caller removed the attempt prefix. No write starts after one,
    so a failed copy costs at most ``max_concurrency`` more objects.
    """
    lengths = manifest.object_lengths
    room = max(1, dst.settings.transport.max_concurrency)
    slots = asyncio.Semaphore(room)
    turn = asyncio.Lock()  # a batch takes its slots in one go, so no two wait on each other
    failed = False

    async def write(index: int, data: memoryview, crc: int, held: dict[int, HostBuffer]) -> None:
        nonlocal failed
        try:
            await dst.put(copied.object_key(index), data, crc32c=crc)
        except BaseException:
            failed = True
            if index in held:
                held[index].discard()  # a cancelled local write's thread may still read it
            raise
        finally:
            give_back(held, index)  # the next batch may use its slot
        if progress is not None:
            progress(len(data))

    def give_back(held: dict[int, HostBuffer], index: int) -> None:
        lent = held.pop(index, None)
        if lent is not None:
            lent.release()
            slots.release()

    async def copy_batch(batch: list[int]) -> None:
        nonlocal failed
        held: dict[int, HostBuffer] = {}  # what this batch holds: a buffer and a slot each
        try:
            async with turn:
                for index in batch:
                    await slots.acquire()
                    try:
                        held[index] = host_buffers.acquire(lengths[index])
                    except BaseException:
                        slots.release()
                        raise
            if failed:
                return  # the copy is lost already; start no more writes
            views = [memoryview(held[i].data)[: lengths[i]] for i in batch]  # type: ignore[arg-type]
            try:
                keys = [manifest.object_key(i) for i in batch]
                crcs = await src.read_objects_crc32c(list(zip(keys, views, strict=True)))
            except BaseException:
                for lent in held.values():
                    lent.discard()  # a cancelled local read's thread may still fill it
                raise
            for index, crc in zip(batch, crcs, strict=True):
                _check_source(src, manifest, index, crc)
            if not failed:
                await gather_all(
                    (write(i, v, c, held) for i, v, c in zip(batch, views, crcs, strict=True)),
                    cancel=False,
                )
        except BaseException:
            failed = True
            raise
        finally:
            for index in list(held):
                give_back(held, index)

    batches: list[list[int]] = []
    size = 0
    for index in indices:
        if not batches or size + lengths[index] > COPY_BATCH_BYTES or len(batches[-1]) == room:
            batches.append([])
            size = 0
        batches[-1].append(index)
        size += lengths[index]
    await gather_all((copy_batch(batch) for batch in batches), cancel=False)


def _check_source(src: Store, manifest: Manifest, index: int, crc: int) -> None:
    if crc != manifest.object_crcs[index]:
        raise CorruptCheckpointError(
            f"{src.url}/{manifest.object_key(index)}: the source object fails its crc32c "
            f"(recorded {manifest.object_crcs[index]}, read {crc}); run 'ckptstore verify' on "
            f"the source; step {manifest.step} was not committed at the destination"
        )
