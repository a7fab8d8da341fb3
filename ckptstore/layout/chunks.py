"""Sharded leaves: one global array stored as chunks, and verified reads of any box of it.

A tensor sharded across ranks (a ``DTensor``, a sharded ``jax.Array``, a
:class:`ckptstore.distributed.Shard`) is saved as *one* leaf of its global shape whose bytes
live in *chunks*: each chunk is one rank's box of the global array (its start in every
dimension and its shape), stored in C order like any leaf (packed when small, an object of
its own when large). A load on another world size or sharding asks for a box of the global
array and reads only the parts of the chunks that overlap it.

Why per-block checksums. A box of a chunk is, in the chunk's bytes, one or more runs; reading
just those runs cannot be checked against a crc32c of the whole chunk, and DESIGN.md
invariant 5 says every byte read back is verified. So a chunk records the crc32c of each
fixed-size *block* of its bytes (the last block may be shorter) instead of one crc32c, and a
reader fetches the whole blocks around the runs it wants, checks each, and copies the runs
out. The block size trades manifest size against over-read: a contiguous run reads at most
one partial block too many at each end, and each block costs about 11 bytes of manifest
(a 10-digit crc32c and a comma). A save picks it with :func:`block_size_for`: a quarter of
its chunks' shortest row, so a column split or a grid of a table saved by rows reads just
its runs (with 1 MiB blocks and rows of 64 KiB such a load read every block, twice its
bytes), at most ``Settings.chunk_block_size`` (1 MiB by default: 11 bytes of manifest per MiB
stored, 11 MB for a 1 TB state, well under the 256 MiB manifest cap), and never more than
:data:`MAX_SAVE_BLOCKS` blocks per save. A rank whose new shard is a row range of 20 MiB or
more reads at most 2 MiB, 10 %, more than it needs. A reader merges only blocks that touch
into one request: the store's usual coalescing gap would read the runs a box skips.
Hashing per block costs the same one pass over the bytes as hashing per chunk.

Format (manifest version 3, see docs/format.md): a leaf stored as chunks has no object of its
own (``object`` -1, ``offset`` 0, ``crc32c`` 0) and its full ``length``; the body's
``chunks`` table, by column::

    "chunks": {"block_size": B, "leaf": [...], "start": [[...]], "shape": [[...]],
               "object": [...], "offset": [...], "crc32c": [[...]]}

:func:`parse_chunks` validates it with hard limits before any data is read: the chunks of a
leaf lie inside its shape, are not empty, and form a *grid* (along every dimension the chunks'
extents split the dimension into intervals with no gap and no overlap, and every combination
of intervals is exactly one chunk), so they cover the leaf exactly once. Every sharding that
DTensor and JAX produce is such a grid. A hostile list (overlapping, leaving a gap, reaching
out of bounds, too many) is refused with the reason.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptstore.errors import CorruptCheckpointError, InvalidRangeError, NotFoundError
from ckptstore.store.base import Store
from ckptstore.store.checksum import crc32c
from ckptstore.store.fanout import gather_all

__all__ = [
    "MAX_BLOCK_SIZE",
    "MAX_CHUNKS",
    "MIN_BLOCK_SIZE",
    "Box",
    "Chunks",
    "block_crcs",
    "block_size_for",
    "check_grid",
    "parse_chunks",
    "read_boxes",
]

#: Smallest and largest block a chunk's checksums may cover (powers of two in between).
MIN_BLOCK_SIZE = 4 << 10
MAX_BLOCK_SIZE = 1 << 30
#: Most chunks one manifest may hold (the manifest's size cap bounds it too).
MAX_CHUNKS = 1 << 22
#: A save's blocks are at most this fraction of its chunks' shortest row (see
#: :func:`block_size_for`).
ROW_BLOCKS = 4
#: A save shrinks its blocks only while its chunks keep at most this many of them (about
#: 11 MB of manifest).
MAX_SAVE_BLOCKS = 1 << 20

#: A box of a global array: its start in every dimension and its shape.
Box = tuple[tuple[int, ...], tuple[int, ...]]

_FIELDS = ("block_size", "leaf", "start", "shape", "object", "offset", "crc32c")


@dataclass(frozen=True, slots=True)
class Chunks:
    """A manifest's chunk table, by column (see the module docstring).

    Attributes:
        block_size: bytes per checksummed block of every chunk.
        leaf: the leaf each chunk belongs to.
        start: each chunk's start in its leaf's global shape.
        shape: each chunk's shape.
        object: the object (index into the manifest's object table) holding each chunk.
        offset: each chunk's byte offset inside its object.
        crc32c: per chunk, the crc32c of each block of its bytes.
        by_leaf: chunk indices per chunked leaf.
    """

    block_size: int
    leaf: list[int]
    start: list[list[int]]
    shape: list[list[int]]
    object: list[int]
    offset: list[int]
    crc32c: list[list[int]]
    by_leaf: dict[int, list[int]]

    @classmethod
    def build(
        cls,
        block_size: int,
        rows: Sequence[tuple[int, Sequence[int], Sequence[int], int, int, list[int]]],
    ) -> Chunks:
        """A table from rows ``(leaf, start, shape, object, offset, block crc32cs)``."""
        by_leaf: dict[int, list[int]] = {}
        for i, row in enumerate(rows):
            by_leaf.setdefault(row[0], []).append(i)
        return cls(
            block_size=block_size,
            leaf=[row[0] for row in rows],
            start=[list(row[1]) for row in rows],
            shape=[list(row[2]) for row in rows],
            object=[row[3] for row in rows],
            offset=[row[4] for row in rows],
            crc32c=[row[5] for row in rows],
            by_leaf=by_leaf,
        )

    def encode(self) -> dict[str, Any]:
        """The table as the manifest's JSON holds it."""
        return {
            "block_size": self.block_size,
            "leaf": self.leaf,
            "start": self.start,
            "shape": self.shape,
            "object": self.object,
            "offset": self.offset,
            "crc32c": self.crc32c,
        }

    def length(self, chunk: int, itemsize: int) -> int:
        """Bytes of chunk ``chunk`` of a leaf whose items are ``itemsize`` bytes."""
        return math.prod(self.shape[chunk]) * itemsize


def block_crcs(data: np.ndarray[Any, Any], block_size: int) -> list[int]:
    """The crc32c of each ``block_size`` block of a C-contiguous array's bytes."""
    view = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))  # type: ignore[arg-type]
    return [crc32c(view[at : at + block_size]) for at in range(0, len(view), block_size)]


def block_size_for(chunks: Sequence[tuple[Sequence[int], int]], limit: int) -> int:
    """The block size a save's chunks are checksummed with.

    A load that splits the rows of a chunk (a column split of a table saved by rows, a grid
    of a table saved by rows) wants, in the chunk's bytes, one run per row; with blocks
    longer than a row every block is touched and the whole chunk is read. So the block is
    at most a :data:`ROW_BLOCKS`-th of the shortest row (the innermost dimension, in bytes)
    of any chunk of two or more dimensions, rounded down to a power of two: a split of rows
    into two or four aligned parts reads exactly its bytes, and any run reads at most one
    partial block too many at each end. It is never larger than ``limit``
    (``Settings.chunk_block_size``), never smaller than :data:`MIN_BLOCK_SIZE`, and never so
    small that the save's chunks hold more than :data:`MAX_SAVE_BLOCKS` blocks: the
    manifest's size, which every rank reads on load, wins over the finer reads.

    Args:
        chunks: ``(shape, itemsize)`` of every chunk of the save, the same list on every rank.
        limit: the largest block, a power of two in ``[MIN_BLOCK_SIZE, MAX_BLOCK_SIZE]``.

    Returns:
        A power of two in ``[MIN_BLOCK_SIZE, limit]``.
    """
    block = limit
    for shape, itemsize in chunks:
        if len(shape) >= 2 and shape[-1] > 0:
            fraction = shape[-1] * itemsize // ROW_BLOCKS
            block = min(block, 1 << max(fraction, 1).bit_length() - 1)
    total = sum(math.prod(shape) * itemsize for shape, itemsize in chunks)
    fewest = 1 << max(-(-total // MAX_SAVE_BLOCKS) - 1, 0).bit_length()  # ceil to a power of 2
    return min(limit, max(block, fewest, MIN_BLOCK_SIZE))


# --------------------------------------------------------------------------- validation


def check_grid(
    global_shape: Sequence[int], starts: Sequence[Sequence[int]], shapes: Sequence[Sequence[int]]
) -> None:
    """Check that boxes ``(start, shape)`` cover ``global_shape`` exactly once, as a grid.

    Raises:
        ValueError: naming the first problem: a box out of bounds or empty, two boxes
            that overlap, a part of the array no box covers, boxes that do not form a grid.
    """
    ndim = len(global_shape)
    if not starts:
        raise ValueError("no chunk covers the array")
    for start, shape in zip(starts, shapes, strict=True):
        if len(start) != ndim or len(shape) != ndim:
            raise ValueError(
                f"chunk at {list(start)} of shape {list(shape)} does not have {ndim} dimensions"
            )
        for d in range(ndim):
            if shape[d] <= 0 or start[d] < 0 or start[d] + shape[d] > global_shape[d]:
                raise ValueError(
                    f"chunk at {list(start)} of shape {list(shape)} is empty or reaches out of "
                    f"the array's shape {list(global_shape)} (dimension {d})"
                )
    cell_of: list[dict[tuple[int, int], int]] = []
    for d in range(ndim):
        intervals = sorted(
            {(start[d], start[d] + shape[d]) for start, shape in zip(starts, shapes, strict=True)}
        )
        at = 0
        for low, high in intervals:
            if low < at:
                raise ValueError(
                    f"chunks overlap along dimension {d}: one spans [{low}, {high}), another "
                    f"ends at {at} (chunks must not overlap and must form a grid)"
                )
            if low > at:
                raise ValueError(f"no chunk covers [{at}, {low}) along dimension {d}")
            at = high
        if at != global_shape[d]:
            raise ValueError(f"no chunk covers [{at}, {global_shape[d]}) along dimension {d}")
        cell_of.append({interval: i for i, interval in enumerate(intervals)})
    cells: set[tuple[int, ...]] = set()
    for start, shape in zip(starts, shapes, strict=True):
        cell = tuple(cell_of[d][(start[d], start[d] + shape[d])] for d in range(ndim))
        if cell in cells:
            raise ValueError(f"two chunks cover the box at {list(start)} of shape {list(shape)}")
        cells.add(cell)
    expected = math.prod(len(c) for c in cell_of)
    if len(cells) != expected:
        grid = [sorted(c) for c in cell_of]
        for cell in itertools.product(*(range(len(c)) for c in cell_of)):
            if cell not in cells:
                box = [grid[d][i] for d, i in enumerate(cell)]
                raise ValueError(f"no chunk covers the box {box} (a gap in the grid)")


def parse_chunks(
    value: Any,
    *,
    shapes: Sequence[list[int]],
    itemsizes: Sequence[int],
    leaf_object: Sequence[int],
    objects: int,
    max_bytes: int,
) -> tuple[Chunks, list[tuple[int, int, int]]]:
    """Validate an untrusted chunk table against the manifest's leaves.

    Args:
        value: the ``chunks`` entry of a manifest body.
        shapes, itemsizes, leaf_object: per leaf (already validated).
        objects: how many objects the manifest names.
        max_bytes: the largest offset or length anything may claim.

    Returns:
        The table, and each chunk's ``(object, offset, length)`` for the extent checks.

    Raises:
        ValueError: with the reason.
    """
    if type(value) is not dict or set(value) != set(_FIELDS):
        raise ValueError(f"chunks is not an object with exactly the fields {list(_FIELDS)}")
    block = value["block_size"]
    if (
        type(block) is not int
        or not MIN_BLOCK_SIZE <= block <= MAX_BLOCK_SIZE
        or block & (block - 1)
    ):
        raise ValueError(
            f"chunks.block_size {block!r} is not a power of two in "
            f"[{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}]"
        )
    columns = [value[name] for name in _FIELDS[1:]]
    if any(type(column) is not list for column in columns):
        raise ValueError("a column of chunks is not a list")
    n = len(columns[0])
    if any(len(column) != n for column in columns):
        raise ValueError("the columns of chunks differ in length")
    if n > MAX_CHUNKS:
        raise ValueError(f"{n} chunks is over the limit of {MAX_CHUNKS}")
    leaf, start, shape, obj, offset, crcs = columns
    nleaves = len(shapes)
    for name, column, high in (("leaf", leaf, nleaves - 1), ("object", obj, objects - 1)):
        if any(type(v) is not int or not 0 <= v <= high for v in column):
            raise ValueError(f"chunks.{name} holds a value that is not an index in [0, {high}]")
    if any(type(v) is not int or not 0 <= v <= max_bytes for v in offset):
        raise ValueError(f"chunks.offset holds a value outside [0, {max_bytes}]")
    by_leaf: dict[int, list[int]] = {}
    extents = []
    for i in range(n):
        owner = leaf[i]
        ndim = len(shapes[owner])
        for name, row in (("start", start[i]), ("shape", shape[i])):
            if type(row) is not list or len(row) != ndim or any(type(v) is not int for v in row):
                raise ValueError(f"chunk {i}: {name} {row!r} is not a list of {ndim} ints")
        crc = crcs[i]
        length = math.prod(shape[i]) * itemsizes[owner] if all(v > 0 for v in shape[i]) else 0
        if not 0 < length <= max_bytes:
            raise ValueError(f"chunk {i}: shape {shape[i]} is empty or too large")
        blocks = -(-length // block)
        if type(crc) is not list or len(crc) != blocks:
            raise ValueError(f"chunk {i}: crc32c does not hold {blocks} block checksums")
        if any(type(v) is not int or not 0 <= v <= 0xFFFFFFFF for v in crc):
            raise ValueError(f"chunk {i}: a block crc32c is not a 32-bit unsigned integer")
        by_leaf.setdefault(owner, []).append(i)
        extents.append((obj[i], offset[i], length))
    for owner, members in by_leaf.items():
        if leaf_object[owner] != -1:
            raise ValueError(f"leaf {owner} has both an object and chunks")
        try:
            check_grid(shapes[owner], [start[i] for i in members], [shape[i] for i in members])
        except ValueError as exc:
            raise ValueError(f"the chunks of leaf {owner}: {exc}") from None
    table = Chunks(block, leaf, start, shape, obj, offset, crcs, by_leaf)
    return table, extents


# --------------------------------------------------------------------------- reading


def _intersect(a: Box, b: Box) -> Box | None:
    """The box common to ``a`` and ``b``, or ``None`` if they share nothing."""
    start = tuple(max(x, y) for x, y in zip(a[0], b[0], strict=True))
    end = tuple(min(x + n, y + m) for x, n, y, m in zip(a[0], a[1], b[0], b[1], strict=True))
    if any(e <= s for s, e in zip(start, end, strict=True)):
        return None
    return start, tuple(e - s for s, e in zip(start, end, strict=True))


def _needed_blocks(
    chunk_shape: Sequence[int], inner: Box, itemsize: int, block: int, nblocks: int
) -> np.ndarray[Any, Any]:
    """Indices of the blocks of a chunk holding the bytes of ``inner`` (a box in the chunk's
    own coordinates), sorted."""
    ndim = len(chunk_shape)
    strides = [itemsize * math.prod(chunk_shape[d + 1 :]) for d in range(ndim)]
    # The run: the innermost dimensions ``inner`` covers fully, plus the one around them.
    j = ndim - 1
    while j > 0 and inner[1][j] == chunk_shape[j] and inner[0][j] == 0:
        j -= 1
    run = inner[1][j] * strides[j] if ndim else itemsize
    base = sum(inner[0][d] * strides[d] for d in range(ndim))
    runs = math.prod(inner[1][:j]) if ndim else 1
    if runs > nblocks:  # more runs than blocks: (nearly) every block in the span is touched
        first = base // block
        last = (base + sum((inner[1][d] - 1) * strides[d] for d in range(j)) + run - 1) // block
        return np.arange(first, last + 1, dtype=np.int64)
    starts = np.full(1, base, dtype=np.int64)
    for d in range(j):
        steps = np.arange(inner[1][d], dtype=np.int64) * strides[d]
        starts = (starts[:, None] + steps[None, :]).reshape(-1)
    marks = np.zeros(nblocks + 1, dtype=np.int64)
    np.add.at(marks, starts // block, 1)
    np.add.at(marks, (starts + run - 1) // block + 1, -1)
    return np.flatnonzero(np.cumsum(marks[:-1]) > 0)


async def read_boxes(
    store: Store,
    key_of: Any,
    chunks: Chunks,
    leaf: int,
    shape: Sequence[int],
    dtype: np.dtype[Any],
    boxes: Sequence[Box],
    *,
    where: str,
) -> list[np.ndarray[Any, Any]]:
    """Read ``boxes`` of chunked leaf ``leaf``, verified block by block.

    For every chunk that overlaps a wanted box, the blocks holding the overlap are fetched
    (adjacent ones in one request, through :meth:`Store.read_ranges_into_crc32c`), each
    checked against its recorded crc32c, and the overlap copied into the box's array.

    Args:
        store: where the objects are.
        key_of: ``key_of(object index)`` is the object's key in ``store``.
        chunks: the manifest's chunk table.
        leaf: the leaf's index.
        shape, dtype: the leaf's global shape and dtype.
        boxes: what to read, each inside ``shape``.
        where: the leaf's name for messages.

    Returns:
        One C-contiguous array per box, of the box's shape.

    Raises:
        ValueError: a box reaches outside the leaf's shape.
        CorruptCheckpointError: a block fails its crc32c, or an object is missing or short.
    """
    block, itemsize = chunks.block_size, dtype.itemsize
    for start, size in boxes:
        if len(start) != len(shape) or any(
            s < 0 or n < 0 or s + n > g for s, n, g in zip(start, size, shape, strict=True)
        ):
            raise ValueError(
                f"{where}: the box at {list(start)} of shape {list(size)} is not inside the "
                f"checkpoint's shape {list(shape)}"
            )
    out = [np.empty(size, dtype) for _, size in boxes]

    async def read_chunk(chunk: int) -> None:
        cbox: Box = (tuple(chunks.start[chunk]), tuple(chunks.shape[chunk]))
        overlaps = [
            (b, common)
            for b, box in enumerate(boxes)
            if (common := _intersect(cbox, (tuple(box[0]), tuple(box[1])))) is not None
        ]
        if not overlaps:
            return
        length = chunks.length(chunk, itemsize)
        nblocks = -(-length // block)
        local = [
            (tuple(s - c for s, c in zip(common[0], cbox[0], strict=True)), common[1])
            for _, common in overlaps
        ]
        needed = np.unique(
            np.concatenate(
                [_needed_blocks(cbox[1], inner, itemsize, block, nblocks) for inner in local]
            )
        )
        low = int(needed[0]) * block
        high = min((int(needed[-1]) + 1) * block, length)
        buf = np.empty(high - low, np.uint8)
        requests = []
        for b in needed.tolist():
            at = b * block
            requests.append(
                (chunks.offset[chunk] + at, buf[at - low : min(at + block, length) - low])
            )
        key = key_of(chunks.object[chunk])
        try:
            # only adjacent blocks share a request: merging across the runs a box skips (the
            # store's coalescing gap is 1 MiB) would read the skipped bytes too
            crcs = await store.read_ranges_into_crc32c(key, requests, gap=0)
        except NotFoundError:
            raise CorruptCheckpointError(
                f"{store.url}: {where}: object {key!r} is missing"
            ) from None
        except InvalidRangeError as exc:
            raise CorruptCheckpointError(
                f"{store.url}: {where}: object {key!r} is shorter than the manifest says ({exc})"
            ) from None
        recorded = chunks.crc32c[chunk]
        for b, crc in zip(needed.tolist(), crcs, strict=True):
            if crc != recorded[b]:
                raise CorruptCheckpointError(
                    f"{store.url}: {where}: object {key!r}: chunk at {list(cbox[0])}, block {b}: "
                    f"crc32c mismatch (recorded {recorded[b]}, read {crc})"
                )
        strides = tuple(itemsize * math.prod(cbox[1][d + 1 :]) for d in range(len(cbox[1])))
        for (b, common), inner in zip(overlaps, local, strict=True):
            first = sum(i * s for i, s in zip(inner[0], strides, strict=True))
            source = np.ndarray(common[1], dtype, buf, first - low, strides)
            box_start = boxes[b][0]
            slices = tuple(
                slice(s - o, s - o + n)
                for s, o, n in zip(common[0], box_start, common[1], strict=True)
            )
            out[b][slices] = source

    await gather_all(read_chunk(chunk) for chunk in chunks.by_leaf.get(leaf, []))
    return out
