"""The storage contract every backend implements.

A :class:`Store` maps ``/``-separated keys, relative to the root the store was opened on, to
immutable byte objects. Every method is a coroutine. The class is split the way
``object_store`` and zarr split theirs: a small required core of single requests that each
backend implements (the ``_``-prefixed abstract methods), and the public surface built on it
here, once, for every backend:

* keys are validated before any I/O, so no backend can be handed ``../x`` or ``a//b``;
* a large ``put`` becomes a multipart upload whose parts go out in parallel, and any failure
  aborts it, so no half-written object or orphaned part outlives the call;
* a large ``read_into`` becomes parallel ranged reads straight into the caller's buffer;
* ``get_ranges`` and ``read_ranges_into`` merge nearby ranges and fetch the groups in parallel;
* every single request runs under one per-store bound on concurrency
  (``Settings.max_concurrency``), so callers may ``gather`` freely;
* every put, part and ranged read holds its bytes in one per-store budget
  (``Settings.max_inflight_bytes``), so the memory a store's transfers pin is bounded on
  every backend, not only where a client library happens to bound it.

Buffers passed to ``put`` are used through a ``memoryview`` and never copied in Python; a
backend copies only where its medium must hold the bytes (the memory store keeps them).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Self

from ckptstore.config import Settings, default_settings
from ckptstore.errors import (
    InvalidKeyError,
    InvalidRangeError,
    NotFoundError,
    NotSupportedError,
)
from ckptstore.store.checksum import acrc32c, crc32c_combine, ledger
from ckptstore.store.fanout import gather_all
from ckptstore.store.transport import ByteBudget, redact_url

if TYPE_CHECKING:
    from typing import TypeAlias

    from numpy.typing import NDArray
    from typing_extensions import Buffer as _Buffer

    #: What ``put`` accepts and ``read_into`` fills: anything exposing the buffer protocol.
    Buffer: TypeAlias = _Buffer | NDArray[Any]

__all__ = [
    "TEMP_PREFIX",
    "Capabilities",
    "MultipartUpload",
    "ObjectMeta",
    "PutMode",
    "Store",
    "as_bytes_view",
    "coalesce_ranges",
    "validate_key",
    "validate_prefix",
]

PutMode = Literal["overwrite", "create"]
_PUT_MODES = ("overwrite", "create")

#: File-name prefix of in-progress writes on POSIX backends. Keys may not use it, listings
#: never show it, and garbage collection may remove such files once their writer is gone.
TEMP_PREFIX = ".ckptstore-tmp."

_MAX_KEY_BYTES = 1024  # S3's key limit; the strictest of our backends


@dataclass(frozen=True, slots=True)
class ObjectMeta:
    """What ``head`` and ``list`` report of one object.

    Attributes:
        key: the key relative to the store root.
        size: length in bytes.
        etag: a version token (S3 ETag, GCS generation, POSIX mtime/inode), if the backend has one.
        last_modified: seconds since the epoch, if known.
    """

    key: str
    size: int
    etag: str | None = None
    last_modified: float | None = None


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend can do, for callers that plan around it.

    Attributes:
        atomic_create: ``put(mode="create")`` is an atomic put-if-absent under concurrency.
        multipart: large puts are split into parts that upload in parallel.
        min_part_size: smallest allowed part except the last, in bytes.
        max_part_size: largest allowed part, in bytes.
        max_parts: most parts one multipart upload may have.
        local_path: keys map to files on a mounted filesystem (mmap-able).
    """

    atomic_create: bool
    multipart: bool = True
    min_part_size: int = 1
    max_part_size: int = 1 << 62
    max_parts: int = 1 << 31
    local_path: bool = False


def validate_key(key: str) -> str:
    """Return ``key`` if it is a safe relative key, else raise :class:`InvalidKeyError`."""
    if not isinstance(key, str):
        raise InvalidKeyError(key, f"keys are str, not {type(key).__name__}")
    if not key:
        raise InvalidKeyError(key, "empty key")
    if key.startswith("/"):
        raise InvalidKeyError(key, "keys are relative to the store root; remove the leading '/'")
    if "\\" in key:
        raise InvalidKeyError(key, "backslashes are not allowed; separate segments with '/'")
    if "\x00" in key:
        raise InvalidKeyError(key, "NUL bytes are not allowed")
    for segment in key.split("/"):
        if segment == "":
            raise InvalidKeyError(key, "empty segment ('//' or a trailing '/')")
        if segment in (".", ".."):
            raise InvalidKeyError(key, f"'{segment}' segments are not allowed")
        if segment.startswith(TEMP_PREFIX):
            raise InvalidKeyError(key, f"segments starting {TEMP_PREFIX!r} are reserved")
    if len(key.encode("utf-8", "surrogatepass")) > _MAX_KEY_BYTES:
        raise InvalidKeyError(key, f"longer than {_MAX_KEY_BYTES} bytes")
    return key


def validate_prefix(prefix: str) -> str:
    """Validate a listing prefix: ``""``, or a key-like string that may end with ``/``."""
    if prefix == "":
        return prefix
    validate_key(prefix.removesuffix("/")) if prefix != "/" else validate_key("")
    return prefix


def as_bytes_view(data: Buffer, key: str) -> memoryview:
    """View ``data`` as flat unsigned bytes without copying; refuse non-contiguous buffers."""
    try:
        view = memoryview(data)  # type: ignore[arg-type]  # ndarray exports the buffer protocol
    except TypeError:
        raise TypeError(
            f"put({key!r}): data must be a bytes-like object (bytes, bytearray, memoryview, "
            f"numpy array), not {type(data).__name__}"
        ) from None
    if not view.c_contiguous:
        raise ValueError(
            f"put({key!r}): the buffer is not C-contiguous; ckptstore does not copy buffers, "
            "so make it contiguous first (numpy.ascontiguousarray)"
        )
    if view.format == "B" and view.ndim == 1:
        return view
    return view.cast("B")


def _check_range(key: str, start: int, end: int | None) -> None:
    if start < 0 or (end is not None and end < start):
        raise InvalidRangeError(f"invalid byte range [{start}, {end}) of {key!r}")


def coalesce_ranges(
    ranges: Sequence[tuple[int, int]], *, gap: int, limit: int
) -> list[tuple[int, int, list[int]]]:
    """Group ranges so that each group is fetched by one request.

    Ranges whose gap to the previous group is at most ``gap`` bytes join it while the group
    stays within ``limit`` bytes. Returns ``(start, end, member indices)`` per group, in
    ascending order of start; members index into ``ranges``.
    """
    order = sorted(range(len(ranges)), key=lambda i: ranges[i][0])
    groups: list[tuple[int, int, list[int]]] = []
    for i in order:
        start, end = ranges[i]
        if groups:
            g_start, g_end, members = groups[-1]
            new_end = max(g_end, end)
            if start - g_end <= gap and new_end - g_start <= limit:
                members.append(i)  # in place: copying the list made this quadratic
                groups[-1] = (g_start, new_end, members)
                continue
        groups.append((start, end, [i]))
    return groups


class MultipartUpload(ABC):
    """One object written as numbered parts, then completed or aborted.

    Part ``i`` (from 0) covers bytes ``[i * part_size, (i + 1) * part_size)``; every part but
    the last is exactly ``part_size`` bytes. Parts may be uploaded concurrently and in any
    order. Nothing is visible under the key until :meth:`complete` returns; :meth:`abort`
    removes every uploaded part. Use as an async context manager to abort on any exception.
    """

    def __init__(self, key: str, part_size: int, mode: PutMode) -> None:
        self.key = key
        self.part_size = part_size
        self.mode = mode
        self._sizes: dict[int, int] = {}
        #: The opening store's bounds on transfers (set by :class:`Store`; None: unbounded).
        self.bounds: Callable[[int], contextlib.AbstractAsyncContextManager[None]] | None = None

    async def put_part(self, index: int, data: Buffer, *, crc32c: int | None = None) -> None:
        """Upload part ``index`` (from 0) from a bytes-like object, without copying it.

        ``crc32c``: the crc32c of ``data``, if the caller has it; a backend that sends one
        with the body sends this one rather than hashing the bytes again
        (:mod:`ckptstore.store.checksum`).
        """
        if crc32c is not None:
            with ledger(data, crc32c):
                await self.put_part(index, data)
            return
        view = as_bytes_view(data, self.key)
        if index < 0:
            raise ValueError(f"part index must be >= 0, got {index}")
        if len(view) > self.part_size:
            raise ValueError(
                f"part {index} of {self.key!r} is {len(view)} bytes, over part_size "
                f"{self.part_size}"
            )
        if self.bounds is None:
            await self._put_part(index, view)
        else:
            async with self.bounds(len(view)):
                await self._put_part(index, view)
        self._sizes[index] = len(view)

    async def put_part_crc32c(self, index: int, data: Buffer) -> int:
        """:meth:`put_part`, returning the crc32c of ``data``: the one the backend sent with
        the body where it sends one, hashed after the upload otherwise."""
        with ledger() as book:
            await self.put_part(index, data)
        crc = book.crc_of(data)
        return crc if crc is not None else await acrc32c(data)

    async def complete(self) -> ObjectMeta:
        """Make the object visible; with ``mode="create"`` raise if the key already exists."""
        count = len(self._sizes)
        if sorted(self._sizes) != list(range(count)):
            missing = sorted(set(range(max(self._sizes, default=-1) + 1)) - set(self._sizes))
            raise ValueError(f"multipart upload of {self.key!r} is missing parts {missing}")
        short = [i for i, n in self._sizes.items() if i < count - 1 and n != self.part_size]
        if short:
            raise ValueError(
                f"multipart upload of {self.key!r}: parts {short} are shorter than part_size "
                f"{self.part_size}; only the last part may be"
            )
        return await self._complete(count, sum(self._sizes.values()))

    async def abort(self) -> None:
        """Discard every uploaded part. Safe to call more than once."""
        await self._abort()

    @abstractmethod
    async def _put_part(self, index: int, data: memoryview) -> None: ...

    @abstractmethod
    async def _complete(self, part_count: int, size: int) -> ObjectMeta: ...

    @abstractmethod
    async def _abort(self) -> None: ...

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None:
            await asyncio.shield(self.abort())


class Store(ABC):
    """An async key-to-bytes store rooted at one URL.

    Subclasses implement the single-request primitives (``_put``, ``_create_multipart``,
    ``_get``, ``_read_into``, ``_head``, ``_list``, ``_delete``) and ``from_url``; they inherit
    validation, parallel multipart writes, parallel and coalesced ranged reads, and the
    concurrency bound from this class.
    """

    #: URL schemes this backend serves (the registry reads it for error messages).
    schemes: ClassVar[tuple[str, ...]] = ()
    #: Whether ``?name=value`` query options in a URL are options to the store.
    url_query_options: ClassVar[bool] = False
    #: Whether :meth:`_read_into_crc32c` hashes the bytes as they arrive (set by backends
    #: that override it); otherwise :meth:`read_into_crc32c` hashes after the read.
    hashes_while_reading: ClassVar[bool] = False

    def __init__(self, *, settings: Settings | None = None) -> None:
        self.settings = settings if settings is not None else default_settings()
        self._slots: asyncio.Semaphore | None = None
        self._budget: ByteBudget | None = None

    # ----------------------------------------------------------------- construction

    @classmethod
    @abstractmethod
    def from_url(cls, url: str, **options: Any) -> Store:
        """Open the store at ``url``; ``options`` are backend options and Settings fields."""

    @property
    @abstractmethod
    def url(self) -> str:
        """The URL of the store root, without credentials or query options."""

    @property
    @abstractmethod
    def capabilities(self) -> Capabilities:
        """What this backend can do."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({redact_url(self.url)!r})"

    def _limit(self) -> asyncio.Semaphore:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.settings.transport.max_concurrency)
        return self._slots

    def _bytes(self) -> ByteBudget:
        """The budget of ``Settings.max_inflight_bytes`` every transfer holds its bytes in."""
        if self._budget is None or self._budget.limit != self.settings.transport.max_inflight_bytes:
            self._budget = ByteBudget(self.settings.transport.max_inflight_bytes)
        return self._budget

    @contextlib.asynccontextmanager
    async def _transfer(self, nbytes: int) -> AsyncIterator[None]:
        """Hold ``nbytes`` of the byte budget, then a concurrency slot: always in this order,
        so that no transfer holds a slot while it waits for bytes another one holds."""
        async with self._bytes().hold(nbytes), self._limit():
            yield

    async def _put_one(self, key: str, view: memoryview, mode: PutMode) -> None:
        """One single-request put, within the byte budget and the concurrency bound."""
        async with self._transfer(len(view)):
            await self._put(key, view, mode)

    async def _start_upload(self, key: str, part_size: int, mode: PutMode) -> MultipartUpload:
        """:meth:`_create_multipart`, with each part put within the store's bounds."""
        upload = await self._create_multipart(key, part_size, mode)
        upload.bounds = self._transfer
        return upload

    # ----------------------------------------------------------------- writes

    async def put(
        self,
        key: str,
        data: Buffer,
        *,
        mode: PutMode = "overwrite",
        crc32c: int | None = None,
    ) -> None:
        """Write one object from a bytes-like ``data``, replacing or refusing an existing one.

        Args:
            key: relative key, validated before any I/O.
            data: bytes, bytearray, memoryview or a C-contiguous numpy array; never copied.
            mode: ``"overwrite"`` replaces an existing object; ``"create"`` is an atomic
                put-if-absent that raises :class:`~ckptstore.errors.AlreadyExistsError` if the
                key exists (exactly one of N concurrent creators wins).
            crc32c: the crc32c of ``data``, if the caller has it: a backend that sends one with
                the body (:attr:`sends_checksums`) sends this one rather than hashing the
                bytes again; a wrong one makes the server refuse the write.

        The object is visible only complete: a reader sees the old object, the new one, or
        nothing, never a prefix. Objects of at least ``Settings.multipart_threshold`` bytes are
        uploaded as parallel parts where the backend supports it.
        """
        validate_key(key)
        _check_mode(mode)
        if mode == "create" and not self.capabilities.atomic_create:
            raise NotSupportedError(
                "put(mode='create')", type(self).__name__, "this store has no atomic create"
            )
        view = as_bytes_view(data, key)
        if crc32c is not None:
            with ledger(view, crc32c):
                await self.put(key, view, mode=mode)
            return
        caps = self.capabilities
        if caps.multipart and len(view) >= self.settings.transport.multipart_threshold:
            await self._put_parallel(key, view, mode)
            return
        await self._put_one(key, view, mode)

    async def put_crc32c(self, key: str, data: Buffer, *, mode: PutMode = "overwrite") -> int:
        """:meth:`put`, returning the crc32c of ``data``, hashed once: where the backend sends
        a crc32c with each body (:attr:`sends_checksums`), the one it sent (its parts'
        combined); elsewhere hashed while the put runs."""
        view = as_bytes_view(data, key)
        if not self.sends_checksums:
            crc, _ = await asyncio.gather(acrc32c(view), self.put(key, view, mode=mode))
            return crc
        with ledger() as book:
            await self.put(key, view, mode=mode)
        found = book.crc_of(view)
        return found if found is not None else await acrc32c(view)

    @property
    def sends_checksums(self) -> bool:
        """Whether each write's body goes to the server with its crc32c, computed once per
        write (:func:`~ckptstore.store.checksum.request_crc32c`), so that
        :meth:`put_crc32c` returns it rather than hashing the bytes a second time."""
        return False

    async def create_multipart(
        self, key: str, *, mode: PutMode = "overwrite", part_size: int | None = None
    ) -> MultipartUpload:
        """Start a multipart upload of ``key`` whose parts the caller uploads.

        Use it for objects produced in pieces; for a buffer already in memory :meth:`put`
        does the splitting and parallelism. The caller must ``complete`` or ``abort``
        (``async with`` aborts on error).
        """
        validate_key(key)
        _check_mode(mode)
        if mode == "create" and not self.capabilities.atomic_create:
            raise NotSupportedError(
                "create_multipart(mode='create')", type(self).__name__, "no atomic create"
            )
        size = self.settings.transport.part_size if part_size is None else part_size
        caps = self.capabilities
        if not caps.min_part_size <= size <= caps.max_part_size:
            raise ValueError(
                f"part_size {size} is outside this backend's limits "
                f"[{caps.min_part_size}, {caps.max_part_size}]"
            )
        return await self._start_upload(key, size, mode)

    def part_size_for(self, size: int) -> int:
        """The part size to upload ``size`` bytes in: the configured one, grown if needed so
        the upload stays within ``max_parts``."""
        caps = self.capabilities
        part = max(self.settings.transport.part_size, caps.min_part_size)
        if -(-size // part) > caps.max_parts:
            part = -(-size // caps.max_parts)
        if part > caps.max_part_size:
            raise ValueError(
                f"{size} bytes cannot be uploaded in at most {caps.max_parts} parts of at most "
                f"{caps.max_part_size} bytes"
            )
        return part

    async def _put_parallel(self, key: str, view: memoryview, mode: PutMode) -> None:
        part = self.part_size_for(len(view))
        upload = await self._start_upload(key, part, mode)
        async with upload:

            async def send(index: int) -> None:
                await upload.put_part(index, view[index * part : (index + 1) * part])

            await gather_all(send(i) for i in range(max(1, -(-len(view) // part))))
            await upload.complete()

    # ----------------------------------------------------------------- reads

    async def get(self, key: str) -> bytes:
        """Read a whole object in one request."""
        validate_key(key)
        async with self._limit():
            return await self._get(key)

    async def get_range(self, key: str, start: int, end: int | None = None) -> bytes:
        """Read bytes ``[start, end)`` (``end=None``: to the end of the object).

        Raises :class:`~ckptstore.errors.InvalidRangeError` if the range reaches past the end.
        """
        validate_key(key)
        _check_range(key, start, end)
        if end is None:
            if start == 0:
                async with self._limit():
                    return await self._get(key)
            return await self._tail(key, start)
        out = bytearray(end - start)
        await self.read_into(key, start, out)
        return bytes(out)

    async def _tail(self, key: str, start: int) -> bytes:
        meta = await self.head(key)
        if start > meta.size:
            raise InvalidRangeError(f"range start {start} is past the end of {key!r} ({meta.size})")
        out = bytearray(meta.size - start)
        await self.read_into(key, start, out)
        return bytes(out)

    async def read_into(self, key: str, start: int, out: Buffer) -> None:
        """Fill the writable buffer ``out`` with the object's bytes from ``start`` on.

        Large reads are split into ``Settings.part_size`` ranges fetched in parallel straight
        into ``out``; nothing is copied twice.
        """
        await self._read_parts(key, start, out, checksum=False)

    async def read_into_crc32c(self, key: str, start: int, out: Buffer) -> int:
        """:meth:`read_into`, returning the crc32c of the bytes read.

        A backend that streams response bodies (S3, GCS) hashes each chunk as it lands, while
        it is still in the CPU's cache, and combines the parts' checksums. Restoring 1 GiB from
        SeaweedFS on the development machine took 0.33 client CPU seconds that way against
        0.37 reading and then hashing, a second pass over memory (medians of 14 runs). Other
        backends, and wrappers (so what a FaultStore does to the bytes is what gets hashed),
        read, then hash in a worker thread.
        """
        if not self.hashes_while_reading:
            await self.read_into(key, start, out)
            return await acrc32c(out)
        return await self._read_parts(key, start, out, checksum=True)

    async def read_objects_crc32c(self, requests: Sequence[tuple[str, Buffer]]) -> list[int]:
        """Fill each ``(key, out)`` buffer with the first ``len(out)`` bytes of its object;
        return their crc32c checksums, in order.

        What a copy of many small objects reads. Here each is one :meth:`read_into_crc32c`,
        all at once; a backend whose reads are blocking calls in a thread pool (local disk)
        reads the small ones in one call, one after another, so the batch costs the event
        loop one hand-over instead of two per object (the read, then the hash).

        Raises what :meth:`read_into_crc32c` raises for the first request that fails.
        """
        return await gather_all(self.read_into_crc32c(key, 0, out) for key, out in requests)

    async def _read_parts(self, key: str, start: int, out: Buffer, *, checksum: bool) -> int:
        """Fill ``out`` in ``part_size`` ranges fetched in parallel; with ``checksum``, each
        through :meth:`_read_into_crc32c`, returning the combined crc32c (else 0)."""
        validate_key(key)
        view = _writable_view(out, key)
        _check_range(key, start, start + len(view))
        if len(view) == 0:
            await self.head(key)  # a missing key is still an error
            return 0
        part = self.settings.transport.part_size
        crcs: dict[int, int] = {}

        async def fetch(offset: int) -> None:
            piece = view[offset : offset + part]
            async with self._transfer(len(piece)):
                if checksum:
                    crcs[offset] = await self._read_into_crc32c(key, start + offset, piece)
                else:
                    await self._read_into(key, start + offset, piece)

        await gather_all(fetch(off) for off in range(0, len(view), part))
        crc = 0
        for offset in sorted(crcs):
            crc = crc32c_combine(crc, crcs[offset], min(part, len(view) - offset))
        return crc

    async def read_ranges_into(self, key: str, requests: Sequence[tuple[int, Buffer]]) -> None:
        """Fill each ``(start, out)`` buffer from the object, merging nearby ranges.

        Ranges within ``Settings.coalesce_gap`` of each other are fetched as one request into
        a scratch buffer and scattered (one memcpy each); a lone range is read straight into
        its buffer. Groups are fetched in parallel.
        """
        await self._read_groups(key, requests, None)

    async def read_ranges_into_crc32c(
        self, key: str, requests: Sequence[tuple[int, Buffer]], *, gap: int | None = None
    ) -> builtins.list[int]:
        """:meth:`read_ranges_into`, returning the crc32c of each buffer's bytes, in the order
        of ``requests``. A lone range is hashed as it arrives (:meth:`read_into_crc32c`); the
        members of a merged range are hashed as soon as their group has landed, while other
        groups are still in flight. ``gap`` replaces ``Settings.coalesce_gap`` for this call
        (``0``: only ranges that touch share a request, so no byte between them is read)."""
        crcs = [0] * len(requests)
        await self._read_groups(key, requests, crcs, gap)
        return crcs

    async def _read_groups(
        self,
        key: str,
        requests: Sequence[tuple[int, Buffer]],
        crcs: builtins.list[int] | None,
        gap: int | None = None,
    ) -> None:
        """Merge the requests' ranges into groups, fetch the groups in parallel and scatter
        each into its members' buffers; with ``crcs``, fill in each member's crc32c."""
        validate_key(key)
        views = [(start, _writable_view(out, key)) for start, out in requests]
        ranges = [(start, start + len(view)) for start, view in views]
        for start, end in ranges:
            _check_range(key, start, end)
        groups = coalesce_ranges(
            ranges,
            gap=self.settings.transport.coalesce_gap if gap is None else gap,
            limit=self.settings.transport.coalesce_limit,
        )

        async def fetch(g_start: int, g_end: int, members: builtins.list[int]) -> None:
            if len(members) == 1:
                (i,) = members
                if crcs is None:
                    await self.read_into(key, g_start, views[i][1])
                else:
                    crcs[i] = await self.read_into_crc32c(key, g_start, views[i][1])
                return
            scratch = bytearray(g_end - g_start)
            await self.read_into(key, g_start, scratch)
            source = memoryview(scratch)  # slicing the bytearray itself would copy twice
            for i in members:
                start, view = views[i]
                view[:] = source[start - g_start : start - g_start + len(view)]
                if crcs is not None:
                    crcs[i] = await acrc32c(view)

        await gather_all(fetch(*group) for group in groups)

    async def get_ranges(
        self, key: str, ranges: Sequence[tuple[int, int]]
    ) -> builtins.list[memoryview]:
        """Read several ``[start, end)`` ranges of one object, merged and fetched in parallel.

        Returns read-only views in the order of ``ranges``; merged ranges share one buffer.
        """
        validate_key(key)
        for start, end in ranges:
            _check_range(key, start, end)
        groups = coalesce_ranges(
            ranges,
            gap=self.settings.transport.coalesce_gap,
            limit=self.settings.transport.coalesce_limit,
        )
        results: list[memoryview | None] = [None] * len(ranges)

        async def fetch(g_start: int, g_end: int, members: list[int]) -> None:
            buf = bytearray(g_end - g_start)
            await self.read_into(key, g_start, buf)
            view = memoryview(buf).toreadonly()
            for i in members:
                start, end = ranges[i]
                results[i] = view[start - g_start : end - g_start]

        await gather_all(fetch(*group) for group in groups)
        return [r if r is not None else memoryview(b"") for r in results]

    async def head(self, key: str) -> ObjectMeta:
        """Size and version of one object; :class:`~ckptstore.errors.NotFoundError` if absent."""
        validate_key(key)
        async with self._limit():
            return await self._head(key)

    async def exists(self, key: str) -> bool:
        """Whether ``key`` exists (one ``head``)."""
        try:
            await self.head(key)
        except NotFoundError:
            return False
        return True

    # ----------------------------------------------------------------- listing, deletes

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectMeta]:
        """Every object whose key starts with ``prefix`` (a string prefix, as in S3), sorted
        by key. In-progress writes are never listed."""
        validate_prefix(prefix)
        async for meta in self._list(prefix):
            yield meta

    async def list_keys(self, prefix: str = "") -> builtins.list[str]:
        """The keys :meth:`list` yields, as a list."""
        return [meta.key async for meta in self.list(prefix)]

    async def list_prefixes(self, prefix: str = "") -> builtins.list[str]:
        """The distinct next ``/``-segments under ``prefix`` (which is ``""`` or ends with
        ``/``), each returned with its trailing ``/``, sorted. Objects directly under
        ``prefix`` are not included.

        The default walks :meth:`list`; backends with a delimiter listing override it.
        """
        if prefix and not prefix.endswith("/"):
            raise ValueError(f"list_prefixes: prefix {prefix!r} must be empty or end with '/'")
        validate_prefix(prefix)
        return await self._list_prefixes(prefix)

    async def _list_prefixes(self, prefix: str) -> builtins.list[str]:
        found: set[str] = set()
        async for meta in self._list(prefix):
            rest = meta.key[len(prefix) :]
            if "/" in rest:
                found.add(prefix + rest.split("/", 1)[0] + "/")
        return sorted(found)

    async def delete(self, keys: Iterable[str]) -> None:
        """Delete objects in batches; keys that do not exist are ignored."""
        batch = [validate_key(key) for key in keys]
        if not batch:
            return
        async with self._limit():
            await self._delete(batch)

    async def delete_prefix(self, prefix: str) -> int:
        """Delete every object under ``prefix``; returns how many were deleted."""
        if not prefix:
            raise ValueError("delete_prefix needs a non-empty prefix; refusing to empty the root")
        keys = await self.list_keys(prefix)
        await self.delete(keys)
        return len(keys)

    async def remove_stale_writes(self, prefix: str = "", *, older_than: float) -> int:
        """Remove in-progress writes under ``prefix`` that their writer abandoned.

        An optional hook for garbage collection (``ckptstore.layout.gc``): writes that never
        became objects but still hold storage, such as temp files of crashed writers (local
        and NFS backends) or multipart uploads never completed nor aborted (S3: an
        implementation lists ``ListMultipartUploads`` under the prefix and aborts those
        initiated before ``older_than``). Only writes last touched before ``older_than``
        (seconds since the epoch) are removed. Returns how many were removed; the default
        has nothing to remove.
        """
        validate_prefix(prefix)
        return 0

    async def writes_verified(self) -> bool:
        """Whether no write of this store becomes an object unless the bytes stored are the
        bytes sent: the server checks a crc32c sent with each body and refuses a body that
        fails it (S3's ``x-amz-checksum-crc32c``, where the server honours it), or this
        store compares the crc32c the server reports for what it stored with its own (GCS).

        A copy to such a store skips reading its objects back
        (:func:`~ckptstore.layout.maintenance.copy_step`). False, the default, where nothing
        checks a write this way (local files, NFS, memory, fsspec): copies read back.
        """
        return False

    async def settle(self) -> None:  # noqa: B027  (optional hook, not abstract)
        """Wait until the work in flight now, including what callers stopped waiting for, has
        ended.

        A cancelled request may still be running where cancellation cannot reach: a local
        write in a thread creates its file after its caller was cancelled. Code that cleans
        up after a cancellation (an interrupted copy removing its attempt) settles first, so
        nothing it removes reappears. The default has no such work.
        """

    async def close(self) -> None:  # noqa: B027  (optional hook, not abstract)
        """Release clients, pools and threads. The store is unusable afterwards."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # ----------------------------------------------------------------- backend primitives

    @abstractmethod
    async def _put(self, key: str, data: memoryview, mode: PutMode) -> None:
        """One single-request write; ``mode="create"`` must be atomic put-if-absent."""

    @abstractmethod
    async def _create_multipart(self, key: str, part_size: int, mode: PutMode) -> MultipartUpload:
        """Start a multipart upload (one request at most)."""

    @abstractmethod
    async def _get(self, key: str) -> bytes:
        """Read a whole object in one request."""

    @abstractmethod
    async def _read_into(self, key: str, start: int, out: memoryview) -> None:
        """Fill ``out`` from ``start`` in one request; raise InvalidRangeError if short."""

    async def _read_into_crc32c(self, key: str, start: int, out: memoryview) -> int:
        """:meth:`_read_into`, returning the crc32c of the bytes read; backends that override
        it hash while the bytes arrive and set :attr:`hashes_while_reading`."""
        await self._read_into(key, start, out)
        return await acrc32c(out)

    @abstractmethod
    async def _head(self, key: str) -> ObjectMeta: ...

    @abstractmethod
    def _list(self, prefix: str) -> AsyncIterator[ObjectMeta]:
        """Objects under ``prefix``, sorted by key, temp files excluded."""

    @abstractmethod
    async def _delete(self, keys: builtins.list[str]) -> None:
        """Delete ``keys`` (any number; the backend batches); missing keys are ignored."""


def _check_mode(mode: str) -> None:
    if mode not in _PUT_MODES:
        raise ValueError(f"mode must be one of {_PUT_MODES}, got {mode!r}")


def _writable_view(out: Buffer, key: str) -> memoryview:
    view = memoryview(out)  # type: ignore[arg-type]  # ndarray exports the buffer protocol
    if view.readonly:
        raise ValueError(f"read of {key!r}: the destination buffer is read-only")
    if not view.c_contiguous:
        raise ValueError(f"read of {key!r}: the destination buffer is not C-contiguous")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")
