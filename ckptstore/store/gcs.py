"""``gs://bucket/prefix`` (also ``gcs://``): Google Cloud Storage through gcsfs's async session.

gcsfs supplies what is tedious to get right: resolving credentials (``token=`` in every form
gcsfs accepts, or the usual Google environment), the endpoint (``endpoint_url=``, or
``STORAGE_EMULATOR_HOST``, or Google's), requester-pays parameters and its aiohttp session.
The requests themselves are issued here against the JSON API, for four reasons gcsfs's
``_call`` cannot serve:

* retries: gcsfs retries with a fixed 1-32 s backoff that no caller can tune; here they follow
  the store's transport policy (:mod:`ckptstore.store.transport`, the same as every network
  backend's: ``Settings.retry_attempts``, ``retry_delay``, ``retry_max_delay``, and no retries
  for a first contact that finds no server), and a body that arrives short or fails its
  crc32c is retried like a 503;
* reads stream straight into the caller's buffer instead of being joined into a new ``bytes``;
* uploads send the caller's ``memoryview`` without copying it into a multipart body;
* every upload carries its crc32c, and the crc32c the server reports for the stored object is
  compared with it, so a corrupted upload is caught by us even where a server (the emulator)
  does not check the value it was sent; whole-object reads are checked against
  ``X-Goog-Hash``.

Large objects: GCS has no S3-style multipart upload. A resumable upload takes its chunks in
order, one at a time, so it cannot use more than one connection. Instead each part is uploaded
in parallel as a temporary object (``.ckptstore-tmp.<name>.<upload id>.<part>`` beside the key,
never listed), the parts are joined server-side with ``compose`` (at most 32 sources per call,
so more parts are composed in levels), and the temporaries are deleted. The final compose
carries ``ifGenerationMatch=0`` for ``mode="create"``, so the create stays one atomic
put-if-absent. ``scripts/benchlib/gcs.py`` measures this against gcsfs's resumable ``pipe``.

Credentials are never logged or put into error messages: errors name the ``gs://`` URL and
the HTTP status only, and are translated in one table (:data:`_ERROR_TABLE`).
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import contextlib
import datetime
import json
import re
import uuid
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import quote

import aiohttp
import gcsfs.core
import yarl

from ckptstore import errors
from ckptstore.config import Settings
from ckptstore.store import base, transport
from ckptstore.store.checksum import b64_crc32c, crc32c, crc32c_b64, request_crc32c
from ckptstore.store.options import parse_bool, split_settings

__all__ = ["GCSStore"]

_T = TypeVar("_T")
_log = transport.store_logger("ckptstore.gcs")

#: Statuses GCS documents as transient: retry them with backoff.
_RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
#: Sources one ``compose`` call accepts.
_COMPOSE_FANIN = 32
#: Components a composite object may have in total.
_MAX_COMPONENTS = 1024
#: Sub-requests one JSON API batch request may carry.
_BATCH_LIMIT = 100
_GCS_MAX_OBJECT = 5 << 40
_BOUNDARY = "==ckptstore-part=="


_CREDENTIALS_HINT = "check the credentials given as token= or in GOOGLE_APPLICATION_CREDENTIALS"
#: HTTP status -> (exception class, what to tell the user), over the shared statuses.
_ERROR_TABLE = transport.ErrorTable(
    {
        "401": (errors.StoreError, f"not authenticated (HTTP 401); {_CREDENTIALS_HINT}"),
        "403": (errors.StoreError, f"permission denied (HTTP 403); {_CREDENTIALS_HINT}"),
    },
    extends=transport.HTTP_ERRORS,
)


class _Transient(Exception):
    """A failure worth retrying: a retryable status, a dropped connection, a broken body."""


def _transient(exc: BaseException) -> bool:
    return isinstance(
        exc, _Transient | aiohttp.ClientConnectionError | aiohttp.ClientPayloadError | TimeoutError
    )


def _retries(value: object) -> int:
    """``retries`` (the old option: retries after the first attempt) as ``retry_attempts``."""
    count = int(str(value))
    if count < 0:
        raise ValueError(f"retries must be >= 0, got {count}")
    return count + 1


def _b64(crc: int) -> str:
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


def _hash_header(response: aiohttp.ClientResponse, name: str) -> str | None:
    """One hash out of ``X-Goog-Hash: crc32c=...,md5=...``."""
    for value in response.headers.getall("X-Goog-Hash", []):
        for item in value.split(","):
            algo, _, digest = item.strip().partition("=")
            if algo == name:
                return digest
    return None


def _parse_time(text: str | None) -> float | None:
    if not text:
        return None
    with contextlib.suppress(ValueError):
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    return None


def _is_temp(name: str) -> bool:
    return any(segment.startswith(base.TEMP_PREFIX) for segment in name.split("/"))


class GCSStore(base.Store):
    """Objects under ``gs://bucket/prefix``.

    Args:
        bucket: the bucket name.
        prefix: key prefix inside the bucket (``""`` for the bucket root).
        token: credentials, as gcsfs takes them: ``None`` (the usual Google environment:
            ``GOOGLE_APPLICATION_CREDENTIALS``, gcloud's defaults, the GCE metadata server),
            ``"anon"``, ``"google_default"``, ``"cloud"``, a service-account JSON file name,
            a dict, or a ``google.auth`` credentials object.
        project: the Google Cloud project (billing for requester-pays buckets).
        endpoint_url: ``http(s)://host:port`` of an emulator or private endpoint.
        requester_pays: bill requests to ``project`` on requester-pays buckets.
        request_timeout: seconds one try of a request may take in total (``None``: no limit
            but ``Settings.request_deadline``, which bounds all tries together).
        connect_timeout: seconds to connect.
        read_timeout: seconds to wait for the first byte of an answer, and for each next
            chunk of it.
        session_kwargs: passed to ``aiohttp.ClientSession`` (proxies, connector).
        settings: tunables, the retry policy among them (``retry_attempts``, ``retry_delay``,
            ``retry_max_delay``); see :class:`~ckptstore.config.Settings`. ``from_url`` still
            takes the old option ``retries`` (retries after the first attempt) for
            ``retry_attempts``.
    """

    schemes = ("gs", "gcs")
    url_query_options = True
    hashes_while_reading = True

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        token: Any = None,
        project: str | None = None,
        endpoint_url: str | None = None,
        requester_pays: bool | str = False,
        request_timeout: float | None = None,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        session_kwargs: dict[str, Any] | None = None,
        scheme: str = "gs",
        settings: Settings | None = None,
    ) -> None:
        super().__init__(settings=settings)
        if not bucket or "/" in bucket:
            raise errors.InvalidURLError(f"invalid GCS bucket name {bucket!r}")
        self.bucket = bucket
        self._prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self._scheme = scheme
        for name, value in (("connect_timeout", connect_timeout), ("read_timeout", read_timeout)):
            if not value > 0:
                raise ValueError(f"gcs store: {name} must be > 0 seconds, got {value!r}")
        # Without sock_connect/sock_read, aiohttp waits forever for a server that accepted
        # and says nothing: a try gives up as the S3 backend's does (connect, then each read).
        self._timeout = aiohttp.ClientTimeout(
            total=request_timeout, sock_connect=connect_timeout, sock_read=read_timeout
        )
        # whether every upload's answer carried the stored object's crc32c to compare
        self._crc_reported = True
        if endpoint_url is not None:
            endpoint_url = transport.check_endpoint_url(endpoint_url)
        fs_options: dict[str, Any] = {
            "token": token,
            "endpoint_url": endpoint_url,
            "requester_pays": requester_pays,
            "session_kwargs": session_kwargs,
            "asynchronous": True,
            "skip_instance_cache": True,
        }
        if project is not None:
            fs_options["project"] = project
        # The core class, not gcsfs's exported one: the experimental zonal-bucket subclass
        # probes every bucket over gRPC, and nothing here goes through its upload paths.
        try:
            self._fs = gcsfs.core.GCSFileSystem(**fs_options)
        except Exception as exc:  # gcsfs checks a token string with Google, and echoes it
            raise errors.StoreError(
                f"{self.url}: gcsfs could not use the credentials given as token= "
                f"({type(exc).__name__}: {transport.redact(str(exc))}); give a service-account "
                "file, 'anon', 'google_default' or leave token unset"
            ) from None
        self._session: aiohttp.ClientSession | None = None
        self._transport = transport.Transport(lambda: self.settings, self._fs._location, _log)

    # ----------------------------------------------------------------- construction

    @classmethod
    def from_url(cls, url: str, **options: Any) -> GCSStore:
        # docstring inherited
        settings, rest = split_settings(options, {"retries": ("retry_attempts", _retries)})
        scheme, sep, path = url.partition("://")
        shown = transport.redact_url(url)
        if not sep or scheme.lower() not in cls.schemes:
            raise errors.InvalidURLError(f"not a gs:// URL: {shown!r}")
        bucket, _, prefix = path.partition("/")
        if not bucket:
            raise errors.InvalidURLError(f"{shown!r} names no bucket; use gs://bucket/prefix")
        known = {
            "token",
            "project",
            "endpoint_url",
            "requester_pays",
            "request_timeout",
            "connect_timeout",
            "read_timeout",
            "session_kwargs",
        }
        unknown = set(rest) - known
        if unknown:
            raise TypeError(f"gcs store: unknown options {sorted(unknown)}; known: {sorted(known)}")
        for name in ("request_timeout", "connect_timeout", "read_timeout"):
            if isinstance(rest.get(name), str):
                rest[name] = float(rest[name])
        if isinstance(rest.get("requester_pays"), str) and rest["requester_pays"].lower() in {
            "1",
            "0",
            "true",
            "false",
            "yes",
            "no",
        }:
            rest["requester_pays"] = parse_bool("requester_pays", rest["requester_pays"])
        return cls(bucket, prefix, scheme=scheme.lower(), settings=settings, **rest)

    @property
    def url(self) -> str:
        # docstring inherited
        return f"{self._scheme}://{self.bucket}/{self._prefix}".rstrip("/")

    @property
    def capabilities(self) -> base.Capabilities:
        # docstring inherited
        return base.Capabilities(
            atomic_create=True,
            multipart=True,
            min_part_size=1,
            max_part_size=_GCS_MAX_OBJECT,
            max_parts=_MAX_COMPONENTS,
        )

    async def writes_verified(self) -> bool:
        # docstring inherited: every upload's object is checked against the crc32c sent
        # (_upload), and compose joins objects so checked on the server, with no transfer;
        # a server whose answers left the crc32c out (GCS always gives it) is not trusted
        return self._crc_reported

    @property
    def sends_checksums(self) -> bool:
        # docstring inherited: every upload names its crc32c in its metadata
        return True

    async def settle(self) -> None:
        # docstring inherited
        await self._transport.settle()

    async def close(self) -> None:
        # docstring inherited
        if self._session is not None:
            await self._session.close()
            self._session = None
            self._fs._session = None

    # ----------------------------------------------------------------- request path

    def _name(self, key: str) -> str:
        return self._prefix + key

    def _object_url(self, name: str) -> str:
        return f"{self._fs._location}/storage/v1/b/{quote(self.bucket, safe='')}/o/" + quote(
            name, safe=""
        )

    def _media_url(self, name: str) -> str:
        return (
            f"{self._fs._location}/download/storage/v1/b/{quote(self.bucket, safe='')}/o/"
            + quote(name, safe="")
        )

    async def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            transport.guard_client_loggers()
            self._session = await self._fs._set_session()
        return self._session

    async def _request(
        self,
        method: str,
        url: str,
        handle: Callable[[aiohttp.ClientResponse], Awaitable[_T]],
        *,
        what: str,
        params: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
        body: Callable[[], Any] | None = None,
        hedge_bytes: int | None = None,
        body_bytes: int = 0,
    ) -> _T:
        """Send one request, retrying transient failures; ``handle`` reads a 2xx response.

        ``handle`` may raise :class:`_Transient` (a short or corrupt body) to retry. Error
        statuses are translated by :meth:`_raise_for`. A ranged read passes ``hedge_bytes``
        (:class:`~ckptstore.store.transport.Hedger`); an upload passes ``body_bytes``, the
        size of its body, which scales its deadline
        (:meth:`~ckptstore.store.transport.Transport.run`).
        """

        async def attempt() -> _T:
            session = await self._client()
            async with session.request(
                method,
                yarl.URL(url, encoded=True),
                params=self._fs._get_params(params or {}),
                headers=self._fs._get_headers(headers),
                data=body() if body is not None else None,
                timeout=self._timeout,
            ) as response:
                if response.status >= 300:
                    await self._fail(response, what)
                return await handle(response)

        try:
            return await self._transport.run(
                attempt,
                transient=_transient,
                what=what,
                hedge_bytes=hedge_bytes,
                body_bytes=body_bytes,
            )
        except errors.DeadlineExceededError:
            raise  # said already, with the deadline
        except (_Transient, aiohttp.ClientError, TimeoutError) as exc:
            raise self._gave_up(exc, what) from None

    def _gave_up(self, exc: BaseException, what: str) -> errors.StoreError:
        """The error for a request that failed on every attempt."""
        tries = transport.attempts_made(exc)
        failure = transport.wire_failure(exc)
        if failure is not None and not isinstance(exc, _Transient):
            return errors.StoreError(
                f"{what} failed after {tries} attempt(s): {failure.phrase} "
                f"({self._transport.endpoint})"
            )
        return errors.StoreError(
            f"{what} failed after {tries} attempt(s): {transport.redact(str(exc))}"
        )

    async def _fail(self, response: aiohttp.ClientResponse, what: str) -> None:
        """Raise for an error response: :class:`_Transient` if worth retrying."""
        text = await response.text(errors="replace")
        if response.status in _RETRYABLE_STATUS:
            raise _Transient(f"HTTP {response.status}: {_error_message(text)}")
        self._raise_for(response.status, text, what)

    def _raise_for(self, status: int, text: str, what: str) -> None:
        message = transport.redact(_error_message(text))
        entry = _ERROR_TABLE.lookup(status)
        if entry is None:
            raise errors.StoreError(f"{what}: HTTP {status}: {message}")
        if status == 404:
            raise entry.error(f"{what}: {entry.hint} ({message or 'HTTP 404'})")
        raise entry.error(f"{what}: {entry.hint}")

    # ----------------------------------------------------------------- writes

    async def _upload(
        self, name: str, data: memoryview, *, create: bool, what: str
    ) -> dict[str, Any]:
        """One multipart upload (metadata + bytes in one request); returns the object JSON
        after checking the stored size and crc32c against what was sent."""
        crc = b64_crc32c(await request_crc32c(data))
        params = {"uploadType": "multipart"}
        if create:
            # If a first attempt commits but its response is lost, the retry gets 412 and
            # this raises errors.AlreadyExistsError; the commit layer tells that case apart by the
            # attempt id inside the object, which a store cannot know.
            params["ifGenerationMatch"] = "0"

        def body() -> aiohttp.MultipartWriter:
            writer = aiohttp.MultipartWriter("related", boundary=_BOUNDARY)
            writer.append_json({"name": name, "crc32c": crc})
            writer.append_payload(_bytes_payload(data))
            return writer

        async def handle(response: aiohttp.ClientResponse) -> dict[str, Any]:
            meta: dict[str, Any] = await response.json(content_type=None)
            if "crc32c" not in meta:  # nothing to compare: writes_verified() says so
                self._crc_reported = False
            if int(meta.get("size", -1)) != len(data) or meta.get("crc32c", crc) != crc:
                raise _Transient(
                    f"stored object has size {meta.get('size')} crc32c {meta.get('crc32c')}, "
                    f"sent {len(data)} bytes crc32c {crc}"
                )
            return meta

        url = f"{self._fs._location}/upload/storage/v1/b/{quote(self.bucket, safe='')}/o"
        return await self._request(
            "POST", url, handle, what=what, params=params, body=body, body_bytes=len(data)
        )

    async def _put(self, key: str, data: memoryview, mode: base.PutMode) -> None:
        # docstring inherited
        await self._upload(
            self._name(key), data, create=mode == "create", what=f"put {self.url}/{key}"
        )

    async def _create_multipart(
        self, key: str, part_size: int, mode: base.PutMode
    ) -> base.MultipartUpload:
        # docstring inherited
        return _ComposeUpload(self, key, part_size, mode)

    async def _compose(
        self, sources: list[str], destination: str, *, create: bool, what: str
    ) -> dict[str, Any]:
        params = {"ifGenerationMatch": "0"} if create else {}
        payload = {
            "kind": "storage#composeRequest",
            "sourceObjects": [{"name": source} for source in sources],
            "destination": {"name": destination, "contentType": "application/octet-stream"},
        }

        async def handle(response: aiohttp.ClientResponse) -> dict[str, Any]:
            meta: dict[str, Any] = await response.json(content_type=None)
            return meta

        return await self._request(
            "POST",
            self._object_url(destination) + "/compose",
            handle,
            what=what,
            params=params,
            headers={"Content-Type": "application/json"},
            body=lambda: json.dumps(payload),
        )

    # ----------------------------------------------------------------- reads

    async def _get(self, key: str) -> bytes:
        # docstring inherited
        what = f"get {self.url}/{key}"

        async def handle(response: aiohttp.ClientResponse) -> bytes:
            data = await response.read()
            expected = response.headers.get("Content-Length")
            if expected is not None and int(expected) != len(data):
                raise _Transient(f"body of {len(data)} bytes, Content-Length {expected}")
            crc = _hash_header(response, "crc32c")
            if crc is not None and _is_identity(response) and crc32c_b64(data) != crc:
                raise _Transient("body does not match the object's crc32c")
            return data

        try:
            return await self._request(
                "GET", self._media_url(self._name(key)), handle, what=what, params={"alt": "media"}
            )
        except errors.StoreError as exc:
            if "crc32c" in str(exc):
                raise errors.CorruptCheckpointError(str(exc)) from exc
            raise

    async def _read_into(self, key: str, start: int, out: memoryview) -> None:
        # docstring inherited
        await self._read_range(key, start, out, checksum=False)

    async def _read_into_crc32c(self, key: str, start: int, out: memoryview) -> int:
        # docstring inherited
        return await self._read_range(key, start, out, checksum=True)

    async def _read_range(self, key: str, start: int, out: memoryview, *, checksum: bool) -> int:
        """GET ``[start, start + len(out))`` into ``out``; returns the bytes' crc32c, computed
        as each chunk lands when ``checksum`` is set or the range is the whole object (whose
        crc32c the response's X-Goog-Hash carries), else 0."""
        size = len(out)
        end = start + size
        what = f"read [{start}, {end}) of {self.url}/{key}"

        async def handle(response: aiohttp.ClientResponse) -> int:
            if response.status == 200:  # a server that ignored Range sends the whole object
                skip, total = start, response.content_length
            else:
                skip, total = 0, _content_range_total(response)
            whole = start == 0 and total == size  # only then does X-Goog-Hash cover the bytes
            hashing = whole or checksum
            pos = 0
            crc = 0
            async for chunk in response.content.iter_any():
                view = memoryview(chunk)
                if skip:
                    dropped = min(skip, len(view))
                    view, skip = view[dropped:], skip - dropped
                take = min(len(view), size - pos)
                out[pos : pos + take] = view[:take]
                if hashing:
                    crc = crc32c(view[:take], crc)
                pos += take
            if pos < size:
                if total is not None and total < end:
                    raise errors.InvalidRangeError(
                        f"{what}: the range reaches past the end of the object"
                    )
                raise _Transient(f"body ended after {pos} of {size} bytes")
            expected = _hash_header(response, "crc32c")
            if whole and expected is not None and _is_identity(response) and _b64(crc) != expected:
                raise _Transient("body does not match the object's crc32c")
            return crc

        return await self._request(
            "GET",
            self._media_url(self._name(key)),
            handle,
            what=what,
            params={"alt": "media"},
            headers={"Range": f"bytes={start}-{end - 1}"},
            hedge_bytes=size,
        )

    async def _head(self, key: str) -> base.ObjectMeta:
        # docstring inherited
        async def handle(response: aiohttp.ClientResponse) -> dict[str, Any]:
            meta: dict[str, Any] = await response.json(content_type=None)
            return meta

        meta = await self._request(
            "GET", self._object_url(self._name(key)), handle, what=f"head {self.url}/{key}"
        )
        return base.ObjectMeta(
            key, int(meta["size"]), str(meta.get("generation")), _parse_time(meta.get("updated"))
        )

    # ----------------------------------------------------------------- listing, deletes

    async def _list_pages(
        self, prefix: str, *, delimiter: str | None
    ) -> AsyncIterator[dict[str, Any]]:
        url = f"{self._fs._location}/storage/v1/b/{quote(self.bucket, safe='')}/o"
        params = {
            "prefix": self._prefix + prefix,
            "fields": "items(name,size,generation,updated),prefixes,nextPageToken",
            "maxResults": "1000",
        }
        if delimiter:
            params["delimiter"] = delimiter

        async def handle(response: aiohttp.ClientResponse) -> dict[str, Any]:
            page: dict[str, Any] = await response.json(content_type=None)
            return page

        while True:
            async with self._limit():
                page = await self._request(
                    "GET", url, handle, what=f"list {self.url}/{prefix}", params=params
                )
            yield page
            token = page.get("nextPageToken")
            if not token:
                return
            params = {**params, "pageToken": token}

    async def _list(self, prefix: str) -> AsyncIterator[base.ObjectMeta]:
        # docstring inherited
        cut = len(self._prefix)
        async for page in self._list_pages(prefix, delimiter=None):
            items = sorted(page.get("items", []), key=lambda item: item["name"])
            for item in items:
                name: str = item["name"]
                if _is_temp(name[cut:]) or name.endswith("/"):
                    continue
                yield base.ObjectMeta(
                    name[cut:],
                    int(item["size"]),
                    str(item.get("generation")),
                    _parse_time(item.get("updated")),
                )

    async def _list_prefixes(self, prefix: str) -> builtins.list[str]:
        # docstring inherited
        cut = len(self._prefix)
        found: set[str] = set()
        async for page in self._list_pages(prefix, delimiter="/"):
            for name in page.get("prefixes", []):
                if not _is_temp(name[cut:]):
                    found.add(name[cut:])
        return sorted(found)

    async def remove_stale_writes(self, prefix: str = "", *, older_than: float) -> int:
        # docstring inherited
        # A writer that dies between uploading parts and `compose` leaves its parts as
        # `.ckptstore-tmp.*` objects beside the key; they are never listed as keys, so only
        # this finds them.
        base.validate_prefix(prefix)
        cut = len(self._prefix)
        stale: builtins.list[str] = []
        async for page in self._list_pages(prefix, delimiter=None):
            for item in page.get("items", []):
                updated = _parse_time(item.get("updated"))
                if _is_temp(item["name"][cut:]) and updated is not None and updated < older_than:
                    stale.append(item["name"])
        if stale:
            await self._delete_names(stale)
        return len(stale)

    async def _delete(self, keys: builtins.list[str]) -> None:
        # docstring inherited
        names = [self._name(key) for key in keys]
        await self._delete_names(names)

    async def _delete_names(self, names: builtins.list[str]) -> None:
        batches = [names[i : i + _BATCH_LIMIT] for i in range(0, len(names), _BATCH_LIMIT)]
        await asyncio.gather(*(self._delete_batch(batch) for batch in batches))

    async def _delete_batch(self, names: builtins.list[str]) -> None:
        """Delete up to 100 objects in one JSON API batch request; sub-requests that fail
        transiently are sent again in the next batch, missing objects are ignored."""
        pending = list(names)

        async def send() -> None:
            nonlocal pending
            statuses = await self._send_batch(pending)
            for name, status in zip(pending, statuses, strict=True):
                if status not in (200, 204, 404) and status not in _RETRYABLE_STATUS:
                    self._raise_for(status, "", f"delete {self._scheme}://{self.bucket}/{name}")
            pending = [
                n for n, s in zip(pending, statuses, strict=True) if s not in (200, 204, 404)
            ]
            if pending:
                raise _Transient(f"{len(pending)} of the batch's deletes failed transiently")

        what = f"delete of {len(names)} objects under {self.url}"
        try:
            await self._transport.run(send, transient=_transient, what=what)
        except _Transient as exc:
            raise self._gave_up(exc, what) from None

    async def _send_batch(self, names: builtins.list[str]) -> builtins.list[int]:
        boundary = "==ckptstore-batch=="
        base = f"/storage/v1/b/{quote(self.bucket, safe='')}/o/"
        parts = []
        for index, name in enumerate(names):
            parts.append(
                f"--{boundary}\r\nContent-Type: application/http\r\n"
                f"Content-ID: <{index}>\r\n\r\n"
                f"DELETE {base}{quote(name, safe='')} HTTP/1.1\r\n\r\n\r\n"
            )
        payload = ("".join(parts) + f"--{boundary}--\r\n").encode()

        async def handle(response: aiohttp.ClientResponse) -> builtins.list[int]:
            text = await response.text(errors="replace")
            statuses: dict[int, int] = {}
            for part in re.split(r"\r?\n--", text):
                cid = re.search(r"Content-ID:\s*<response-(\d+)>", part, re.IGNORECASE)
                status = re.search(r"HTTP/[0-9.]+ (\d{3})", part)
                if cid and status:
                    statuses[int(cid.group(1))] = int(status.group(1))
            if len(statuses) != len(names):
                raise _Transient(f"batch response has {len(statuses)} of {len(names)} parts")
            return [statuses[i] for i in range(len(names))]

        return await self._request(
            "POST",
            f"{self._fs._location}/batch/storage/v1",
            handle,
            what=f"delete under {self.url}",
            headers={"Content-Type": f'multipart/mixed; boundary="{boundary}"'},
            body=lambda: payload,
        )


class _ComposeUpload(base.MultipartUpload):
    """Parts as temporary objects, joined by ``compose`` on complete, deleted after."""

    def __init__(self, store: GCSStore, key: str, part_size: int, mode: base.PutMode) -> None:
        super().__init__(key, part_size, mode)
        self._store = store
        self._name = store._name(key)
        head, _, leaf = self._name.rpartition("/")
        self._temp_base = (
            f"{head}/{base.TEMP_PREFIX}{leaf}" if head else f"{base.TEMP_PREFIX}{leaf}"
        )
        self._upload_id = uuid.uuid4().hex[:16]
        self._temps: set[str] = set()

    def _temp(self, tag: str) -> str:
        return f"{self._temp_base}.{self._upload_id}.{tag}"

    async def _put_part(self, index: int, data: memoryview) -> None:
        name = self._temp(f"{index:05d}")
        self._temps.add(name)
        await self._store._upload(
            name, data, create=False, what=f"put part {index} of {self._store.url}/{self.key}"
        )

    async def _complete(self, part_count: int, size: int) -> base.ObjectMeta:
        what = f"complete {self._store.url}/{self.key}"
        sources = [self._temp(f"{i:05d}") for i in range(part_count)]
        level = 0
        while len(sources) > _COMPOSE_FANIN:
            level += 1
            groups = [
                sources[i : i + _COMPOSE_FANIN] for i in range(0, len(sources), _COMPOSE_FANIN)
            ]
            names = [self._temp(f"c{level}.{j:05d}") for j in range(len(groups))]
            self._temps.update(names)

            async def join(group: list[str], name: str) -> None:
                async with self._store._limit():
                    await self._store._compose(group, name, create=False, what=what)

            await asyncio.gather(*(join(g, n) for g, n in zip(groups, names, strict=True)))
            sources = names
        meta = await self._store._compose(
            sources, self._name, create=self.mode == "create", what=what
        )
        if int(meta.get("size", -1)) != size:
            raise errors.StoreError(f"{what}: composed {meta.get('size')} bytes, expected {size}")
        # The object is committed; temporaries that fail to go are left for `gc`.
        with contextlib.suppress(errors.StoreError):
            await self._abort()
        return base.ObjectMeta(
            self.key, size, str(meta.get("generation")), _parse_time(meta.get("updated"))
        )

    async def _abort(self) -> None:
        if self._temps:
            names = sorted(self._temps)
            await self._store._delete_names(names)
            self._temps.difference_update(names)


def _bytes_payload(data: memoryview) -> aiohttp.BytesPayload:
    """The caller's buffer as a request body, uncopied.

    aiohttp warns about bodies over 1 MiB given as bytes ("might lock the event loop"); the
    transport queues what the socket does not take at once, so nothing blocks, and a
    file-like body would add a copy per chunk instead.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Sending a large body", ResourceWarning)
        return aiohttp.BytesPayload(data, content_type="application/octet-stream")


def _is_identity(response: aiohttp.ClientResponse) -> bool:
    encoding = response.headers.get("X-Goog-Stored-Content-Encoding", "identity")
    return encoding == "identity"


def _content_range_total(response: aiohttp.ClientResponse) -> int | None:
    value = response.headers.get("Content-Range", "")
    total = value.rpartition("/")[2]
    return int(total) if total.isdigit() else None


def _error_message(text: str) -> str:
    with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
        message = json.loads(text)["error"]["message"]
        return str(message)
    return text[:200]
