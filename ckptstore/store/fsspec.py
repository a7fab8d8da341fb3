"""Any other fsspec filesystem: Azure (adlfs), HTTP stores, SFTP, fsspec's in-memory store...

The registry sends here every URL scheme that has no dedicated backend but that fsspec knows
(``fsspec.available_protocols()``), and ``fsspec+PROTOCOL://`` URLs, which force fsspec's
implementation even where ckptstore has its own (``fsspec+memory://`` is fsspec's memory
filesystem, ``memory://`` ckptstore's). Keyword options that are not ckptstore settings are
the filesystem's ``storage_options``, as with ``fsspec.open(url, **storage_options)``;
a ``storage_options={...}`` dict is accepted too.

Asynchronous filesystems (``async_impl``) are driven through their coroutine methods on the
caller's loop; synchronous ones run in a thread pool of ``Settings.io_threads`` threads.

Commit safety is only as strong as the filesystem underneath. A checkpoint commit needs an
atomic put-if-absent, and fsspec has no general one: ``pipe_file(mode="create")`` is atomic
on the object stores whose fsspec drivers send a precondition (s3fs, gcsfs), and on most
others is an existence check followed by a write, which two writers can both pass. So
``put(mode="create")`` raises :class:`~ckptstore.errors.NotSupportedError` naming the protocol
unless the filesystem is one of the former, or the user passes ``single_writer=True``: then
the check and the write are serialized within this store object, which is correct only if no
other process or store object writes the same checkpoint root at the same time.
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import contextlib
import datetime
import functools
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import fsspec
import fsspec.core
from fsspec.spec import AbstractFileSystem

from ckptstore.config import Settings
from ckptstore.errors import (
    AlreadyExistsError,
    InvalidRangeError,
    InvalidURLError,
    NotFoundError,
    NotSupportedError,
    StoreError,
)
from ckptstore.store.base import (
    TEMP_PREFIX,
    Capabilities,
    MultipartUpload,
    ObjectMeta,
    PutMode,
    Store,
)
from ckptstore.store.options import parse_bool, split_settings

if TYPE_CHECKING:
    from ckptstore.store.base import Buffer

__all__ = ["ATOMIC_CREATE_PROTOCOLS", "FsspecStore"]

_T = TypeVar("_T")

#: Protocols whose fsspec driver makes ``pipe_file(mode="create")`` one conditional request
#: (s3fs: ``If-None-Match: *``; gcsfs: ``ifGenerationMatch=0``).
ATOMIC_CREATE_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs"})
_FORCE_PREFIX = "fsspec+"


class FsspecStore(Store):
    """Objects under ``root`` on an fsspec filesystem.

    Args:
        fs: the filesystem instance; an async one must have been created with
            ``asynchronous=True`` (``from_url`` does this).
        root: the root path on ``fs``, without protocol.
        single_writer: allow ``put(mode="create")`` on a filesystem without an atomic create,
            as an existence check and a write serialized within this object. Not safe if
            another process or store object writes the same keys concurrently.
        settings: tunables; see :class:`~ckptstore.config.Settings`.
    """

    def __init__(
        self,
        fs: AbstractFileSystem,
        root: str,
        *,
        single_writer: bool = False,
        settings: Settings | None = None,
    ) -> None:
        super().__init__(settings=settings)
        self.fs = fs
        protocols = fs.protocol if isinstance(fs.protocol, tuple | list) else (fs.protocol,)
        self.protocol: str = str(protocols[0])
        self._atomic = any(p in ATOMIC_CREATE_PROTOCOLS for p in protocols)
        self.single_writer = single_writer
        self._root = root.rstrip("/")
        self._async = bool(getattr(fs, "async_impl", False)) and bool(
            getattr(fs, "asynchronous", False)
        )
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._create_lock = asyncio.Lock()
        self._made_dirs: set[str] = set()
        self._session_ready = False

    # ----------------------------------------------------------------- construction

    @classmethod
    def from_url(cls, url: str, **options: Any) -> FsspecStore:
        # docstring inherited
        settings, rest = split_settings(options)
        single_writer = parse_bool("single_writer", rest.pop("single_writer", False))
        storage_options = dict(rest.pop("storage_options", None) or {})
        storage_options.update(rest)
        if url.lower().startswith(_FORCE_PREFIX):
            url = url[len(_FORCE_PREFIX) :]
        protocol = url.split("://", 1)[0] if "://" in url else "file"
        try:
            fs_class = fsspec.get_filesystem_class(protocol)
        except ValueError as exc:
            raise InvalidURLError(f"fsspec knows no protocol {protocol!r} ({url!r})") from exc
        if getattr(fs_class, "async_impl", False):
            # One instance per store, bound to the loop it is first used on.
            storage_options.setdefault("asynchronous", True)
            storage_options.setdefault("skip_instance_cache", True)
        fs, root = fsspec.core.url_to_fs(url, **storage_options)
        return cls(fs, root, single_writer=single_writer, settings=settings)

    @property
    def url(self) -> str:
        # docstring inherited
        from ckptstore.store.registry import registered_schemes

        # "memory://" would reopen ckptstore's own memory store, not fsspec's
        forced = _FORCE_PREFIX if self.protocol in registered_schemes() else ""
        path = self._root if self.protocol in ("file", "local") else self._root.lstrip("/")
        return f"{forced}{self.protocol}://{path}"

    @property
    def capabilities(self) -> Capabilities:
        # docstring inherited
        # Each put is one pipe_file: fsspec offers no portable parallel multipart upload.
        return Capabilities(atomic_create=self._atomic or self.single_writer, multipart=False)

    def __repr__(self) -> str:
        return f"FsspecStore({self.url!r}, fs={type(self.fs).__name__})"

    async def close(self) -> None:
        # docstring inherited
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
        if self._async and self._session_ready:
            session = getattr(self.fs, "_session", None)
            if session is not None and hasattr(session, "close"):
                with contextlib.suppress(Exception):
                    await session.close()

    # ----------------------------------------------------------------- create guard

    def _refuse_create(self, operation: str) -> None:
        raise NotSupportedError(
            operation,
            f"fsspec {self.protocol}://",
            f"{self.protocol}:// has no atomic create, so two writers could both commit; pass "
            "single_writer=True if only one process ever writes this root",
        )

    async def put(self, key: str, data: Buffer, *, mode: PutMode = "overwrite") -> None:
        # docstring inherited
        if mode == "create" and not self.capabilities.atomic_create:
            self._refuse_create("put(mode='create')")
        await super().put(key, data, mode=mode)

    async def create_multipart(
        self, key: str, *, mode: PutMode = "overwrite", part_size: int | None = None
    ) -> MultipartUpload:
        # docstring inherited
        if mode == "create" and not self.capabilities.atomic_create:
            self._refuse_create("create_multipart(mode='create')")
        return await super().create_multipart(key, mode=mode, part_size=part_size)

    # ----------------------------------------------------------------- calling the fs

    def _path(self, key: str) -> str:
        return f"{self._root}/{key}" if self._root else key

    async def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """``fs.<name>(...)``: the coroutine ``_<name>`` of an async filesystem, else the
        blocking method in the thread pool."""
        if self._async:
            if not self._session_ready:
                setter = getattr(self.fs, "set_session", None)
                if setter is not None:
                    await setter()
                self._session_ready = True
            return await getattr(self.fs, "_" + name)(*args, **kwargs)
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self.settings.io_threads, thread_name_prefix=f"ckptstore-{self.protocol}"
            )
        call: Callable[[], Any] = functools.partial(getattr(self.fs, name), *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    async def _ensure_parent(self, path: str) -> None:
        parent = path.rpartition("/")[0]
        if not parent or parent in self._made_dirs:
            return
        # Object stores ignore this or have nothing to make; POSIX-like ones need it.
        with contextlib.suppress(NotImplementedError, FileExistsError, PermissionError):
            await self._call("makedirs", parent, exist_ok=True)
        self._made_dirs.add(parent)

    # ----------------------------------------------------------------- writes

    async def _put(self, key: str, data: memoryview, mode: PutMode) -> None:
        # docstring inherited
        path = self._path(key)
        await self._ensure_parent(path)
        if mode == "overwrite":
            await self._call_translated("pipe_file", key, path, data)
        elif self._atomic:
            await self._call_translated("pipe_file", key, path, data, mode="create")
        else:
            async with self._create_lock:  # single_writer: check-then-write, one at a time
                if await self._exists(path):
                    raise AlreadyExistsError(f"{self.url}/{key} already exists")
                await self._call_translated("pipe_file", key, path, data)

    async def _call_translated(self, name: str, key: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return await self._call(name, *args, **kwargs)
        except FileExistsError as exc:
            raise AlreadyExistsError(f"{self.url}/{key} already exists") from exc
        except (FileNotFoundError, IsADirectoryError) as exc:
            raise NotFoundError(f"{self.url}/{key} does not exist") from exc
        except (NotFoundError, AlreadyExistsError, InvalidRangeError):
            raise
        except OSError as exc:
            raise StoreError(f"{name} of {self.url}/{key} failed: {exc}") from exc

    async def _exists(self, path: str) -> bool:
        try:
            info = await self._call("info", path)
        except FileNotFoundError:
            return False
        return bool(info.get("type") != "directory")

    async def _create_multipart(self, key: str, part_size: int, mode: PutMode) -> MultipartUpload:
        # docstring inherited
        return _BufferedUpload(self, key, part_size, mode)

    # ----------------------------------------------------------------- reads

    async def _get(self, key: str) -> bytes:
        # docstring inherited
        data: bytes = await self._call_translated("cat_file", key, self._path(key))
        return data

    async def _read_into(self, key: str, start: int, out: memoryview) -> None:
        # docstring inherited
        end = start + len(out)
        try:
            data = await self._call_translated(
                "cat_file", key, self._path(key), start=start, end=end
            )
        except Exception as exc:
            # HTTP-backed drivers raise their own error for 416 Range Not Satisfiable
            if 416 not in (getattr(exc, "code", None), getattr(exc, "status", None)):
                raise
            raise InvalidRangeError(
                f"range [{start}, {end}) reaches past the end of {self.url}/{key}"
            ) from exc
        if len(data) != len(out):  # fsspec clips ranges at the end of the file
            raise InvalidRangeError(
                f"range [{start}, {end}) reaches past the end of {self.url}/{key}"
            )
        out[:] = data

    async def _head(self, key: str) -> ObjectMeta:
        # docstring inherited
        info = await self._call_translated("info", key, self._path(key))
        if info.get("type") == "directory":
            raise NotFoundError(f"{self.url}/{key} does not exist (it is a directory)")
        return self._meta(key, info)

    @staticmethod
    def _meta(key: str, info: dict[str, Any]) -> ObjectMeta:
        etag = next(
            (str(info[k]) for k in ("ETag", "etag", "generation", "version_id") if info.get(k)),
            None,
        )
        modified = next(
            (info[k] for k in ("mtime", "LastModified", "last_modified", "updated", "created")
             if info.get(k) is not None),
            None,
        )  # fmt: skip
        if isinstance(modified, datetime.datetime):
            modified = modified.timestamp()
        elif not isinstance(modified, int | float):
            modified = None
        return ObjectMeta(key, int(info.get("size") or 0), etag, modified)

    # ----------------------------------------------------------------- listing, deletes

    async def _list(self, prefix: str) -> AsyncIterator[ObjectMeta]:
        # docstring inherited
        directory = prefix.rpartition("/")[0]
        base = self._path(directory) if directory else self._root
        try:
            found: dict[str, dict[str, Any]] = await self._call(
                "find", base or "/", detail=True, withdirs=False
            )
        except FileNotFoundError:
            return
        root = self._root + "/" if self._root else ""
        metas = []
        for path, info in found.items():
            if root and not path.startswith(root):
                continue
            key = path[len(root) :] if root else path.lstrip("/")
            if not key.startswith(prefix) or info.get("type") == "directory":
                continue
            if any(segment.startswith(TEMP_PREFIX) for segment in key.split("/")):
                continue
            metas.append(self._meta(key, info))
        for meta in sorted(metas, key=lambda m: m.key):
            yield meta

    async def _delete(self, keys: builtins.list[str]) -> None:
        # docstring inherited
        async def remove(key: str) -> None:
            with contextlib.suppress(FileNotFoundError, NotFoundError):
                await self._call_translated("rm_file", key, self._path(key))

        await asyncio.gather(*(remove(key) for key in keys))


class _BufferedUpload(MultipartUpload):
    """Parts held in memory and written as one object on complete: fsspec has no portable
    multipart upload. Costs a copy of the object in memory until ``complete``."""

    def __init__(self, store: FsspecStore, key: str, part_size: int, mode: PutMode) -> None:
        super().__init__(key, part_size, mode)
        self._store = store
        self._parts: dict[int, bytes] = {}

    async def _put_part(self, index: int, data: memoryview) -> None:
        self._parts[index] = bytes(data)  # the caller may reuse its buffer

    async def _complete(self, part_count: int, size: int) -> ObjectMeta:
        data = b"".join(self._parts[i] for i in range(part_count))
        self._parts.clear()
        await self._store._put(self.key, memoryview(data), self.mode)
        return ObjectMeta(self.key, size)

    async def _abort(self) -> None:
        self._parts.clear()
