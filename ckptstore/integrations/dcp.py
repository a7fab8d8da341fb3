"""ckptstore as the storage layer of ``torch.distributed.checkpoint`` (DCP).

``dcp.save(state, storage_writer=Writer("s3://bucket/run/step100"))`` stores a DCP checkpoint
on any ckptstore URL, and ``dcp.load(state, storage_reader=Reader(...))`` reads it back, with
DCP's planning and resharding unchanged. What this layer adds to DCP's own file writers:

* **Commit.** Every rank writes its objects under one fresh attempt prefix
  (``<url>/<attempt>/r<rank>-pack-<n>``, ``...-leaf-<n>``), drawn by the coordinator in
  ``prepare_global_plan``.
  DCP gathers every rank's write results to the coordinator, whose ``finish`` writes
  ``<url>/manifest.json`` with one put-if-absent, after every object is durable. A checkpoint
  is visible if and only if that manifest exists; a rank that fails or dies makes DCP skip
  ``finish``, so nothing becomes visible and the attempt's objects are garbage for ``gc``.
  No rename is involved, so this is as safe on S3 and GCS as on a local disk.
* **No pickle from storage.** DCP's ``Metadata`` goes into the manifest as JSON
  (:mod:`ckptstore.integrations.dcp_manifest`) and is validated before any data read.
* **One save path.** Items are planned, packed, written and committed by the same pipeline
  as every other save (:mod:`ckptstore.pipeline.save`): items under ``pack_threshold`` bytes
  are copied into pooled pack objects of up to ``pack_size`` bytes at
  ``Settings.leaf_alignment``, so thousands of small tensors cost a handful of PUTs; larger
  tensors are written straight from their memory, one object each, as parallel multipart
  uploads. Every dtype the manager stores is accepted (bfloat16, complex32, each float8).
* **Incremental.** As on every face, a save records each item's xxh3-128 and, when the root's
  newest committed step is a DCP checkpoint, does not write again an item whose bytes are
  unchanged in an object whose every item is: the manifest references that step's object. The
  coordinator holds every object of that step for the attempt in ``prepare_global_plan``,
  before any rank writes, so each rank may reference any of them.
* **Verified parallel reads.** Each rank fetches just the items its load plan names, as ranged
  reads merged per object and issued in parallel, straight into the destination tensors where
  their layout allows, and checks every item's crc32c.

Both classes pickle without their open store (DCP's process-based ``async_save`` sends the
writer to another process), and reopen it on first use there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import io
import math
import os
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ckptstore import background
from ckptstore.errors import (
    AlreadyExistsError,
    CheckpointFormatError,
    CommitConflictError,
    CorruptCheckpointError,
    NotFoundError,
)
from ckptstore.integrations.dcp_manifest import (
    ItemLocation,
    build_manifest,
    dtype_from_name,
    dtype_name,
    is_dcp_manifest,
    leaf_dtype,
    leaf_path,
    read_dcp_metadata,
)
from ckptstore.integrations.tensor_objects import CheckpointTarget, host_bytes, served
from ckptstore.pipeline import save as save_path
from ckptstore.pipeline.restore import find_manifest, read_leaves
from ckptstore.pipeline.root import check_options
from ckptstore.pipeline.save import Attempt, PackPlan, Reuse, SaveSession, Written
from ckptstore.pipeline.steps import (
    Manifest,
    latest_step,
    manifest_key,
    step_prefix,
)
from ckptstore.store.base import Store
from ckptstore.store.checksum import crc32c
from ckptstore.store.fanout import gather_all
from ckptstore.store.transport import redact_url

__all__ = ["Reader", "Writer"]


@dataclass(frozen=True, slots=True)
class _AttemptPrefix:
    """What the coordinator hands each rank in ``SavePlan.storage_data``: its session's
    ticket (the attempt), the rank's part of it, and the step an incremental save compares
    with (held for the session), if any."""

    attempt: Attempt
    rank: int
    base_step: int | None = None


# =========================================================================== writer


class _AtCheckpoint:
    """What the writer and the reader share: the one checkpoint URL they work on."""

    _target: CheckpointTarget

    def _aim(
        self, url: str | os.PathLike[str] | Store, step: int | None, options: dict[str, Any]
    ) -> None:
        check_options(url, options)  # a bad option fails here, as on every face
        self._target = CheckpointTarget(url, step, options)

    def _follow(self, checkpoint_id: str | os.PathLike[str] | None) -> None:
        """Point at the ``checkpoint_id`` DCP passes to ``reset``, if any."""
        if checkpoint_id is not None:
            self._target.point_at(checkpoint_id)

    @property
    def url(self) -> str:
        """The checkpoint URL this object saves to or loads from."""
        return self._target.url

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint URL (DCP logs it under this name)."""
        return self._target.url

    def close(self) -> None:
        """Close the store this object opened (it reopens on next use)."""
        self._target.handle.close()


class Writer(_AtCheckpoint, StorageWriter):
    """A DCP ``StorageWriter`` that stores one checkpoint at a ckptstore URL.

    Args:
        url: where the checkpoint goes (``/path``, ``s3://bucket/run/step100``, ...), or an
            open :class:`~ckptstore.Store` (a pickled writer reopens it by its URL); a
            ``checkpoint_id`` given to ``dcp.save`` replaces it.
        pack_threshold: items smaller than this many bytes are packed together; default
            ``Settings.pack_threshold``, as on every face (1 MiB).
        pack_size: target size of one pack object, in bytes; default ``Settings.pack_size``
            (8 MiB).
        incremental: write only the items whose bytes changed since the root's newest
            committed step (a DCP checkpoint) and reference that step's objects for the rest,
            as every face does; default ``Settings.incremental`` (on). Each item's
            xxh3-128 is recorded either way, for the next save to compare with.
        **options: store options and Settings fields, as for :func:`ckptstore.open_store`.

    The same URL must not already hold a committed checkpoint: the coordinator checks before
    anything is written, and the commit itself is put-if-absent, so of two concurrent saves
    to one URL exactly one succeeds and the other raises
    :class:`~ckptstore.errors.CommitConflictError`.
    """

    def __init__(
        self,
        url: str | os.PathLike[str] | Store,
        *,
        step: int | None = None,
        pack_threshold: int | None = None,
        pack_size: int | None = None,
        incremental: bool | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        if (pack_threshold is not None and pack_threshold < 0) or (
            pack_size is not None and pack_size <= 0
        ):
            raise ValueError(
                f"pack_threshold must be >= 0 and pack_size > 0, got {pack_threshold} and "
                f"{pack_size}"
            )
        self._aim(url, step, options)
        self.pack_threshold = pack_threshold
        self.pack_size = pack_size
        self.incremental = incremental
        self.save_id = uuid.uuid4().hex
        self._is_coordinator = False
        self._rank = 0
        self._attempt: Attempt | None = None
        #: The session this coordinator began, holding its lease (ckptstore.layout.lease).
        self._session: SaveSession | None = None

    # ------------------------------------------------------------- DCP's calls, in order

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        # docstring inherited
        self._follow(checkpoint_id)
        self.save_id = uuid.uuid4().hex
        self._attempt = None
        if self._session is not None:
            background.run(self._session.release())  # a save that never reached finish()
        self._session = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        # docstring inherited
        self._is_coordinator = is_coordinator
        self._rank = int(kwargs.get("rank") or 0)
        if kwargs.get("use_collectives", True) is False:
            raise ValueError(
                "ckptstore.dcp.Writer commits once from the coordinator and needs DCP's "
                "collectives; call dcp.save with use_collectives=True"
            )

    def storage_meta(self) -> StorageMeta | None:
        # docstring inherited
        # DCP keeps this in the checkpoint's metadata and may show it: never a credential
        return StorageMeta(checkpoint_id=redact_url(self.url), save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # docstring inherited
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # docstring inherited
        store = self._target.store
        try:
            session = self._begin(store, self._target.step)
        except BaseException:
            # DCP calls nothing more after a failed plan: the client opened for it closes
            # now, not as an "Unclosed client session" at exit
            self._target.handle.release()
            raise
        try:
            base_step = background.run(self._hold_base(session))
        except BaseException:
            background.run(session.abandon())
            self._target.handle.release()
            raise
        self._session = session  # it holds the lease; the ranks get its ticket
        return [
            SavePlan(
                items=plan.items,
                storage_data=_AttemptPrefix(session.ticket, rank, base_step),
                planner_data=plan.planner_data,
                usable=plan.usable,
            )
            for rank, plan in enumerate(plans)
        ]

    def _begin(self, store: Store, step: int) -> SaveSession:
        """Begin the session at ``step``, refusing a step the root holds or is past.

        Raises:
            CommitConflictError: ``step`` is below the root's newest step.
            AlreadyExistsError: ``step`` is committed.
        """
        newest = background.run(latest_step(store))
        if newest is not None and step < newest:
            raise CommitConflictError(
                f"{store.url}: cannot save step {step}: the newest step of this root is "
                f"{newest}, and a step is saved once, in increasing order. To resume that "
                "run, dcp.load from ckptstore.dcp.Reader('<root>/<newest>') "
                "(ckptstore.list_steps(root)[-1]) and save the steps after it; to go back "
                "to an older step and save the steps after it again, "
                "ckptstore.rollback(root, step) sets the newer ones aside first; or save "
                "to a new root"
            )
        try:
            return background.run(SaveSession.begin(store, step))
        except CommitConflictError:
            raise AlreadyExistsError(
                f"{self.url} already holds a committed checkpoint (step {step} of "
                f"{store.url}); save to a new URL (checkpoints are immutable)"
            ) from None

    def _incremental(self, store: Store) -> bool:
        return store.settings.layout.incremental if self.incremental is None else self.incremental

    async def _hold_base(self, session: SaveSession) -> int | None:
        """The step an incremental save compares with: the root's newest committed step, if
        it is a DCP checkpoint, with all its objects held for ``session`` before any rank
        writes, so a rank may reference any of them; ``None`` for a full save."""
        if not self._incremental(session.store):
            return None
        base = await session.hold_base(accept=is_dcp_manifest)
        return None if base is None else base.step

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Plan, pack and write this rank's items with the one save pipeline
        (:mod:`ckptstore.pipeline.save`).

        Tensor items are planned from DCP's metadata before any is resolved; each object is
        written on the background loop as soon as its items are resolved, so the first
        uploads overlap the resolution (device copies, serialisation) of the rest. Returns a
        future that completes, with one ``WriteResult`` per item, once every object of this
        rank is durable. On a failure this rank's objects are removed (best effort).

        An incremental save (:class:`Writer`'s ``incremental``) records each item's xxh3-128,
        hashed while the objects are written. With a base step to compare with, every item is
        resolved and hashed first; an item whose name, dtype, shape and hash equal the
        base's, in a base object whose every item is unchanged, is not written: its result
        points at the base's bytes (:func:`ckptstore.pipeline.save.reuse`, the rule of every
        face).
        """
        given = plan.storage_data
        if not isinstance(given, _AttemptPrefix):
            raise TypeError(
                "SavePlan.storage_data was not set by ckptstore.dcp.Writer.prepare_global_plan"
            )
        self._attempt = given.attempt
        store, handle, coordinator = self._target.store, self._target.handle, self._is_coordinator
        prefix = f"{given.attempt.prefix}r{given.rank}-"
        items = list(plan.items)
        arrays: list[Any] = [None] * len(items)
        keep: list[object] = []  # owners of the arrays' memory, alive until the writes end
        lengths = []
        for leaf, item in enumerate(items):
            if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
                arrays[leaf], owner = _resolve(planner, item)  # serialised now: sized by it
                keep.append(owner)
                lengths.append(arrays[leaf].nbytes)
            else:
                lengths.append(_planned_bytes(item))

        def resolve(leaf: int) -> None:
            """Resolve item ``leaf`` into ``arrays`` unless it already is."""
            if arrays[leaf] is None:
                arrays[leaf], owner = _resolve(planner, items[leaf], lengths[leaf])
                keep.append(owner)

        hashing = self._incremental(store)
        base = None
        if hashing and given.base_step is not None:
            base = background.run(save_path.read_base(store, given.base_step))
        reuse: Reuse | None = None
        hashes: list[str | None] | None = None
        if base is not None:
            for leaf in range(len(items)):  # every item is compared before planning
                resolve(leaf)
            hashes = background.run(save_path.hashes(arrays))
            reuse = save_path.reuse(
                base,
                [leaf_path(item.index, item.tensor_data is not None) for item in items],
                [leaf_dtype(_typeinfo(item)[0]) for item in items],
                [_leaf_shape(item, length) for item, length in zip(items, lengths, strict=True)],
                hashes,
            )
        packing = save_path.plan(
            store,
            lengths,
            [item.index.fqn for item in items],
            pack_threshold=self.pack_threshold,
            pack_size=self.pack_size,
            reuse=reuse,
        )
        writer = save_path.object_writer(store, packing, prefix, arrays)
        writes: list[concurrent.futures.Future[None]] = []

        async def abandon() -> None:
            # wait for the writes already started (a write cannot be stopped halfway), then
            # remove what they wrote
            await asyncio.gather(*(asyncio.wrap_future(w) for w in writes), return_exceptions=True)
            await save_path.discard(store, prefix)
            await handle.arelease()

        async def settle_writes() -> list[WriteResult]:
            digests = hashes
            try:
                if hashing and digests is None:  # hashed while the objects are written
                    digests = await _hashed_while(arrays, [asyncio.wrap_future(w) for w in writes])
                else:
                    await gather_all((asyncio.wrap_future(w) for w in writes), cancel=False)
            except BaseException:
                await abandon()
                raise
            if not coordinator:  # the coordinator commits in finish(), with the same store
                await handle.arelease()
            return _results(items, packing, writer.written, prefix, digests, reuse)

        try:
            for number, obj in enumerate(packing.objects):
                for leaf in obj.leaves:
                    resolve(leaf)
                writes.append(background.submit(writer.write(number)))
            if hashing:  # empty items take no object, but are hashed too
                for leaf in range(len(items)):
                    resolve(leaf)
        except BaseException:
            background.submit(abandon())
            raise

        future: Future[list[WriteResult]] = Future()

        def settle(done: concurrent.futures.Future[list[WriteResult]]) -> None:
            keep.clear()
            error = done.exception()
            if error is None:
                future.set_result(done.result())
            else:
                future.set_exception(error)  # type: ignore[arg-type]  # torch's stub is wrong

        background.submit(settle_writes()).add_done_callback(settle)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Commit: write the manifest with one put-if-absent (coordinator only), through the
        session's commit (:meth:`ckptstore.pipeline.save.SaveSession.commit`).

        A retry that finds the manifest of its own attempt succeeds; a manifest of another
        attempt raises :class:`~ckptstore.errors.CommitConflictError`.
        """
        if self._attempt is None:
            raise RuntimeError("finish() called before write_data()")
        attempt = self._attempt
        session = self._session
        if session is None or session.attempt.id != attempt.id:
            # a coordinator that did not begin it (DCP passed the plan on): no lease to check
            session = SaveSession(self._target.store, attempt)
        self._session = None
        locations: dict[MetadataIndex, ItemLocation] = {}
        for rank_results in results:
            for result in rank_results:
                if not isinstance(result.storage_data, ItemLocation):
                    raise TypeError(f"write result of {result.index.fqn} was not written here")
                locations[result.index] = result.storage_data
        # DCP's planners leave storage_meta to the writer (its FileSystemWriter sets it here
        # too); without it a reader cannot tell which save it loads.
        metadata.storage_meta = self.storage_meta()
        manifest = build_manifest(
            attempt.step,
            attempt.id,
            metadata,
            locations,
            object_prefix=step_prefix(attempt.step),
        )
        try:
            background.run(session.commit(manifest))
        finally:
            self._target.handle.release()
        metadata.storage_data = locations

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        # docstring inherited
        return served(checkpoint_id)


def _planned_bytes(item: WriteItem) -> int:
    """The bytes of a tensor item, from DCP's metadata (its dtype checked against the table)."""
    assert item.tensor_data is not None
    dtype = item.tensor_data.properties.dtype
    dtype_name(dtype)  # refuses a dtype outside the table before anything is written
    return math.prod(item.tensor_data.chunk.sizes) * dtype.itemsize


def _resolve(
    planner: SavePlanner, item: WriteItem, planned: int | None = None
) -> tuple[np.ndarray[Any, Any], object]:
    """The bytes of one item as a flat ``uint8`` array, and the object that owns them.

    Raises:
        ValueError: the planner resolved a tensor of another size than ``planned``.
    """
    data = planner.resolve_data(item)
    if item.type == WriteItemType.BYTE_IO:
        if not isinstance(data, io.BytesIO):
            raise TypeError(
                f"{item.index.fqn}: planner returned {type(data).__name__}, not BytesIO"
            )
        raw = data.getvalue()
        return np.frombuffer(raw, dtype=np.uint8), raw
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"{item.index.fqn}: planner returned {type(data).__name__}, not a tensor")
    tensor, array = host_bytes(data)
    if planned is not None and array.nbytes != planned:
        raise ValueError(
            f"{item.index.fqn}: the planner resolved {array.nbytes} bytes of tensor data; its "
            f"write item describes {planned}"
        )
    return array, tensor


def _results(
    items: list[WriteItem],
    plan: PackPlan,
    written: Written,
    prefix: str,
    hashes: list[str | None] | None = None,
    reuse: Reuse | None = None,
) -> list[WriteResult]:
    """DCP's write results: where each item landed, in one pass over the plan; an item
    ``reuse`` takes from the base lies where the base keeps it."""
    objects = plan.objects
    results = []
    for leaf, item in enumerate(items):
        number = plan.leaf_object[leaf]
        source = -1 if reuse is None else reuse.leaf_source[leaf]
        digest = None if hashes is None else hashes[leaf]
        if source >= 0:
            assert reuse is not None
            loc = ItemLocation.of_leaf(
                reuse.base, source, *_typeinfo(item), hash=digest, referenced=True
            )
            results.append(
                WriteResult(index=item.index, size_in_bytes=loc.length, storage_data=loc)
            )
            continue
        if number < 0:  # an empty item takes no object
            key, object_size, object_crc = "", 0, 0
        else:
            key = prefix + objects[number].name
            object_size, object_crc = objects[number].size, written.object_crc[number]
        loc = ItemLocation(
            key,
            plan.leaf_offset[leaf],
            plan.leaf_length[leaf],
            written.leaf_crc[leaf],
            object_size,
            object_crc,
            *_typeinfo(item),
            hash=digest,
        )
        results.append(WriteResult(index=item.index, size_in_bytes=loc.length, storage_data=loc))
    return results


async def _hashed_while(arrays: list[Any], writes: list[asyncio.Future[None]]) -> list[str | None]:
    """The items' xxh3-128, hashed while their ``writes`` run. Returns (or raises the first
    failure) once both have ended: the hashing reads the arrays, which must outlive it."""
    outcomes: list[Any] = await asyncio.gather(
        save_path.hashes(arrays), gather_all(writes, cancel=False), return_exceptions=True
    )
    hashed, written = outcomes
    for outcome in (written, hashed):
        if isinstance(outcome, BaseException):
            raise outcome
    return list(hashed)


def _leaf_shape(item: WriteItem, length: int) -> list[int]:
    """The shape of an item's leaf in the manifest: a tensor chunk's, or a bytes item's
    length."""
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return [length]
    return list(item.tensor_data.chunk.sizes)


def _typeinfo(item: WriteItem) -> tuple[str | None, tuple[int, ...] | None]:
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return None, None
    return dtype_name(item.tensor_data.properties.dtype), tuple(item.tensor_data.chunk.sizes)


# =========================================================================== reader


class Reader(_AtCheckpoint, StorageReader):
    """A DCP ``StorageReader`` for checkpoints written by :class:`Writer`.

    Args:
        url: the checkpoint URL or an open :class:`~ckptstore.Store`; a ``checkpoint_id``
            given to ``dcp.load`` replaces it.
        **options: store options and Settings fields, as for :func:`ckptstore.open_store`.
    """

    def __init__(
        self, url: str | os.PathLike[str] | Store, *, step: int | None = None, **options: Any
    ) -> None:
        super().__init__()
        self._aim(url, step, options)
        self.load_id = uuid.uuid4().hex
        self._manifest: Manifest | None = None
        self._locations: dict[MetadataIndex, ItemLocation] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        # docstring inherited
        self._follow(checkpoint_id)
        self.load_id = uuid.uuid4().hex
        self._manifest = None
        self._locations = {}

    def read_metadata(self, *args: Any, **options: Any) -> Metadata:
        """Read and validate the manifest; every rank calls this.

        Raises:
            NotFoundError: the URL holds no committed checkpoint.
            CorruptCheckpointError: the manifest fails validation.
        """
        # The keyword parameter is deliberately not named ``kwargs``: DCP probes for that name
        # to decide whether to fall back to per-rank metadata, which ckptstore never writes.
        if options.get("rank") is not None:
            raise NotFoundError(f"{self.url}: ckptstore writes no per-rank metadata")
        try:
            metadata = self._metadata()
        except BaseException:
            # DCP calls nothing more after a failed read_metadata: the client opened for it
            # closes now, not as an "Unclosed client session" at exit
            self._target.handle.release()
            raise
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _metadata(self) -> Metadata:
        """The DCP metadata of the checkpoint's manifest, which is kept for the reads."""
        store, step = self._target.store, self._target.step
        try:
            manifest = background.run(find_manifest(store, step))
        except NotFoundError:
            raise NotFoundError(
                f"{self.url} holds no committed checkpoint (no manifest for step {step} of "
                f"{store.url}); the save may not have finished"
            ) from None
        if not isinstance(manifest.metadata, dict) or "dcp" not in manifest.metadata:
            raise CheckpointFormatError(
                f"{self.url}: step {step} of {store.url} is a ckptstore checkpoint, not a DCP "
                "one; read it with ckptstore.load or CheckpointManager.restore"
            )
        metadata = read_dcp_metadata(manifest, f"{store.url}/{manifest_key(step)}")
        self._manifest = manifest
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        # docstring inherited
        locations = metadata.storage_data
        if not isinstance(locations, dict) or not all(
            isinstance(loc, ItemLocation) for loc in locations.values()
        ):
            raise TypeError("this Metadata was not read by ckptstore.dcp.Reader.read_metadata")
        if self._manifest is None:  # DCP handed over metadata another reader read
            try:
                self._manifest = background.run(
                    find_manifest(self._target.store, self._target.step)
                )
            except BaseException:
                self._target.handle.release()  # as after a failed read_metadata
                raise
        self._locations = locations

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        # docstring inherited
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        # docstring inherited
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Fetch the items of ``plan`` with parallel ranged reads, verify, and deliver them.

        A stored tensor chunk whose destination is a contiguous CPU tensor of the same dtype
        and shape is read straight into the destination; others go through a scratch buffer
        and are narrowed and copied as DCP's plan says.
        """
        if self._manifest is None:
            raise RuntimeError("read_data() called before set_up_storage_reader()")
        reads = _ReadPlan(self._manifest, self._locations, plan.items, planner)
        try:
            background.run(reads.fetch(self._target.store))
        finally:
            self._target.handle.release()
        reads.deliver(planner, self.url)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        # docstring inherited
        return served(checkpoint_id)


class _ReadPlan:
    """The manifest leaves one rank's load plan reads, and where each lands.

    DCP's planner decides which items a rank reads and where they go; the reading and the
    verification are the restore path's (:func:`ckptstore.layout.restore.read_leaves`, as
    for every face): each item is a leaf of the manifest, read into the destination tensor's
    own memory where its layout allows, else into a fresh array, and its crc32c checked.
    """

    def __init__(
        self,
        manifest: Manifest,
        locations: dict[MetadataIndex, ItemLocation],
        items: Iterable[ReadItem],
        planner: LoadPlanner,
    ) -> None:
        self.manifest = manifest
        self.items = list(items)
        uses: dict[MetadataIndex, int] = {}
        for req in self.items:
            uses[req.storage_index] = uses.get(req.storage_index, 0) + 1
        # the leaf of each stored byte range (empty items have no object and are not read)
        leaf_at = {
            (manifest.object_key(obj), manifest.leaf_offset[leaf]): leaf
            for leaf, obj in enumerate(manifest.leaf_object)
            if obj >= 0
        }
        #: storage index -> (location, its leaf or None when empty)
        self.leaves: dict[MetadataIndex, tuple[ItemLocation, int | None]] = {}
        self.direct: dict[MetadataIndex, torch.Tensor] = {}
        self.into: dict[int, np.ndarray[Any, Any]] = {}
        self.arrays: dict[int, np.ndarray[Any, Any]] = {}
        for req in self.items:
            try:
                loc = locations[req.storage_index]
            except KeyError:
                raise CorruptCheckpointError(
                    f"the manifest has no item {req.storage_index.fqn} at "
                    f"{req.storage_index.offset}"
                ) from None
            if req.storage_index in self.leaves:
                continue
            leaf = leaf_at.get((loc.key, loc.start)) if loc.length else None
            if loc.length and leaf is None:
                raise CorruptCheckpointError(
                    f"{req.storage_index.fqn}: no manifest leaf at {loc.key} byte {loc.start}"
                )
            self.leaves[req.storage_index] = (loc, leaf)
            target = None
            if req.type == LoadItemType.TENSOR and uses[req.storage_index] == 1:
                target = _direct_target(req, loc, planner)
            if target is not None:
                self.direct[req.storage_index] = target
                if leaf is not None:
                    raw = target.reshape(-1).view(torch.uint8).numpy()
                    self.into[leaf] = raw.view(manifest.dtype(leaf)).reshape(loc.shape)

    async def fetch(self, store: Store) -> None:
        """Read and verify every non-empty item, straight into direct destinations."""
        wanted = [leaf for _, leaf in self.leaves.values() if leaf is not None]
        self.arrays = await read_leaves(store, self.manifest, wanted, self.into)

    def _stored(self, index: MetadataIndex) -> np.ndarray[Any, Any]:
        """The item's bytes as read (empty for an empty item)."""
        loc, leaf = self.leaves[index]
        if leaf is None:
            if loc.crc32c != crc32c(b""):
                raise CorruptCheckpointError(f"{index.fqn}: an empty item with a non-empty crc32c")
            return np.empty(0, np.uint8)
        return self.arrays[leaf].reshape(-1).view(np.uint8)

    def deliver(self, planner: LoadPlanner, url: str) -> None:
        for req in self.items:
            loc, _ = self.leaves[req.storage_index]
            buffer = self._stored(req.storage_index)
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(buffer.tobytes()))
                continue
            direct = self.direct.get(req.storage_index)
            if direct is not None:
                planner.commit_tensor(req, direct)
                continue
            stored = _as_tensor(loc, buffer, url)
            for dim, (start, length) in enumerate(
                zip(req.storage_offsets, req.lengths, strict=True)
            ):
                stored = stored.narrow(dim, start, length)
            target = planner.resolve_tensor(req).detach()
            if target.size() != stored.size():
                raise CorruptCheckpointError(
                    f"{url}: {req.storage_index.fqn} has shape {tuple(stored.size())} in the "
                    f"checkpoint, but the load plan expects {tuple(target.size())}"
                )
            target.copy_(stored)
            planner.commit_tensor(req, target)


def _direct_target(req: ReadItem, loc: ItemLocation, planner: LoadPlanner) -> torch.Tensor | None:
    """The destination tensor, if the stored chunk can be read straight into its memory."""
    if loc.shape is None or loc.dtype is None:
        return None
    if any(req.storage_offsets) or tuple(req.lengths) != loc.shape:
        return None
    target = planner.resolve_tensor(req).detach()
    if (
        target.device.type != "cpu"
        or not target.is_contiguous()
        or target.dtype != dtype_from_name(loc.dtype, loc.key)
        or tuple(target.size()) != loc.shape
        or target.is_conj()
        or target.is_neg()
    ):
        return None
    return target


def _as_tensor(loc: ItemLocation, buffer: np.ndarray[Any, Any], url: str) -> torch.Tensor:
    if loc.dtype is None or loc.shape is None:
        raise CorruptCheckpointError(f"{url}/{loc.key}: a tensor was requested from a bytes item")
    dtype = dtype_from_name(loc.dtype, loc.key)
    if loc.length == 0:
        return torch.empty(loc.shape, dtype=dtype)
    return torch.from_numpy(buffer).view(dtype).reshape(loc.shape)
