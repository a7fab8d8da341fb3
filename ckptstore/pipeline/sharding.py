"""Sharded tensors in a multi-rank save: each rank's shards become chunks of one global leaf.

:func:`ckptstore.distributed.save` merges the ranks' parts by path. A leaf that is a shard of
a global array on every rank that holds it (a :class:`~ckptstore.stage.shards.Shard`, a
``DTensor``, a sharded ``jax.Array``; see :mod:`ckptstore.stage.shards`) is not written whole
by one owner: it becomes one leaf of the global shape, and every distinct box any rank holds
becomes one chunk of it (:mod:`ckptstore.layout.chunks`), written by one of the ranks that
hold it. Identical boxes on several ranks (replicas: a DTensor replicated along one mesh
dimension, a JAX array replicated over some devices) are written once, each by the holder
with the fewest bytes assigned so far, so replicas spread the writing over the ranks as
replicated leaves do.

Everything here runs on every rank with the same input and gives the same result, so a
disagreement (a leaf sharded on one rank and whole on another, boxes that overlap or leave a
gap) raises the same ``ValueError`` on every rank before anything is written.

The steps, as :mod:`ckptstore.manager.distributed` calls them:

1. :func:`split_shards`: the rank's state with each sharded leaf replaced by an empty
   placeholder of its framework and dtype (staged like any leaf, so the leaf's attributes are
   recorded as usual), and what the rank holds of each.
2. :func:`describe`: the global shape, bytes and boxes of those leaves for the part every
   rank shares.
3. :func:`merged_chunks` (in the merge) and :func:`assign_writers`: one writer per box,
   after checking that the boxes tile the global shape exactly.
4. :func:`block_checksums`: the crc32c of every block of the chunks a rank writes.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptstore.layout.chunks import Box, Chunks, block_crcs, check_grid
from ckptstore.layout.tree import map_leaves
from ckptstore.stage.shards import LocalChunks, Shard, local_chunks
from ckptstore.stage.tree import expand
from ckptstore.store.checksum import in_hash_thread

__all__ = [
    "ChunkRow",
    "RankShards",
    "Shard",
    "assign_writers",
    "block_checksums",
    "chunk_state",
    "chunk_table",
    "describe",
    "merged_chunks",
    "split_shards",
]

#: One chunk a rank wrote: (global leaf, start, shape, object (rank-local), offset, block crcs).
ChunkRow = tuple[int, list[int], list[int], int, int, list[int]]


def split_shards(state: Any) -> tuple[Any, dict[str, LocalChunks]]:
    """``state`` with every sharded leaf replaced by its placeholder, and what this rank
    holds of each sharded leaf, by path.

    Raises:
        ValueError: a DTensor with a ``Partial`` placement.
    """
    found: dict[str, LocalChunks] = {}

    def swap(path: str, leaf: Any) -> Any:
        local = local_chunks(leaf)
        if local is None:
            return leaf
        # an empty shard (an uneven split can leave a rank none) contributes no chunk
        local = LocalChunks(
            local.global_shape,
            [(box, data) for box, data in local.chunks if math.prod(box[1])],
            local.placeholder,
        )
        found[path] = local
        return local.placeholder

    return map_leaves(swap, state, expand=expand), found


@dataclass(frozen=True, slots=True)
class RankShards:
    """This rank's chunks of the sharded leaves, staged.

    Attributes:
        boxes: by index of the rank's flat leaf, the boxes it holds.
        arrays: by index of the rank's flat leaf, the host array of each box.
        global_shapes: by index of the rank's flat leaf, the global shape.
    """

    boxes: dict[int, list[Box]]
    arrays: dict[int, list[np.ndarray[Any, Any]]]
    global_shapes: dict[int, list[int]]

    @classmethod
    def of(
        cls, paths: Sequence[str], found: dict[str, LocalChunks], staged: Sequence[Any]
    ) -> RankShards:
        """Match the sharded leaves to the rank's flat leaves (by ``paths``) and to their
        staged chunk arrays (``staged``, in the order of :func:`chunk_state`)."""
        boxes: dict[int, list[Box]] = {}
        arrays: dict[int, list[np.ndarray[Any, Any]]] = {}
        shapes: dict[int, list[int]] = {}
        index = {path: i for i, path in enumerate(paths)}
        at = 0
        for path, local in found.items():
            i = index[path]
            boxes[i] = [box for box, _ in local.chunks]
            arrays[i] = list(staged[at : at + len(local.chunks)])
            shapes[i] = list(local.global_shape)
            at += len(local.chunks)
        return cls(boxes, arrays, shapes)


def chunk_state(found: dict[str, LocalChunks]) -> list[Any]:
    """The chunks' framework arrays as one list, for the stager to copy to host."""
    return [data for local in found.values() for _, data in local.chunks]


def describe(
    shards: RankShards, shapes: list[list[int]], nbytes: list[int]
) -> tuple[list[list[int]], list[int], dict[int, list[Box]]]:
    """The shapes, bytes and boxes a rank shares: a sharded leaf has its global shape and
    bytes (its placeholder's itemsize times the global size)."""
    shapes, nbytes = list(shapes), list(nbytes)
    for i, shape in shards.global_shapes.items():
        arrays = shards.arrays[i]
        itemsize = arrays[0].itemsize if arrays else 0
        shapes[i] = shape
        nbytes[i] = math.prod(shape) * itemsize
    return shapes, nbytes, shards.boxes


def merged_chunks(
    path: str, shape: Sequence[int], boxes: dict[int, list[Box] | None]
) -> list[tuple[int, int, Box]] | None:
    """The chunks of a leaf that several ranks hold (``boxes`` by rank, ``None`` where the
    rank holds it whole): ``(rank, the rank's chunk number, box)`` for every box any rank
    holds, or ``None`` for an ordinary leaf.

    Raises:
        ValueError: the leaf is sharded on one rank and whole on another, or the boxes do
            not tile its shape exactly (named by path).
    """
    whole = sorted(rank for rank, held in boxes.items() if held is None)
    if len(whole) == len(boxes):
        return None
    if whole:
        sharded = min(rank for rank, held in boxes.items() if held is not None)
        raise ValueError(
            f"array {path!r} is a shard of a global array on rank {sharded} and a whole array "
            f"on rank {whole[0]}; every rank must pass it the same way"
        )
    if not math.prod(shape):
        return None  # an empty array: no bytes to split, stored as an empty leaf
    out = [
        (rank, k, (tuple(box[0]), tuple(box[1])))
        for rank, held in sorted(boxes.items())
        for k, box in enumerate(held or [])
    ]
    distinct = {box for _, _, box in out}
    try:
        check_grid(shape, [box[0] for box in distinct], [box[1] for box in distinct])
    except ValueError as exc:
        raise ValueError(f"the shards of {path!r} over the ranks: {exc}") from None
    return out


def assign_writers(
    chunks: list[tuple[int, int, Box]], itemsize: int, assigned: list[int]
) -> list[tuple[int, int, Box]]:
    """One writer per distinct box: the holder with the fewest bytes in ``assigned`` so far
    (the lowest rank on a tie), largest boxes first; ``assigned`` is updated."""
    holders: dict[Box, list[tuple[int, int]]] = {}
    for rank, k, box in chunks:
        holders.setdefault(box, []).append((rank, k))
    order = sorted(holders, key=lambda box: (-math.prod(box[1]), box))
    writers = []
    for box in order:
        rank, k = min(holders[box], key=lambda held: (assigned[held[0]], held[0]))
        assigned[rank] += math.prod(box[1]) * itemsize
        writers.append((rank, k, box))
    return writers


async def block_checksums(
    arrays: Sequence[np.ndarray[Any, Any]], block_size: int
) -> list[list[int]]:
    """The crc32c of each block of each chunk a rank writes: one pass over the staged bytes
    in the hashing threads, which the caller runs alongside the writes."""
    return list(await asyncio.gather(*(in_hash_thread(block_crcs, a, block_size) for a in arrays)))


def chunk_table(block_size: int, rows: list[ChunkRow]) -> Chunks:
    """The manifest's chunk table from the rows the ranks reported (objects already
    numbered in the manifest's object table)."""
    return Chunks.build(block_size, rows)
