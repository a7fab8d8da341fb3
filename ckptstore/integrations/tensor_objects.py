"""Tensors to store objects and back, shared by the DCP and Lightning integrations.

* :class:`Packer` copies small items into pack objects (one copy each, 64-byte aligned) and
  reports where each landed and its crc32c; large items go out as objects of their own
  straight from the tensor's memory.
* :class:`UploadBatch` starts each PUT on the background loop as soon as its bytes are ready,
  so packing the next object overlaps the upload of the previous one, and completes once all
  are durable.
* :class:`StoreHandle` holds a URL and opens its store on first use; it pickles without the
  open store, so an integration object can be sent to another process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import ml_dtypes
import numpy as np
import torch

from ckptstore import background
from ckptstore.errors import CorruptCheckpointError
from ckptstore.layout.keys import check_step, parse_step
from ckptstore.store.base import Store
from ckptstore.store.checksum import crc32c
from ckptstore.store.registry import open_store, registered_schemes

__all__ = [
    "ALIGN",
    "TORCH_TO_NUMPY",
    "CheckpointTarget",
    "numpy_dtype",
    "torch_dtype",
    "Packer",
    "Placed",
    "StoreHandle",
    "UploadBatch",
    "crc32c",
    "served",
    "tensor_bytes",
]

#: Items start on 64-byte boundaries inside pack objects.
ALIGN = 64

T = TypeVar("T")


def tensor_bytes(tensor: torch.Tensor) -> tuple[torch.Tensor, memoryview]:
    """A CPU, contiguous version of ``tensor`` (the same tensor if it already is one) and a
    flat byte view of its memory."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    tensor = tensor.resolve_conj().resolve_neg().contiguous()
    if tensor.numel() == 0:
        return tensor, memoryview(b"")
    flat = tensor.reshape(-1).view(torch.uint8).numpy()
    return tensor, memoryview(flat)  # type: ignore[arg-type]  # ndarray is a buffer


TORCH_TO_NUMPY: dict[torch.dtype, np.dtype[Any]] = {
    torch.float64: np.dtype(np.float64),
    torch.float32: np.dtype(np.float32),
    torch.float16: np.dtype(np.float16),
    torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
    torch.complex64: np.dtype(np.complex64),
    torch.complex128: np.dtype(np.complex128),
    torch.int8: np.dtype(np.int8),
    torch.int16: np.dtype(np.int16),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
    torch.uint8: np.dtype(np.uint8),
    torch.uint16: np.dtype(np.uint16),
    torch.uint32: np.dtype(np.uint32),
    torch.uint64: np.dtype(np.uint64),
    torch.bool: np.dtype(np.bool_),
    torch.float8_e4m3fn: np.dtype(ml_dtypes.float8_e4m3fn),
    torch.float8_e5m2: np.dtype(ml_dtypes.float8_e5m2),
    torch.float8_e4m3fnuz: np.dtype(ml_dtypes.float8_e4m3fnuz),
    torch.float8_e5m2fnuz: np.dtype(ml_dtypes.float8_e5m2fnuz),
}
_NUMPY_TO_TORCH = {np_dtype: dtype for dtype, np_dtype in TORCH_TO_NUMPY.items()}


def numpy_dtype(dtype: torch.dtype) -> np.dtype[Any]:
    """The numpy dtype with the same bytes as a torch dtype; refuses others."""
    try:
        return TORCH_TO_NUMPY[dtype]
    except KeyError:
        known = ", ".join(str(d).removeprefix("torch.") for d in TORCH_TO_NUMPY)
        raise TypeError(
            f"ckptstore cannot store tensors of dtype {dtype}; supported: {known}"
        ) from None


def torch_dtype(dtype: np.dtype[Any], where: str) -> torch.dtype:
    """The torch dtype of a manifest leaf's numpy dtype, or CorruptCheckpointError."""
    try:
        return _NUMPY_TO_TORCH[dtype]
    except KeyError:
        raise CorruptCheckpointError(f"{where}: dtype {dtype} has no torch equivalent") from None


def served(url: str | os.PathLike[str]) -> bool:
    """Whether a ckptstore backend serves ``url``'s scheme (without importing it)."""
    text = os.fspath(url)
    if not isinstance(text, str) or not text:
        return False
    scheme = text.split("://", 1)[0].lower() if "://" in text else "file"
    return scheme in registered_schemes()


class StoreHandle:
    """A URL, its store options, and the store opened on first use; pickles without the
    store, which the unpickled copy reopens by URL."""

    def __init__(self, url: str | os.PathLike[str] | Store, options: dict[str, Any]) -> None:
        if isinstance(url, Store):
            if options:
                raise TypeError("store options cannot be given with an open Store")
            self.url, self.options = url.url, options
            self._store: Store | None = url
            self._owned = False
            return
        self.url = os.fspath(url)
        self.options = options
        self._store = None
        self._owned = True

    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = open_store(self.url, **self.options)
        return self._store

    def reopen(self, url: str | os.PathLike[str]) -> None:
        """Point at ``url``, closing the store if it was open on another one."""
        new = os.fspath(url)
        if new != self.url:
            self.close()
            self.url = new

    def close(self) -> None:
        """Close the store, also one the caller passed in."""
        if self._store is not None:
            store, self._store = self._store, None
            self._owned = True  # reopened by URL from now on
            background.run(store.close())

    def release(self) -> None:
        """Close the store if this handle opened it (a caller's Store stays open); the next
        use reopens it. Called at the end of each save or load, so no client outlives it."""
        if self._owned:
            self.close()

    async def arelease(self) -> None:
        """:meth:`release`, from a coroutine on the background loop."""
        if self._owned and self._store is not None:
            store, self._store = self._store, None
            await store.close()

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "options": self.options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.url = state["url"]
        self.options = state["options"]
        self._store = None
        self._owned = True


@dataclass(frozen=True, slots=True)
class Placed(Generic[T]):
    """Where one item landed: ``[start, start + length)`` of object ``key``.

    Attributes:
        token: what the caller passed to :meth:`Packer.add` or :meth:`UploadBatch.single`.
        key: the object, relative to the store root.
        start: byte offset of the item in the object.
        length: its length in bytes.
        crc32c: crc32c of the item.
        object_size: size of the whole object.
        object_crc32c: crc32c of the whole object.
    """

    token: T
    key: str
    start: int
    length: int
    crc32c: int
    object_size: int
    object_crc32c: int


class UploadBatch:
    """PUTs started from the calling thread on the background loop, awaited together.

    Objects are named ``<key_prefix>-<n>``; each buffer stays referenced until its PUT returns.
    """

    def __init__(self, store: Store, key_prefix: str) -> None:
        self.store = store
        self.key_prefix = key_prefix
        self.futures: list[concurrent.futures.Future[None]] = []
        self.count = 0

    def next_key(self) -> str:
        key = f"{self.key_prefix}-{self.count}"
        self.count += 1
        return key

    def upload(self, key: str, data: memoryview, keep: object) -> None:
        """Start the PUT of ``data``; ``keep`` (the owner of its memory) lives until it ends."""

        async def put() -> None:
            await self.store.put(key, data)
            del keep_alive[:]

        keep_alive = [keep]
        self.futures.append(background.submit(put()))

    def single(self, token: T, data: memoryview, keep: object) -> Placed[T]:
        """Upload one item as an object of its own, straight from its memory."""
        key = self.next_key()
        crc = crc32c(data)
        self.upload(key, data, keep)
        return Placed(token, key, 0, len(data), crc, len(data), crc)

    def wait(self) -> None:
        """Block until every PUT has returned; raise the first failure."""
        for future in concurrent.futures.as_completed(self.futures):
            future.result()

    def when_done(
        self,
        callback: Callable[[BaseException | None], None],
        cleanup: Callable[[BaseException | None], Awaitable[None]] | None = None,
    ) -> None:
        """Call ``callback(None)`` once every PUT has returned, or with the first error;
        ``cleanup`` gets the same argument first, on the background loop."""

        async def wait_all(futures: Sequence[concurrent.futures.Future[None]]) -> None:
            error: BaseException | None = None
            try:
                await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
            except BaseException as exc:
                error = exc
                raise
            finally:
                if cleanup is not None:
                    await cleanup(error)

        def done(f: concurrent.futures.Future[None]) -> None:
            callback(f.exception())

        background.submit(wait_all(self.futures)).add_done_callback(done)


class Packer(Generic[T]):
    """Gathers small items into pack objects of up to ``pack_size`` bytes."""

    def __init__(self, batch: UploadBatch, pack_size: int) -> None:
        self.batch = batch
        self.pack_size = pack_size
        self.items: list[tuple[T, memoryview, int]] = []
        self.size = 0

    def add(self, token: T, data: memoryview) -> list[Placed[T]]:
        """Add one item; returns the items of a pack this filled and sent, if any."""
        sent: list[Placed[T]] = []
        if self.items and _aligned(self.size) + len(data) > self.pack_size:
            sent = self.flush()
        start = _aligned(self.size)
        self.items.append((token, data, start))
        self.size = start + len(data)
        return sent

    def flush(self) -> list[Placed[T]]:
        """Copy the gathered items into one buffer and start its upload."""
        if not self.items:
            return []
        buffer = np.zeros(self.size, dtype=np.uint8)
        spans = []
        for token, data, start in self.items:
            end = start + len(data)
            buffer[start:end] = np.frombuffer(data, dtype=np.uint8)
            spans.append((token, start, len(data), crc32c(buffer[start:end])))
        key = self.batch.next_key()
        object_crc = crc32c(buffer)
        self.batch.upload(key, memoryview(buffer), buffer)  # type: ignore[arg-type]
        placed = [
            Placed(token, key, start, length, crc, self.size, object_crc)
            for token, start, length, crc in spans
        ]
        self.items, self.size = [], 0
        return placed


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


class CheckpointTarget:
    """Where one DCP checkpoint lives: a run root (URL or Store) and a step under it.

    A URL whose last segment is a step number (``s3://b/run/100``) is step 100 of the root
    ``s3://b/run``, exactly as :func:`ckptstore.save` would store it; any other URL is the root
    of a checkpoint stored as step 0, unless ``step`` is given. Pickles without its store.
    """

    def __init__(
        self, target: str | os.PathLike[str] | Store, step: int | None, options: dict[str, Any]
    ) -> None:
        if isinstance(target, Store):
            self.url = f"{target.url}/{step or 0}"
            self.handle = StoreHandle(target, options)
            self.step = check_step(step or 0)
            return
        self.options = options
        self.url = os.fspath(target)
        root, self.step = _split(self.url, step)
        self.handle = StoreHandle(root, options)

    @property
    def store(self) -> Store:
        return self.handle.store

    def point_at(self, checkpoint_id: str | os.PathLike[str]) -> None:
        """Follow a ``checkpoint_id`` that DCP passes to ``reset``."""
        url = os.fspath(checkpoint_id)
        if url == self.url:
            return
        root, self.step = _split(url, None)
        self.url = url
        self.handle.reopen(root)


def _split(url: str, step: int | None) -> tuple[str, int]:
    if step is not None:
        return url, check_step(step)
    trimmed = url.rstrip("/")
    parent, _, last = trimmed.rpartition("/")
    number = parse_step(last)
    if number is None or not parent or parent.endswith(":/") or parent.endswith(":"):
        return url, 0
    return parent, number
