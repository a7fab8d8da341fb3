"""crc32c of buffers, without copying them and without stalling other threads.

The ``crc32c`` package hashes any contiguous buffer in place with the CPU's crc32 instruction
and releases the GIL while it hashes more than 32 KiB, so the training thread's Python keeps
running while a background save checksums a gigabyte. (google-crc32c, used before, holds the
GIL on anything but ``bytes``: with it hashing nonstop on the other core, a Python thread here
made 46-48% of its normal progress, against 78-100% with ``crc32c``.) Large buffers are
hashed in a worker thread by :func:`acrc32c` so the event loop keeps moving.

A body is hashed once on its way to a store that sends a checksum with it (S3's
``x-amz-checksum-crc32c``, GCS's upload metadata) although the checkpoint layer needs the same
crc32c for its manifest: the two meet in a :class:`Ledger`. A caller that already has the
crc32c of what it writes hands it to ``Store.put(..., crc32c=)`` or ``put_part``, and the
backend sends that one (:func:`request_crc32c`) instead of hashing again; a caller that needs
it asks ``Store.put_crc32c``, which returns what the backend computed for its requests (the
parts' checksums combined) or, for a backend that sends none, hashes while the put runs. The
ledger reaches the backend through a context variable, so every wrapper, retry and part task
between the caller and the request passes it on untouched. A crc32c sent that is not the
bytes' fails the write: an S3 server refuses the body, and the GCS store finds the crc32c the
server reports for what it stored differ from the one sent. A wrong entry fails a write; it
cannot make one store other bytes than the ones given.

This is the one place ckptstore hashes bytes: the backends (request checksums), the transfer
and maintenance code (copies) and the checkpoint layout (every object and leaf in a manifest)
all call it, so every layer hashes the same way.

Hashing runs on one small process-wide pool (:func:`in_hash_thread`), not on asyncio's default
executor: that one has ``cpus + 4`` threads, and a background save that handed it sixteen
64 MiB leaves at once had five threads hashing on a 2-core machine, taking the training
thread's core too. Its first step after each 1 GiB save ran 30-33 ms long; with one hashing
thread, 3-5 ms (the async benchmark's training loop, two runs each).
``CKPTSTORE_HASH_THREADS`` sets the pool's size (default: half the CPUs this process may run
on, at least 1, at most 4; 1 thread hashes about 16 GiB/s here).

Packs of many small leaves are built and checked by :func:`gather_crc32c` and
:func:`first_mismatch`, one call per pack: in the compiled ``ckptstore.store._gather`` where
the install built it and the CPU has the crc32 instruction (``CKPTSTORE_NATIVE=0`` turns it
off), else in a Python loop that gives the same bytes and checksums. The Python loop costs
about 2.4 us and a GIL hold per 4 KiB leaf; see :data:`NATIVE`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import contextvars
import importlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import crc32c as _crc32c
import numpy as np

from ckptstore.store.native import compiled as _gather
from ckptstore.threads import Pool

__all__ = [
    "CHUNK",
    "NATIVE",
    "Ledger",
    "OFFLOAD_THRESHOLD",
    "acrc32c",
    "as_uint8",
    "b64_crc32c",
    "crc32c",
    "crc32c_b64",
    "crc32c_combine",
    "digests",
    "first_mismatch",
    "gather_crc32c",
    "gather_digests",
    "hash_threads",
    "in_hash_thread",
    "ledger",
    "native_hashes",
    "request_crc32c",
]

_T = TypeVar("_T")

#: Bytes hashed per call (the GIL is released during each).
CHUNK = 64 << 20
#: Buffers at least this large are hashed in a worker thread by :func:`acrc32c`.
OFFLOAD_THRESHOLD = 1 << 20


def as_uint8(data: Any) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """A flat uint8 view of a contiguous buffer or array (no copy)."""
    if isinstance(data, np.ndarray):
        return data.reshape(-1).view(np.uint8)
    return np.frombuffer(data, dtype=np.uint8)


def crc32c(data: Any, crc: int = 0) -> int:
    """crc32c of a contiguous buffer (bytes, bytearray, memoryview, numpy array), or ``crc``
    extended over it (the crc32c of the earlier bytes followed by ``data``)."""
    view = memoryview(as_uint8(data))  # type: ignore[arg-type]  # ndarray is a Buffer
    for start in range(0, max(len(view), 1), CHUNK):
        crc = _crc32c.crc32c(view[start : start + CHUNK], crc)
    return int(crc)


#: Bytes of a buffer :func:`digests` gives each hash in turn: a block stays in the core's
#: cache from the xxh3 to the crc32c, so the buffer is read from memory once; each call is
#: long enough to release the GIL.
DIGEST_BLOCK = 256 << 10


def digests(data: Any) -> tuple[str, int]:
    """The xxh3-128 (32 hex digits) and the crc32c of a contiguous buffer, in one pass.

    An incremental save needs both for every large leaf (the hash decides reuse, the crc32c
    goes into the manifest and, for S3 and GCS, with the body); hashed one after the other,
    each read the whole leaf from memory. Block by block, 126 leaves of 3.6 MiB took 56-57
    ms against 68 ms for the two passes (3 rounds each on the development machine, 2 CPUs).
    """
    import xxhash  # a dependency of ckptstore; imported here to keep `import ckptstore` light

    view = as_uint8(data)
    n = len(view)
    if n <= DIGEST_BLOCK:
        return xxhash.xxh3_128_hexdigest(view), int(_crc32c.crc32c(view))  # type: ignore[arg-type,unused-ignore]
    state, crc = xxhash.xxh3_128(), 0
    for start in range(0, n, DIGEST_BLOCK):
        block = view[start : start + DIGEST_BLOCK]
        state.update(block)  # type: ignore[arg-type]  # a buffer
        crc = _crc32c.crc32c(block, crc)  # type: ignore[arg-type]  # a buffer
    return state.hexdigest(), int(crc)


#: Whether packs are built and checked by the compiled module (built, on a CPU with the crc32
#: instruction, and not turned off by ``CKPTSTORE_NATIVE=0``). A save of 20,000 leaves of 4 KiB
#: built its 10 packs in 1.5-3 ms each instead of 4-5 ms, with the GIL released for the copies
#: and checksums.
NATIVE: bool = _gather is not None and bool(_gather.hardware_crc32c)

_UINT8 = np.dtype(np.uint8)


def gather_crc32c(
    out: np.ndarray[Any, np.dtype[np.uint8]],
    arrays: Sequence[np.ndarray[Any, Any]],
    leaves: Sequence[int],
    offsets: Sequence[int],
    lengths: Sequence[int],
) -> list[int]:
    """Copy each of ``leaves`` (indices into ``arrays``, in offset order) into ``out`` at
    ``offsets[leaf]``, zero the gaps between them, and return each one's crc32c, in order.

    ``out`` is a writable uint8 array; ``lengths[leaf]`` is the leaf's size in bytes. One copy
    per leaf; a non-contiguous leaf is gathered by that same copy.

    Raises:
        ValueError: a leaf reaching past ``out``, or whose size is not its length.
    """
    whole = memoryview(out)  # type: ignore[arg-type]  # ndarray exports the buffer protocol
    if not NATIVE:
        crcs: list[int] = []
        position = 0
        for leaf in leaves:
            offset, length = offsets[leaf], lengths[leaf]
            if offset > position:
                out[position:offset] = 0
            _copy_leaf(out, whole, arrays[leaf], offset, length)
            position = offset + length
            crcs.append(_crc32c.crc32c(whole[offset:position]))
        return crcs
    found, skipped = _gather.gather(out, arrays, leaves, offsets, lengths)
    for at in skipped:  # no C-contiguous buffer: gathered here
        leaf = leaves[at]
        offset = offsets[leaf]
        _copy_leaf(out, whole, arrays[leaf], offset, lengths[leaf])
        found[at] = _crc32c.crc32c(whole[offset : offset + lengths[leaf]])
    return found  # type: ignore[return-value]  # every None was replaced


def native_hashes() -> bool:
    """Whether :func:`gather_digests` finds the leaves' xxh3-128 in the compiled pass (with
    the crc32c, right after each copy, without the GIL): :data:`NATIVE`, and the xxhash
    package's ``XXH3_128bits`` found in its module and checked to give xxhash's own digest.
    Otherwise the hashes are a Python loop over the built pack (one GIL hold per leaf)."""
    global _xxh3_bound
    if not NATIVE:
        return False
    if _xxh3_bound is None:
        _xxh3_bound = _bind_xxh3()
    return _xxh3_bound


_xxh3_bound: bool | None = None  # found once, on the first native_hashes()


def _bind_xxh3() -> bool:
    import ctypes

    import xxhash

    try:
        # the package's compiled module, which holds the library and exports its functions
        compiled = importlib.import_module("xxhash._xxhash").__file__
        function = ctypes.CDLL(compiled).XXH3_128bits
    except (ImportError, OSError, AttributeError, TypeError):
        return False  # another build of the package: the Python loop
    address = ctypes.cast(function, ctypes.c_void_p).value
    if not address:
        return False
    _gather.bind_xxh3(address)
    # the same digest as the package's own, on lengths that take each of its code paths
    for length in (1, 16, 17, 128, 129, 240, 241, 1024, 4096, 100_003):
        sample = np.arange(length, dtype=np.uint32).astype(np.uint8)
        out = np.empty(length, np.uint8)
        _, _, found = _gather.gather(out, [sample], [0], [0], [length], True)
        if found != [xxhash.xxh3_128_hexdigest(sample)]:  # type: ignore[arg-type]  # a buffer
            return False
    return True


def gather_digests(
    out: np.ndarray[Any, np.dtype[np.uint8]],
    arrays: Sequence[np.ndarray[Any, Any]],
    leaves: Sequence[int],
    offsets: Sequence[int],
    lengths: Sequence[int],
) -> tuple[list[int], list[str]]:
    """:func:`gather_crc32c`, and each leaf's xxh3-128 (32 hex digits, as
    :func:`~ckptstore.layout.incremental.leaf_hashes` gives), in order: one pass over each
    leaf where :func:`native_hashes`, else hashed from ``out`` after the copies.

    Raises:
        ValueError: a leaf reaching past ``out``, or whose size is not its length.
    """
    import xxhash  # a dependency of ckptstore; imported here to keep `import ckptstore` light

    whole = memoryview(out)  # type: ignore[arg-type]  # ndarray exports the buffer protocol
    if not native_hashes():
        crcs = gather_crc32c(out, arrays, leaves, offsets, lengths)
        digest = xxhash.xxh3_128_hexdigest
        return crcs, [
            digest(whole[offsets[leaf] : offsets[leaf] + lengths[leaf]]) for leaf in leaves
        ]
    found, skipped, hashes = _gather.gather(out, arrays, leaves, offsets, lengths, True)
    for at in skipped:  # no C-contiguous buffer: gathered here
        leaf = leaves[at]
        offset, end = offsets[leaf], offsets[leaf] + lengths[leaf]
        _copy_leaf(out, whole, arrays[leaf], offset, lengths[leaf])
        found[at] = _crc32c.crc32c(whole[offset:end])
        hashes[at] = xxhash.xxh3_128_hexdigest(whole[offset:end])
    return found, hashes  # type: ignore[return-value]  # every None was replaced


def _copy_leaf(
    out: np.ndarray[Any, np.dtype[np.uint8]],
    whole: memoryview,
    array: np.ndarray[Any, Any],
    offset: int,
    length: int,
) -> None:
    if array.nbytes != length or offset < 0 or offset + length > len(whole):
        raise ValueError(
            f"a leaf of {array.nbytes} bytes does not fit [{offset}, +{length}) of a "
            f"{len(out)}-byte buffer"
        )
    end = offset + length
    if array.flags.c_contiguous:
        try:
            # memoryview assignment is a plain memcpy, ~3x cheaper than numpy's for small leaves
            whole[offset:end] = memoryview(array).cast("B")  # type: ignore[arg-type]
        except (ValueError, TypeError):  # dtypes without a buffer format (ml_dtypes)
            out[offset:end] = array.reshape(-1).view(_UINT8)
    else:
        np.copyto(np.ndarray(array.shape, array.dtype, buffer=out[offset:end]), array)


def first_mismatch(
    buf: np.ndarray[Any, Any],
    leaves: Sequence[int],
    offsets: Sequence[int],
    lengths: Sequence[int],
    recorded: Sequence[int],
) -> tuple[int, int] | None:
    """The first of ``leaves`` whose bytes ``buf[offsets[leaf]:][:lengths[leaf]]`` fail their
    ``recorded`` crc32c, with the crc32c they have; ``None`` if all match.

    Raises:
        ValueError: a leaf reaching past ``buf``.
    """
    if NATIVE:
        found: tuple[int, int] | None = _gather.first_mismatch(
            buf, leaves, offsets, lengths, recorded
        )
        return found
    view = memoryview(buf)  # type: ignore[arg-type]  # ndarray exports the buffer protocol
    size = len(view)
    for leaf in leaves:
        start, length = offsets[leaf], lengths[leaf]
        if start < 0 or start + length > size:
            raise ValueError(f"leaf {leaf} ([{start}, +{length})) lies outside the buffer")
        crc = int(_crc32c.crc32c(view[start : start + length]))
        if crc != recorded[leaf]:
            return leaf, crc
    return None


def crc32c_b64(data: Any) -> str:
    """crc32c of ``data`` as object stores send it in headers: 4 big-endian bytes, base64."""
    return b64_crc32c(crc32c(data))


def b64_crc32c(crc: int) -> str:
    """A crc32c as object stores send it in headers: 4 big-endian bytes, base64."""
    return base64.b64encode(crc.to_bytes(4, "big")).decode("ascii")


async def acrc32c(data: Any) -> int:
    """:func:`crc32c`, in a hashing thread (:func:`in_hash_thread`) when the buffer is large."""
    view = as_uint8(data)
    if len(view) < OFFLOAD_THRESHOLD:
        return crc32c(view)
    return await in_hash_thread(crc32c, view)


def hash_threads() -> int:
    """Threads in the hashing pool: ``CKPTSTORE_HASH_THREADS``, else half the CPUs this process
    may run on (at least 1, at most 4)."""
    value = os.environ.get("CKPTSTORE_HASH_THREADS", "").strip()
    if value:
        if not value.isdigit() or int(value) < 1:
            raise ValueError(
                f"environment variable CKPTSTORE_HASH_THREADS: expected a thread count >= 1, "
                f"got {value!r}"
            )
        return int(value)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(4, (cpus or 2) // 2))


_pool: Pool | None = None
_pool_lock = threading.Lock()


def _forget_pool() -> None:  # a forked child has none of the parent's threads
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


async def in_hash_thread(fn: Callable[..., _T], *args: Any) -> _T:
    """Run ``fn(*args)`` (work that is mostly hashing) on the process-wide hashing pool."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = Pool(hash_threads(), "ckptstore-hash")
        pool = _pool
    return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)


# The GF(2) polynomial arithmetic of zlib's crc32_combine, for the crc32c polynomial: the
# checksum of a whole from the checksums of its consecutive pieces, so pieces hashed in
# parallel (or as they arrive) need no second pass.
_POLY = 0x82F63B78  # crc32c (Castagnoli), bit-reflected


def _multmodp(a: int, b: int) -> int:
    """``a * b`` modulo the crc32c polynomial (bit-reflected representation)."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    table = [1 << 30]  # x^1
    for _ in range(31):
        table.append(_multmodp(table[-1], table[-1]))
    return table


_X2N = _x2n_table()


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """The crc32c of ``A + B`` from ``crc32c(A)``, ``crc32c(B)`` and ``len(B)``."""
    if len2 < 0:
        raise ValueError(f"length must be >= 0, got {len2}")
    p = 1 << 31  # x^0
    n, k = len2, 3  # x^(8 * len2): 8 bits per byte
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2


# ----------------------------------------------------------------- hashing a body once


def _span(data: Any) -> tuple[int, int]:
    """Where a buffer's bytes are: ``(address, length)``."""
    view = as_uint8(data)
    return view.ctypes.data, int(view.nbytes)


class Ledger:
    """The crc32c of byte ranges in memory, by address and length, for the length of one
    write (see the module docstring): what a caller knew before it, and what the backend
    hashed for its requests during it."""

    def __init__(self) -> None:
        self._crcs: dict[tuple[int, int], int] = {}
        # the buffers noted, kept alive with the ledger: memory a noted buffer held cannot be
        # freed and reused by another one (same address, other bytes) while it is in use
        self._held: list[Any] = []

    def record(self, data: Any, crc: int) -> None:
        """Note that the bytes of ``data`` have crc32c ``crc``."""
        self._crcs[_span(data)] = crc
        self._held.append(data)

    def lookup(self, data: Any) -> int | None:
        """The crc32c noted for exactly the bytes of ``data``, if any."""
        return self._crcs.get(_span(data))

    def crc_of(self, data: Any) -> int | None:
        """The crc32c of ``data``: noted for it, or combined from noted pieces that tile it
        end to end (the parts of a multipart put); ``None`` if they do not."""
        address, length = _span(data)
        whole = self._crcs.get((address, length))
        if whole is not None:
            return whole
        starts = {a: (n, crc) for (a, n), crc in self._crcs.items() if n}
        at, end, crc = address, address + length, 0
        while at < end:
            piece = starts.get(at)
            if piece is None:
                return None
            n, piece_crc = piece
            crc = crc32c_combine(crc, piece_crc, n) if at > address else piece_crc
            at += n
        return crc if at == end and length else None


_LEDGER: contextvars.ContextVar[Ledger | None] = contextvars.ContextVar(
    "ckptstore_crc32c_ledger", default=None
)


@contextlib.contextmanager
def ledger(data: Any = None, crc: int | None = None) -> Iterator[Ledger]:
    """A fresh :class:`Ledger` for the writes made inside, with ``crc`` noted for ``data``
    if given; the one outside (if any) is back after."""
    book = Ledger()
    if crc is not None:
        book.record(data, crc)
    token = _LEDGER.set(book)
    try:
        yield book
    finally:
        _LEDGER.reset(token)


async def request_crc32c(data: Any) -> int:
    """The crc32c a backend sends with a request's body: the one the write's ledger holds for
    exactly these bytes, else hashed now (:func:`acrc32c`) and noted there."""
    book = _LEDGER.get()
    if book is not None:
        crc = book.lookup(data)
        if crc is not None:
            return crc
    crc = await acrc32c(data)
    if book is not None:
        book.record(data, crc)
    return crc
