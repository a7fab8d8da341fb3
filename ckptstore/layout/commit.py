"""Writing a checkpoint so that it becomes visible whole or not at all.

The commit protocol (DESIGN.md, "layout/" invariants 1-4):

1. If ``<step>/manifest.json`` already exists the save fails at once with
   :class:`~ckptstore.errors.CommitConflictError`, before writing any data.
2. Every data object is written under a fresh ``<step>/<attempt-id>/`` prefix. Nothing there
   is ever rewritten; a failed or crashed attempt leaves only invisible garbage for
   :mod:`ckptstore.layout.gc`. From :func:`begin_attempt` to :func:`commit_attempt` the
   committing writer holds a lease on the prefix that garbage collection honours
   (:mod:`ckptstore.layout.lease`), and it does not commit if the lease lapsed.
3. Only after every data ``put`` has returned (and a put returns only once its object is
   durable: fsynced files and directories on POSIX, a completed upload on S3/GCS) is the
   manifest written, with one ``put(mode="create")``: an atomic put-if-absent, so of N
   concurrent attempts on one step exactly one commits.
4. If that put reports that the manifest exists, the existing manifest is read: if it carries
   this attempt's id, an earlier try of this very put succeeded and only its response was
   lost, so the save succeeded; otherwise another attempt won and this one raises
   :class:`~ckptstore.errors.CommitConflictError` and stays invisible.

No rename, listing or "latest" pointer is involved, so the protocol is the same on a local
disk, NFS, S3 and GCS.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ckptstore.errors import (
    AlreadyExistsError,
    BrokenReferenceError,
    BucketNotFoundError,
    CommitConflictError,
    CorruptCheckpointError,
    NotFoundError,
    StoreError,
)
from ckptstore.layout.incremental import (
    CHANGED,
    Reuse,
    leaf_digests,
    plan_reuse,
    unchanged_before,
)
from ckptstore.layout.keys import (
    ATTEMPT_RE,
    MANIFEST_NAME,
    attempt_prefix,
    check_step,
    manifest_key,
    new_attempt_id,
    parse_step,
)
from ckptstore.layout.lease import SaveLease
from ckptstore.layout.manifest import Manifest
from ckptstore.layout.plan import PackPlan
from ckptstore.layout.session import ManifestDraft
from ckptstore.layout.tree import FlatState, is_optimizer_path
from ckptstore.store.base import Store
from ckptstore.store.buffers import PAGE, host_buffers
from ckptstore.store.checksum import (
    as_uint8,
    crc32c,
    crc32c_combine,
    in_hash_thread,
    native_hashes,
)
from ckptstore.store.fanout import gather_all
from ckptstore.store.transport import store_logger
from ckptstore.threads import collection_paused

__all__ = [
    "Attempt",
    "CommitInfo",
    "LeafDigests",
    "ObjectWriter",
    "SaveSession",
    "Written",
    "base_manifest",
    "begin_attempt",
    "check_metadata",
    "commit_attempt",
    "commit_manifest",
    "committed_steps",
    "delete_step",
    "encode_checked",
    "gather_all",
    "hashes_in_turns",
    "latest_step",
    "plan_changed",
    "read_manifest",
    "remove_objects",
    "write_checkpoint",
    "write_objects",
]

#: One INFO record per save (docs/reference.md, "Logging"), redacted like every record.
_log = store_logger("ckptstore.save")

#: Waits between reads of a manifest that the put-if-absent reported existing but a read did
#: not find yet. On a FUSE mount of SeaweedFS under load a lookup missed the file that
#: ``link()`` had just refused with EEXIST (in 4 and 3 of two runs of 300 races of 6
#: savers); an NFS client's cached negative lookups lag the same way. About 6 s in all.
MANIFEST_REREAD_WAITS = (0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.0)

#: The first of those waits, for the reads that decide a manifest put that failed: the
#: manifest is there only if the put landed and just its answer was lost, so a read that
#: keeps missing it for a moment means the put most likely never landed. About 0.35 s.
FAILED_PUT_REREAD_WAITS = MANIFEST_REREAD_WAITS[:4]


@dataclass(frozen=True, slots=True)
class CommitInfo:
    """What a committed save wrote.

    Attributes:
        step: the committed step.
        attempt: the attempt id whose objects the manifest names.
        objects: data objects written (the manifest not included).
        nbytes: bytes of data objects written.
        manifest_bytes: size of the manifest.
        referenced_objects: objects of earlier steps the manifest references instead.
        referenced_bytes: bytes over those objects (not written by this save).
        referenced_attempts: prefixes (``<step>/<attempt>/``) of the attempts they live in.
    """

    step: int
    attempt: str
    objects: int
    nbytes: int
    manifest_bytes: int
    referenced_objects: int = 0
    referenced_bytes: int = 0
    referenced_attempts: tuple[str, ...] = ()


def check_metadata(metadata: Any) -> None:
    """Raise ``TypeError`` unless ``metadata`` is plain JSON."""
    try:
        json.dumps(metadata, allow_nan=True)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"metadata must be plain JSON (dicts, lists, numbers, str): {exc}"
        ) from None


@dataclass(frozen=True, slots=True, weakref_slot=True)
class Attempt:
    """One try at committing a step: its id, drawn when it began, names its objects' prefix.

    Attributes:
        step: the step it commits.
        id: the attempt id (``attempt-<millis>-<random>``, :func:`new_attempt_id`).
        started: when it began, seconds since the epoch.
    """

    step: int
    id: str
    started: float
    #: The lease that keeps garbage collection off this attempt (ckptstore.layout.lease),
    #: held by the one writer that will commit it; not sent to other writers.
    lease: SaveLease | None = field(default=None, compare=False, repr=False)

    def __reduce__(self) -> tuple[Any, ...]:
        # Other writers (ranks) get the attempt without the committing writer's lease.
        return (Attempt, (self.step, self.id, self.started))

    @property
    def prefix(self) -> str:
        """``<step>/<attempt-id>/``: every object of this attempt lies under it."""
        return attempt_prefix(self.step, self.id)


@dataclass(frozen=True, slots=True)
class Written:
    """The checksums of the objects one writer wrote for a plan.

    Attributes:
        leaf_crc: per leaf of the plan, the crc32c of its bytes (0 for an empty leaf).
        object_crc: per object of the plan, the crc32c of the whole object.
    """

    leaf_crc: list[int]
    object_crc: list[int]


async def begin_attempt(store: Store, step: int, metadata: Any = None) -> Attempt:
    """The first step of the protocol: draw a fresh attempt and take its lease, unless the
    step is committed (looked for at the same time; the lease is then removed).

    Raises:
        CommitConflictError: ``step`` already has a manifest.
        TypeError: ``metadata`` is not plain JSON.
    """
    check_step(step)
    check_metadata(metadata)
    mkey = manifest_key(step)
    started = time.time()
    attempt_id = new_attempt_id(started)
    # Taken before any data is written: gc in another process leaves the attempt alone,
    # whatever its grace period, until commit_attempt releases the lease. An attempt that
    # never gets there stops renewing once it is dropped, and its lease then expires.
    # The lease is written while the step is looked for, not after: one round trip, not
    # two, before a save's first write; a committed step's lease is then removed at once.
    taking = asyncio.ensure_future(SaveLease.take(store, step, attempt_id))
    try:
        committed = await store.exists(mkey)
    except BaseException:
        await _dropped(taking)
        raise
    if committed:
        await _dropped(taking)
        raise CommitConflictError(f"{store.url}/{mkey}: step {step} is already committed")
    try:
        # shielded: a cancelled begin waits for the taking (_dropped), which on a failure
        # removes what it wrote; cancelled, that removal would go on unwatched
        lease = await asyncio.shield(taking)
    except BaseException:
        await _dropped(taking)
        raise
    attempt = Attempt(step, attempt_id, started, lease)
    weakref.finalize(attempt, lease.stop)
    return attempt


async def _dropped(taking: asyncio.Future[SaveLease]) -> None:
    """Wait for a lease's taking to end, not cancelling it (a failed taking removes what it
    wrote), and release the lease it took. Shielded as a whole: cancelled meanwhile, the
    caller stops waiting, but a lease the taking still puts is released, not left renewing
    for the life of the process. Never raises but for that cancellation."""

    async def drop() -> None:
        await _settled(taking)
        if not taking.cancelled() and taking.exception() is None:
            await taking.result().release()  # never raises

    await asyncio.shield(drop())


class SaveSession:
    """One save attempt at one step, from its beginning to its commit: the one way every face
    writes a checkpoint (``save``, both managers, the multi-rank save, the DCP writer,
    Lightning, the file adapters, ``cp`` and the tier copy).

    The committing writer begins it (:meth:`begin`: the committed step refused, a fresh
    attempt drawn, its lease taken), holds what the save will reference (:meth:`hold_base`,
    :meth:`hold`), writes its objects under :attr:`prefix` (writers in other processes, the
    ranks of a multi-rank save, write under it from :attr:`ticket`), assembles the manifest
    with :meth:`draft` and ends it with :meth:`commit` or :meth:`abandon`. Used as an
    ``async with`` block, a session that is left by an error or a cancellation before its
    commit began is abandoned (once the writes still running in threads have ended), and its
    lease is released however the block ends.

    Attributes:
        store: the checkpoint root it writes to.
        attempt: the attempt, holding the lease (:mod:`ckptstore.layout.lease`).
        base: the step held for it by :meth:`hold_base`, if any.
    """

    __slots__ = ("_ended", "_released", "attempt", "base", "store")

    def __init__(self, store: Store, attempt: Attempt) -> None:
        self.store = store
        self.attempt = attempt
        self.base: Manifest | None = None
        #: committed, abandoned or released: nothing is left for the ``async with`` block
        self._ended = False
        self._released = False  # the lease: a commit releases it too, however it ends

    @classmethod
    async def begin(cls, store: Store, step: int, metadata: Any = None) -> SaveSession:
        """Begin a session at ``step`` (:func:`begin_attempt`).

        Raises:
            CommitConflictError: ``step`` already has a manifest.
            TypeError: ``metadata`` is not plain JSON.
        """
        return cls(store, await begin_attempt(store, step, metadata))

    @property
    def step(self) -> int:
        """The step it commits."""
        return self.attempt.step

    @property
    def prefix(self) -> str:
        """``<step>/<attempt-id>/``: every object of the session lies under it."""
        return self.attempt.prefix

    @property
    def ticket(self) -> Attempt:
        """What another writer of the session needs (picklable): the attempt without its
        lease, which stays with the committing writer."""
        return Attempt(self.attempt.step, self.attempt.id, self.attempt.started)

    async def hold_base(self, accept: Callable[[Manifest], bool] | None = None) -> Manifest | None:
        """Find the base of an incremental save (:func:`base_manifest`) and hold every object
        of it (its own and those it references) for this session before any data is
        written, for a save whose writers decide what they reuse only later (the ranks of a
        multi-rank save, the DCP writer's): any writer may then reference any of them.

        Returns:
            The base, also kept as :attr:`base`; ``None`` (then save in full) when there is
            none, when ``accept`` refuses it (a face that compares only with checkpoints of
            its own kind), or when it is being deleted meanwhile.
        """
        base = await base_manifest(self.store, self.step)
        if base is None or (accept is not None and not accept(base)):
            return None
        every = Reuse(base, [], list(range(len(base.object_keys))), [])
        try:
            await self.hold(_references_of(self.attempt, every))
        except BrokenReferenceError:
            return None
        self.base = base
        return base

    async def hold(self, references: Manifest) -> None:
        """Hold the objects of earlier steps that ``references`` names (an incremental save's
        reused objects, the destination objects a copy links to) for this session, and check
        them, before any data is written
        (:func:`ckptstore.layout.references.hold_references`).

        Raises:
            BrokenReferenceError: one of them is being deleted; the caller writes those
                bytes itself instead.
        """
        from ckptstore.layout.references import hold_references  # builds on this module

        assert self.attempt.lease is not None
        await hold_references(self.store, self.attempt.lease, references)

    def draft(
        self,
        paths: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[list[int]],
        lengths: Sequence[int],
        attrs: Sequence[dict[str, Any] | None] | None = None,
        hashes: Sequence[str | None] | None = None,
    ) -> ManifestDraft:
        """A :class:`ManifestDraft` of these leaves for this session's step and attempt."""
        return ManifestDraft.of_leaves(
            self.step, self.attempt.id, paths, dtypes, shapes, lengths, attrs, hashes
        )

    async def commit(
        self, manifest: Manifest, *, encoded: bytes | None = None, log: bool = True
    ) -> CommitInfo:
        """Commit ``manifest`` once every object it names is durable (:func:`commit_attempt`:
        the lease checked, the size cap, one put-if-absent, a conflict's objects removed, a
        failed put decided by reading the manifest back). ``encoded``: the manifest's
        encoding, checked against the cap already (a copy refuses an oversized manifest
        before it copies a byte); ``log``: write the save's INFO record (a copy writes one of
        its own). The session is over once this is called, whatever it raises: an error of
        the put itself leaves the data in place, since the step may be committed."""
        self._ended = True
        try:
            return await commit_attempt(
                self.store, self.attempt, manifest, encoded=encoded, log=log
            )
        finally:
            self._released = True

    async def abandon(self) -> None:
        """Give the session up: once the writes still running in threads, and the requests a
        server may still complete, have ended (:meth:`Store.settle`), so that none recreates
        an object afterwards, remove its objects and release its lease. Best effort, never
        raises: the objects are invisible without a manifest, so removing them now only
        spares garbage collection the work. Nothing once the session ended: a committed
        step's objects are never removed by its own session."""
        if self._ended:
            return
        self._ended = True
        with contextlib.suppress(Exception):
            await self.store.settle()
        await remove_objects(self.store, self.prefix)
        await self.release()

    async def release(self) -> None:
        """Release the lease and nothing else (for a session given up by a writer that
        removes its objects another way); nothing once it is released, or the session
        committed."""
        self._ended = True
        if self.attempt.lease is not None and not self._released:
            self._released = True
            await self.attempt.lease.release()

    async def __aenter__(self) -> SaveSession:
        return self

    async def __aexit__(self, kind: Any, error: Any, traceback: Any) -> None:
        if self._ended:
            return
        if isinstance(error, Exception | asyncio.CancelledError):
            # cancelled (an interrupted save) as well as failed: the objects are removed once
            # the writes still running in threads have ended
            await asyncio.shield(self.abandon())
        elif error is None:
            await self.release()


async def write_checkpoint(
    store: Store,
    flat: FlatState,
    *,
    step: int,
    metadata: Any = None,
    full: bool = False,
) -> CommitInfo:
    """Write ``flat`` as step ``step`` of the checkpoint rooted at ``store`` and commit it: a
    :class:`SaveSession` in one process.

    An incremental save (``Settings.incremental``, :mod:`ckptstore.layout.incremental`)
    hashes every leaf, and, unless ``full``, writes only the leaves that changed since the
    newest committed step, whose objects its manifest references for the rest; the
    references are held against deletion before any data is written
    (:meth:`SaveSession.hold`), and if that fails (the base is being deleted) the save
    writes everything instead.

    Args:
        store: the store; its root is the checkpoint root.
        flat: the state's leaves and tree (from :func:`~ckptstore.layout.tree.flatten` or a
            stager). Arrays must not change until this returns.
        step: the step number.
        metadata: JSON stored in the manifest.
        full: with incremental saves, record the hashes but reference nothing (a full save
            that bounds the chain of references).

    Returns:
        What was written.

    Raises:
        CommitConflictError: the step was already committed, by another attempt.
        UnsupportedLeafError: a leaf with a dtype no checkpoint can hold.
        StoreError: the store failed; if it failed on the manifest itself the step may or
            may not be committed (its data is then left in place for a later check).
    """
    check_step(step)
    check_metadata(metadata)
    n = len(flat.arrays)
    if not len(flat.paths) == len(flat.attrs) == n:
        raise ValueError("FlatState: paths, arrays and attrs must have one entry per leaf")
    with collection_paused():
        dtypes = flat.dtype_names()
        # each a list built per call: once per save, not once per use
        lengths = flat.nbytes
    # the shapes are found when first needed: to compare with a base, else for the manifest,
    # built while the last writes are in flight (4 ms on 20,000 leaves, off the path to the
    # first write)
    shapes: list[list[int]] | None = None
    hashes: list[str | None] | None = None
    reuse: Reuse | None = None
    hashing: asyncio.Future[list[str | None]] | None = None
    digests: LeafDigests | None = None
    if store.settings.layout.incremental:
        # The hashes run on a hashing thread while the base manifest is read, and, when
        # there is no base to compare with (the first save, a full one), while the data is
        # written: they are needed only for the manifest then. Awaited first, they added
        # their whole time (~0.1 s a GiB) to every save. The same pass finds the crc32c of
        # each leaf written alone, which its write waits for (LeafDigests).
        # a body sent in parts carries each part's crc32c, hashed as it is sent: for such a
        # leaf the pass's would be one more read of it
        parts = store.sends_checksums and store.capabilities.multipart
        # Listed before the pass starts: with nothing to compare with (the first save), its
        # first turn would hash for the manifest alone, and took the GIL from the listing
        # (0.2 ms alone, 2.2 ms beside it on 20,000 leaves) and the hashing thread from the
        # first pack's build.
        base_at = None if full else await base_step(store, step)
        digests = LeafDigests(
            flat.arrays,
            crc_from=store.settings.layout.pack_threshold,
            crc_below=store.settings.transport.multipart_threshold if parts else None,
            lengths=lengths,
        )
        if base_at is None:
            digests.defer()  # before its first turn: the hashes are for the manifest alone
        hashing = digests.hashes
        try:
            base = await read_base_of(store, base_at)
            if base is None:
                # the hashes are for the manifest alone: the pack builds go first
                digests.defer()
            else:
                digests.expect(base, flat.paths)
                # shielded: a cancelled save must not stop waiting for the hashing thread,
                # which goes on reading the arrays (_settled waits for it)
                hashes = await asyncio.shield(hashing)
                shapes = flat.shapes
                reuse = plan_reuse(base, flat.paths, dtypes, shapes, hashes)
        except BaseException:
            await _settled_digests(digests)
            raise
    # The session begins (its lease is put while the step is looked for) while the plan is
    # made and the first packs are built: they write nothing, and the writes wait for it
    # (ObjectWriter.start). Begun after the base was looked for, as before: the first
    # request to a store is a read, so an endpoint that is not the store's API is named by
    # it before anything is written there (a SeaweedFS filer port stores a PutObject's body
    # as a file of its own, and its listings then fail with 500s, retried for 18 s).
    beginning = asyncio.ensure_future(SaveSession.begin(store, step))
    writer: ObjectWriter | None = None
    writes: asyncio.Future[None] | None = None
    try:
        with collection_paused():
            # in place unless this is the full save (or the first) of an incremental root:
            # that one gives each large leaf an object of its own, which the next saves
            # reuse leaf by leaf; cut from the arena, a frozen leaf would share an object
            # with leaves that change, and the next save would write it again
            in_place = reuse is not None or not store.settings.layout.incremental
            offsets = flat.region_offsets() if in_place else None
            plan = plan_changed(store, lengths, flat.paths, reuse, offsets=offsets)
        if reuse is None or not reuse.objects:
            # nothing to hold before the writes (SaveSession.hold)
            writer = _object_writer(store, plan, None, flat, digests)
            writes = asyncio.ensure_future(writer.write_all())
        session = await beginning
    except BaseException:
        # nothing was written: the writes wait for the session
        if writes is not None:
            writes.cancel()
            await _settled(writes)
        beginning.cancel()  # a begin cancelled releases what it took (begin_attempt)
        await _settled(beginning)
        if beginning.done() and not beginning.cancelled() and beginning.exception() is None:
            # begun as the save was cancelled: give the session up, its lease with it
            await asyncio.shield(beginning.result().abandon())
        await _settled_digests(digests)
        raise
    async with session:
        try:
            if writer is not None:
                writer.start(session.prefix)
            else:
                if reuse is not None and reuse.objects:
                    try:
                        await session.hold(_references_of(session.attempt, reuse))
                    except BrokenReferenceError:
                        # the base is being deleted meanwhile: write everything this time
                        reuse = None
                        plan = plan_changed(store, lengths, flat.paths, None)
                writer = _object_writer(store, plan, session.prefix, flat, digests)
                writes = asyncio.ensure_future(writer.write_all())
        except BaseException:
            # the session is abandoned once the hashing thread, which reads the arrays, ended
            await _settled_digests(digests)
            raise
        assert writes is not None  # made with the writer
        try:
            # The manifest is built and encoded while the last objects are still being made
            # durable: it needs only their checksums, known once they are built. After the
            # writes, that Python (~8 ms on 20,000 leaves) stood between the disk and the
            # commit's put. It is put only once every write returned (invariant 3).
            await writer.checksummed.wait()
            if writer.failed:
                await writes  # raises the failed write's error, once every write ended
            if hashing is not None and hashes is None:
                hashes = await asyncio.shield(hashing)
            with collection_paused():
                written = writer.written
                if shapes is None:
                    shapes = flat.shapes
                draft = session.draft(flat.paths, dtypes, shapes, lengths, flat.attrs, hashes)
                draft.add_plan(plan, written.object_crc, written.leaf_crc)
                if reuse is not None and reuse.objects:
                    draft.reference(reuse.base, enumerate(reuse.leaf_source))
                manifest = draft.build(tree=flat.tree, metadata=metadata)
                encoded = encode_checked(manifest, store.settings.layout.manifest_max_bytes)
            await writes
        except BaseException:
            # the session is abandoned once the writes and the hashing thread, which read the
            # arrays, ended
            writes.cancel()
            await _settled(writes)
            await _settled_digests(digests)
            raise
        return await session.commit(manifest, encoded=encoded)


def _object_writer(
    store: Store,
    plan: PackPlan,
    prefix: str | None,
    flat: FlatState,
    digests: LeafDigests | None,
) -> ObjectWriter:
    """``write_checkpoint``'s writer of ``plan``."""
    return ObjectWriter(
        store,
        plan,
        prefix,
        flat.arrays,
        digests=digests,
        region=flat.region,
        # with no base, a packed leaf is hashed as its pack is built, still in cache
        hash_packs=digests is not None and digests.deferred and native_hashes(),
    )


#: Leaves of an in-region pack smaller than this extend the pack's crc32c by hashing them
#: again (about 4 us for 64 KiB) rather than by ``crc32c_combine`` (10-30 us of Python).
COMBINE_MIN = 256 << 10
#: Bytes of leaves one turn of :class:`LeafDigests` hashes before it lets the other work of the
#: hashing pool (one thread on a machine of up to 3 CPUs) have it: pack builds, checksums.
HASH_TURN_BYTES = 64 << 20
#: The first turn's bytes: the writes of the leaves it hashes wait for it.
FIRST_TURN_BYTES = 8 << 20
#: Leaves of one turn at most, whatever their bytes: small leaves cost the hash ~0.5 us each
#: beyond their bytes, and a turn of 16,384 leaves of 4 KiB (64 MiB) held the pack builds
#: queued behind it on the hashing thread for 8-12 ms.
HASH_TURN_LEAVES = 2048


class LeafDigests:
    """The leaves' xxh3-128 hashes, and the crc32c of those written alone, computed on the
    hashing pool in turns of about :data:`HASH_TURN_BYTES` (the first one smaller) from the
    moment this is made.

    One pass gives both (:func:`~ckptstore.layout.incremental.leaf_digests`): the write of a
    leaf of at least ``crc_from`` bytes awaits its turn (:meth:`crc`) and sends the crc32c it
    found instead of reading the leaf again. Leaves the base reused too (:meth:`expect`) are
    likely frozen and not written: their turns hash them only. Turns, not one job: the pool
    is first come, first served, and the hashes of a whole state submitted at once held every
    pack build behind them (seen with one hashing thread, a machine of 2 CPUs).

    Args:
        arrays: the leaves' host arrays; read until :attr:`hashes` is done.
        crc_from: the size from which a leaf's crc32c is computed with its hash.
        crc_below: if given, the size from which it is not (a leaf the store sends in parts,
            each with its own crc32c, hashed on the way).
        lengths: the leaves' sizes in bytes, if the caller has them (a list of ints is
            read faster than 20,000 arrays' ``nbytes``).
    """

    def __init__(
        self,
        arrays: Sequence[np.ndarray[Any, Any]],
        crc_from: int,
        crc_below: int | None = None,
        *,
        lengths: Sequence[int] | None = None,
    ) -> None:
        self._arrays = arrays
        count = len(arrays)
        self._crcs: list[int | None] = [None] * count
        if lengths is not None and len(lengths) != count:
            raise ValueError("LeafDigests: one length per array")
        # with numpy, not leaf by leaf: 2.6 ms of a 20,000-leaf save's path to its first
        # write went to a loop over the leaves here
        sizes = np.asarray(
            [array.nbytes for array in arrays] if lengths is None else lengths, dtype=np.int64
        ).reshape(count)
        with_crc = sizes >= crc_from
        if crc_below is not None:
            with_crc &= sizes < crc_below
        self._with_crc: list[bool] = with_crc.tolist()
        # A turn ends at the leaf that brings its bytes to the goal, at HASH_TURN_LEAVES
        # leaves, or at the last leaf, whichever comes first.
        through = np.cumsum(sizes)  # the bytes of the leaves up to each, itself included
        self._turns: list[tuple[int, int]] = []
        start, goal = 0, FIRST_TURN_BYTES
        while start < count:
            before = int(through[start - 1]) if start else 0
            reached = int(np.searchsorted(through, before + goal, side="left")) + 1
            end = min(reached, start + HASH_TURN_LEAVES, count)
            self._turns.append((start, end))
            start, goal = end, HASH_TURN_BYTES
        spans = [end - start for start, end in self._turns]
        self._turn_of: list[int] = np.repeat(np.arange(len(spans)), spans).tolist()
        self._done = [asyncio.Event() for _ in self._turns]
        self._resumed: asyncio.Event | None = None  # set by defer()
        self._known: Sequence[str | None] | None = None  # given to resume()
        self._abandoned = False
        #: Every leaf's hash, in order, once all turns ran; the pass's error if one failed.
        self.hashes: asyncio.Future[list[str | None]] = asyncio.ensure_future(self._run())

    async def _run(self) -> list[str | None]:
        out: list[str | None] = [None] * len(self._arrays)
        later: list[int] = []
        try:
            for turn, (start, end) in enumerate(self._turns):
                if self._resumed is not None and not any(self._with_crc[start:end]):
                    later.append(turn)  # no write waits for it (defer)
                    continue
                await self._turn(turn, out)
            if later:
                assert self._resumed is not None
                await self._resumed.wait()
                for turn in later:
                    if self._abandoned:
                        break  # the save failed: nobody needs these hashes
                    await self._turn(turn, out, self._known)
        finally:
            for done in self._done:  # a failed pass: the writes hash for themselves
                done.set()
        return out

    async def _turn(
        self, turn: int, out: list[str | None], known: Sequence[str | None] | None = None
    ) -> None:
        start, end = self._turns[turn]
        # the leaves whose hash a pack's build found are not read again
        todo = [leaf for leaf in range(start, end) if known is None or known[leaf] is None]
        if known is not None:
            out[start:end] = known[start:end]
        if len(todo) == end - start:
            arrays, with_crc = self._arrays[start:end], self._with_crc[start:end]
        else:
            arrays = [self._arrays[leaf] for leaf in todo]
            with_crc = [self._with_crc[leaf] for leaf in todo]
        if todo:
            hashes, crcs = await in_hash_thread(leaf_digests, arrays, with_crc)
            for leaf, digest, crc in zip(todo, hashes, crcs, strict=True):
                out[leaf] = digest
                self._crcs[leaf] = crc
        self._done[turn].set()

    @property
    def deferred(self) -> bool:
        """Whether :meth:`defer` holds turns (until :meth:`resume`)."""
        return self._resumed is not None

    def defer(self) -> None:
        """Hold the turns not begun yet that no write waits for (no leaf of theirs is hashed
        for its crc32c) until :meth:`resume`: for a save with no base, whose hashes only the
        manifest needs, so that the pack builds, which share the hashing thread, are not
        each queued behind a turn. The caller must call :meth:`resume`, on failure too."""
        if self._resumed is None:
            self._resumed = asyncio.Event()

    def resume(self, known: Sequence[str | None] | None = None) -> None:
        """Let the turns held by :meth:`defer` run (nothing if none are held). ``known``:
        per leaf, its hash where the caller found it (a pack's build,
        :attr:`ObjectWriter.leaf_hashes`), which those turns take instead of reading the
        leaf again."""
        if self._resumed is not None and not self._resumed.is_set():
            self._known = known
            self._resumed.set()

    def abandon(self) -> None:
        """The save failed: the turns :meth:`defer` held, begun or not, end the pass at the
        first one not begun (:attr:`hashes` then misses theirs)."""
        self._abandoned = True
        self.resume()

    def expect(self, base: Manifest, paths: Sequence[str]) -> None:
        """The turns not begun yet skip the crc32c of the leaves ``base`` reused from an earlier
        step (:func:`~ckptstore.layout.incremental.unchanged_before`): such a leaf is likely
        unchanged again, and its crc32c would be read for nothing (a write of one that did
        change hashes it itself)."""
        for leaf, frozen in enumerate(unchanged_before(base, paths)):
            if frozen:
                self._with_crc[leaf] = False

    async def crc(self, leaf: int) -> int | None:
        """The crc32c of leaf ``leaf`` found by the pass, once its turn ran; ``None`` for a
        leaf outside the pass's sizes or one it skipped (:meth:`expect`), or if it failed."""
        if not self._with_crc[leaf]:
            return None  # at once: its turn may be one that defer() holds
        await self._done[self._turn_of[leaf]].wait()
        return self._crcs[leaf]


async def hashes_in_turns(arrays: Sequence[np.ndarray[Any, Any]]) -> list[str | None]:
    """The leaves' xxh3-128 hashes on the hashing pool, in turns (:class:`LeafDigests`)."""
    return await LeafDigests(arrays, crc_from=1 << 62).hashes


async def _settled_digests(digests: LeafDigests | None) -> None:
    """Wait for the hashing pass of a failed save to end (the turns it held not run)."""
    if digests is not None:
        digests.abandon()
        await _settled(digests.hashes)


async def _settled(work: asyncio.Future[Any] | None) -> None:
    """Wait for ``work`` (a thread's, which cannot be stopped) to end, ignoring its outcome:
    a save that fails does not leave it running on the arrays it was given."""
    if work is not None:
        await asyncio.gather(work, return_exceptions=True)


async def base_manifest(store: Store, step: int) -> Manifest | None:
    """The newest committed step other than ``step``, the base of an incremental save, or
    ``None`` (nothing committed, or its manifest fails validation: then save in full)."""
    return await read_base_of(store, await base_step(store, step))


async def base_step(store: Store, step: int) -> int | None:
    """The step an incremental save of ``step`` takes as its base: the newest committed step
    other than ``step``, or ``None``.

    One listing and, on a root whose newest step is committed, one ``head``, however many
    steps the root keeps (:func:`_newest_committed`). It took one ``head`` per step
    directory (:func:`committed_steps`) on every save: a thousand requests a save on an
    object store, for a run that keeps a thousand steps.
    """
    return await _newest_committed(store, [s for s in await _step_candidates(store) if s != step])


async def read_base_of(store: Store, step: int | None) -> Manifest | None:
    """The manifest of ``step`` (:func:`base_step`), or ``None`` (no step, or its manifest
    fails validation: then save in full)."""
    if step is None:
        return None
    try:
        # only read: the plan copies what it takes (the base's own object entries)
        return await read_manifest(store, step, shared=True)
    except (NotFoundError, CorruptCheckpointError):
        return None


def _references_of(attempt: Attempt, reuse: Reuse) -> Manifest:
    """A manifest of the base objects ``reuse`` references alone (no leaves), as the base
    names them (so references stay flat), to hold and check them."""
    base, draft = reuse.base, ManifestDraft.empty(attempt.step, attempt.id)
    for obj in reuse.objects:
        draft.add_objects(
            [base.object_keys[obj]],
            [base.object_lengths[obj]],
            [base.object_crcs[obj]],
            step=base.object_step(obj),
        )
    return draft.build(tree=None, created=attempt.started)


def plan_changed(
    store: Store,
    lengths: Sequence[int],
    paths: Sequence[str],
    reuse: Reuse | None,
    *,
    pack_threshold: int | None = None,
    pack_size: int | None = None,
    offsets: Sequence[int] | None = None,
) -> PackPlan:
    """The plan of the leaves of ``lengths`` to write: all, or those ``reuse`` does not take
    from the base, the unchanged ones and the changed ones kept apart (by group). Leaves
    past the end of ``reuse`` (a rank's chunks of sharded leaves) are written, as changed.
    ``pack_threshold`` and ``pack_size`` override the store's settings (a face's own).

    With ``offsets`` (:meth:`FlatState.region_offsets`), a store of files (local, NFS)
    writes the leaves in the region as runs cut straight from it
    (:meth:`PackPlan.in_region`, up to ``multipart_threshold`` bytes each: the largest
    object it writes in one piece), optimizer state apart from the rest (a streaming
    restore reads the rest first); an object store keeps the packed plan.
    """
    settings, caps = store.settings, store.capabilities
    groups: list[int] | None = None
    if reuse is not None:
        extra = len(lengths) - len(reuse.leaf_source)
        if extra < 0:
            raise ValueError("the reuse was decided for more leaves than are planned")
        source = [*reuse.leaf_source, *([-1] * extra)]
        groups = [*reuse.groups, *([CHANGED] * extra)]
        lengths = [0 if j >= 0 else n for j, n in zip(source, lengths, strict=True)]

    def packed(kept: Sequence[int]) -> PackPlan:
        return PackPlan.for_store(
            kept,
            settings,
            caps,
            paths,
            pack_threshold=pack_threshold,
            pack_size=pack_size,
            groups=groups,
        )

    if offsets is None or not caps.local_path or all(o < 0 for o in offsets):
        return packed(lengths)
    optimizer = [is_optimizer_path(path) for path in paths]
    kinds = [2 * g + o for g, o in zip(groups, optimizer, strict=True)] if groups else optimizer
    return PackPlan.in_region(
        lengths,
        offsets,
        object_size=settings.transport.multipart_threshold,
        gap=PAGE,
        rest=packed,
        groups=kinds,
    )


async def write_objects(
    store: Store,
    arrays: Sequence[np.ndarray[Any, Any]],
    plan: PackPlan,
    prefix: str,
    *,
    digests: LeafDigests | None = None,
) -> Written:
    """Write the objects of ``plan`` under ``prefix`` (every key is ``prefix + name``) and
    return their checksums. Returns once every object is durable; on a failure, only after
    every write has finished, so the caller can remove what was written
    (:func:`remove_objects`).

    Args:
        store: where to write.
        arrays: the leaves' bytes, one host array per leaf of the plan (any dtype, any
            strides: a pack copies each leaf once, gathering strided ones on the way).
        plan: which object and offset each leaf gets.
        prefix: the attempt's prefix, plus a writer's own part (``r3-``) when several write.
        digests: the leaves' hashing pass, whose crc32c a leaf written alone takes rather
            than hashing itself again.
    """
    writer = ObjectWriter(store, plan, prefix, arrays, digests=digests)
    await writer.write_all()
    return writer.written


class ObjectWriter:
    """Writes the objects of one plan, each as soon as its caller says its leaves are ready.

    :func:`write_objects` writes them all at once; a writer whose leaves become ready one
    after another (the DCP writer resolves its items one by one) calls :meth:`write` for each
    object once its leaves are in ``arrays``, so the first uploads overlap the preparation of
    the rest. Call :meth:`write` once per object, on one event loop.

    Args:
        store: where to write.
        plan: which object and offset each leaf gets.
        prefix: the attempt's prefix, plus a writer's own part (``r3-``) when several write;
            ``None`` while the session is still beginning: the packs are built meanwhile, and
            the writes wait for :meth:`start`.
        arrays: one host array per leaf; read when an object holding the leaf is written.
        digests: the leaves' hashing pass (:class:`LeafDigests`) if one runs: a leaf written
            alone waits for the crc32c it finds rather than reading its bytes again.
        hash_packs: find each packed leaf's xxh3-128 as its pack is built
            (:meth:`PackPlan.fill_digests`), into :attr:`leaf_hashes`.
        region: the host buffer the plan's in-region packs (``PlannedObject.start``) are
            cut from (:meth:`PackPlan.in_region`); the writer zeroes their padding.
    """

    def __init__(
        self,
        store: Store,
        plan: PackPlan,
        prefix: str | None,
        arrays: Sequence[np.ndarray[Any, Any]],
        *,
        digests: LeafDigests | None = None,
        hash_packs: bool = False,
        region: np.ndarray[Any, np.dtype[np.uint8]] | None = None,
    ) -> None:
        settings = store.settings
        self.region = region
        self.store = store
        self.digests = digests
        self.plan = plan
        self.prefix = prefix
        self._placed = asyncio.Event()
        if prefix is not None:
            self._placed.set()
        self.arrays = arrays
        self.written = Written([0] * len(plan.leaf_length), [0] * len(plan.objects))
        # Packs are built in pooled buffers; bound how many exist at once.
        self._pack_slots = asyncio.Semaphore(
            max(
                2,
                min(
                    settings.transport.max_concurrency,
                    settings.transport.max_inflight_bytes // settings.layout.pack_size,
                ),
            )
        )
        # Packs are built one at a time, in plan order: a build in Python is a loop over small
        # leaves that holds the GIL, so concurrent builds all finished together and no pack's
        # upload began until nearly all were built; one at a time, the first upload starts
        # after one build and the rest are built while it is in flight. (Handing the compiled
        # builds to the hashing pool at once saved 1-1.5 ms of the event loop between builds,
        # within the noise of 8 A/B rounds, and let 16 small packs be built before the first
        # upload began on a loaded machine.)
        self._build_lane = asyncio.Lock()
        self.hash_packs = hash_packs
        #: Per leaf, its xxh3-128 where its pack's build found it (``hash_packs``), else None.
        self.leaf_hashes: list[str | None] = [None] * len(plan.leaf_length)
        self._unchecked = len(plan.objects)
        self._unbuilt = sum(obj.packed for obj in plan.objects)
        #: Set once every object's checksums are in :attr:`written` (an object's are known
        #: when it is built, before it is durable) or its write failed (:attr:`failed`): the
        #: manifest can be built while the last writes are still in flight.
        self.checksummed = asyncio.Event()
        #: Whether a write failed (or was cancelled) before its checksums were known.
        self.failed = False
        if not self._unchecked:
            self.checksummed.set()
        if not self._unbuilt:
            self._packs_built()

    def start(self, prefix: str) -> None:
        """Let the writes of a writer made without a prefix go to ``prefix``: the session
        has begun (its lease landed), and data may be written under it."""
        if self.prefix is not None:
            raise RuntimeError(f"the writer already writes under {self.prefix!r}")
        self.prefix = prefix
        self._placed.set()

    async def _key(self, name: str) -> str:
        await self._placed.wait()
        assert self.prefix is not None  # set with _placed
        return self.prefix + name

    async def write_all(self) -> None:
        """Write every object of the plan; returns once all are durable, and on a failure
        only after every write has finished (the caller can then remove what was written)."""
        await gather_all((self.write(i) for i in range(len(self.plan.objects))), cancel=False)

    async def write(self, index: int) -> None:
        """Write object ``index`` of the plan; durable when this returns."""
        checked = False

        def known(leaf_crcs: Sequence[int], whole: int) -> None:
            nonlocal checked
            obj, written = self.plan.objects[index], self.written
            for leaf, crc in zip(obj.leaves, leaf_crcs, strict=True):
                written.leaf_crc[leaf] = crc
            written.object_crc[index] = whole
            checked = True
            self._checked(index)

        try:
            if self.plan.objects[index].packed:
                await self._write_pack(index, known)
            else:
                await self._write_leaf(index, known)
        finally:
            if not checked:
                self.failed = True
                self._checked(index)

    def _checked(self, index: int) -> None:
        self._unchecked -= 1
        if not self._unchecked:
            self.checksummed.set()
        if self.plan.objects[index].packed:
            self._unbuilt -= 1
            if not self._unbuilt:
                self._packs_built()

    def _packs_built(self) -> None:
        """Every pack is built (or its build failed): the hashing pass's turns that
        :meth:`LeafDigests.defer` held run now, taking the hashes the builds found."""
        if self.digests is not None:
            self.digests.resume(self.leaf_hashes if self.hash_packs else None)

    async def _write_leaf(self, index: int, known: Callable[[Sequence[int], int], None]) -> None:
        obj = self.plan.objects[index]
        (leaf,) = obj.leaves
        array = self.arrays[leaf]
        if not array.flags.c_contiguous:
            array = np.ascontiguousarray(array)
        view = as_uint8(array)
        crc = None if self.digests is None else await self.digests.crc(leaf)
        key = await self._key(obj.name)
        if crc is not None:
            put = asyncio.ensure_future(self.store.put(key, view, crc32c=crc))
            known((crc,), crc)  # after the put started (see _write_pack)
            await put
        else:
            # hashed once: with the put where the backend sends a checksum, else beside it
            crc = await self.store.put_crc32c(key, view)
            known((crc,), crc)

    async def _write_pack(self, index: int, known: Callable[[Sequence[int], int], None]) -> None:
        plan, store = self.plan, self.store
        obj = plan.objects[index]
        if obj.start is not None:
            await self._write_in_region(index, known)
            return
        async with self._pack_slots:
            pooled = host_buffers.acquire(max(obj.size, store.settings.layout.pack_size))
            try:
                buf = pooled.data[: obj.size]

                def build() -> tuple[list[int], list[str] | None, int]:
                    if self.hash_packs:
                        crcs, hashes = plan.fill_digests(index, self.arrays, buf)
                        return crcs, hashes, crc32c(buf)
                    return plan.fill(index, self.arrays, buf), None, crc32c(buf)

                async with self._build_lane:
                    crcs, hashes, whole = await in_hash_thread(build)
                key = await self._key(obj.name)
                # sent before the checksums are made known: the manifest that may be built
                # once they are would otherwise hold the GIL before this put reached its thread
                put = asyncio.ensure_future(store.put(key, buf, crc32c=whole))
                if hashes is not None:
                    for leaf, digest in zip(obj.leaves, hashes, strict=True):
                        self.leaf_hashes[leaf] = digest
                known(crcs, whole)
                await put
            except BaseException:
                pooled.discard()  # a cancelled build's thread may still fill it
                raise
            finally:
                pooled.release()

    async def _write_in_region(
        self, index: int, known: Callable[[Sequence[int], int], None]
    ) -> None:
        """Write a pack that is a slice of the region as it lies there: no build, no copy.
        Its padding is zeroed (the region is the writer's; its gaps held whatever an
        earlier save left), and its checksums are found from its leaves': the crc32c the
        hashing pass found for a leaf, else the leaf hashed here (with its xxh3-128 when
        ``hash_packs``), combined with the padding's."""
        plan, region = self.plan, self.region
        obj = plan.objects[index]
        if region is None or obj.start is None:
            raise ValueError(f"object {obj.name} of the plan lies in a region the writer lacks")
        body = region[obj.start : obj.start + obj.size]
        found: dict[int, int | None] = {}
        if self.digests is not None and not self.hash_packs:
            for leaf in obj.leaves:
                found[leaf] = await self.digests.crc(leaf)

        def checksums() -> tuple[list[int], list[str] | None, int]:
            views, at = [], 0
            for leaf in obj.leaves:
                offset, length = plan.leaf_offset[leaf], plan.leaf_length[leaf]
                if offset > at:
                    body[at:offset] = 0
                views.append(body[offset : offset + length])
                at = offset + length
            hashes: list[str] | None = None
            if self.hash_packs:
                found_hashes, found_crcs = leaf_digests(views, [True] * len(views))
                hashes = [h for h in found_hashes if h is not None]
                crcs = [c for c in found_crcs if c is not None]
            else:
                crcs = []
                for leaf, view in zip(obj.leaves, views, strict=True):
                    known_crc = found.get(leaf)
                    crcs.append(crc32c(view) if known_crc is None else known_crc)
            # The object's crc32c: each stretch of zeroed padding and small leaves is hashed
            # in one call over the body; a large leaf's own crc32c is combined in. A combine
            # is Python holding the GIL (10-30 us), so below COMBINE_MIN bytes hashing the
            # leaf once more is cheaper; and two calls per small leaf cost 20,000 leaves of
            # 4 KiB 0.15-0.39 s a save.
            whole, hashed = 0, 0
            for leaf, view, crc in zip(obj.leaves, views, crcs, strict=True):
                if len(view) < COMBINE_MIN:
                    continue
                offset = plan.leaf_offset[leaf]
                whole = crc32c(body[hashed:offset], whole)
                whole = crc32c_combine(whole, crc, len(view))
                hashed = offset + len(view)
            whole = crc32c(body[hashed:at], whole)
            return crcs, hashes, whole

        crcs, hashes, whole = await in_hash_thread(checksums)
        key = await self._key(obj.name)
        # sent before the checksums are made known (see _write_pack)
        put = asyncio.ensure_future(self.store.put(key, body, crc32c=whole))
        if hashes is not None:
            for leaf, digest in zip(obj.leaves, hashes, strict=True):
                self.leaf_hashes[leaf] = digest
        known(crcs, whole)
        await put


async def remove_objects(store: Store, prefix: str) -> None:
    """Remove what a failed or losing writer wrote under ``prefix``: an attempt's prefix
    (``<step>/<attempt>/``) or one writer's part of it (``<step>/<attempt>/r3-``).

    Best effort, and never raises: the objects are invisible without a manifest, and garbage
    collection removes whatever is left.
    """
    with contextlib.suppress(Exception):
        if prefix.endswith("/"):
            await store.delete_prefix(prefix)
        else:
            directory = prefix.rsplit("/", 1)[0] + "/"
            keys = await store.list_keys(directory)
            await store.delete([k for k in keys if k.startswith(prefix)])


async def _settle_then_keep_or_abandon(store: Store, attempt: Attempt) -> None:
    with contextlib.suppress(Exception):
        await store.settle()
    with contextlib.suppress(NotFoundError, CorruptCheckpointError):
        if (await read_manifest(store, attempt.step)).attempt == attempt.id:
            return  # the put landed: the step is committed, whatever the caller sees
    await remove_objects(store, attempt.prefix)


async def commit_attempt(
    store: Store,
    attempt: Attempt,
    manifest: Manifest,
    *,
    encoded: bytes | None = None,
    log: bool = True,
) -> CommitInfo:
    """The last steps of the protocol, once every object ``manifest`` names is durable.

    Refuses to commit if the attempt's lease lapsed (a concurrent garbage collection may
    have removed its data; :mod:`ckptstore.layout.lease`) and a manifest over
    ``Settings.manifest_max_bytes``; then :func:`commit_manifest`. An attempt that loses the
    step to another removes its objects.

    Raises:
        CkptStoreError: the attempt's lease lapsed; nothing is committed.
        ValueError: the manifest is too large; nothing is committed.
        CommitConflictError: another attempt committed the step first.
        StoreError: every try of the manifest put failed; the step may or may not be
            committed, so the data is left in place.
    """
    try:
        return await _commit_leased(store, attempt, manifest, encoded, log)
    finally:
        if attempt.lease is not None:
            await attempt.lease.release()


async def _commit_leased(
    store: Store, attempt: Attempt, manifest: Manifest, encoded: bytes | None, log: bool
) -> CommitInfo:
    if attempt.lease is not None:
        attempt.lease.check()  # no gc can have removed the data, nor can before the commit
    data = (
        encode_checked(manifest, store.settings.layout.manifest_max_bytes)
        if encoded is None
        else encoded
    )
    try:
        await commit_manifest(store, manifest, encoded=data)
    except asyncio.CancelledError:
        # Interrupted around the manifest put: once the write in flight has ended, the step
        # is either committed by this attempt (kept) or not (its objects removed).
        await asyncio.shield(_settle_then_keep_or_abandon(store, attempt))
        raise
    except CommitConflictError:
        # Another attempt's manifest is in place, so this attempt's objects can never become
        # visible: remove them now rather than leave them to garbage collection.
        await remove_objects(store, attempt.prefix)
        raise
    referenced = manifest.references()
    info = CommitInfo(
        attempt.step,
        attempt.id,
        len(manifest.object_keys) - len(referenced),
        manifest.own_bytes,
        len(data),
        len(referenced),
        manifest.referenced_bytes,
        tuple(sorted(manifest.referenced_attempts())),
    )
    if log and _log.isEnabledFor(logging.INFO):
        seconds = max(time.time() - attempt.started, 0.0)
        _log.info(
            "saved step %d to %s: %d objects, %.1f MiB written (%.1f MiB referenced) in "
            "%.2f s, %.1f MiB/s",
            info.step,
            store.url,
            info.objects,
            info.nbytes / 2**20,
            info.referenced_bytes / 2**20,
            seconds,
            info.nbytes / 2**20 / max(seconds, 1e-6),
        )
    return info


def encode_checked(manifest: Manifest, max_bytes: int) -> bytes:
    """``manifest.encode()``, refused over ``max_bytes`` (``Settings.manifest_max_bytes`` of
    the store it commits to, which no reader would load a larger manifest from).

    Raises:
        ValueError: the manifest is too large; nothing is committed.
    """
    data = manifest.encode()
    if len(data) > max_bytes:
        raise ValueError(
            f"the manifest of step {manifest.step} is {len(data)} bytes, over "
            f"Settings.manifest_max_bytes ({max_bytes}); raise it or save fewer, larger arrays"
        )
    return data


async def commit_manifest(
    store: Store, manifest: Manifest, *, encoded: bytes | None = None
) -> None:
    """Commit ``manifest`` for its attempt: the last step of the commit protocol.

    Call it only once every object the manifest names is durable (invariant 2). The manifest
    is written to ``<step>/manifest.json`` with one put-if-absent, retried as the store
    retries every request (a network backend's transport: ``Settings.retry_attempts`` within
    ``Settings.request_deadline``; a local or NFS directory: not at all), and this function
    never puts it again: one retry policy, not a loop of retries around another.
    When the manifest already exists, or the put failed (it may have landed with only its
    answer lost), the manifest is read back: if it carries ``manifest.attempt``, this
    attempt committed; if another attempt's, that one committed the step first.

    Args:
        store: the checkpoint root.
        manifest: the manifest to commit; its ``step`` and ``attempt`` decide where it goes
            and whether an existing manifest is this attempt's own.
        encoded: ``manifest.encode()``, if the caller already has it (saves encoding twice).

    Raises:
        CommitConflictError: another attempt's manifest (or an invalid one) holds the step;
            this attempt stays invisible and its objects may be deleted.
        StoreError: the put failed and no manifest could be read back, or one exists that
            could not be read: whether this attempt committed is unknown, so its data must
            be left in place.
    """
    step, attempt = manifest.step, manifest.attempt
    data = manifest.encode() if encoded is None else encoded
    key = manifest_key(step)
    failed: StoreError | None = None
    try:
        await store.put(key, data, mode="create")
    except AlreadyExistsError:
        pass
    except StoreError as exc:
        failed = exc
    else:
        return
    try:
        if failed is None:
            existing = await _read_existing_manifest(store, step)
        else:
            existing = await _read_after_failed_put(store, step, failed)
    except CorruptCheckpointError as exc:
        raise CommitConflictError(
            f"{store.url}/{key}: step {step} already has a manifest, and it is invalid ({exc})"
        ) from None
    if existing.attempt == attempt:
        return  # our own put landed; only its answer was lost
    raise CommitConflictError(
        f"{store.url}/{key}: step {step} was committed by attempt {existing.attempt} first; "
        f"this attempt ({attempt}) stays invisible"
    )


async def _read_back(store: Store, step: int, waits: tuple[float, ...]) -> Manifest | None:
    """The manifest of ``step``, read again after each of ``waits`` while a read does not
    find it (lookups can lag a create); ``None`` if the last read does not find it either."""
    for wait in (*waits, None):
        try:
            return await read_manifest(store, step)
        except NotFoundError:
            if wait is None:
                return None
            _log.debug("%s: step %d manifest not visible yet; reading again", store.url, step)
            await asyncio.sleep(wait)
    raise AssertionError("unreachable")


async def _read_after_failed_put(store: Store, step: int, failed: StoreError) -> Manifest:
    """Read the manifest of ``step`` after its put failed with ``failed``: the put may have
    landed with only its answer lost. Raises ``failed`` when no manifest is found within
    :data:`FAILED_PUT_REREAD_WAITS`, or the read fails too."""
    try:
        manifest = await _read_back(store, step, FAILED_PUT_REREAD_WAITS)
    except StoreError as exc:
        failed.add_note(f"reading the manifest back to see whether the put landed: {exc}")
        raise failed from None
    if manifest is not None:
        return manifest
    failed.add_note(
        f"no manifest of step {step} was found after the failed put: the step is not "
        "committed, or its manifest is not visible yet; this attempt's data is left for "
        "garbage collection"
    )
    raise failed


async def _read_existing_manifest(store: Store, step: int) -> Manifest:
    """Read the manifest a put-if-absent was refused by, within
    :data:`MANIFEST_REREAD_WAITS` (lookups can lag the create).

    Raises:
        StoreError: it stayed unreadable: whether this attempt committed is unknown, so its
            data is left in place (garbage collection decides later).
    """
    manifest = await _read_back(store, step, MANIFEST_REREAD_WAITS)
    if manifest is not None:
        return manifest
    waited = sum(MANIFEST_REREAD_WAITS)
    raise StoreError(
        f"{store.url}/{manifest_key(step)}: the put-if-absent found a manifest for step {step}, "
        f"but it could not be read back within {waited:.1f} s (removed since, or the "
        "filesystem's lookups lag); whether this attempt committed is unknown, so its data "
        "is left for garbage collection"
    )


# ---------------------------------------------------------------------- reading the index


async def read_manifest(
    store: Store, step: int, *, under: str = "", shared: bool = False
) -> Manifest:
    """Read and validate the manifest of ``step``.

    Args:
        under: the prefix of a root inside ``store`` (``"name/"``), for a caller that reads
            the manifests of many roots side by side (Lightning's checkpoints in a directory).
        shared: the caller only reads the manifest: the bytes read are parsed by
            :meth:`Manifest.parse_shared`, which spares the parse of bytes it parsed lately.

    Raises:
        NotFoundError: the step is not committed.
        CorruptCheckpointError: the manifest fails validation (or is over the size cap,
            which is checked before reading it).
    """
    check_step(step)
    key = under + manifest_key(step)
    cap = store.settings.layout.manifest_max_bytes
    try:
        meta = await store.head(key)
        if meta.size > cap:
            raise CorruptCheckpointError(
                f"{store.url}/{key}: manifest is {meta.size} bytes, over the {cap}-byte cap "
                "(Settings.manifest_max_bytes); not reading it"
            )
        data = await store.get(key)
    except BucketNotFoundError:
        raise  # not the step: nothing under the URL can be found
    except NotFoundError:
        raise NotFoundError(f"{store.url}: step {step} is not committed (no {key})") from None
    parse = Manifest.parse_shared if shared else Manifest.parse
    return parse(data, step=step, max_bytes=cap, source=f"{store.url}/{key}")


async def _step_candidates(store: Store) -> list[int]:
    steps = [parse_step(p) for p in await store.list_prefixes("")]
    return sorted((s for s in steps if s is not None), reverse=True)


async def committed_steps(store: Store) -> list[int]:
    """Steps with a manifest, ascending (one listing plus one ``head`` per step directory).

    A manifest is not validated here; :func:`read_manifest` does that.
    """
    candidates = await _step_candidates(store)
    present = await gather_all(store.exists(manifest_key(s)) for s in candidates)
    return sorted(s for s, ok in zip(candidates, present, strict=True) if ok)


async def latest_step(store: Store) -> int | None:
    """The highest step with a manifest, or ``None`` if nothing is committed."""
    return await _newest_committed(store, await _step_candidates(store))


#: The most ``head`` requests :func:`_newest_committed` has in flight at once.
NEWEST_WINDOW = 32


async def _newest_committed(store: Store, steps: Sequence[int]) -> int | None:
    """The first of ``steps`` (newest first) that has a manifest, or ``None``.

    Asked in windows of 1, 2, 4, ... up to :data:`NEWEST_WINDOW` steps, the windows' heads
    at once: the newest step, committed on a root in use, costs one request, and a run of
    step directories with none (attempts in flight, or left by a crash) a few round trips,
    not one each.
    """
    start, window = 0, 1
    while start < len(steps):
        chunk = steps[start : start + window]
        present = await gather_all(store.exists(manifest_key(s)) for s in chunk)
        for s, ok in zip(chunk, present, strict=True):
            if ok:
                return s
        start += window
        window = min(2 * window, NEWEST_WINDOW)
    return None


def is_own_key(key: str) -> bool:
    """Whether ``key`` has a shape ckptstore writes: a manifest or an object under an
    attempt prefix of a step."""
    parts = key.split("/")
    if len(parts) < 2 or parse_step(parts[0]) is None:
        return False
    if len(parts) == 2:
        return parts[1] == MANIFEST_NAME
    return ATTEMPT_RE.fullmatch(parts[1]) is not None


async def delete_step(store: Store, step: int) -> None:
    """Delete a step, keeping what later steps reference: see
    :func:`ckptstore.layout.references.delete_step`.

    Raises:
        NotFoundError: there is nothing of ``step`` to delete.
    """
    # imported here: the references module builds on this one
    from ckptstore.layout.references import delete_step as delete_referenced

    await delete_referenced(store, step)
