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

Whatever the driver raises is translated in one table (:data:`_ERROR_TABLE`, keyed by
exception class and HTTP status), so no client library's exception (a botocore error under
``fsspec+s3://``, an aiohttp one under ``http://``) reaches the caller raw. Failures of the
connection itself are retried under the transport policy every network backend follows
(:mod:`ckptstore.store.transport`), on top of whatever retries the driver makes; the driver's
own retry options, where it has them, stay storage options.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import datetime
import functools
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import fsspec
import fsspec.core
from fsspec.spec import AbstractFileSystem

from ckptstore import errors
from ckptstore.config import Settings
from ckptstore.store import base, transport
from ckptstore.store.options import parse_bool, split_settings
from ckptstore.threads import Pool

if TYPE_CHECKING:
    from ckptstore.store.base import Buffer

__all__ = ["ATOMIC_CREATE_PROTOCOLS", "FsspecStore"]

_T = TypeVar("_T")

#: Protocols whose fsspec driver makes ``pipe_file(mode="create")`` one conditional request
#: (s3fs: ``If-None-Match: *``; gcsfs: ``ifGenerationMatch=0``).
ATOMIC_CREATE_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs"})
#: Protocols whose driver refuses a ``memoryview`` body (botocore validates s3fs's
#: parameters: bytes, bytearray or a file object); they get a copy as ``bytes``.
_BYTES_ONLY_PROTOCOLS = frozenset({"s3", "s3a"})
_FORCE_PREFIX = "fsspec+"
_log = transport.store_logger("ckptstore.fsspec")

#: Exception class name (nearest in the MRO) or HTTP status -> (exception, what to tell),
#: over the statuses every HTTP store shares.
_ERROR_TABLE = transport.ErrorTable(
    {
        "FileNotFoundError": (errors.NotFoundError, "does not exist"),
        "NotADirectoryError": (errors.NotFoundError, "does not exist"),
        "IsADirectoryError": (errors.NotFoundError, "does not exist (it is a directory)"),
        "FileExistsError": (errors.AlreadyExistsError, "already exists"),
        "PermissionError": (
            errors.StoreError,
            "permission denied; check the credentials given as storage options or in the "
            "environment",
        ),
        "NoCredentialsError": (
            errors.StoreError,
            "no credentials found; pass them as storage options or through the environment",
        ),
    },
    extends=transport.HTTP_ERRORS,
)


#: The driver's method names as the operations messages name.
_OPERATIONS = {"pipe_file": "put", "cat_file": "read", "info": "head", "rm_file": "delete"}


def _status(exc: BaseException) -> int | None:
    """The HTTP status an HTTP-backed driver's error carries, if any."""
    for name in ("status", "code", "status_code"):
        value = getattr(exc, name, None)
        if isinstance(value, int) and 100 <= value < 600:
            return value
    return None


def _transient(exc: BaseException) -> bool:
    """Failures of the connection itself (the driver's own errors are final)."""
    if isinstance(exc, errors.CkptStoreError | FileNotFoundError | FileExistsError):
        return False
    status = _status(exc)
    if status is not None:
        return status in (408, 429) or status >= 500
    return transport.wire_failure(exc) is not None


def _check_endpoints(options: dict[str, Any]) -> None:
    """Validate ``endpoint_url`` where s3fs and gcsfs take it, at open time."""
    for holder in (options, options.get("client_kwargs")):
        if isinstance(holder, dict) and holder.get("endpoint_url") is not None:
            holder["endpoint_url"] = transport.check_endpoint_url(holder["endpoint_url"])


class FsspecStore(base.Store):
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
        self._bytes_only = any(p in _BYTES_ONLY_PROTOCOLS for p in protocols)
        self.single_writer = single_writer
        self._root = root.rstrip("/")
        self._async = bool(getattr(fs, "async_impl", False)) and bool(
            getattr(fs, "asynchronous", False)
        )
        self._pool: Pool | None = None
        self._create_lock = asyncio.Lock()
        self._made_dirs: set[str] = set()
        self._session_ready = False
        options = getattr(fs, "storage_options", None) or {}
        endpoint = options.get("endpoint_url") or (options.get("client_kwargs") or {}).get(
            "endpoint_url"
        )
        self._transport = transport.Transport(
            lambda: self.settings, str(endpoint or f"{self.protocol}://"), _log
        )

    # ----------------------------------------------------------------- construction

    @classmethod
    def from_url(cls, url: str, **options: Any) -> FsspecStore:
        # docstring inherited
        settings, rest = split_settings(options)
        single_writer = parse_bool("single_writer", rest.pop("single_writer", False))
        storage_options = dict(rest.pop("storage_options", None) or {})
        storage_options.update(rest)
        _check_endpoints(storage_options)
        if url.lower().startswith(_FORCE_PREFIX):
            url = url[len(_FORCE_PREFIX) :]
        protocol = url.split("://", 1)[0] if "://" in url else "file"
        try:
            fs_class = fsspec.get_filesystem_class(protocol)
        except ValueError:
            raise errors.InvalidURLError(
                f"fsspec knows no protocol {protocol!r} ({transport.redact_url(url)!r})"
            ) from None
        if getattr(fs_class, "async_impl", False):
            # One instance per store, bound to the loop it is first used on.
            storage_options.setdefault("asynchronous", True)
            storage_options.setdefault("skip_instance_cache", True)
        try:
            fs, root = fsspec.core.url_to_fs(url, **storage_options)
        except (TypeError, ValueError) as exc:  # the driver refused an option
            raise type(exc)(
                f"fsspec {protocol}:// refused the options: {transport.redact(str(exc))}"
            ) from None
        return cls(fs, root, single_writer=single_writer, settings=settings)

    @property
    def url(self) -> str:
        # docstring inherited
        from ckptstore.store.registry import registered_schemes

        # "memory://" would reopen ckptstore's own memory store, not fsspec's
        forced = _FORCE_PREFIX if self.protocol in registered_schemes() else ""
        path = self._root if self.protocol in ("file", "local") else self._root.lstrip("/")
        if "://" in path:  # the HTTP driver keeps the whole URL as its path
            return transport.redact_url(f"{forced}{path}")
        return transport.redact_url(f"{forced}{self.protocol}://{path}")

    @property
    def capabilities(self) -> base.Capabilities:
        # docstring inherited
        # Each put is one pipe_file: fsspec offers no portable parallel multipart upload.
        return base.Capabilities(atomic_create=self._atomic or self.single_writer, multipart=False)

    def __repr__(self) -> str:
        return f"FsspecStore({transport.redact_url(self.url)!r}, fs={type(self.fs).__name__})"

    async def settle(self) -> None:
        # docstring inherited
        await self._transport.settle()

    async def close(self) -> None:
        # docstring inherited
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
        if not self._async:
            return
        # Whatever the driver opened, on every path: a session set up by a call that then
        # failed is as open as one that served a thousand. s3fs keeps an aiobotocore client
        # context, gcsfs and the HTTP driver an aiohttp session.
        self._session_ready = False
        creator = getattr(self.fs, "_s3creator", None)
        if creator is not None:
            self.fs._s3creator = None
            self.fs._s3 = None
            with contextlib.suppress(Exception):
                await creator.__aexit__(None, None, None)
        session = getattr(self.fs, "_session", None)
        if session is not None and hasattr(session, "close"):
            with contextlib.suppress(Exception):
                await session.close()

    # ----------------------------------------------------------------- create guard

    def _refuse_create(self, operation: str) -> None:
        raise errors.NotSupportedError(
            operation,
            f"fsspec {self.protocol}://",
            f"{self.protocol}:// has no atomic create, so two writers could both commit; pass "
            "single_writer=True if only one process ever writes this root",
        )

    async def put(
        self,
        key: str,
        data: Buffer,
        *,
        mode: base.PutMode = "overwrite",
        crc32c: int | None = None,
    ) -> None:
        # docstring inherited
        if mode == "create" and not self.capabilities.atomic_create:
            self._refuse_create("put(mode='create')")
        await super().put(key, data, mode=mode, crc32c=crc32c)

    async def create_multipart(
        self, key: str, *, mode: base.PutMode = "overwrite", part_size: int | None = None
    ) -> base.MultipartUpload:
        # docstring inherited
        if mode == "create" and not self.capabilities.atomic_create:
            self._refuse_create("create_multipart(mode='create')")
        return await super().create_multipart(key, mode=mode, part_size=part_size)

    # ----------------------------------------------------------------- calling the fs

    def _path(self, key: str) -> str:
        return f"{self._root}/{key}" if self._root else key

    async def _call(
        self, name: str, key: str, *args: Any, body_bytes: int = 0, **kwargs: Any
    ) -> Any:
        """:meth:`_invoke` under the transport policy's retries, its failures translated
        into ckptstore's errors (``key`` names the object in messages). ``body_bytes``: the
        bytes the call moves in one request, which scale its deadline."""
        try:
            return await self._transport.run(
                lambda: self._invoke(name, *args, **kwargs),
                transient=_transient,
                what=f"{name} {self.url}/{key}",
                body_bytes=body_bytes,
            )
        except Exception as exc:
            raise self._translate(exc, name, key) from None

    def _translate(self, exc: Exception, op: str, key: str) -> Exception:
        """The ckptstore error for what the driver raised (:data:`_ERROR_TABLE`)."""
        if isinstance(exc, errors.CkptStoreError):
            return exc
        where = f"{self.url}/{key}" if key else self.url
        op = _OPERATIONS.get(op, op)
        entry = _ERROR_TABLE.lookup(_status(exc)) or _ERROR_TABLE.lookup_exception(exc)
        if entry is not None:
            return entry.error(f"{op} {where}: {entry.hint}")
        tries = transport.attempts_made(exc)
        failure = transport.wire_failure(exc)
        if failure is not None:
            return errors.StoreError(
                f"{op} {where} failed after {tries} attempt(s): {failure.phrase} "
                f"({self._transport.endpoint})"
            )
        return errors.StoreError(
            f"{op} {where} failed after {tries} attempt(s): {type(exc).__name__}: "
            f"{transport.redact(str(exc))}"
        )

    async def _invoke(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """``fs.<name>(...)``: the coroutine ``_<name>`` of an async filesystem, else the
        blocking method in the thread pool."""
        if self._async:
            if not self._session_ready:
                transport.guard_client_loggers()
                setter = getattr(self.fs, "set_session", None)
                if setter is not None:
                    await setter()
                self._session_ready = True
            return await getattr(self.fs, "_" + name)(*args, **kwargs)
        if self._pool is None:
            self._pool = Pool(self.settings.transport.io_threads, f"ckptstore-{self.protocol}")
        call: Callable[[], Any] = functools.partial(getattr(self.fs, name), *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    async def _ensure_parent(self, path: str) -> None:
        parent = path.rpartition("/")[0]
        if not parent or parent in self._made_dirs:
            return
        # Object stores ignore this or have nothing to make; POSIX-like ones need it.
        try:
            await self._invoke("makedirs", parent, exist_ok=True)
        except (NotImplementedError, FileExistsError, PermissionError):
            pass
        except Exception as exc:
            raise self._translate(exc, "makedirs", parent) from None
        self._made_dirs.add(parent)

    # ----------------------------------------------------------------- writes

    async def _put(self, key: str, data: memoryview, mode: base.PutMode) -> None:
        # docstring inherited
        path = self._path(key)
        await self._ensure_parent(path)
        body: memoryview | bytes = bytes(data) if self._bytes_only else data
        size = len(data)  # one pipe_file moves the whole body: its deadline scales with it
        if mode == "overwrite":
            await self._call("pipe_file", key, path, body, body_bytes=size)
        elif self._atomic:
            await self._call("pipe_file", key, path, body, body_bytes=size, mode="create")
        else:
            async with self._create_lock:  # single_writer: check-then-write, one at a time
                if await self._exists(key, path):
                    raise errors.AlreadyExistsError(f"{self.url}/{key} already exists")
                await self._call("pipe_file", key, path, body, body_bytes=size)

    async def _exists(self, key: str, path: str) -> bool:
        try:
            info = await self._call("info", key, path)
        except errors.NotFoundError:
            return False
        return bool(info.get("type") != "directory")

    async def _create_multipart(
        self, key: str, part_size: int, mode: base.PutMode
    ) -> base.MultipartUpload:
        # docstring inherited
        return _BufferedUpload(self, key, part_size, mode)

    # ----------------------------------------------------------------- reads

    async def _get(self, key: str) -> bytes:
        # docstring inherited
        data: bytes = await self._call("cat_file", key, self._path(key))
        return data

    async def _read_into(self, key: str, start: int, out: memoryview) -> None:
        # docstring inherited
        end = start + len(out)
        try:
            data = await self._call(
                "cat_file", key, self._path(key), start=start, end=end, body_bytes=len(out)
            )
        except errors.InvalidRangeError:  # HTTP-backed drivers: 416 Range Not Satisfiable
            raise errors.InvalidRangeError(
                f"range [{start}, {end}) reaches past the end of {self.url}/{key}"
            ) from None
        if len(data) != len(out):  # fsspec clips ranges at the end of the file
            raise errors.InvalidRangeError(
                f"range [{start}, {end}) reaches past the end of {self.url}/{key}"
            )
        out[:] = data

    async def _head(self, key: str) -> base.ObjectMeta:
        # docstring inherited
        info = await self._call("info", key, self._path(key))
        if info.get("type") == "directory":
            raise errors.NotFoundError(f"{self.url}/{key} does not exist (it is a directory)")
        return self._meta(key, info)

    @staticmethod
    def _meta(key: str, info: dict[str, Any]) -> base.ObjectMeta:
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
        return base.ObjectMeta(key, int(info.get("size") or 0), etag, modified)

    # ----------------------------------------------------------------- listing, deletes

    async def _list(self, prefix: str) -> AsyncIterator[base.ObjectMeta]:
        # docstring inherited
        directory = prefix.rpartition("/")[0]
        top = self._path(directory) if directory else self._root
        try:
            found: dict[str, dict[str, Any]] = await self._call(
                "find", prefix, top or "/", detail=True, withdirs=False
            )
        except errors.NotFoundError:
            return
        root = self._root + "/" if self._root else ""
        metas = []
        for path, info in found.items():
            if root and not path.startswith(root):
                continue
            key = path[len(root) :] if root else path.lstrip("/")
            if not key.startswith(prefix) or info.get("type") == "directory":
                continue
            if any(segment.startswith(base.TEMP_PREFIX) for segment in key.split("/")):
                continue
            metas.append(self._meta(key, info))
        for meta in sorted(metas, key=lambda m: m.key):
            yield meta

    async def _delete(self, keys: builtins.list[str]) -> None:
        # docstring inherited
        async def remove(key: str) -> None:
            with contextlib.suppress(errors.NotFoundError):
                await self._call("rm_file", key, self._path(key))

        await asyncio.gather(*(remove(key) for key in keys))


class _BufferedUpload(base.MultipartUpload):
    """Parts held in memory and written as one object on complete: fsspec has no portable
    multipart upload. Costs a copy of the object in memory until ``complete``."""

    def __init__(self, store: FsspecStore, key: str, part_size: int, mode: base.PutMode) -> None:
        super().__init__(key, part_size, mode)
        self._store = store
        self._parts: dict[int, bytes] = {}

    async def _put_part(self, index: int, data: memoryview) -> None:
        self._parts[index] = bytes(data)  # the caller may reuse its buffer

    async def _complete(self, part_count: int, size: int) -> base.ObjectMeta:
        data = b"".join(self._parts[i] for i in range(part_count))
        self._parts.clear()
        await self._store._put(self.key, memoryview(data), self.mode)
        return base.ObjectMeta(self.key, size)

    async def _abort(self) -> None:
        self._parts.clear()
