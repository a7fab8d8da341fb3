"""Multi-rank saves without DCP: every rank writes its own objects, one commit.

::

    import torch.distributed as dist
    import ckptstore.distributed

    dist.init_process_group("gloo")                 # or "nccl"; any initialised group
    rank = dist.get_rank()
    part = {"model": {f"shard{rank}": shard}, "step": 100}   # this rank's part of the state
    ckptstore.distributed.save("s3://bucket/run", part, step=100)        # on every rank
    ...
    mine = ckptstore.distributed.load("s3://bucket/run", target={"model": {"shard0": like}})

Each rank passes its part of one global state. The parts are merged by dict key: entries
only one rank holds are written by that rank; an entry several ranks hold (a replicated
tensor, the step counter) must agree on every rank that holds it (dtype and shape for arrays,
the value for plain values, the kind of container) and is written once, by the holder with
the fewest bytes assigned so far. The checkpoint is then an ordinary ckptstore checkpoint of
the merged state: ``ckptstore.load``, :class:`~ckptstore.CheckpointManager` ``restore`` and
the CLI read it like any other, on any number of processes, and a rank that loads with
``keys`` or a ``target`` reads only the byte ranges of the leaves it names. A leaf that
several ranks load is read from the store by one of them and sent to the others
(:mod:`ckptstore.manager.broadcast`; ``broadcast=False`` turns it off).

The save is three collectives around the commit protocol of :mod:`ckptstore.layout.commit`:

1. Every rank stages and flattens its part. The coordinator checks that the step is not
   committed and draws the attempt id. One ``all_gather`` shares every rank's tree, paths,
   dtypes and shapes (never array bytes), and every rank computes the same merge and the same
   owner of every leaf, so a conflict raises the same error on every rank.
2. Every rank writes the leaves it owns under ``<step>/<attempt>/r<rank>-...`` (packs of small
   leaves and one object per large leaf, as a single-process save), durable before it
   reports. A ``gather`` brings each rank's object list and leaf checksums to the coordinator.
3. Only if every rank succeeded does the coordinator write the one manifest with a
   put-if-absent; a ``broadcast`` of the outcome makes every rank return the same
   :class:`~ckptstore.CommitInfo` or raise.

A rank that fails anywhere still takes part in the remaining collectives, so the others learn
of its failure instead of waiting for it; a rank that dies makes the collectives fail on the
others (at once when the transport sees the closed connection, else at the process group's
timeout). Either way no manifest is written and the attempt's objects are garbage for ``gc``
(the surviving ranks remove their own at once).

A leaf that is a shard of a global array on the ranks that hold it (a
:class:`~ckptstore.stage.shards.Shard`, a ``DTensor``, a sharded ``jax.Array``) becomes one
leaf of the global shape made of the ranks' chunks (:mod:`ckptstore.pipeline.sharding`), and
a load with shard targets reads only the parts of the chunks its boxes overlap.

Saving blocks until the commit; a rank's arrays are written from their own memory (CUDA
tensors through a host copy), so they must not change until ``save`` returns. The multi-rank
:class:`~ckptstore.manager.distributed_manager.CheckpointManager` copies them instead and runs
:func:`commit_parts` in the background, on a process group of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import sys
import threading
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ckptstore import background
from ckptstore.errors import CkptStoreError, CommitConflictError, NotFoundError, StoreError
from ckptstore.pipeline import save as save_path
from ckptstore.pipeline import sharding, streaming
from ckptstore.pipeline.codec import FlatState, escape_key, join_path
from ckptstore.pipeline.deadline import bounded
from ckptstore.pipeline.restore import Request, read, rebuild, request
from ckptstore.pipeline.root import Root, open_root, opened
from ckptstore.pipeline.save import Attempt, SaveSession, Stager, block_size_for
from ckptstore.pipeline.steps import (
    CommitInfo,
    Manifest,
    check_step,
    latest_step,
    step_prefix,
)
from ckptstore.store.base import Store

__all__ = [
    "Collectives",
    "LocalGroup",
    "TorchCollectives",
    "default_collectives",
    "load",
    "save",
]

#: One point-to-point transfer of :meth:`Collectives.exchange`: ``(peer, tag, buffer)``.
Message = tuple[int, int, "np.ndarray[Any, Any]"]


# =========================================================================== collectives


class Collectives(Protocol):
    """The three collectives a multi-rank save needs, over some group of processes.

    :class:`TorchCollectives` implements them with ``torch.distributed``; another launcher
    (MPI, JAX's multi-process runtime) can pass its own. Every member must call the same
    collectives in the same order. The objects of ``all_gather``, ``gather`` and
    ``broadcast`` are small (trees, paths, checksums), never array bytes; array bytes go
    through :meth:`exchange` as raw buffers.
    """

    @property
    def rank(self) -> int:
        """This member's rank in the group, ``0 <= rank < world``."""
        ...

    @property
    def world(self) -> int:
        """How many members the group has."""
        ...

    def all_gather(self, obj: Any) -> list[Any]:
        """Every member's ``obj``, by rank, on every member."""
        ...

    def gather(self, obj: Any, root: int) -> list[Any] | None:
        """Every member's ``obj``, by rank, on ``root``; ``None`` elsewhere."""
        ...

    def broadcast(self, obj: Any, root: int) -> Any:
        """``root``'s ``obj`` on every member."""
        ...

    def exchange(self, sends: list[Message], receives: list[Message]) -> None:
        """Send and receive array bytes point to point, all at once, without pickling.

        Each ``(peer, tag, buffer)`` of ``sends`` goes to ``peer``; each of ``receives`` is
        filled with what ``peer`` sent with the same ``tag`` (exactly its length). Buffers
        are 1-D C-contiguous ``uint8`` arrays; a member sends at most one buffer per peer
        and tag. Returns once every send and receive of this member is done. Only a
        multi-rank load with ``broadcast=True`` calls it (every member calls it, some with
        nothing to do).
        """
        ...


class TorchCollectives:
    """:class:`Collectives` over a ``torch.distributed`` process group (default: the world).

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
    """

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "ckptstore.distributed needs torch.distributed initialised "
                "(dist.init_process_group), jax.distributed initialised "
                "(jax.distributed.initialize), or a Collectives passed as comm="
            )
        self._dist = dist
        self._group = group
        self._rank = dist.get_rank(group)
        self._world = dist.get_world_size(group)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world(self) -> int:
        return self._world

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self._world
        self._dist.all_gather_object(out, obj, group=self._group)
        return out

    def gather(self, obj: Any, root: int) -> list[Any] | None:
        out: list[Any] | None = [None] * self._world if self._rank == root else None
        self._dist.gather_object(obj, out, group=self._group, group_dst=root)
        return out

    def broadcast(self, obj: Any, root: int) -> Any:
        box = [obj]
        self._dist.broadcast_object_list(box, group=self._group, group_src=root)
        return box[0]

    def exchange(self, sends: list[Message], receives: list[Message]) -> None:
        # One batch of non-blocking sends and receives: every transfer runs at once, so no
        # order of them can deadlock, and the bytes travel as tensors, never pickled.
        import torch

        dist = self._dist
        ops = [
            dist.P2POp(
                dist.irecv, torch.from_numpy(buffer), group=self._group, tag=tag, group_peer=peer
            )
            for peer, tag, buffer in receives
        ] + [
            dist.P2POp(
                dist.isend, torch.from_numpy(buffer), group=self._group, tag=tag, group_peer=peer
            )
            for peer, tag, buffer in sends
        ]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()


class LocalGroup:
    """A group of threads of one process acting as ranks, for tests and single-host tools.

    ``group.member(rank)`` is the :class:`Collectives` of one thread. A member that stops
    taking part can call :meth:`abort`: every collective then raises
    ``threading.BrokenBarrierError`` on the others, as a dead process fails a real group's
    collectives.
    """

    def __init__(self, world: int, *, timeout: float = 120.0) -> None:
        if world < 1:
            raise ValueError("a group has at least one member")
        self.world = world
        self._barrier = threading.Barrier(world, timeout=timeout)
        self._slots: list[Any] = [None] * world

    def member(self, rank: int) -> Collectives:
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside a group of {self.world}")
        return _LocalMember(self, rank)

    def abort(self) -> None:
        self._barrier.abort()

    def _exchange(self, rank: int, obj: Any) -> list[Any]:
        self._slots[rank] = obj
        self._barrier.wait()
        out = list(self._slots)
        self._barrier.wait()  # nobody writes the next round's slot before all have read
        return out


@dataclass(frozen=True)
class _LocalMember:
    group: LocalGroup
    rank: int

    @property
    def world(self) -> int:
        return self.group.world

    def all_gather(self, obj: Any) -> list[Any]:
        return self.group._exchange(self.rank, obj)

    def gather(self, obj: Any, root: int) -> list[Any] | None:
        out = self.group._exchange(self.rank, obj)
        return out if self.rank == root else None

    def broadcast(self, obj: Any, root: int) -> Any:
        return self.group._exchange(self.rank, obj if self.rank == root else None)[root]

    def exchange(self, sends: list[Message], receives: list[Message]) -> None:
        posted = self.group._exchange(self.rank, {(peer, tag): buf for peer, tag, buf in sends})
        for peer, tag, buffer in receives:
            buffer[...] = posted[peer][(self.rank, tag)]
        self.group._exchange(self.rank, None)  # no sender reuses a buffer still being read


# =========================================================================== messages


@dataclass(frozen=True)
class _Failure:
    """A rank's exception, as the other ranks learn of it."""

    rank: int
    kind: str
    message: str

    @classmethod
    def of(cls, rank: int, exc: BaseException) -> _Failure:
        return cls(rank, type(exc).__name__, str(exc))

    def describe(self) -> str:
        return f"rank {self.rank}: {self.kind}: {self.message}"


@dataclass(frozen=True)
class _Part:
    """What a rank tells every other rank about its part before anything is written."""

    step: int
    tree: Any
    paths: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    nbytes: list[int]
    attrs: list[dict[str, Any] | None]
    ticket: Attempt | None = None  # the coordinator's only: its session's attempt
    chunks: dict[int, list[Any]] = field(default_factory=dict)  # sharded leaf -> its boxes
    hashing: bool = False  # the coordinator's only: whether ranks hash their leaves
    base: int | None = None  # the coordinator's only: the held base step of the save


@dataclass(frozen=True)
class _Written:
    """What a rank wrote: its objects and, per leaf it owns, where the leaf lies."""

    objects: list[tuple[str, int, int]]  # name, size, crc32c
    leaves: list[tuple[int, int, int, int]]  # global leaf, object (rank-local, -1), offset, crc
    chunks: list[sharding.ChunkRow] = field(default_factory=list)  # object rank-local
    block_size: int = 0  # the chunks' checksummed block
    hashes: list[tuple[int, str | None]] = field(default_factory=list)  # global leaf, hash
    reused: list[tuple[int, int]] = field(default_factory=list)  # global leaf, base leaf
    base_attempt: str | None = None  # the base manifest the rank compared with


@dataclass(frozen=True)
class _Outcome:
    """The coordinator's word on the save, broadcast to every rank."""

    info: CommitInfo | None
    failure: _Failure | None = None
    remove: bool = True  # whether the ranks may delete their objects (nothing committed)


# =========================================================================== merging


@dataclass
class _Leaf:
    path: str
    dtype: str
    shape: list[int]
    nbytes: int
    attrs: dict[str, Any] | None
    holders: dict[int, int]  # rank -> that rank's leaf index
    owner: int = -1
    chunks: list[tuple[int, int, Any]] | None = None  # sharded: (writer rank, its chunk, box)


def _kind(node: Any) -> str:
    if type(node) is int:
        return "array"
    if "s" in node:
        return "numpy scalar"
    if "v" in node or "x" in node:
        return "plain value"
    if "d" in node:
        return "dict"
    return "list" if "l" in node else "tuple"


def _plain(node: dict[str, Any]) -> Any:
    return node["v"] if "v" in node else node["x"]


def _same_value(a: Any, b: Any) -> bool:
    return type(a) is type(b) and (a == b or (a != a and b != b))  # NaN equals NaN here


def merge_parts(parts: list[_Part]) -> tuple[Any, list[_Leaf]]:
    """Merge the ranks' parts into one tree and its leaves, and choose each leaf's writer.

    Every rank runs this on the same input and gets the same result.

    Raises:
        ValueError: the parts disagree where they overlap (named by path and ranks).
    """
    leaves: list[_Leaf] = []

    def where(path: str) -> str:
        return repr(path) if path else "<root>"

    def visit(nodes: list[tuple[int, Any]], path: str, depth: int) -> Any:
        kinds = [(rank, _kind(node)) for rank, node in nodes]
        first_rank, kind = kinds[0]
        for rank, other in kinds[1:]:
            if other != kind:
                raise ValueError(
                    f"state entry {where(path)} is a {kind} on rank {first_rank} and a "
                    f"{other} on rank {rank}; where the ranks' parts overlap they must agree"
                )
        if kind == "dict":
            order: list[str] = []
            original: dict[str, str | int] = {}
            children: dict[str, list[tuple[int, Any]]] = {}
            for rank, node in nodes:
                for key, child in zip(node["d"], node["c"], strict=True):
                    segment = escape_key(key)
                    if segment not in children:
                        order.append(segment)
                        original[segment] = key
                        children[segment] = []
                    elif type(original[segment]) is not type(key):
                        raise ValueError(
                            f"dict {where(path)} has key {original[segment]!r} on one rank "
                            f"and {key!r} on rank {rank}; they would share one path"
                        )
                    children[segment].append((rank, child))
            merged: dict[str, Any] = {
                "d": [original[s] for s in order],
                "c": [visit(children[s], join_path(path, s, depth), depth + 1) for s in order],
            }
            if any("o" in node for _, node in nodes):  # an OrderedDict on some rank
                merged["o"] = 1
            return merged
        if kind in ("list", "tuple"):
            tag = "l" if kind == "list" else "t"
            lengths = {rank: len(node[tag]) for rank, node in nodes}
            if len(set(lengths.values())) > 1:
                raise ValueError(
                    f"{kind} {where(path)} has different lengths on different ranks "
                    f"({lengths}); where the ranks' parts overlap they must agree"
                )
            return {
                tag: [
                    visit(
                        [(rank, node[tag][i]) for rank, node in nodes],
                        join_path(path, str(i), depth),
                        depth + 1,
                    )
                    for i in range(lengths[first_rank])
                ]
            }
        if kind == "plain value":  # or a typed value, compared by its [kind, name]
            value = _plain(nodes[0][1])
            for rank, node in nodes[1:]:
                if not _same_value(_plain(node), value):
                    raise ValueError(
                        f"state entry {where(path)} is {value!r:.80} on rank {first_rank} and "
                        f"{_plain(node)!r:.80} on rank {rank}; a value several ranks hold must "
                        "be the same on all (keep per-rank values under per-rank keys)"
                    )
            return nodes[0][1]
        holders: dict[int, int] = {}
        described: dict[int, tuple[str, list[int]]] = {}
        for rank, node in nodes:
            index = node if kind == "array" else node["s"]
            holders[rank] = index
            part = parts[rank]
            described[rank] = (part.dtypes[index], part.shapes[index])
        dtype, shape = described[first_rank]
        for rank, (other_dtype, other_shape) in described.items():
            if (other_dtype, other_shape) != (dtype, shape):
                raise ValueError(
                    f"array {where(path)} is {dtype}{shape} on rank {first_rank} and "
                    f"{other_dtype}{other_shape} on rank {rank}; an array several ranks hold "
                    "is written once, so it must be the same array on all of them"
                )
        index = holders[first_rank]
        chunks = sharding.merged_chunks(
            path, shape, {rank: parts[rank].chunks.get(i) for rank, i in holders.items()}
        )
        leaves.append(
            _Leaf(
                path,
                dtype,
                shape,
                parts[first_rank].nbytes[index],
                parts[first_rank].attrs[index],
                holders,
                chunks=chunks,
            )
        )
        number = len(leaves) - 1
        return number if kind == "array" else {"s": number}

    tree = visit(list(enumerate(part.tree for part in parts)), "", 0)
    _assign_owners(leaves, len(parts))
    return tree, leaves


def _assign_owners(leaves: list[_Leaf], world: int) -> None:
    """A leaf one rank holds is that rank's; a leaf several hold goes, largest first, to the
    holder with the fewest bytes so far (the lowest rank on a tie). A sharded leaf has no
    owner: each of its boxes gets a writer the same way, after the whole leaves."""
    assigned = [0] * world
    shared = []
    for number, leaf in enumerate(leaves):
        if leaf.chunks is not None:
            continue
        if len(leaf.holders) == 1:
            (leaf.owner,) = leaf.holders
            assigned[leaf.owner] += leaf.nbytes
        else:
            shared.append(number)
    shared.sort(key=lambda number: (-leaves[number].nbytes, number))
    for number in shared:
        leaf = leaves[number]
        leaf.owner = min(leaf.holders, key=lambda rank: (assigned[rank], rank))
        assigned[leaf.owner] += leaf.nbytes
    for leaf in leaves:
        if leaf.chunks is not None:
            itemsize = leaf.nbytes // max(1, math.prod(leaf.shape))
            leaf.chunks = sharding.assign_writers(leaf.chunks, itemsize, assigned)


# =========================================================================== saving


def save(
    root: Root,
    state: Any,
    *,
    step: int,
    metadata: Any = None,
    full: bool = False,
    group: Any = None,
    coordinator: int = 0,
    comm: Collectives | None = None,
    **store_options: Any,
) -> CommitInfo:
    """Save this rank's part of a state as step ``step``; every rank of the group calls it.

    With ``Settings.incremental`` (the default; the coordinator's), each rank hashes the
    leaves it writes and leaves out those unchanged since the newest committed step, whose
    objects the manifest references instead, as ``ckptstore.save`` does (docs/format.md,
    "Incremental saves").

    Args:
        root: URL, path or Store of the run's checkpoint root (the same root on every rank).
        state: this rank's part: nested dicts/lists/tuples of torch tensors, JAX or numpy
            arrays and plain values, merged with the other ranks' parts by dict key.
        step: the step number, the same on every rank.
        metadata: JSON stored in the manifest (the coordinator's is used).
        full: write every leaf and reference no earlier step (the coordinator's is used).
        group: a ``torch.distributed`` process group (default: the whole world).
        coordinator: the rank (within the group) that commits.
        comm: collectives to use; by default ``torch.distributed``'s if it is initialised,
            else those of an initialised ``jax.distributed`` job (:func:`default_collectives`).
        **store_options: options for a URL ``root`` (endpoint, credentials, settings), as on
            every face (:mod:`ckptstore.pipeline.root`).

    Returns:
        What was committed, the same on every rank.

    Raises:
        CommitConflictError: the step is already committed.
        ValueError: the ranks' parts disagree where they overlap, or the ranks disagree on
            the step.
        CkptStoreError: another rank failed; the message names it and its error. A rank's
            own error is raised as itself. Nothing is committed in either case.
    """
    comm = comm if comm is not None else default_collectives(group)
    check_coordinator(comm, coordinator)
    with (
        opened(root, store_options) as store,
        _stager(store) as stager,
        contextlib.ExitStack() as later,
    ):
        flat: FlatState | None = None
        shards = sharding.RankShards({}, {}, {})
        error: BaseException | None = None
        try:
            check_step(step)
            state, sharded = sharding.split_shards(state)
            staged = save_path.stage(stager, state, copy=False)
            later.callback(staged.release)
            staged.wait_ready()
            flat = staged.flat()
            if sharded:
                pieces = save_path.stage(stager, sharding.chunk_state(sharded), copy=False)
                later.callback(pieces.release)
                pieces.wait_ready()
                shards = sharding.RankShards.of(flat.paths, sharded, pieces.flat().arrays)
        except Exception as exc:
            error = exc
        return commit_parts(
            comm, store, flat, error, step, metadata, coordinator, shards=shards, full=full
        )


def default_collectives(group: Any = None) -> Collectives:
    """The collectives of the running job: ``torch.distributed``'s (over ``group``) if it is
    initialised, else a ``jax.distributed`` job's
    (:class:`~ckptstore.manager.jax_collectives.JaxCollectives`).

    Raises:
        RuntimeError: neither is initialised (the message says what to do).
    """
    if not _torch_group_running():
        from ckptstore.manager.jax_collectives import JaxCollectives, jax_group_running

        if group is None and jax_group_running():
            return JaxCollectives()
    return TorchCollectives(group)


def check_coordinator(comm: Collectives, coordinator: int) -> None:
    """Refuse a coordinator outside the group."""
    if not 0 <= coordinator < comm.world:
        raise ValueError(f"coordinator {coordinator} is outside a group of {comm.world}")


def commit_parts(
    comm: Collectives,
    store: Store,
    flat: FlatState | None,
    error: BaseException | None,
    step: int,
    metadata: Any,
    coordinator: int,
    *,
    shards: sharding.RankShards | None = None,
    full: bool = False,
) -> CommitInfo:
    """Everything of a multi-rank save after this rank's part is staged: the collectives,
    this rank's writes and the coordinator's commit (:func:`save` runs it in the caller's
    thread; the multi-rank :class:`~ckptstore.manager.distributed_manager.CheckpointManager`
    in a thread of its own, on a group of its own).

    Args:
        flat: this rank's staged part, which must not change until this returns; ``None``
            if staging failed.
        error: why staging failed, or ``None``. A failed rank still takes part, so the
            others learn of it instead of waiting, and then raises ``error`` itself.
        shards: this rank's staged chunks of sharded leaves (:mod:`ckptstore.manager.
            sharding`), whose placeholders are in ``flat``.
        full: with incremental saves (``Settings.incremental``, the coordinator's), record
            the leaves' hashes but reference nothing.

    Returns and raises as :func:`save`.
    """
    rank = comm.rank
    shards = shards or sharding.RankShards({}, {}, {})
    with contextlib.ExitStack() as later:
        # 1. share every rank's part; the coordinator adds its session's ticket
        session: SaveSession | None = None  # the coordinator's, holding the lease
        base: Manifest | None = None  # the coordinator's, held for the session
        shared: Any = None if error is None else _Failure.of(rank, error)
        if flat is not None and error is None:
            try:
                part = _describe(flat, step)
                if shards.global_shapes:
                    shapes, nbytes, boxes = sharding.describe(shards, part.shapes, part.nbytes)
                    part = dataclasses.replace(part, shapes=shapes, nbytes=nbytes, chunks=boxes)
                if rank == coordinator:
                    session = background.run(SaveSession.begin(store, step, metadata))
                    later.callback(_release, session)  # committed or not, at the end
                    hashing = store.settings.layout.incremental
                    if hashing and not full:
                        base = background.run(session.hold_base())
                    part = dataclasses.replace(
                        part,
                        ticket=session.ticket,
                        hashing=hashing,
                        base=None if base is None else base.step,
                    )
                shared = part
            except Exception as exc:
                error, shared = exc, _Failure.of(rank, exc)
        try:
            parts = comm.all_gather(shared)
        except Exception as exc:
            raise lost_rank(store, step, "sharing the ranks' parts", exc) from exc
        _raise_first(parts, error, store, step)
        steps = {p.step for p in parts}
        if len(steps) > 1:
            raise ValueError(f"the ranks save different steps: {sorted(steps)}")
        assert flat is not None
        attempt = parts[coordinator].ticket
        assert attempt is not None
        tree, leaves = merge_parts(parts)

        # 2. write what this rank owns, then tell the coordinator
        prefix = f"{attempt.prefix}r{rank}-"
        try:
            written: Any = background.run(
                bounded(
                    _write_own(store, flat, leaves, rank, prefix, shards, parts[coordinator], base),
                    seconds=store.settings.layout.save_deadline,
                    what=f"rank {rank}'s writes of step {step} to {store.url}",
                    setting="save_deadline",
                )
            )
        except Exception as exc:
            error, written = exc, _Failure.of(rank, exc)
        try:
            reports = comm.gather(written, coordinator)
        except BaseException as exc:
            _remove(store, prefix)  # a rank died before the commit: nothing is committed
            if isinstance(exc, Exception):
                raise lost_rank(store, step, "gathering the written objects", exc) from exc
            raise
        outcome: _Outcome | None = None
        if reports is not None:
            assert session is not None  # the coordinator's
            try:
                outcome = background.run(
                    _commit(
                        session,
                        reports,
                        tree,
                        leaves,
                        metadata,
                        parts[coordinator].hashing,
                    )
                )
            except Exception as exc:  # unforeseen: keep the data, the manifest may exist
                outcome = _Outcome(None, _Failure.of(rank, exc), remove=False)
        # 3. every rank learns the outcome. If this fails the coordinator may have committed
        # already, so the objects stay (gc removes them if it did not).
        try:
            outcome = comm.broadcast(outcome, coordinator)
        except Exception as exc:
            # The coordinator knows the outcome without hearing it: a committed step is
            # committed, whatever became of the ranks it was telling.
            if reports is None or outcome is None or outcome.info is None:
                raise CkptStoreError(
                    f"{store.url}: the outcome of step {step} is unknown to rank {rank}: "
                    f"hearing it from the coordinator failed ({type(exc).__name__}: {exc}); "
                    "the step is committed only if it is listed"
                ) from exc
        assert outcome is not None
        if outcome.info is not None:
            return outcome.info
        if outcome.remove:
            _remove(store, prefix)
        if error is not None:
            raise error
        failure = outcome.failure
        assert failure is not None
        if failure.kind == CommitConflictError.__name__:
            raise CommitConflictError(failure.message)
        raise CkptStoreError(f"{store.url}: step {step} was not saved: {failure.describe()}")


def _release(session: SaveSession) -> None:
    background.run(session.release())


def lost_rank(
    store: Store, step: int, what: str, exc: Exception, outcome: str = "was not saved"
) -> CkptStoreError:
    """The error a surviving rank raises when a collective fails, which is how a rank learns
    that another one died or stalled (torch.distributed raises its transport's RuntimeError
    then, after the group's timeout for a silent rank); ``outcome`` says what became of the
    step (``"was not saved"``, ``"was not loaded"``)."""
    timed_out = isinstance(exc, TimeoutError) or "timed out" in str(exc).lower()
    why = (
        "another rank died or stalled: none answered within the collectives' timeout"
        if timed_out
        else "another rank died"
    )
    return CkptStoreError(
        f"{store.url}: step {step} {outcome}: {what} failed, most likely because {why} "
        f"({type(exc).__name__}: {exc})"
    )


def _describe(flat: FlatState, step: int) -> _Part:
    return _Part(
        step=step,
        tree=flat.tree,
        paths=flat.paths,
        dtypes=flat.dtype_names(),
        shapes=flat.shapes,
        nbytes=flat.nbytes,
        attrs=flat.attrs,
    )


def _raise_first(parts: list[Any], own: BaseException | None, store: Store, step: int) -> None:
    """Raise if any rank failed before writing: its own error on a failed rank, on the
    others an error naming every failed rank."""
    failures = [p for p in parts if isinstance(p, _Failure)]
    if own is not None:
        raise own
    if failures:
        first = failures[0]
        if first.kind == CommitConflictError.__name__:
            raise CommitConflictError(first.message)
        raise CkptStoreError(
            f"{store.url}: step {step} was not saved: " + "; ".join(f.describe() for f in failures)
        )


def _block_size(leaves: list[_Leaf], limit: int) -> int:
    """The chunks' block size, from every rank's boxes (the same on every rank)."""
    # an empty chunk has no rows to split: it must not shrink every chunk's blocks
    return block_size_for(
        [
            (box[1], leaf.nbytes // math.prod(leaf.shape))
            for leaf in leaves
            if math.prod(leaf.shape) > 0
            for _, _, box in leaf.chunks or ()
            if math.prod(box[1]) > 0
        ],
        limit,
    )


async def _write_own(
    store: Store,
    flat: FlatState,
    leaves: list[_Leaf],
    rank: int,
    prefix: str,
    shards: sharding.RankShards,
    coordinator: _Part,
    base: Manifest | None,
) -> _Written:
    """Write the leaves and chunks this rank owns. With incremental saves, hash the leaves
    first and leave out those unchanged in the coordinator's base (``base`` on the
    coordinator; the others read it)."""
    mine = [number for number, leaf in enumerate(leaves) if leaf.owner == rank]
    # the boxes of sharded leaves this rank writes, planned and written like leaves
    boxes = [
        (number, k, box)
        for number, leaf in enumerate(leaves)
        for writer, k, box in leaf.chunks or ()
        if writer == rank
    ]
    chunk_arrays = [shards.arrays[leaves[n].holders[rank]][k] for n, k, _ in boxes]
    own = FlatState(
        tree=None,
        paths=[leaves[n].path for n in mine]
        + [f"{leaves[n].path} {list(b[0])}" for n, _, b in boxes],
        arrays=[flat.arrays[leaves[n].holders[rank]] for n in mine] + chunk_arrays,
        attrs=[leaves[n].attrs for n in mine] + [None] * len(boxes),
    )
    hashes: list[str | None] = []
    reuse: save_path.Reuse | None = None
    # With no base to compare with, the hashes are only for the manifest: they are made
    # while the leaves are written (a save's time grew by the whole hashing pass, about
    # 0.1 s a GiB, when it came first).
    hash_later = coordinator.hashing and bool(mine) and coordinator.base is None
    if coordinator.hashing and mine and coordinator.base is not None:
        hashes = await save_path.hashes(own.arrays[: len(mine)])
        base = base or await save_path.read_base(store, coordinator.base)
        if base is not None:
            picked = [leaves[n] for n in mine]
            reuse = save_path.reuse(
                base,
                [leaf.path for leaf in picked],
                [leaf.dtype for leaf in picked],
                [leaf.shape for leaf in picked],
                hashes,
            )
    plan = save_path.plan(store, own.nbytes, own.paths, reuse=reuse)
    block = _block_size(leaves, store.settings.layout.chunk_block_size)
    # every part runs to its end before an error is raised: the hashing and checksum
    # threads read the arrays, which the caller may reuse once this returns
    written, blocks, hashed = await asyncio.gather(
        save_path.write(store, own.arrays, plan, prefix),
        sharding.block_checksums(chunk_arrays, block),
        _hashes_if(hash_later, own.arrays[: len(mine)]),
        return_exceptions=True,
    )
    if isinstance(written, BaseException):
        raise written
    if isinstance(blocks, BaseException):
        raise blocks
    if isinstance(hashed, BaseException):
        raise hashed
    if hashed is not None:
        hashes = hashed
    at = len(mine)
    return _Written(
        objects=[
            (obj.name, obj.size, crc)
            for obj, crc in zip(plan.objects, written.object_crc, strict=True)
        ],
        leaves=[
            (number, plan.leaf_object[i], plan.leaf_offset[i], written.leaf_crc[i])
            for i, number in enumerate(mine)
        ],
        chunks=[
            (n, list(box[0]), list(box[1]), obj, offset, crcs)
            for (n, _, box), obj, offset, crcs in zip(
                boxes, plan.leaf_object[at:], plan.leaf_offset[at:], blocks, strict=True
            )
        ],
        block_size=block,
        hashes=list(zip(mine, hashes, strict=True)) if hashes else [],
        reused=[]
        if reuse is None
        else [(mine[i], j) for i, j in enumerate(reuse.leaf_source) if j >= 0],
        base_attempt=None if reuse is None else reuse.base.attempt,
    )


async def _hashes_if(wanted: bool, arrays: list[np.ndarray[Any, Any]]) -> list[str | None] | None:
    return await save_path.hashes(arrays) if wanted else None


async def _commit(
    session: SaveSession,
    reports: list[Any],
    tree: Any,
    leaves: list[_Leaf],
    metadata: Any,
    hashing: bool,
) -> _Outcome:
    failures = [r for r in reports if isinstance(r, _Failure)]
    if failures:
        return _Outcome(None, failures[0])
    store, attempt, base = session.store, session.attempt, session.base
    draft = session.draft(
        [leaf.path for leaf in leaves],
        [leaf.dtype for leaf in leaves],
        [leaf.shape for leaf in leaves],
        [leaf.nbytes for leaf in leaves],
        [leaf.attrs for leaf in leaves],
    )
    reported = [False] * len(leaves)
    chunk_rows: list[sharding.ChunkRow] = []
    for rank, written in enumerate(reports):
        first = draft.add_objects(
            [f"{attempt.id}/r{rank}-{name}" for name, _, _ in written.objects],
            [size for _, size, _ in written.objects],
            [crc for _, _, crc in written.objects],
        )
        for number, obj, offset, crc in written.leaves:
            draft.place(number, first + obj if obj >= 0 else -1, offset, crc)
            reported[number] = True
        for number, start, shape, obj, offset, crcs in written.chunks:
            chunk_rows.append((number, start, shape, first + obj, offset, crcs))
        if hashing:
            draft.set_hashes(written.hashes)
    reused = [pair for written in reports for pair in written.reused]
    compared = {r.base_attempt for r in reports if r.reused}
    if reused and (base is None or compared != {base.attempt}):
        return _Outcome(
            None,
            _Failure(
                -1,
                "CkptStoreError",
                "the ranks compared their leaves with another base step than the one held "
                f"for the save ({sorted(a or '?' for a in compared)})",
            ),
        )
    for number, _ in reused:
        reported[number] = True
    block_sizes = {r.block_size for r in reports if r.chunks}
    if len(block_sizes) > 1:
        return _Outcome(
            None,
            _Failure(
                -1,
                "CkptStoreError",
                f"the ranks use different chunk block sizes {sorted(block_sizes)} "
                "(different Settings.chunk_block_size?)",
            ),
        )
    written_boxes = Counter(row[0] for row in chunk_rows)
    for number, leaf in enumerate(leaves):
        if leaf.chunks is not None:
            reported[number] = written_boxes[number] == len(leaf.chunks)
    if not all(reported):
        missing = [leaves[i].path for i, ok in enumerate(reported) if not ok]
        return _Outcome(
            None, _Failure(-1, "CkptStoreError", f"no rank wrote the leaves {missing[:5]}")
        )
    unseen = await _unseen_objects(store, attempt, draft.object_keys, draft.object_lengths)
    if unseen:
        return _Outcome(
            None,
            _Failure(
                -1,
                "CkptStoreError",
                f"objects the ranks reported as written are not in {store.url} as the "
                f"coordinator sees it: {unseen[:3]}; do all ranks save to the same shared "
                "root (a local path must be a filesystem every rank mounts)?",
            ),
        )
    if reused:
        assert base is not None
        draft.reference(base, reused)
    manifest = draft.build(
        tree=tree,
        metadata=metadata,
        chunks=sharding.chunk_table(
            block_sizes.pop() if block_sizes else store.settings.layout.chunk_block_size, chunk_rows
        ),
    )
    try:
        return _Outcome(await session.commit(manifest))
    except StoreError as exc:
        # the manifest may have landed with its reply lost: keep the data for a later check
        return _Outcome(None, _Failure.of(-1, exc), remove=False)
    except (CkptStoreError, ValueError) as exc:
        # a conflict, data older than half the gc grace period, a manifest over its cap:
        # nothing of this attempt is committed
        return _Outcome(None, _Failure.of(-1, exc))


async def _unseen_objects(
    store: Store, attempt: Attempt, keys: list[str], lengths: list[int]
) -> list[str]:
    """Reported objects the coordinator cannot see with their reported length (one listing
    of the attempt prefix). A rank whose root is not the coordinator's (a local path on
    another host) reports objects the manifest must not name: the step would commit and
    only fail when loaded."""
    root = step_prefix(attempt.step)
    found = {meta.key: meta.size async for meta in store.list(attempt.prefix)}
    return [
        f"{root}{key} ({length} bytes)"
        for key, length in zip(keys, lengths, strict=True)
        if found.get(f"{root}{key}") != length
    ]


def _remove(store: Store, prefix: str) -> None:
    """Remove this rank's objects of a save that was not committed."""
    background.run(save_path.discard(store, prefix))


# =========================================================================== loading


def load(
    root: Root,
    step: int | None = None,
    *,
    keys: Any = None,
    target: Any = None,
    group: Any = None,
    coordinator: int = 0,
    comm: Collectives | None = None,
    broadcast: bool | None = None,
    shared_memory: bool = True,
    stream: bool | str | Iterable[str] = False,
    **store_options: Any,
) -> Any:
    """Load the part of a checkpoint this rank needs, verifying every byte read.

    On several ranks (``comm``, or an initialised ``torch.distributed``) a leaf that several
    ranks select is read from the store by one of them and sent to the others over the
    group (:mod:`ckptstore.manager.broadcast`), so a state replicated on N ranks is read
    once, not N times; the load is then a collective every rank must call, for the same
    step.

    Args:
        root: URL, path or Store of the run's checkpoint root.
        step: the step; ``None`` takes the newest committed step as the coordinator sees it,
            so every rank loads the same one (a collective: every rank must call).
        keys: leaf paths or prefixes to read; only their byte ranges are fetched.
        target: what to rebuild the arrays as; a state given here without ``keys`` also
            selects what is read: exactly the leaves it holds, so a rank reads only its own
            shards. ``keys`` and ``target`` follow the rule of every face (see
            :meth:`~ckptstore.CheckpointManager.restore`, :mod:`ckptstore.pipeline.restore`).
        group, coordinator, comm: as for :func:`save`; ``coordinator`` chooses the step
            when ``step`` is ``None``.
        broadcast: read shared leaves once and send them between ranks; ``False`` makes
            every rank read all it selects from the store itself, and a load with a step
            given a plain read that needs no process group. ``None`` (the default) is
            ``True`` except with collectives whose ``broadcast_by_default`` is false
            (:class:`~ckptstore.manager.jax_collectives.JaxCollectives`, whose bytes would
            all pass through the coordination service).
        shared_memory: with ``broadcast``, ranks on one host hand each other the shared
            leaves through memory segments (``/dev/shm``, or ``CKPTSTORE_SHM_DIR``) rather
            than over the group (:mod:`ckptstore.manager.segments`); ``False`` sends them
            over the group as between hosts.
        stream: return once the first part is in place, as ``CheckpointManager.restore``'s
            (``True``: every leaf but the optimizer's state; or the keys given), and read the
            rest in the background (:mod:`ckptstore.pipeline.streaming`). The first part is
            loaded as without it (shared leaves read once, with ``broadcast``); the rest each
            rank reads from the store itself, so no collective runs beside the training
            loop's. A torch optimizer step, ``ckptstore.fence()`` and the next save wait for
            it, and raise its error, on the rank whose read failed.
        **store_options: options for a URL ``root``, as on every face
            (:mod:`ckptstore.pipeline.root`).

    Raises:
        NotFoundError: nothing committed, no such step, or a key (or target leaf) matching
            nothing; every such key is named.
        CorruptCheckpointError: anything read fails verification (with ``broadcast``, on
            every rank, whichever rank read it).
        CkptStoreError: with ``broadcast``, another rank failed or died.
    """
    asked = request(keys, target, stream)  # bad arguments fail here, before any collective
    streaming.wait_all()
    store, owned = open_root(root, store_options)
    handed = False  # the background part of a streaming load closes the store
    try:
        state, handed = _load(
            store, owned, step, asked, group, coordinator, comm, broadcast, shared_memory
        )
        return state
    finally:
        if owned and not handed:
            background.run(store.close())


def _load(
    store: Store,
    owned: bool,
    step: int | None,
    asked: Request,
    group: Any,
    coordinator: int,
    comm: Collectives | None,
    broadcast: bool | None,
    shared_memory: bool,
) -> tuple[Any, bool]:
    """:func:`load` on an open store; returns the state and whether a streaming load's
    background part took the store over."""
    if comm is None and (step is None or (broadcast is not False and _group_running())):
        comm = default_collectives(group)
    if broadcast is None:
        broadcast = bool(getattr(comm, "broadcast_by_default", True))
    if step is None:
        assert comm is not None
        found: Any = None
        if comm.rank == coordinator:
            try:
                found = background.run(latest_step(store))
            except Exception as exc:
                found = _Failure.of(coordinator, exc)
        found = comm.broadcast(found, coordinator)
        if isinstance(found, _Failure):
            raise CkptStoreError(
                f"{store.url}: finding the latest step failed on {found.describe()}"
            )
        if found is None:
            raise NotFoundError(f"{store.url}: no committed checkpoint")
        step = int(found)
    if broadcast and comm is not None and comm.world > 1:
        if not callable(getattr(comm, "exchange", None)):
            raise TypeError(
                f"{type(comm).__name__} has no exchange(), which a load with "
                "broadcast=True sends shared leaves with; add it (see Collectives) or "
                "pass broadcast=False"
            )
        # imported here: the broadcast module builds on this one's collectives
        from ckptstore.manager.broadcast import load_shared

        selection = load_shared(store, step, asked, comm, shared_memory=shared_memory)
    else:
        selection = background.run(read(store, step, asked))
    state = rebuild(selection, store=store, owned=owned)
    return state, selection.stream is not None


def _group_running() -> bool:
    """Whether ``torch.distributed`` or ``jax.distributed`` is initialised."""
    from ckptstore.manager.jax_collectives import jax_group_running

    return _torch_group_running() or jax_group_running()


def _torch_group_running() -> bool:
    """Whether ``torch.distributed`` is initialised, without importing torch for it."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and bool(dist.is_available() and dist.is_initialized())


# =========================================================================== helpers


@contextlib.contextmanager
def _stager(store: Store) -> Iterator[Stager]:
    stager = Stager(leaf_alignment=store.settings.layout.leaf_alignment)
    try:
        yield stager
    finally:
        stager.close()
