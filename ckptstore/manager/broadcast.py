"""Read once, broadcast: a multi-rank load reads each leaf several ranks need only once.

When every rank of a job loads the same bytes (replicated weights, a DDP model on every
rank, the optimizer state of a data-parallel group), reading them on every rank costs N
times the egress and N times the requests against the store. :func:`load_shared` runs the
one restore path of :mod:`ckptstore.pipeline.restore` on every rank with the store reads
split between them:

1. **select**: every rank selects what it asked for, as a single-process load does. One
   ``all_gather`` shares each rank's manifest identity (step and attempt) and its selected
   leaf indices; every rank then computes the same :class:`ReadPlan`.
2. **plan** (:func:`plan_reads`): a leaf only one rank selected is read by that rank (ranged
   reads of only its bytes, as today). The leaves several ranks selected go, largest
   first and a pack's together, to the rank among them with the fewest bytes to read so
   far, so the store reads are spread over the ranks by bytes; the leaves one rank reads
   for the same set of other ranks form one :class:`Transfer`, laid out in one buffer.
3. **read** and **verify**: each rank reads its leaves with
   :func:`~ckptstore.pipeline.restore.read_selected`, shared leaves straight into their
   transfer buffers, and every crc32c is checked before a byte leaves the rank.
4. **status**: a second ``all_gather`` shares whether each rank's reads succeeded. A failure
   anywhere (a store error, a checksum mismatch) raises on every rank before any transfer
   starts, so no rank waits for bytes that will never come: the failed rank raises its own
   error, the others the same kind of error (a ``CorruptCheckpointError`` stays one, so a
   job that falls back to an earlier step on corruption does so on every rank) naming the
   rank and its message.
5. **transfer**: :meth:`~ckptstore.manager.distributed.Collectives.exchange` sends each
   transfer buffer from its reader to each of its receivers, all at once, as raw bytes
   (tensors over ``torch.distributed``, never pickled); point to point rather than a
   broadcast to the whole group, so a leaf that only some ranks share (a tensor-parallel
   shard replicated across the data-parallel ranks) reaches only them, and the readers'
   sends run in parallel instead of one broadcast after another.
6. **rebuild**: each rank rebuilds its request from the arrays it read and received, as a
   single-process load does.

Each rank still reads the manifest itself (one small ``get``): it is needed to select, and
validating it on every rank keeps the one rule that nothing is used unverified.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptstore import background
from ckptstore.errors import (
    BrokenReferenceError,
    CheckpointFormatError,
    CkptStoreError,
    CorruptCheckpointError,
    NotFoundError,
)
from ckptstore.layout.restore import empty_array
from ckptstore.manager.distributed import Collectives, Message, _Failure
from ckptstore.pipeline.restore import Request, Selection, read_selected, rebuild, select_step
from ckptstore.store.base import Store

__all__ = ["ReadPlan", "Transfer", "load_shared", "plan_reads"]

#: Offsets of leaves in a transfer buffer are multiples of this, so each leaf's array is
#: aligned for every dtype, as leaves are in a pack object.
_ALIGNMENT = 64

#: Errors a rank's failure is raised as on the other ranks, by name: what a caller may
#: catch to react to the checkpoint itself (fall back to an earlier step on corruption).
_SHARED_KINDS: dict[str, type[CkptStoreError]] = {
    cls.__name__: cls
    for cls in (BrokenReferenceError, CorruptCheckpointError, CheckpointFormatError, NotFoundError)
}


@dataclass(frozen=True, slots=True)
class Transfer:
    """Leaves one rank reads from the store for other ranks, sent as one buffer.

    Attributes:
        reader: the rank that reads them.
        receivers: the other ranks that need exactly these leaves, ascending.
        leaves: leaf indices, in buffer order.
        offsets: each leaf's byte offset in the buffer.
        nbytes: the buffer's length.
    """

    reader: int
    receivers: tuple[int, ...]
    leaves: tuple[int, ...]
    offsets: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True, slots=True)
class ReadPlan:
    """Who reads what from the store in a multi-rank load; the same on every rank.

    Attributes:
        reads: by rank, the leaves it reads from the store: those only it selected and the
            shared ones it reads for others.
        transfers: what goes from reader to receivers; a transfer's index is its tag.
    """

    reads: tuple[tuple[int, ...], ...]
    transfers: tuple[Transfer, ...]

    def store_bytes(self, lengths: Sequence[int]) -> list[int]:
        """Bytes of leaves each rank reads from the store, by rank."""
        return [sum(lengths[leaf] for leaf in leaves) for leaves in self.reads]


def plan_reads(
    selected: Sequence[Sequence[int]], lengths: Sequence[int], objects: Sequence[int]
) -> ReadPlan:
    """Plan a multi-rank load: every selected leaf read from the store once.

    A leaf one rank selected (or an empty one, which costs no read) is read by each rank
    that selected it. The leaves several ranks selected are read by one of them, in units:
    the shared leaves of one object that the same ranks selected stay together, so a pack
    of small leaves is one ranged read of one rank rather than ranges of several ranks,
    each of which the store's range merging would widen over the others' leaves. Largest
    units first, each goes to the rank among its selectors with the fewest bytes to read so
    far (the lowest rank on a tie), counting the leaves the ranks read for themselves.

    Args:
        selected: by rank, the leaf indices it selected.
        lengths: every leaf's length in bytes, by leaf index.
        objects: every leaf's object index (negative: the leaf is stored in no object), by
            leaf index.
    """
    world = len(selected)
    selectors: dict[int, list[int]] = {}
    for rank, leaves in enumerate(selected):
        for leaf in leaves:
            selectors.setdefault(leaf, []).append(rank)
    reads: list[list[int]] = [[] for _ in range(world)]
    assigned = [0] * world
    units: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    for leaf, ranks in selectors.items():
        if len(ranks) == 1 or lengths[leaf] == 0:
            for rank in ranks:
                reads[rank].append(leaf)
                assigned[rank] += lengths[leaf]
        else:
            units.setdefault((objects[leaf], tuple(ranks)), []).append(leaf)
    size = {unit: sum(lengths[leaf] for leaf in leaves) for unit, leaves in units.items()}
    grouped: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    for unit in sorted(units, key=lambda unit: (-size[unit], unit)):
        ranks = list(unit[1])
        reader = min(ranks, key=lambda rank: (assigned[rank], rank))
        assigned[reader] += size[unit]
        reads[reader] += units[unit]
        receivers = tuple(rank for rank in ranks if rank != reader)
        grouped.setdefault((reader, receivers), []).extend(units[unit])
    transfers = []
    for (reader, receivers), leaves in grouped.items():
        offsets, end = [], 0
        for leaf in leaves:
            end = -(-end // _ALIGNMENT) * _ALIGNMENT
            offsets.append(end)
            end += lengths[leaf]
        transfers.append(Transfer(reader, receivers, tuple(leaves), tuple(offsets), end))
    return ReadPlan(tuple(tuple(leaves) for leaves in reads), tuple(transfers))


@dataclass(frozen=True)
class _Selected:
    """What a rank tells the others it will load: the manifest and its leaves (int64)."""

    step: int
    attempt: str
    leaves: bytes


def load_shared(store: Store, step: int, asked: Request, comm: Collectives) -> Any:
    """Load ``asked`` of ``step`` on every rank of ``comm``, each shared leaf read once.

    Every rank of the group calls it, with its own request (see the module docstring).

    Raises:
        NotFoundError: no such step, or a key or target leaf naming nothing (on the rank
            that asked for it; the others raise a ``NotFoundError`` naming that rank).
        CorruptCheckpointError: anything read fails verification, on whichever rank read
            it; on every rank.
        ValueError: the ranks load different steps (or different commits of one).
        CkptStoreError: another rank failed otherwise, or a collective failed (most likely
            because a rank died).
    """
    rank = comm.rank
    selection: Selection | None = None
    error: Exception | None = None
    mine: Any
    try:
        selection = background.run(select_step(store, step, asked))
        leaves = np.asarray(selection.leaves, np.int64).tobytes()
        mine = _Selected(selection.manifest.step, selection.manifest.attempt, leaves)
    except Exception as exc:
        error, mine = exc, _Failure.of(rank, exc)
    chosen = _share(comm, mine, store, step, "sharing what each rank selects")
    _raise_failures(chosen, error, store, step)
    assert selection is not None
    loaded = {(c.step, c.attempt) for c in chosen}
    if len(loaded) > 1:
        raise ValueError(
            f"{store.url}: the ranks load different checkpoints {sorted(loaded)}; a load with "
            "broadcast=True must load the same step on every rank (broadcast=False does not)"
        )
    selected = [np.frombuffer(c.leaves, np.int64).tolist() for c in chosen]
    manifest = selection.manifest
    plan = plan_reads(selected, manifest.leaf_length, manifest.leaf_object)

    buffers = {
        tag: empty_array((transfer.nbytes,), np.dtype(np.uint8))
        for tag, transfer in enumerate(plan.transfers)
        if rank == transfer.reader or rank in transfer.receivers
    }
    views = {
        leaf: view
        for tag, transfer in enumerate(plan.transfers)
        if transfer.reader == rank
        for leaf, view in _views(selection, transfer, buffers[tag])
    }
    status: _Failure | None = None
    try:
        background.run(read_selected(store, selection, leaves=plan.reads[rank], into=views))
    except Exception as exc:
        error, status = exc, _Failure.of(rank, exc)
    _raise_failures(
        _share(comm, status, store, step, "sharing the reads' outcome"), error, store, step
    )

    sends: list[Message] = []
    receives: list[Message] = []
    for tag, transfer in enumerate(plan.transfers):
        if transfer.reader == rank:
            sends += [(peer, tag, buffers[tag]) for peer in transfer.receivers]
        elif rank in transfer.receivers:
            receives.append((transfer.reader, tag, buffers[tag]))
    try:
        comm.exchange(sends, receives)
    except Exception as exc:
        raise _lost(store, step, "sending the shared leaves", exc) from exc
    for _, tag, buffer in receives:
        selection.arrays.update(_views(selection, plan.transfers[tag], buffer))
    return rebuild(selection)


def _views(
    selection: Selection, transfer: Transfer, buffer: np.ndarray[Any, Any]
) -> list[tuple[int, np.ndarray[Any, Any]]]:
    """Each leaf of ``transfer`` as an array over its bytes in ``buffer``."""
    manifest = selection.manifest
    return [
        (leaf, np.ndarray(tuple(manifest.shapes[leaf]), manifest.dtype(leaf), buffer, offset))
        for leaf, offset in zip(transfer.leaves, transfer.offsets, strict=True)
    ]


def _share(comm: Collectives, obj: Any, store: Store, step: int, what: str) -> list[Any]:
    try:
        return comm.all_gather(obj)
    except Exception as exc:
        raise _lost(store, step, what, exc) from exc


def _lost(store: Store, step: int, what: str, exc: Exception) -> CkptStoreError:
    return CkptStoreError(
        f"{store.url}: loading step {step} failed: {what} failed, most likely because "
        f"another rank died ({type(exc).__name__}: {exc})"
    )


def _raise_failures(shared: list[Any], own: Exception | None, store: Store, step: int) -> None:
    """Raise if any rank failed: its own error on a failed rank; on the others an error of
    the same kind where a caller may act on it (see ``_SHARED_KINDS``), naming every failed
    rank."""
    if own is not None:
        raise own
    failures = [f for f in shared if isinstance(f, _Failure)]
    if not failures:
        return
    kind = _SHARED_KINDS.get(failures[0].kind, CkptStoreError)
    raise kind(
        f"{store.url}: loading step {step} failed on another rank: "
        + "; ".join(f.describe() for f in failures)
    )
