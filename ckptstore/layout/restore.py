"""Reading leaves back, verifying every byte read.

Before anything is allocated for an object, its real size is asked of the store (one
``head`` per object, all in flight at once, so a load pays one round trip for it) and must be
exactly the length the manifest records. A manifest is validated before this (offsets,
lengths and shapes agree with each other and lie under hard limits), but only the store knows
how large an object really is: without this check, a manifest that claims a 2**50-byte object
and a leaf of that shape would have a load try to allocate it before a single byte came back
short. With it, a load never allocates more than the objects it reads really hold.

Then, per data object, in parallel:

* an object holding one leaf is read straight into that leaf's array (a fresh one or the
  caller's ``into`` array), in parallel ranges;
* a pack whose leaves are all wanted (and none goes to a caller's array) is read whole into
  one buffer and its leaves are returned as views into that buffer (no copy; offsets are
  aligned for every dtype);
* otherwise only the wanted leaves' byte ranges are read (``Store.read_ranges_into``, which
  merges close ranges), each into its destination array.

The checksum rule is the same on every path: **every leaf a load returns has been checked
against its own recorded crc32c, and an object read from its first byte to its last is also
checked against the object's crc32c.** A whole read and a partial read of the same leaf
therefore accept and refuse the same manifests: a wrong leaf crc32c fails both, even when the
object's bytes and crc32c are intact. (Before, a whole-pack read checked only the object's
crc32c, so such a manifest loaded in full while a partial load of that leaf failed.) A partial
read does not check the object's crc32c, as it does not read the whole object (DESIGN.md
invariant 5: a partial restore verifies just what it reads).

The leaf checks of a whole pack cost a second pass over the pack's bytes, in a hashing thread,
while the buffer is still warm. That is the cheap way to do it: on the development machine
hashing an 8 MiB pack of 2,048 leaves of 4 KiB leaf by leaf took 0.9-1.1 ms (0.4-0.6 ms as one
buffer), about 0.5 us per leaf, whereas deriving the object's crc32c from the recorded leaf
crc32cs with :func:`~ckptstore.store.checksum.crc32c_combine` (no pass over the bytes, but
GF(2) arithmetic in Python) took about 10 us per leaf, twenty times as much.

A manifest that references objects of earlier steps (an incremental save) has each
referenced attempt checked first (:func:`ckptstore.layout.references.check_references`: one
record read per attempt): the object must be a committed object of it, with the length and
crc32c its own record gives; a reference that is not raises
:class:`~ckptstore.errors.BrokenReferenceError`. The check runs alongside the data reads, not
before them: it costs up to three round trips one after the other (the referenced step's
manifest, then the attempt's record, its size and its bytes), which a restore from a
high-latency store would otherwise pay before its first byte. No leaf is returned unless the
check passed, and when a read fails as well, the broken reference is the error raised, as it
is the cause. Referenced bytes are read and verified exactly like the step's own.

A leaf stored as chunks (sharded across ranks when saved, :mod:`ckptstore.layout.chunks`) is
read by box: a caller may ask for boxes of a leaf (a rank's new shard) and gets exactly those,
and a leaf asked for whole is its one full box. Only the blocks of the chunks that overlap a box
are fetched, and each is checked against its own crc32c. A box of a leaf stored whole is cut
from the whole leaf, read and checked as always.

A mismatch, a short, long or missing object raises
:class:`~ckptstore.errors.CorruptCheckpointError` naming the object and, where one is to
blame, the leaf, with the recorded and the computed checksums when they differ.

A verify is a restore that keeps nothing (:func:`read_into_sink`, which fills a
:class:`VerifyReport`): the same size check before any read, the same references check, every
leaf's, chunk block's and object's crc32c, with the same messages; but each object is read in
part-sized chunks through a bounded pool of buffers whatever its size (a chunk boundary may
cut a leaf in two: the pieces' checksums are combined, so no leaf is read twice), and every
problem is recorded rather than raised at the first.
"""

from __future__ import annotations

import asyncio
import bisect
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ckptstore.errors import (
    BrokenReferenceError,
    CorruptCheckpointError,
    InvalidRangeError,
    NotFoundError,
)
from ckptstore.layout.chunks import Box, read_boxes
from ckptstore.layout.commit import gather_all
from ckptstore.layout.dtypes import dtype_from_name
from ckptstore.layout.keys import manifest_key
from ckptstore.layout.manifest import Manifest
from ckptstore.layout.references import check_references
from ckptstore.store import checksum
from ckptstore.store.base import Store
from ckptstore.store.buffers import host_buffers
from ckptstore.store.checksum import acrc32c, as_uint8, in_hash_thread

__all__ = [
    "Damage",
    "Pieces",
    "VerifyReport",
    "check_object_size",
    "empty_array",
    "read_into_sink",
    "read_leaves",
]


@dataclass(frozen=True, slots=True)
class Pieces:
    """Boxes of one leaf, read for a caller that asked for parts of it (a rank's shard).

    Attributes:
        boxes: each box, as ``(start, shape)`` in the leaf's global shape.
        arrays: the bytes of each box, an array of the box's shape.
        shape: the leaf's global shape.
    """

    boxes: list[Box]
    arrays: list[np.ndarray[Any, Any]]
    shape: tuple[int, ...]


#: Fresh arrays at least this large start on a page boundary, so stores that read with
#: O_DIRECT (local directories) can read straight into them without a bounce copy.
_ALIGN_MIN = 1 << 20
_PAGE = 4096


def empty_array(shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    """A fresh array to read into: page-aligned when large (see ``_ALIGN_MIN``)."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes < _ALIGN_MIN:
        return np.empty(shape, dtype)
    raw = np.empty(nbytes + _PAGE, np.uint8)
    start = -raw.ctypes.data % _PAGE
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def _destination(
    manifest: Manifest, leaf: int, into: Mapping[int, np.ndarray[Any, Any]]
) -> np.ndarray[Any, Any]:
    dtype, shape = manifest.dtype(leaf), tuple(manifest.shapes[leaf])
    out = into.get(leaf)
    if out is None:
        return empty_array(shape, dtype)
    path = manifest.paths[leaf]
    if out.dtype != dtype or out.shape != shape:
        raise ValueError(
            f"into[{path!r}] is {out.dtype}{list(out.shape)}, but the checkpoint holds "
            f"{dtype}{list(shape)}"
        )
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"into[{path!r}] must be a writable C-contiguous array")
    return out


async def read_leaves(
    store: Store,
    manifest: Manifest,
    leaves: Sequence[int],
    into: Mapping[int, np.ndarray[Any, Any]] | None = None,
    boxes: Mapping[int, Sequence[Box]] | None = None,
) -> dict[int, Any]:
    """Read the given leaves of a validated manifest; returns arrays by leaf index.

    Args:
        store: the store the manifest was read from.
        manifest: a validated manifest.
        leaves: leaf indices to read.
        into: caller arrays to fill, by leaf index (dtype and shape must match exactly).
        boxes: for leaves read in parts, the boxes wanted; such a leaf's value is a
            :class:`Pieces`.

    Raises:
        BrokenReferenceError: a referenced object is not a committed object of its attempt.
        CorruptCheckpointError: an object is missing, of the wrong size, or fails a crc32c.
    """
    if not manifest.references():
        return await _read_verified(store, manifest, leaves, into or {}, boxes or {})
    checking = asyncio.ensure_future(check_references(store, manifest))
    try:
        out = await _read_verified(store, manifest, leaves, into or {}, boxes or {})
    except Exception:
        # a broken reference (a reclaimed or foreign object) is the cause of a failed read
        broken = await _broken(checking)
        if broken is not None:
            raise broken from None
        raise
    except BaseException:
        checking.cancel()
        raise
    await checking
    return out


async def _broken(checking: asyncio.Future[None]) -> BrokenReferenceError | None:
    """The error of a finished reference check if it found a broken reference."""
    try:
        await checking
    except BrokenReferenceError as exc:
        return exc
    except Exception:  # the read's own error is the one to report
        return None
    return None


async def _read_verified(
    store: Store,
    manifest: Manifest,
    leaves: Sequence[int],
    into: Mapping[int, np.ndarray[Any, Any]],
    boxes: Mapping[int, Sequence[Box]],
) -> dict[int, Any]:
    """:func:`read_leaves` without the reference check."""
    out: dict[int, Any] = {}
    by_object: dict[int, list[int]] = defaultdict(list)
    chunked: list[int] = []
    chunked_leaves = manifest.chunks.by_leaf if manifest.chunks is not None else {}
    leaf_object = manifest.leaf_object
    for leaf in leaves:  # no call per leaf: this runs for each of 20,000 small leaves
        obj = leaf_object[leaf]
        if leaf in chunked_leaves:
            chunked.append(leaf)
        elif obj < 0:
            out[leaf] = _destination(manifest, leaf, into)
        else:
            by_object[obj].append(leaf)
    members: Counter[int] = Counter()
    if by_object:
        members.update(manifest.leaf_object)
        # a multi-rank save packs chunks beside whole leaves: an object holding chunks is
        # never read whole for its whole leaves alone
        members.update(manifest.chunks.object if manifest.chunks is not None else ())

    def corrupt(obj: int, leaf: int | None, what: str) -> CorruptCheckpointError:
        key = manifest.object_key(obj)
        name = f"leaf {manifest.paths[leaf]!r} in " if leaf is not None else ""
        return CorruptCheckpointError(f"{store.url}: {name}object {key!r}: {what}")

    async def read_object(obj: int, wanted: list[int]) -> None:
        key = manifest.object_key(obj)
        length = manifest.object_lengths[obj]
        try:
            # Nothing is allocated for an object before its real size is known (see above).
            await check_object_size(store, key, length)
            if len(wanted) == members[obj] == 1 and manifest.leaf_length[wanted[0]] == length:
                await read_single(obj, key, wanted[0])
            elif len(wanted) == members[obj] and not any(leaf in into for leaf in wanted):
                await read_whole(obj, key, length, wanted)
            else:
                await read_parts(obj, key, wanted)
        except NotFoundError:
            raise corrupt(obj, None, "is missing") from None
        except InvalidRangeError as exc:
            raise corrupt(obj, None, f"is shorter than the manifest says ({exc})") from None

    async def read_single(obj: int, key: str, leaf: int) -> None:
        dest = _destination(manifest, leaf, into)
        crc = await store.read_into_crc32c(key, 0, as_uint8(dest))
        if crc != manifest.leaf_crc[leaf]:
            raise corrupt(obj, leaf, _mismatch(manifest.leaf_crc[leaf], crc))
        if crc != manifest.object_crcs[obj]:
            raise corrupt(
                obj,
                leaf,
                f"crc32c mismatch: the bytes read match the leaf's recorded crc32c ({crc}) but "
                f"not the object's ({manifest.object_crcs[obj]}), which must be the same",
            )
        out[leaf] = dest

    async def read_whole(obj: int, key: str, length: int, wanted: list[int]) -> None:
        buf = empty_array((length,), np.dtype(np.uint8))
        crc = await store.read_into_crc32c(key, 0, buf)
        # Every leaf's crc32c and the leaves' arrays in one call on the hashing thread: split
        # between threads, the two Python loops over 20,000 leaves waited on each other for
        # the GIL.
        bad, views = await in_hash_thread(
            _check_whole,
            buf,
            wanted,
            manifest.leaf_offset,
            manifest.leaf_length,
            manifest.leaf_crc,
            manifest.shapes,
            manifest.dtypes,
        )
        if bad is not None:
            leaf, read = bad
            raise corrupt(obj, leaf, _mismatch(manifest.leaf_crc[leaf], read))
        if crc != manifest.object_crcs[obj]:
            raise corrupt(
                obj,
                None,
                f"{_mismatch(manifest.object_crcs[obj], crc)}; every leaf in it matches its "
                "own crc32c, so the damage is in the padding between them",
            )
        out.update(views)

    async def read_parts(obj: int, key: str, wanted: list[int]) -> None:
        dests = [_destination(manifest, leaf, into) for leaf in wanted]
        views = [as_uint8(d) for d in dests]
        await store.read_ranges_into(
            key, [(manifest.leaf_offset[leaf], v) for leaf, v in zip(wanted, views, strict=True)]
        )
        for leaf, dest, view in zip(wanted, dests, views, strict=True):
            crc = await acrc32c(view)
            if crc != manifest.leaf_crc[leaf]:
                raise corrupt(obj, leaf, _mismatch(manifest.leaf_crc[leaf], crc))
            out[leaf] = dest

    async def read_chunked(leaf: int) -> None:
        chunks = manifest.chunks
        assert chunks is not None
        shape = tuple(manifest.shapes[leaf])
        objects = {chunks.object[c] for c in chunks.by_leaf[leaf]}
        try:
            await gather_all(
                check_object_size(store, manifest.object_key(o), manifest.object_lengths[o])
                for o in objects
            )
        except NotFoundError:
            raise CorruptCheckpointError(
                f"{store.url}: leaf {manifest.paths[leaf]!r}: an object of its chunks is missing"
            ) from None
        wanted = list(boxes.get(leaf, [((0,) * len(shape), shape)]))
        arrays = await read_boxes(
            store,
            manifest.object_key,
            chunks,
            leaf,
            shape,
            manifest.dtype(leaf),
            wanted,
            where=f"leaf {manifest.paths[leaf]!r}",
        )
        if leaf in boxes:
            out[leaf] = Pieces(wanted, arrays, shape)
        elif leaf in into:
            dest = _destination(manifest, leaf, into)
            dest[...] = arrays[0]
            out[leaf] = dest
        else:
            out[leaf] = arrays[0]

    await gather_all(
        [
            *(read_object(obj, wanted) for obj, wanted in by_object.items()),
            *(read_chunked(leaf) for leaf in chunked),
        ]
    )
    for leaf, wanted in boxes.items():
        whole = out.get(leaf)
        if isinstance(whole, np.ndarray):  # a leaf stored whole: cut the boxes from it
            out[leaf] = Pieces(
                list(wanted),
                [_cut(whole, box, manifest.paths[leaf]) for box in wanted],
                whole.shape,
            )
    return out


def _cut(whole: np.ndarray[Any, Any], box: Box, path: str) -> np.ndarray[Any, Any]:
    start, shape = box
    if len(start) != whole.ndim or any(
        s < 0 or n < 0 or s + n > g for s, n, g in zip(start, shape, whole.shape, strict=True)
    ):
        raise ValueError(
            f"leaf {path!r}: the box at {list(start)} of shape {list(shape)} is not inside the "
            f"checkpoint's shape {list(whole.shape)}"
        )
    return whole[tuple(slice(s, s + n) for s, n in zip(start, shape, strict=True))]


async def check_object_size(store: Store, key: str, length: int) -> None:
    """Raise unless object ``key`` is exactly ``length`` bytes, as its manifest says (one
    ``head``). Every reader calls this before it allocates anything for the object.

    Raises:
        CorruptCheckpointError: the object has another size.
        NotFoundError: it is missing.
    """
    problem = await _size_problem(store, key, length)
    if problem is not None:
        raise CorruptCheckpointError(f"{store.url}: object {key!r} {problem}")


async def _size_problem(store: Store, key: str, length: int) -> str | None:
    """What is wrong with object ``key``'s size (one ``head``), or ``None`` if it is
    ``length`` bytes. Raises :class:`NotFoundError` if it is missing."""
    size = (await store.head(key)).size
    return None if size == length else f"is {size} bytes, but the manifest says {length}"


def _mismatch(recorded: int, read: int) -> str:
    return f"crc32c mismatch (recorded {recorded}, read {read})"


def _check_whole(
    buf: np.ndarray[Any, Any],
    leaves: Sequence[int],
    offsets: Sequence[int],
    lengths: Sequence[int],
    recorded: Sequence[int],
    shapes: Sequence[Sequence[int]],
    names: Sequence[str],
) -> tuple[tuple[int, int] | None, dict[int, np.ndarray[Any, Any]]]:
    """For an object read whole into ``buf``: the first leaf failing its recorded crc32c
    (:func:`~ckptstore.store.checksum.first_mismatch`), and, if none does, the leaves' arrays
    (:func:`_leaf_views`)."""
    bad = checksum.first_mismatch(buf, leaves, offsets, lengths, recorded)
    if bad is not None:
        return bad, {}
    return None, _leaf_views(buf, leaves, offsets, shapes, names)


def _leaf_views(
    buf: np.ndarray[Any, Any],
    leaves: Sequence[int],
    offsets: Sequence[int],
    shapes: Sequence[Sequence[int]],
    names: Sequence[str],
) -> dict[int, np.ndarray[Any, Any]]:
    """Each of ``leaves`` as an array viewing its bytes in ``buf`` (an object read whole).

    A run of leaves of one dtype and shape at evenly spaced offsets (a pack of same-sized
    leaves, as a model's layers give) is made as the rows of one strided array: numpy makes a
    row in about 0.2 us, against 1 us for an ``ndarray`` built per leaf, which was a fifth of
    the restore of 20,000 leaves of 4 KiB. Every leaf still views exactly its own bytes (its
    offset, shape and dtype as the manifest says), whichever way it was made.
    """
    dtypes: dict[str, np.dtype[Any]] = {}
    for name in {names[leaf] for leaf in leaves}:
        dtype = dtype_from_name(name)
        assert dtype is not None  # validated by Manifest.parse
        dtypes[name] = dtype
    out: dict[int, np.ndarray[Any, Any]] = {}
    i, count = 0, len(leaves)
    while i < count:
        first = leaves[i]
        shape, name, start = shapes[first], names[first], offsets[first]
        end = i + 1
        # 0-d leaves stay single: the rows of a 1-d array would be numpy scalars
        stride = offsets[leaves[end]] - start if shape and end < count else 0
        if stride > 0:
            while (
                end < count
                and offsets[leaves[end]] == start + (end - i) * stride
                and names[leaves[end]] == name
                and shapes[leaves[end]] == shape
            ):
                end += 1
        dtype = dtypes[name]
        if end - i == 1:
            out[first] = np.ndarray(shape, dtype, buf, start)
        else:
            inner = [dtype.itemsize]
            for size in reversed(shape[1:]):
                inner.append(inner[-1] * size)
            rows = np.ndarray((end - i, *shape), dtype, buf, start, (stride, *inner[::-1]))
            out.update(zip(leaves[i:end], rows, strict=True))
        i = end
    return out


# ------------------------------------------------------------------ reading into a sink


@dataclass(frozen=True, slots=True)
class Damage:
    """One problem found by a verify (:func:`read_into_sink`).

    Attributes:
        kind: ``"manifest"``, ``"reference"``, ``"object"`` or ``"leaf"``.
        name: the manifest key, object key (relative to the store root) or leaf path.
        problem: what is wrong, e.g. ``"crc32c mismatch (recorded 1, read 2)"``.
    """

    kind: str
    name: str
    problem: str


@dataclass(frozen=True, slots=True)
class _Span:
    """A byte range of an object with a recorded crc32c: a leaf, or a block of a chunk of a
    sharded leaf (see :mod:`ckptstore.layout.chunks`)."""

    offset: int
    length: int
    crc: int
    name: str
    leaf: bool


def _spans(manifest: Manifest) -> list[tuple[int, _Span]]:
    """Every checksummed range of every object: ``(object, span)``."""
    spans = [
        (
            obj,
            _Span(
                manifest.leaf_offset[leaf],
                manifest.leaf_length[leaf],
                manifest.leaf_crc[leaf],
                manifest.paths[leaf],
                True,
            ),
        )
        for leaf, obj in enumerate(manifest.leaf_object)
        if obj >= 0 and manifest.leaf_length[leaf] > 0
    ]
    chunks = manifest.chunks
    if chunks is not None:
        block = chunks.block_size
        for c, leaf in enumerate(chunks.leaf):
            length = chunks.length(c, manifest.dtype(leaf).itemsize)
            where = f"{manifest.paths[leaf]} (chunk at {chunks.start[c]}"
            for b, crc in enumerate(chunks.crc32c[c]):
                size = min(block, length - b * block)
                name = f"{where}, block {b})"
                spans.append(
                    (chunks.object[c], _Span(chunks.offset[c] + b * block, size, crc, name, False))
                )
    return spans


def _leaf_index(
    spans: list[tuple[int, _Span]],
) -> dict[int, tuple[list[int], list[int], list[int]]]:
    """Per object: its spans (indices into ``spans``) sorted by offset, their offsets and
    their ends."""
    by_object: dict[int, list[int]] = defaultdict(list)
    for i, (obj, _) in enumerate(spans):
        by_object[obj].append(i)
    index = {}
    for obj, members in by_object.items():
        members.sort(key=lambda i: spans[i][1].offset)
        offsets = [spans[i][1].offset for i in members]
        ends = [spans[i][1].offset + spans[i][1].length for i in members]
        index[obj] = (members, offsets, ends)
    return index


def _combine(pieces: list[tuple[int, int, int]]) -> int:
    """crc32c of consecutive pieces given as ``(start, crc, length)``, in any order."""
    if not pieces:
        return 0
    pieces.sort()
    crc = pieces[0][1]  # most leaves are one piece: no combining (it costs ~50 us in Python)
    for _, piece_crc, length in pieces[1:]:
        crc = checksum.crc32c_combine(crc, piece_crc, length)
    return crc


@dataclass(slots=True)
class VerifyReport:
    """What a verify (:func:`read_into_sink`) checked and found: the sink it reads into,
    which keeps no byte.

    Attributes:
        step: the step checked.
        objects: data objects read whole.
        leaves: leaves checked.
        nbytes: bytes read and checked.
        damage: every problem found; empty means intact.
    """

    step: int
    objects: int = 0
    leaves: int = 0
    nbytes: int = 0
    damage: list[Damage] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.damage


async def read_into_sink(
    store: Store,
    manifest: Manifest,
    *,
    chunk_size: int | None = None,
    progress: Callable[[int], None] | None = None,
    objects: Collection[int] | None = None,
    references: bool = False,
) -> VerifyReport:
    """Read every data object ``manifest`` names and keep nothing: every byte is checked as
    a restore checks it (the object's size before anything is read; each leaf's crc32c, each
    chunk block's, the object's), and every problem is recorded in the report's ``damage``
    instead of raised at the first. Each object is read in chunks of ``chunk_size`` bytes
    (default ``Settings.part_size``), ``Settings.max_concurrency`` of them in flight.

    Args:
        progress: called with the byte count of each chunk checked.
        objects: read only these objects (by index) and the leaves in them (a copy checks
            what it wrote, not the earlier steps' objects it references).
        references: also check, as :func:`read_leaves` does, that each object referenced
            from an earlier step is a committed object of its attempt; a broken reference is
            recorded as damage of kind ``"reference"``.
    """
    checking = (
        asyncio.ensure_future(check_references(store, manifest))
        if references and manifest.references()
        else None
    )
    sink = VerifyReport(manifest.step)
    try:
        await _read_into_sink(
            store,
            manifest,
            sink,
            chunk_size or store.settings.transport.part_size,
            progress,
            objects,
        )
    except BaseException:
        if checking is not None:
            checking.cancel()
            await asyncio.wait([checking])
            if not checking.cancelled():
                checking.exception()  # retrieved: the read's own error is the one raised
        raise
    if checking is not None:
        try:
            await checking
        except BrokenReferenceError as exc:
            sink.damage.insert(0, Damage("reference", manifest_key(manifest.step), str(exc)))
    return sink


async def _read_into_sink(
    store: Store,
    manifest: Manifest,
    sink: VerifyReport,
    chunk: int,
    progress: Callable[[int], None] | None,
    objects: Collection[int] | None,
) -> None:
    buffer_size = max(1, min(chunk, max(manifest.object_lengths, default=1)))
    slots = asyncio.Semaphore(max(1, store.settings.transport.max_concurrency))
    spans = _spans(manifest)
    leaf_index = _leaf_index(spans)
    leaf_pieces: dict[int, list[tuple[int, int, int]]] = defaultdict(list)

    def hash_chunk(obj: int, start: int, view: memoryview) -> tuple[int, list[tuple[int, int]]]:
        """crc of the chunk, and ``(leaf, crc)`` of each leaf's piece inside it."""
        leaves, offsets, ends = leaf_index.get(obj, ([], [], []))
        end = start + len(view)
        pieces = []
        i = bisect.bisect_right(ends, start)
        while i < len(leaves) and offsets[i] < end:
            lo, hi = max(offsets[i], start), min(ends[i], end)
            pieces.append((leaves[i], checksum.crc32c(view[lo - start : hi - start])))
            i += 1
        return checksum.crc32c(view), pieces

    async def check_chunk(obj: int, key: str, start: int, length: int) -> tuple[int, int, int]:
        async with slots:
            buf = host_buffers.acquire(buffer_size)
            try:
                view = memoryview(buf.data)[:length]  # type: ignore[arg-type]
                await store.read_into(key, start, view)
                crc, pieces = await in_hash_thread(hash_chunk, obj, start, view)
            except BaseException:
                buf.discard()  # a cancelled local read's thread may still fill it
                raise
            finally:
                buf.release()
        for leaf, piece_crc in pieces:
            span = spans[leaf][1]
            lo = max(span.offset, start)
            hi = min(span.offset + span.length, start + length)
            leaf_pieces[leaf].append((lo, piece_crc, hi - lo))
        if progress is not None:
            progress(length)
        return start, crc, length

    async def check_object(obj: int) -> None:
        key = manifest.object_key(obj)
        expected = manifest.object_lengths[obj]
        try:
            problem = await _size_problem(store, key, expected)
        except NotFoundError:
            problem = "missing"
        if problem is not None:
            sink.damage.append(Damage("object", key, problem))
            return
        try:
            pieces = await gather_all(
                check_chunk(obj, key, start, min(chunk, expected - start))
                for start in range(0, expected, chunk)
            )
        except (NotFoundError, InvalidRangeError) as exc:
            sink.damage.append(Damage("object", key, f"read failed: {exc}"))
            return
        sink.objects += 1
        sink.nbytes += expected
        crc = _combine(pieces)
        if crc != manifest.object_crcs[obj]:
            sink.damage.append(
                Damage(
                    "object",
                    key,
                    _mismatch(manifest.object_crcs[obj], crc),
                )
            )
        for leaf in leaf_index.get(obj, ([], [], []))[0]:
            span = spans[leaf][1]
            sink.leaves += int(span.leaf)
            leaf_crc = _combine(leaf_pieces.pop(leaf, []))
            if leaf_crc != span.crc:
                sink.damage.append(
                    Damage(
                        "leaf",
                        span.name,
                        f"{_mismatch(span.crc, leaf_crc)} in {key}",
                    )
                )

    # Objects run concurrently; the chunk slots bound how many reads are in flight.
    checked = range(len(manifest.object_keys)) if objects is None else sorted(objects)
    await gather_all(check_object(i) for i in checked)
    sink.leaves += sum(
        1
        for leaf, obj in enumerate(manifest.leaf_object)
        if obj < 0 or not manifest.leaf_length[leaf]
    )
    sink.damage.sort(key=lambda d: (d.kind != "object", d.name))
