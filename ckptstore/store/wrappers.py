"""Stores that wrap another store: counting, fault injection, concurrency limits.

A wrapper sits at the level of single requests: the wrapped store's public methods (key
validation, splitting into parts, coalescing) run in the wrapper, and each primitive request
they issue passes through the wrapper's hook before reaching the inner backend. So a
``CountingStore`` counts real requests (one per part of a multipart upload), and a
``FaultStore`` can fail the third part of an upload or truncate one ranged read.
"""

from __future__ import annotations

import asyncio
import random
import re
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from ckptstore.errors import StoreError
from ckptstore.store.base import Capabilities, MultipartUpload, ObjectMeta, PutMode, Store

__all__ = ["CountingStore", "Fault", "FaultStore", "LimitStore", "StoreWrapper"]

#: Operation names used by the wrappers, one per primitive request.
OPERATIONS = (
    "put",
    "create_multipart",
    "put_part",
    "complete_multipart",
    "abort_multipart",
    "get",
    "read",
    "head",
    "list",
    "delete",
)


class StoreWrapper(Store):
    """Delegates every primitive to ``inner`` through :meth:`_hook`."""

    def __init__(self, inner: Store) -> None:
        super().__init__(settings=inner.settings)
        self.inner = inner

    @classmethod
    def from_url(cls, url: str, **options: Any) -> Store:
        raise TypeError(f"{cls.__name__} wraps a store; construct it with the store to wrap")

    @property
    def url(self) -> str:
        return self.inner.url

    @property
    def capabilities(self) -> Capabilities:
        return self.inner.capabilities

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"

    async def _hook(self, op: str, key: str, nbytes: int) -> Any:
        """Called before each request; subclasses count, delay or raise here. What it
        returns for a read is handed to :meth:`_after_read` with the bytes read."""

    def _after_read(self, token: Any, data: memoryview) -> None:
        """Called with the bytes a read returned (subclasses may damage them)."""

    async def _put(self, key: str, data: memoryview, mode: PutMode) -> None:
        await self._hook("put", key, len(data))
        await self.inner._put(key, data, mode)

    async def _create_multipart(self, key: str, part_size: int, mode: PutMode) -> MultipartUpload:
        await self._hook("create_multipart", key, 0)
        return _WrappedUpload(self, await self.inner._create_multipart(key, part_size, mode))

    async def _get(self, key: str) -> bytes:
        token = await self._hook("get", key, 0)
        data = await self.inner._get(key)
        if token is None:
            return data
        buf = bytearray(data)
        self._after_read(token, memoryview(buf))
        return bytes(buf)

    async def _read_into(self, key: str, start: int, out: memoryview) -> None:
        token = await self._hook("read", key, len(out))
        await self.inner._read_into(key, start, out)
        if token is not None:
            self._after_read(token, out)

    async def _head(self, key: str) -> ObjectMeta:
        await self._hook("head", key, 0)
        return await self.inner._head(key)

    async def _list(self, prefix: str) -> AsyncIterator[ObjectMeta]:
        await self._hook("list", prefix, 0)
        async for meta in self.inner._list(prefix):
            yield meta

    async def _list_prefixes(self, prefix: str) -> list[str]:
        await self._hook("list", prefix, 0)
        return await self.inner._list_prefixes(prefix)

    async def _delete(self, keys: list[str]) -> None:
        await self._hook("delete", keys[0], len(keys))
        await self.inner._delete(keys)

    async def remove_stale_writes(self, prefix: str = "", *, older_than: float) -> int:
        # docstring inherited
        await self._hook("list", prefix, 0)
        return await self.inner.remove_stale_writes(prefix, older_than=older_than)

    async def writes_verified(self) -> bool:
        # docstring inherited; no wrapper changes the bytes a write sends
        return await self.inner.writes_verified()

    @property
    def sends_checksums(self) -> bool:
        # docstring inherited; writes reach the inner store's requests, ledger and all
        return self.inner.sends_checksums

    async def settle(self) -> None:
        # docstring inherited
        await self.inner.settle()

    async def close(self) -> None:
        # docstring inherited
        await self.inner.close()


class _WrappedUpload(MultipartUpload):
    def __init__(self, wrapper: StoreWrapper, inner: MultipartUpload) -> None:
        super().__init__(inner.key, inner.part_size, inner.mode)
        self._wrapper = wrapper
        self._inner = inner

    async def _put_part(self, index: int, data: memoryview) -> None:
        await self._wrapper._hook("put_part", self.key, len(data))
        await self._inner._put_part(index, data)

    async def _complete(self, part_count: int, size: int) -> ObjectMeta:
        await self._wrapper._hook("complete_multipart", self.key, 0)
        return await self._inner._complete(part_count, size)

    async def _abort(self) -> None:
        await self._wrapper._hook("abort_multipart", self.key, 0)
        await self._inner._abort()


class CountingStore(StoreWrapper):
    """Counts requests and bytes per operation (see ``OPERATIONS``).

    Attributes:
        requests: requests issued, by operation.
        bytes: bytes sent (writes) or requested (reads), by operation; for ``delete``, keys.
    """

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.requests: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    async def _hook(self, op: str, key: str, nbytes: int) -> None:
        self.requests[op] += 1
        self.bytes[op] += nbytes

    @property
    def total_requests(self) -> int:
        return sum(self.requests.values())

    def reset(self) -> None:
        self.requests.clear()
        self.bytes.clear()


@dataclass(frozen=True, slots=True)
class Fault:
    """One kind of fault a :class:`FaultStore` injects.

    Attributes:
        ops: operation names it applies to (see ``OPERATIONS``).
        error: exception to raise, or a factory taking ``(op, key)``; ``None`` raises nothing.
        latency: seconds to wait before the request.
        truncate: for reads, keep only this many bytes (the rest of the buffer is zeroed),
            as a server that closes a body early but reports success would.
        corrupt: for reads, flip the first byte returned.
        rate: probability a matching request is hit (drawn from the store's seeded RNG).
        after: let this many matching requests through before any is hit.
        times: hit at most this many requests (``None``: no limit).
        key: regular expression a key must contain a match of.
    """

    ops: frozenset[str]
    error: BaseException | Callable[[str, str], BaseException] | None = None
    latency: float = 0.0
    truncate: int | None = None
    corrupt: bool = False
    rate: float = 1.0
    after: int = 0
    times: int | None = None
    key: str | None = None

    def __post_init__(self) -> None:
        unknown = set(self.ops) - set(OPERATIONS)
        if unknown:
            raise ValueError(f"unknown operations {sorted(unknown)}; known: {OPERATIONS}")
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"rate must be in [0, 1], got {self.rate}")


def transient_error(op: str, key: str) -> BaseException:
    """A retryable-looking backend failure: the ``error`` to give a fault that should fail
    requests (a fault without one only delays, truncates or corrupts)."""
    return StoreError(f"injected fault in {op} of {key!r}")


class FaultStore(StoreWrapper):
    """Injects errors, latency, truncation or corruption into chosen requests.

    Args:
        inner: the store to wrap.
        faults: the faults; each request is checked against them in order and the first that
            hits applies.
        seed: seed of the random draws for ``rate``, so a failing run can be replayed.
    """

    def __init__(self, inner: Store, faults: list[Fault], *, seed: int = 0) -> None:
        super().__init__(inner)
        self.faults = list(faults)
        self._rng = random.Random(seed)
        self._seen: Counter[int] = Counter()
        self._hits: Counter[int] = Counter()
        self.injected: Counter[str] = Counter()

    def _match(self, op: str, key: str) -> Fault | None:
        for index, fault in enumerate(self.faults):
            if op not in fault.ops or (fault.key is not None and not re.search(fault.key, key)):
                continue
            self._seen[index] += 1
            if self._seen[index] <= fault.after:
                continue
            if fault.times is not None and self._hits[index] >= fault.times:
                continue
            if fault.rate < 1.0 and self._rng.random() >= fault.rate:
                continue
            self._hits[index] += 1
            return fault
        return None

    async def _hook(self, op: str, key: str, nbytes: int) -> Fault | None:
        fault = self._match(op, key)
        if fault is None:
            return None
        self.injected[op] += 1
        if fault.latency:
            await asyncio.sleep(fault.latency)
        if fault.error is not None:
            error = fault.error if isinstance(fault.error, BaseException) else fault.error(op, key)
            raise error
        return fault if fault.truncate is not None or fault.corrupt else None

    def _after_read(self, token: Any, data: memoryview) -> None:
        fault: Fault = token
        if fault.truncate is not None and fault.truncate < len(data):
            data[fault.truncate :] = bytes(len(data) - fault.truncate)
        if fault.corrupt and len(data):
            data[0] ^= 0xFF


class LimitStore(StoreWrapper):
    """Caps the wrapped store at ``max_concurrency`` requests in flight."""

    def __init__(self, inner: Store, max_concurrency: int) -> None:
        super().__init__(inner)
        self.settings = inner.settings.replace(max_concurrency=max_concurrency)
