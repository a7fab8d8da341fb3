"""ckptstore as the storage layer of ``torch.distributed.checkpoint`` (DCP).

``dcp.save(state, storage_writer=Writer("s3://bucket/run/step100"))`` stores a DCP checkpoint
on any ckptstore URL, and ``dcp.load(state, storage_reader=Reader(...))`` reads it back, with
DCP's planning and resharding unchanged. What this layer adds to DCP's own file writers:

* **Commit.** Every rank writes its objects under one fresh attempt prefix
  (``<url>/<attempt>/r<rank>-<n>``), chosen by the coordinator in ``prepare_global_plan``.
  DCP gathers every rank's write results to the coordinator, whose ``finish`` writes
  ``<url>/manifest.json`` with one put-if-absent, after every object is durable. A checkpoint
  is visible if and only if that manifest exists; a rank that fails or dies makes DCP skip
  ``finish``, so nothing becomes visible and the attempt's objects are garbage for ``gc``.
  From ``prepare_global_plan`` to ``finish`` the coordinator holds a lease on the attempt
  that ``gc`` honours (:mod:`ckptstore.layout.lease`), and ``finish`` does not commit if
  it lapsed.
  No rename is involved, so this is as safe on S3 and GCS as on a local disk.
* **No pickle from storage.** DCP's ``Metadata`` goes into the manifest as JSON
  (:mod:`ckptstore.integrations.dcp_manifest`) and is validated before any data read.
* **Packing.** Items under ``pack_threshold`` bytes are copied into pack objects of up to
  ``pack_size`` bytes, so thousands of small tensors cost a handful of PUTs; larger tensors are
  written straight from their memory, one object each, as parallel multipart uploads.
* **Verified parallel reads.** Each rank fetches just the items its load plan names, as ranged
  reads merged per object and issued in parallel, straight into the destination tensors where
  their layout allows, and checks every item's crc32c.

Both classes pickle without their open store (DCP's process-based ``async_save`` sends the
writer to another process), and reopen it on first use there.
"""

from __future__ import annotations

import asyncio
import io
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
    CorruptCheckpointError,
    NotFoundError,
)
from ckptstore.integrations.dcp_manifest import (
    ItemLocation,
    build_manifest,
    dtype_from_name,
    dtype_name,
    read_dcp_metadata,
)
from ckptstore.integrations.tensor_objects import (
    CheckpointTarget,
    Packer,
    Placed,
    UploadBatch,
    crc32c,
    served,
    tensor_bytes,
)
from ckptstore.layout.commit import commit_manifest, gather_all, read_manifest
from ckptstore.layout.keys import (
    attempt_prefix,
    manifest_key,
    new_attempt_id,
    step_prefix,
)
from ckptstore.layout.lease import SaveLease
from ckptstore.layout.restore import check_object_size
from ckptstore.store.base import Store

__all__ = ["Reader", "Writer"]


@dataclass(frozen=True, slots=True)
class _AttemptPrefix:
    """What the coordinator hands each rank in ``SavePlan.storage_data``."""

    attempt: str
    rank: int


# =========================================================================== writer


class Writer(StorageWriter):
    """A DCP ``StorageWriter`` that stores one checkpoint at a ckptstore URL.

    Args:
        url: where the checkpoint goes (``/path``, ``s3://bucket/run/step100``, ...), or an
            open :class:`~ckptstore.Store` (a pickled writer reopens it by its URL); a
            ``checkpoint_id`` given to ``dcp.save`` replaces it.
        pack_threshold: items smaller than this many bytes are packed together.
        pack_size: target size of one pack object, in bytes.
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
        pack_threshold: int = 8 << 20,
        pack_size: int = 64 << 20,
        **options: Any,
    ) -> None:
        super().__init__()
        if pack_threshold < 0 or pack_size <= 0:
            raise ValueError("pack_threshold must be >= 0 and pack_size > 0")
        self._target = CheckpointTarget(url, step, options)
        self.pack_threshold = pack_threshold
        self.pack_size = pack_size
        self.save_id = uuid.uuid4().hex
        self._is_coordinator = False
        self._rank = 0
        self._attempt: str | None = None
        #: The coordinator's lease on the attempt, from prepare_global_plan to finish.
        self._lease: SaveLease | None = None

    @property
    def url(self) -> str:
        """The checkpoint URL this writer saves to."""
        return self._target.url

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint URL (DCP logs it under this name)."""
        return self._target.url

    def close(self) -> None:
        """Close the store this writer opened (it reopens on next use)."""
        self._target.handle.close()

    # ------------------------------------------------------------- DCP's calls, in order

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        # docstring inherited
        if checkpoint_id is not None:
            self._target.point_at(checkpoint_id)
        self.save_id = uuid.uuid4().hex
        self._attempt = None
        self._release_lease()  # a save that never reached finish() (a rank failed)

    def _release_lease(self) -> None:
        if self._lease is not None:
            lease, self._lease = self._lease, None
            background.run(lease.release())

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
        return StorageMeta(checkpoint_id=self.url, save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # docstring inherited
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # docstring inherited
        store, step = self._target.store, self._target.step
        if background.run(store.exists(manifest_key(step))):
            raise AlreadyExistsError(
                f"{self.url} already holds a committed checkpoint (step {step} of "
                f"{store.url}); save to a new URL (checkpoints are immutable)"
            )
        attempt = new_attempt_id()
        # Held until finish(): gc in another process leaves the attempt alone while the ranks
        # write (ckptstore.layout.lease).
        self._release_lease()
        self._lease = background.run(SaveLease.take(store, step, attempt))
        return [
            SavePlan(
                items=plan.items,
                storage_data=_AttemptPrefix(attempt, rank),
                planner_data=plan.planner_data,
                usable=plan.usable,
            )
            for rank, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Resolve every item, pack the small ones, and upload in the background.

        Returns a future that completes, with one ``WriteResult`` per item, once every object
        of this rank is durable.
        """
        prefix = plan.storage_data
        if not isinstance(prefix, _AttemptPrefix):
            raise TypeError(
                "SavePlan.storage_data was not set by ckptstore.dcp.Writer.prepare_global_plan"
            )
        self._attempt = prefix.attempt
        batch = UploadBatch(
            self._target.store, f"{attempt_prefix(self._target.step, prefix.attempt)}r{prefix.rank}"
        )
        packer: Packer[WriteItem] = Packer(batch, self.pack_size)
        placed: list[Placed[WriteItem]] = []
        for item in plan.items:
            data, keep = _resolve(planner, item)
            if len(data) >= self.pack_threshold:
                placed.append(batch.single(item, data, keep))
            else:
                placed.extend(packer.add(item, data))
        placed.extend(packer.flush())
        results = [_result(p) for p in placed]

        future: Future[list[WriteResult]] = Future()

        def settle(error: BaseException | None) -> None:
            if error is None:
                future.set_result(results)
            else:
                future.set_exception(error)  # type: ignore[arg-type]  # torch's stub is wrong

        handle, coordinator = self._target.handle, self._is_coordinator

        async def cleanup(error: BaseException | None) -> None:
            if error is not None or not coordinator:  # the coordinator commits in finish()
                await handle.arelease()

        batch.when_done(settle, cleanup)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Commit: write the manifest with one put-if-absent (coordinator only).

        A retry that finds the manifest of its own attempt succeeds; a manifest of another
        attempt raises :class:`~ckptstore.errors.CommitConflictError`.
        """
        if self._attempt is None:
            raise RuntimeError("finish() called before write_data()")
        locations: dict[MetadataIndex, ItemLocation] = {}
        for rank_results in results:
            for result in rank_results:
                if not isinstance(result.storage_data, ItemLocation):
                    raise TypeError(f"write result of {result.index.fqn} was not written here")
                locations[result.index] = result.storage_data
        step = self._target.step
        # DCP's planners leave storage_meta to the writer (its FileSystemWriter sets it here
        # too); without it a reader cannot tell which save it loads.
        metadata.storage_meta = self.storage_meta()
        manifest = build_manifest(
            step, self._attempt, metadata, locations, object_prefix=step_prefix(step)
        )
        try:
            if self._lease is not None:
                self._lease.check()
            background.run(commit_manifest(self._target.store, manifest))
        finally:
            self._release_lease()
            self._target.handle.release()
        metadata.storage_data = locations

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        # docstring inherited
        return served(checkpoint_id)


def _resolve(planner: SavePlanner, item: WriteItem) -> tuple[memoryview, object]:
    """The bytes of one item, and the object that must stay alive while they upload."""
    data = planner.resolve_data(item)
    if item.type == WriteItemType.BYTE_IO:
        if not isinstance(data, io.BytesIO):
            raise TypeError(
                f"{item.index.fqn}: planner returned {type(data).__name__}, not BytesIO"
            )
        raw = data.getvalue()
        return memoryview(raw), raw
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"{item.index.fqn}: planner returned {type(data).__name__}, not a tensor")
    tensor, view = tensor_bytes(data)
    return view, tensor


def _typeinfo(item: WriteItem) -> tuple[str | None, tuple[int, ...] | None]:
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return None, None
    return dtype_name(item.tensor_data.properties.dtype), tuple(item.tensor_data.chunk.sizes)


def _result(placed: Placed[WriteItem]) -> WriteResult:
    item = placed.token
    loc = ItemLocation(
        placed.key,
        placed.start,
        placed.length,
        placed.crc32c,
        placed.object_size,
        placed.object_crc32c,
        *_typeinfo(item),
    )
    return WriteResult(index=item.index, size_in_bytes=loc.length, storage_data=loc)


# =========================================================================== reader


class Reader(StorageReader):
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
        self._target = CheckpointTarget(url, step, options)
        self.load_id = uuid.uuid4().hex
        self._locations: dict[MetadataIndex, ItemLocation] = {}

    @property
    def url(self) -> str:
        """The checkpoint URL this reader loads from."""
        return self._target.url

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint URL (DCP logs it under this name)."""
        return self._target.url

    def close(self) -> None:
        """Close the store this reader opened (it reopens on next use)."""
        self._target.handle.close()

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        # docstring inherited
        if checkpoint_id is not None:
            self._target.point_at(checkpoint_id)
        self.load_id = uuid.uuid4().hex
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
        store, step = self._target.store, self._target.step
        try:
            manifest = background.run(read_manifest(store, step))
        except NotFoundError:
            raise NotFoundError(
                f"{self.url} holds no committed checkpoint (no manifest for step {step} of "
                f"{store.url}); the save may not have finished"
            ) from None
        metadata = read_dcp_metadata(manifest, f"{store.url}/{manifest_key(step)}")
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
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
        # The manifest's sizes are claims: check the objects' real sizes before _ReadPlan
        # allocates a buffer per item (ckptstore.layout.restore).
        sizes = {
            loc.key: loc.object_size
            for loc in (self._locations.get(req.storage_index) for req in plan.items)
            if loc is not None and loc.length
        }
        store = self._target.store
        try:
            background.run(
                gather_all(check_object_size(store, key, size) for key, size in sizes.items())
            )
            reads = _ReadPlan(self._locations, plan.items, planner)
            background.run(reads.fetch(store))
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
    """The byte ranges one rank reads, and where each lands."""

    def __init__(
        self,
        locations: dict[MetadataIndex, ItemLocation],
        items: Iterable[ReadItem],
        planner: LoadPlanner,
    ) -> None:
        self.items = list(items)
        uses: dict[MetadataIndex, int] = {}
        for req in self.items:
            uses[req.storage_index] = uses.get(req.storage_index, 0) + 1
        # storage index -> (location, destination buffer, destination tensor if direct)
        self.buffers: dict[MetadataIndex, tuple[ItemLocation, np.ndarray[Any, Any]]] = {}
        self.direct: dict[MetadataIndex, torch.Tensor] = {}
        #: crc32c of each item's bytes as read (items of length 0 are not read).
        self.crcs: dict[MetadataIndex, int] = {}
        for req in self.items:
            try:
                loc = locations[req.storage_index]
            except KeyError:
                raise CorruptCheckpointError(
                    f"the manifest has no item {req.storage_index.fqn} at "
                    f"{req.storage_index.offset}"
                ) from None
            if req.storage_index in self.buffers:
                continue
            target = None
            if req.type == LoadItemType.TENSOR and uses[req.storage_index] == 1:
                target = _direct_target(req, loc, planner)
            if target is not None:
                self.direct[req.storage_index] = target
                buffer = (
                    target.reshape(-1).view(torch.uint8).numpy()
                    if loc.length
                    else np.empty(0, np.uint8)
                )
            else:
                buffer = np.empty(loc.length, dtype=np.uint8)
            self.buffers[req.storage_index] = (loc, buffer)

    async def fetch(self, store: Store) -> None:
        """Read every item's bytes, hashing them as they land (no second pass over them)."""
        per_object: dict[str, list[MetadataIndex]] = {}
        for index, (loc, _) in self.buffers.items():
            if loc.length:
                per_object.setdefault(loc.key, []).append(index)

        async def read(key: str, indices: list[MetadataIndex]) -> None:
            requests = [(self.buffers[i][0].start, self.buffers[i][1]) for i in indices]
            crcs = await store.read_ranges_into_crc32c(key, requests)
            self.crcs.update(zip(indices, crcs, strict=True))

        await asyncio.gather(*(read(key, indices) for key, indices in per_object.items()))

    def deliver(self, planner: LoadPlanner, url: str) -> None:
        for index, (loc, buffer) in self.buffers.items():
            crc = self.crcs[index] if loc.length else crc32c(buffer)
            if crc != loc.crc32c:
                raise CorruptCheckpointError(
                    f"{url}/{loc.key}: item {index.fqn} at bytes [{loc.start}, "
                    f"{loc.start + loc.length}) fails its crc32c check"
                )
        for req in self.items:
            loc, buffer = self.buffers[req.storage_index]
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
