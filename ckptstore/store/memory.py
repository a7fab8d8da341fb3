"""``memory://``: an in-process store, the reference implementation of the contract.

Objects live in one process-wide table, so ``memory://run1`` opened twice sees the same
objects (as fsspec's memory filesystem does); ``MemoryStore()`` with no name gets a private
namespace. A put copies the caller's bytes once into the table: that copy is this medium's
write, the equivalent of a disk write, since the caller may reuse its buffer afterwards.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ckptstore.config import Settings
from ckptstore.errors import AlreadyExistsError, InvalidRangeError, InvalidURLError, NotFoundError
from ckptstore.store.base import Capabilities, MultipartUpload, ObjectMeta, PutMode, Store
from ckptstore.store.options import split_settings

__all__ = ["MemoryStore"]


@dataclass(frozen=True, slots=True)
class _Object:
    data: bytes
    generation: int
    mtime: float


class _Table:
    """Process-wide objects keyed by full path, with keys kept sorted for listing."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.objects: dict[str, _Object] = {}
        self.sorted_keys: list[str] = []
        self.generations = itertools.count(1)

    def set(self, path: str, data: bytes, *, create: bool) -> _Object:
        with self.lock:
            if create and path in self.objects:
                raise AlreadyExistsError(f"memory://{path} already exists")
            if path not in self.objects:
                bisect.insort(self.sorted_keys, path)
            obj = _Object(data, next(self.generations), time.time())
            self.objects[path] = obj
            return obj

    def get(self, path: str) -> _Object:
        with self.lock:
            try:
                return self.objects[path]
            except KeyError:
                raise NotFoundError(f"memory://{path} does not exist") from None

    def delete(self, paths: list[str]) -> None:
        with self.lock:
            for path in paths:
                if self.objects.pop(path, None) is not None:
                    index = bisect.bisect_left(self.sorted_keys, path)
                    del self.sorted_keys[index]

    def under(self, prefix: str) -> list[tuple[str, _Object]]:
        with self.lock:
            start = bisect.bisect_left(self.sorted_keys, prefix)
            out = []
            for path in itertools.islice(self.sorted_keys, start, None):
                if not path.startswith(prefix):
                    break
                out.append((path, self.objects[path]))
            return out


_TABLE = _Table()


class MemoryStore(Store):
    """Objects in this process's memory; shared by every store opened on the same name."""

    schemes = ("memory",)

    def __init__(self, name: str | None = None, *, settings: Settings | None = None) -> None:
        super().__init__(settings=settings)
        name = name.strip("/") if name else f"anonymous-{uuid.uuid4().hex}"
        if not name:
            raise InvalidURLError("memory:// needs a name, e.g. memory://run1")
        self._root = name + "/"

    @classmethod
    def from_url(cls, url: str, **options: Any) -> MemoryStore:
        settings, rest = split_settings(options)
        if rest:
            raise TypeError(f"memory store: unknown options {sorted(rest)}")
        if not url.startswith("memory://"):
            raise InvalidURLError(f"not a memory:// URL: {url!r}")
        return cls(url.removeprefix("memory://"), settings=settings)

    @property
    def url(self) -> str:
        return "memory://" + self._root.rstrip("/")

    @property
    def capabilities(self) -> Capabilities:
        # One put is one dict assignment: splitting it into parts only adds a join.
        return Capabilities(atomic_create=True, multipart=False)

    async def _put(self, key: str, data: memoryview, mode: PutMode) -> None:
        _TABLE.set(self._root + key, bytes(data), create=mode == "create")

    async def _create_multipart(self, key: str, part_size: int, mode: PutMode) -> MultipartUpload:
        return _MemoryUpload(self._root + key, key, part_size, mode)

    async def _get(self, key: str) -> bytes:
        return _TABLE.get(self._root + key).data

    async def _read_into(self, key: str, start: int, out: memoryview) -> None:
        data = _TABLE.get(self._root + key).data
        end = start + len(out)
        if end > len(data):
            raise InvalidRangeError(
                f"range [{start}, {end}) reaches past the end of {self.url}/{key} ({len(data)})"
            )
        out[:] = memoryview(data)[start:end]

    async def _head(self, key: str) -> ObjectMeta:
        obj = _TABLE.get(self._root + key)
        return ObjectMeta(key, len(obj.data), str(obj.generation), obj.mtime)

    async def _list(self, prefix: str) -> AsyncIterator[ObjectMeta]:
        cut = len(self._root)
        for path, obj in _TABLE.under(self._root + prefix):
            yield ObjectMeta(path[cut:], len(obj.data), str(obj.generation), obj.mtime)

    async def _delete(self, keys: list[str]) -> None:
        _TABLE.delete([self._root + key for key in keys])


class _MemoryUpload(MultipartUpload):
    def __init__(self, path: str, key: str, part_size: int, mode: PutMode) -> None:
        super().__init__(key, part_size, mode)
        self._path = path
        self._parts: dict[int, bytes] = {}

    async def _put_part(self, index: int, data: memoryview) -> None:
        self._parts[index] = bytes(data)

    async def _complete(self, part_count: int, size: int) -> ObjectMeta:
        data = b"".join(self._parts[i] for i in range(part_count))
        self._parts.clear()
        obj = _TABLE.set(self._path, data, create=self.mode == "create")
        return ObjectMeta(self.key, size, str(obj.generation), obj.mtime)

    async def _abort(self) -> None:
        self._parts.clear()
