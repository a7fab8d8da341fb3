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
   transfer buffers, and every crc32c is checked before a byte leaves the rank. The buffer
   of a transfer that a rank of the reader's own host receives is a shared-memory segment
   (:mod:`ckptstore.manager.segments`): the first ``all_gather`` also shares each rank's
   host identity, so every rank knows which ranks share its host.
4. **status**: a second ``all_gather`` shares whether each rank's reads succeeded, and the
   segments it filled. A failure anywhere (a store error, a checksum mismatch) raises on
   every rank before any transfer starts, so no rank waits for bytes that will never come:
   the failed rank raises its own error, the others the same kind of error (a
   ``CorruptCheckpointError`` stays one, so a job that falls back to an earlier step on
   corruption does so on every rank) naming the rank and its message. Every segment is
   removed on the way out.
5. **transfer**: a receiver on the reader's host maps the reader's segment copy-on-write:
   no copy and no socket, and its arrays are its own (the reader's too). A third
   ``all_gather``, run only when some segment was announced, says which segments a rank
   could not map; after it the readers remove their segments' names (the mappings stay
   valid). Everything else, to ranks of other hosts and to a rank that could not map a
   segment, goes with :meth:`~ckptstore.manager.distributed.Collectives.exchange` from
   each reader to each of its receivers, all at once, as raw bytes (tensors over
   ``torch.distributed``, never pickled); point to point rather than a broadcast to the
   whole group, so a leaf that only some ranks share (a tensor-parallel shard replicated
   across the data-parallel ranks) reaches only them, and the readers' sends run in
   parallel instead of one broadcast after another.
6. **rebuild**: each rank rebuilds its request from the arrays it read and received, as a
   single-process load does.

Each rank still reads the manifest itself (one small ``get``): it is needed to select, and
validating it on every rank keeps the one rule that nothing is used unverified.

Shared memory lives here, not in a :class:`~ckptstore.manager.distributed.Collectives`:
only the load knows before the read which transfers stay on the host, so only it can have
the store's reads land in the segment. Behind ``exchange`` the bytes would already be in a
private buffer, to be copied into a segment and out again; and every launcher's
collectives (torch, JAX, MPI) would need its own copy of the code. The protocol stays the
small one; ``shared_memory=False`` sends every transfer through it.

Between processes of one host the transfer over the group was the cost: gloo on loopback
TCP moves each receiver's bytes through the kernel's socket path, as much CPU as reading
them from the store again (8 ranks, 512 MiB from a local SeaweedFS, two cores: 1.17x the
time of every rank reading, before segments).
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
from ckptstore.manager import segments
from ckptstore.manager.distributed import Collectives, Message, _Failure, lost_rank
from ckptstore.pipeline.codec import empty_array
from ckptstore.pipeline.deadline import bounded
from ckptstore.pipeline.restore import Request, Selection, read_selected, select_step
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
    host: str | None  # what ranks that can share memory segments have in common


def load_shared(
    store: Store, step: int, asked: Request, comm: Collectives, *, shared_memory: bool = True
) -> Selection:
    """Read ``asked`` of ``step`` on every rank of ``comm``, each shared leaf read once;
    returns the selection with every array of its first part in place, for
    :func:`~ckptstore.pipeline.restore.rebuild`.

    Every rank of the group calls it, with its own request (see the module docstring).
    ``shared_memory=False`` sends every transfer over ``comm``, between ranks of one host too.

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
    host = segments.host_identity() if shared_memory else None
    selection: Selection | None = None
    boxed: dict[int, Any] = {}
    error: Exception | None = None
    mine: Any
    try:
        selection = background.run(select_step(store, step, asked))
        # a leaf this rank wants in parts (its shard of a sharded leaf) it reads itself:
        # the ranks want different boxes of it, so there is nothing to share
        boxed = selection.boxes()
        # a streaming load's background part each rank reads itself (no collective may run
        # beside the training loop's): only the first part is shared
        shared = [leaf for leaf in selection.first() if leaf not in boxed]
        leaves = np.asarray(shared, np.int64).tobytes()
        mine = _Selected(selection.manifest.step, selection.manifest.attempt, leaves, host)
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
    hosts = [c.host for c in chosen]
    with _Handover(rank, hosts) as handover:
        _read_and_transfer(store, step, selection, boxed, plan, comm, handover)
    return selection


def _read_and_transfer(
    store: Store,
    step: int,
    selection: Selection,
    boxed: dict[int, Any],
    plan: ReadPlan,
    comm: Collectives,
    handover: _Handover,
) -> None:
    """Stages 3 to 5 (read, verify, status, transfer): every leaf this rank loads lands in
    ``selection.arrays``."""
    rank = comm.rank
    buffers: dict[int, np.ndarray[Any, Any]] = {}
    error: Exception | None = None
    status: Any = None
    try:
        for tag, transfer in enumerate(plan.transfers):
            if transfer.reader == rank:
                segment = handover.create(tag, transfer)
                buffers[tag] = (
                    segment.buffer
                    if segment is not None and segment.buffer is not None
                    else empty_array((transfer.nbytes,), np.dtype(np.uint8))
                )
        views = {
            leaf: view
            for tag, buffer in buffers.items()
            for leaf, view in _views(selection, plan.transfers[tag], buffer)
        }
        own = [*plan.reads[rank], *boxed]
        background.run(
            bounded(
                read_selected(store, selection, leaves=own, into=views),
                seconds=store.settings.layout.restore_deadline,
                what=f"rank {rank}'s reads of step {selection.manifest.step} from {store.url}",
                setting="restore_deadline",
            )
        )
        # the reader's own arrays over a segment: private, as every receiver's are (the
        # shared mapping goes once nothing holds a view of it)
        del views
        for tag in handover.own_tags():
            del buffers[tag]
            for leaf in plan.transfers[tag].leaves:
                del selection.arrays[leaf]
        for tag, buffer in handover.private().items():
            buffers[tag] = buffer
            selection.arrays.update(_views(selection, plan.transfers[tag], buffer))
        status = handover.announced()
    except Exception as exc:
        error, status = exc, _Failure.of(rank, exc)
    statuses = _share(comm, status, store, step, "sharing the reads' outcome")
    _raise_failures(statuses, error, store, step)

    # ranks of this rank's host map the segments announced to them
    handover.heard(statuses)
    for tag, transfer in enumerate(plan.transfers):
        if rank in transfer.receivers:
            attached = handover.attach(tag, transfer.reader)
            if attached is not None:
                buffers[tag] = attached
                selection.arrays.update(_views(selection, plan.transfers[tag], attached))
    if handover.any_announced:
        # every receiver has mapped what it could: the names can go, and a receiver that
        # could not map one gets it over the group
        unmapped = _share(comm, handover.unmapped(), store, step, "mapping shared memory")
        handover.remove_own()
        handover.heard_unmapped(unmapped)

    sends: list[Message] = []
    receives: list[Message] = []
    for tag, transfer in enumerate(plan.transfers):
        if transfer.reader == rank:
            sends += [
                (peer, tag, buffers[tag])
                for peer in transfer.receivers
                if not handover.mapped(tag, rank, peer)
            ]
        elif rank in transfer.receivers and not handover.mapped(tag, transfer.reader, rank):
            buffers[tag] = empty_array((transfer.nbytes,), np.dtype(np.uint8))
            receives.append((transfer.reader, tag, buffers[tag]))
    try:
        comm.exchange(sends, receives)
    except Exception as exc:
        raise lost_rank(store, step, "sending the shared leaves", exc, "was not loaded") from exc
    for _, tag, buffer in receives:
        selection.arrays.update(_views(selection, plan.transfers[tag], buffer))


class _Handover:
    """The shared-memory segments of one load on one rank: those it fills for ranks of its
    host, those it maps from them, and who mapped what (:mod:`ckptstore.manager.segments`).

    As a context manager it removes, on any exit, this rank's segments and, if the load
    failed, any other announced to it (a reader that died no longer can) and any orphan of
    a dead rank on the host.
    """

    def __init__(self, rank: int, hosts: list[str | None]) -> None:
        self._rank = rank
        self._hosts = hosts
        self._host = hosts[rank]
        self._token = segments.new_token()
        self._own: dict[int, segments.Segment] = {}
        self._heard: list[dict[int, segments.SegmentName]] = []
        self._attached: set[int] = set()
        self._tried: set[int] = set()
        self._unmapped: list[set[int]] = [set() for _ in hosts]
        self.any_announced = False
        self._swept = False

    def __enter__(self) -> _Handover:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        self.remove_own()
        if kind is not None and self._host is not None:
            for reader, names in enumerate(self._heard):
                if reader != self._rank and self._hosts[reader] == self._host:
                    for name in names.values():
                        segments.remove(name)
            segments.remove_orphans()

    def create(self, tag: int, transfer: Transfer) -> segments.Segment | None:
        """A segment for ``transfer`` if a receiver shares this rank's host (``None``: the
        bytes go over the group)."""
        if self._host is None or transfer.nbytes == 0:
            return None
        if not any(self._hosts[peer] == self._host for peer in transfer.receivers):
            return None
        if not self._swept:
            self._swept = True
            segments.remove_orphans()  # what killed readers left on this host
        segment = segments.Segment.create(transfer.nbytes, self._token, tag)
        if segment is not None:
            self._own[tag] = segment
        return segment

    def own_tags(self) -> list[int]:
        """The transfers this rank filled a segment for."""
        return list(self._own)

    def private(self) -> dict[int, np.ndarray[Any, Any]]:
        """This rank's own copy-on-write view of each segment it filled, by tag."""
        return {tag: segment.private() for tag, segment in self._own.items()}

    def announced(self) -> dict[int, segments.SegmentName]:
        """The segments this rank filled, by tag: its status when its reads succeeded."""
        return {tag: segment.name for tag, segment in self._own.items()}

    def heard(self, statuses: list[Any]) -> None:
        """Take note of every rank's announced segments (all reads succeeded)."""
        self._heard = [dict(status or {}) for status in statuses]
        self.any_announced = any(self._heard)

    def attach(self, tag: int, reader: int) -> np.ndarray[Any, Any] | None:
        """Map ``reader``'s segment for ``tag`` if it announced one to this rank's host."""
        name = self._heard[reader].get(tag)
        if name is None or self._hosts[reader] != self._host:
            return None
        self._tried.add(tag)
        mapped = segments.attach(name)
        if mapped is not None:
            self._attached.add(tag)
        return mapped

    def unmapped(self) -> list[int]:
        """The announced segments this rank tried and failed to map, by tag."""
        return sorted(self._tried - self._attached)

    def heard_unmapped(self, unmapped: list[list[int]]) -> None:
        self._unmapped = [set(tags) for tags in unmapped]

    def mapped(self, tag: int, reader: int, peer: int) -> bool:
        """Whether receiver ``peer`` has from a segment the bytes ``reader`` read for
        transfer ``tag`` (the same answer on every rank, from what all were told)."""
        return (
            self.any_announced
            and tag in self._heard[reader]
            and self._hosts[peer] is not None
            and self._hosts[peer] == self._hosts[reader]
            and tag not in self._unmapped[peer]
        )

    def remove_own(self) -> None:
        for segment in self._own.values():
            segment.remove()


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
        raise lost_rank(store, step, what, exc, "was not loaded") from exc


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
