"""Host memory ckptstore owns and reuses: the one buffer pool of every layer.

Copying into freshly allocated memory runs 2-4x slower than copying into memory that was
touched before: every new page costs a fault, and the kernel zeroes it first (on this
project's machines a first copy of 1 GiB into fresh memory took 2.9 s against 0.08 s into a
reused buffer). So every byte ckptstore copies on its way to or from a store lands in a
:class:`HostBuffer` lent by a :class:`BufferPool`, and goes back to it once the bytes are
durable or consumed:

* the stager (``ckptstore.stage``) lays every leaf of a save out in one arena, so a save holds
  one buffer and gives it back in one call; a manager keeps its own pool, so closing it frees
  its arenas;
* pack objects (many small leaves in one object, ``ckptstore.layout.commit``), DCP items
  included, are built in buffers of :data:`host_buffers`, the process-wide pool;
* :func:`ckptstore.store.transfer.copy_object` and ``verify`` stream parts through it too.

A buffer goes back only when nothing can write into it any more. A read of a local file and a
pack build run in threads that cancelling their caller does not stop, so a user that fails or
is cancelled while such work may be running *discards* its buffer (:meth:`HostBuffer.discard`)
instead of releasing it: released, the next save's pack could be built in memory a stale
read still fills.

The pool lives in ``store/`` because that is the lowest layer that needs it (a copy between
two stores); it knows nothing of tensors. Page-locked memory for CUDA sources is allocated by
a function the caller passes (the stage layer passes torch's), so ``store/`` never imports a
framework.

Two alignments meet here and they are different things. :data:`PAGE` aligns each arena (and
the large leaves a stager places in one) to the operating system's page, because ``O_DIRECT``
writes and page-aligned mmaps need it. ``Settings.leaf_alignment`` (:mod:`ckptstore.config`)
aligns leaves *inside* an arena or a pack object, so each can be viewed in place with its
dtype: it is part of the checkpoint format, tunable, and much smaller than a page.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ckptstore.store.native import compiled as _gather

__all__ = [
    "NATIVE_COPY",
    "PAGE",
    "BufferPool",
    "HostBuffer",
    "PinnedAllocator",
    "PoolStats",
    "align_up",
    "copy_into",
    "host_buffers",
]

#: The operating system's page size: arenas start on a page, as ``O_DIRECT`` needs.
PAGE = mmap.PAGESIZE

#: Allocates ``capacity`` bytes of page-locked memory; returns them as flat ``uint8`` and the
#: object that owns the allocation (kept alive as long as the buffer).
PinnedAllocator = Callable[[int], tuple[NDArray[np.uint8], Any]]


def align_up(n: int, alignment: int = PAGE) -> int:
    """``n`` rounded up to a multiple of ``alignment`` (a power of two)."""
    return (n + alignment - 1) & ~(alignment - 1)


#: Whether :func:`copy_into` runs compiled (``ckptstore.store._gather`` built, and not turned
#: off by ``CKPTSTORE_NATIVE=0``): one call for all its copies, without the GIL, and sources
#: given by address accepted.
NATIVE_COPY: bool = _gather is not None and hasattr(_gather, "copy_from")


def copy_into(
    out: NDArray[np.uint8],
    sources: Sequence[Any],
    offsets: Sequence[int],
    lengths: Sequence[int],
) -> None:
    """Copy each ``sources[k]`` into ``out`` at ``offsets[k]`` (``lengths[k]`` bytes), and
    write nothing else in ``out``: many small host arrays into a staging arena in one call.

    A source is an object exporting a C-contiguous buffer of exactly ``lengths[k]`` bytes (a
    numpy array of one of numpy's own dtypes; one of an extension dtype, such as ml_dtypes'
    bfloat16, exports none), or, only where :data:`NATIVE_COPY`, an ``int``: the host address
    of an array that exports no buffer (a torch tensor's data pointer), which the caller
    holds, C-contiguous and unchanged, until the call returns. Compiled, the copies run in
    one call without the GIL; elsewhere in a Python loop. Every range and source is checked
    before anything is copied.

    Raises:
        ValueError: a range reaching outside ``out``, a source of another length, or lists of
            different lengths.
        TypeError: a source that is neither (an address where the module is missing).
    """
    if NATIVE_COPY:
        _gather.copy_from(out, sources, offsets, lengths)
        return
    if not len(sources) == len(offsets) == len(lengths):
        raise ValueError(
            f"copy_into: {len(sources)} sources, {len(offsets)} offsets and {len(lengths)} "
            "lengths (one each per copy)"
        )
    views: list[memoryview] = []
    for k, (source, offset, length) in enumerate(zip(sources, offsets, lengths, strict=True)):
        if offset < 0 or length < 0 or offset + length > out.nbytes:
            raise ValueError(
                f"copy {k} ([{offset}, +{length})) lies outside the {out.nbytes}-byte buffer"
            )
        try:
            view = memoryview(source)
        except (TypeError, ValueError):
            view = None
        if view is None or not view.c_contiguous:
            raise TypeError(
                f"copy {k}: a {type(source).__name__} is neither an address (which needs the "
                "compiled module) nor a C-contiguous buffer"
            )
        if view.nbytes != length:
            raise ValueError(f"copy {k}: the source is {view.nbytes} bytes, not {length}")
        views.append(view)
    whole = memoryview(out)  # type: ignore[arg-type]  # ndarray exports the buffer protocol
    for view, offset in zip(views, offsets, strict=True):
        if view.nbytes:
            whole[offset : offset + view.nbytes] = view.cast("B")


class HostBuffer:
    """One arena of host memory lent by a :class:`BufferPool`.

    Attributes:
        data: the whole arena as flat ``uint8``; ``data.ctypes.data`` is page aligned.
        pinned: page-locked memory (for CUDA sources).
    """

    __slots__ = ("_owner", "_pool", "data", "pinned")

    def __init__(self, data: NDArray[np.uint8], pinned: bool, owner: Any, pool: BufferPool):
        self.data = data
        self.pinned = pinned
        self._owner = owner  # keeps the real allocation (a larger array, a torch tensor) alive
        self._pool: BufferPool | None = pool

    @property
    def capacity(self) -> int:
        return int(self.data.nbytes)

    def view(self, offset: int, nbytes: int) -> NDArray[np.uint8]:
        """Bytes ``[offset, offset + nbytes)`` of the arena, without copying."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.capacity:
            end = offset + nbytes
            raise ValueError(f"range [{offset}, {end}) outside a {self.capacity} B buffer")
        return self.data[offset : offset + nbytes]

    def release(self) -> None:
        """Give the buffer back to its pool; views into it must not be used afterwards.

        Safe to call more than once.
        """
        pool, self._pool = self._pool, None
        if pool is not None:
            pool._give_back(self)

    def discard(self) -> None:
        """Leave the pool without going back to it: for a buffer that work which could not be
        stopped may still write into (a cancelled read or pack build running in a thread).
        Reused, it would be another user's bytes that thread overwrites; discarded, its memory
        is freed once the last reference to it (that thread's) is gone. Safe to call more
        than once, and after :meth:`release` does nothing."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool._forget(self)

    def __repr__(self) -> str:
        kind = "pinned" if self.pinned else "pageable"
        return f"HostBuffer({self.capacity} B, {kind})"


@dataclass(frozen=True, slots=True)
class PoolStats:
    """Counters of one pool, for tests and benchmarks.

    Attributes:
        allocations: arenas allocated (each costs page faults on its first use).
        reuses: requests served by an arena given back earlier.
        idle_bytes: bytes held in arenas nobody is using.
        lent_bytes: bytes in arenas currently lent out.
    """

    allocations: int
    reuses: int
    idle_bytes: int
    lent_bytes: int


class BufferPool:
    """Arenas of host memory, reused from one use to the next.

    ``acquire(n)`` returns the smallest idle arena that holds ``n`` bytes without wasting more
    than ``slack`` of it; failing that it frees the idle arenas of that kind (pageable or
    pinned: a state that grew, or a use of another size, makes them useless) and allocates a
    new one. Arenas are given back with :meth:`HostBuffer.release`.

    Args:
        slack: an idle arena is reused only if ``n >= capacity * (1 - slack)``, so a small
            request does not pin down a huge arena; a new arena gets ``n`` rounded up to a page.
        max_idle_bytes: idle arenas beyond this many bytes are freed, oldest first, when
            given back (``None``: keep them all; a stager with one save in flight keeps one).
    """

    def __init__(self, *, slack: float = 0.5, max_idle_bytes: int | None = None) -> None:
        if not 0.0 <= slack < 1.0:
            raise ValueError(f"slack must be in [0, 1), got {slack}")
        if max_idle_bytes is not None and max_idle_bytes < 0:
            raise ValueError(f"max_idle_bytes must be >= 0 or None, got {max_idle_bytes}")
        self.slack = slack
        self.max_idle_bytes = max_idle_bytes
        self._lock = threading.Lock()
        self._idle: list[HostBuffer] = []  # oldest first
        self._lent = 0
        self._allocations = 0
        self._reuses = 0

    def acquire(self, nbytes: int, *, pin: PinnedAllocator | None = None) -> HostBuffer:
        """An arena of at least ``nbytes`` bytes (contents undefined), reused if one is idle.

        Args:
            nbytes: the bytes needed.
            pin: allocates page-locked memory; given, the arena is pinned (and only another
                pinned request reuses it). The stage layer passes torch's allocator.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        pinned = pin is not None
        with self._lock:
            best: HostBuffer | None = None
            for buf in self._idle:
                if (
                    buf.pinned == pinned
                    and buf.capacity >= nbytes
                    and nbytes >= buf.capacity * (1.0 - self.slack)
                    and (best is None or buf.capacity < best.capacity)
                ):
                    best = buf
            if best is not None:
                self._idle.remove(best)
                self._reuses += 1
                best._pool = self
                self._lent += best.capacity
                return best
            # None fits: free idle arenas of this kind before allocating, so the pool does
            # not hold an old, now useless, arena beside the new one.
            self._idle = [b for b in self._idle if b.pinned != pinned]
        capacity = align_up(max(nbytes, 1))
        if pin is not None:
            data, owner = pin(capacity)
            buf = HostBuffer(data, True, owner, self)
        else:
            # Over-allocate by one page and slice, so the arena starts on a page boundary.
            raw = np.empty(capacity + PAGE, dtype=np.uint8)
            start = (-raw.ctypes.data) % PAGE
            buf = HostBuffer(raw[start : start + capacity], False, raw, self)
        with self._lock:
            self._allocations += 1
            self._lent += buf.capacity
        return buf

    def _give_back(self, buf: HostBuffer) -> None:
        with self._lock:
            self._lent -= buf.capacity
            self._idle.append(buf)
            if self.max_idle_bytes is not None:
                idle = sum(b.capacity for b in self._idle)
                while self._idle and idle > self.max_idle_bytes:
                    idle -= self._idle.pop(0).capacity

    def _forget(self, buf: HostBuffer) -> None:
        with self._lock:
            self._lent -= buf.capacity

    def clear(self) -> None:
        """Free every idle arena (lent ones are freed when given back and no longer held)."""
        with self._lock:
            self._idle.clear()

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(
                allocations=self._allocations,
                reuses=self._reuses,
                idle_bytes=sum(b.capacity for b in self._idle),
                lent_bytes=self._lent,
            )


#: The process-wide pool: pack objects, DCP items, copied and verified parts. Up to 256 MiB
#: of idle buffers stay for the next save (a pack is ``Settings.pack_size``, 8 MiB).
host_buffers = BufferPool(max_idle_bytes=256 << 20)
