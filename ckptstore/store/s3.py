"""``s3://bucket/prefix``: Amazon S3 and S3-compatible stores, on aiobotocore directly.

Why each piece is the way it is:

* **One client per store**, created lazily on the event loop that first uses it (an aiohttp
  session belongs to one loop) and closed by :meth:`S3Store.close`. Its connection pool is as
  large as ``Settings.max_concurrency``, so the base class's parallel parts and ranges each get
  a connection.
* **Zero-copy bodies.** A part is sent as a ``memoryview`` of the caller's buffer; aiohttp
  writes it to the socket as is. botocore's parameter validation only knows ``bytes`` and file
  objects, so it is turned off: every request here is built by this module, not by a user.
* **Checksums once.** The crc32c of every PutObject and UploadPart body is computed here, once
  (in a thread for large bodies, which ``crc32c`` runs without the GIL), and sent as
  ``x-amz-checksum-crc32c`` so the server rejects a body damaged on the way. botocore is told
  to checksum only where a request requires it (``request_checksum_calculation=
  "when_required"``; DeleteObjects does), or it would hash every body a second time; and
  payload signing is off (over ``http://`` botocore would otherwise SHA-256 every byte). Reads
  are verified by length here and by crc32c in the checkpoint layer, which knows the expected
  value of every range; ``response_checksum_validation="when_required"`` keeps botocore from
  asking for whole-object checksums a ranged read cannot use.
* **Retries follow the store's transport policy** (:mod:`ckptstore.store.transport`:
  ``Settings.retry_attempts``, ``retry_delay``, ``retry_max_delay``), the same as every other
  network backend's. botocore is told to make one attempt per call, and each call is retried
  here: throttling (503 SlowDown and the other throttling codes), 5xx, 408/429, a 409
  ``ConditionalRequestConflict``, a 400 ``BadDigest`` (the body was damaged in transit) and
  broken connections. Errors while *reading a response body* happen after botocore has
  returned, so a ranged read retries the whole GET: a reset, a timeout or a body shorter than
  its range restarts that range. One loop for both means the delays, the attempt count and the
  rule for a first contact that finds no server (fail at once) are the transport's, not
  botocore's. ``retry_mode="adaptive"`` keeps botocore's client-side rate limiting.
* **Put-if-absent** is ``If-None-Match: *`` on PutObject and on CompleteMultipartUpload; 412
  means another writer won. A server that ignores the header would let two writers both
  "win", so the first create on a store runs a probe (write a scratch object twice with the
  condition; the second must fail) and, if the server ignores it, refuses ``mode="create"``
  unless the user declared ``single_writer=True``. When a create meets 412, the object's ETag
  is compared with the ETag our own bytes give: equal means an earlier attempt of this same put
  landed and only its reply was lost (botocore resends, and so does aiohttp, unseen by
  botocore, when a keep-alive connection drops), and the put reports success. So a create
  whose key already holds exactly the bytes sent succeeds; the commit layer's manifests carry
  an attempt id, so two attempts never send the same bytes.
* **Errors** are translated in one table (:data:`_ERROR_TABLE`); messages name the
  ``s3://`` URL and the fix, and never carry credentials or signatures (AWS echoes the
  signature in SignatureDoesNotMatch bodies, so only the code and message are kept).
  ``endpoint_url`` is validated when the store is opened, and may not carry a password.
"""

from __future__ import annotations

import asyncio
import binascii
import builtins
import contextlib
import hashlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, ClassVar, NoReturn, TypeVar
from urllib.parse import urlsplit

import aiohttp
import aiohttp.payload
import botocore
import botocore.exceptions as bx
import crc32c as _crc32c
from aiobotocore.config import AioConfig
from aiobotocore.session import AioSession
from botocore.parsers import ResponseParserError

from ckptstore import errors
from ckptstore.config import Settings
from ckptstore.store import base, transport
from ckptstore.store.checksum import b64_crc32c, request_crc32c
from ckptstore.store.options import parse_bool, split_settings

__all__ = ["S3Store", "StaleUpload"]

_log = transport.store_logger("ckptstore.s3")
_T = TypeVar("_T")

_MIN_PART = 5 << 20  # S3: every part but the last
_MAX_PART = 5 << 30
_MAX_PARTS = 10_000
_DELETE_BATCH = 1000  # DeleteObjects limit
_READ_CHUNK = 1 << 20
_FIRST_SLICE = 64 << 10  # of a request body: sent together with the headers
_BODY_SLICE = 1 << 20  # of a request body: what one socket write may leave to the transport


class _ViewBody(aiohttp.payload.Payload):
    """A request body that is a view of the caller's buffer, written to the socket as is.

    A plain ``memoryview`` body would work in aiohttp but not in botocore, whose retry path
    rewinds any body that is not ``bytes`` and fails on a view; this payload "rewinds" by
    doing nothing (it is re-sent whole) and tells botocore its length.
    """

    _autoclose = True  # no resource to release, so aiohttp may reuse it on a retry

    def __init__(self, view: memoryview) -> None:
        super().__init__(view, content_type="application/octet-stream")
        self._view = view
        self._size = len(view)

    def __len__(self) -> int:
        return len(self._view)

    def __repr__(self) -> str:
        return f"<{len(self._view)} bytes>"

    def seek(self, offset: int, whence: int = 0) -> int:
        return 0

    def tell(self) -> int:
        return 0

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return bytes(self._view).decode(encoding, errors)

    async def write(self, writer: Any) -> None:
        await self.write_with_length(writer, None)

    async def write_with_length(self, writer: Any, content_length: int | None) -> None:
        view = self._view if content_length is None else self._view[:content_length]
        # Slices, not the whole view: aiohttp joins the headers with the first write
        # (``b"".join``, a copy of all of it, before Python 3.12.9), and asyncio's transport
        # copies whatever the socket does not take at once into its buffer. Whole 32 MiB parts
        # cost two copies into fresh memory each; slices keep both to one small slice, and
        # aiohttp waits for the socket (drain) between them.
        first = min(len(view), _FIRST_SLICE)
        await writer.write(view[:first])
        for offset in range(first, len(view), _BODY_SLICE):
            await writer.write(view[offset : offset + _BODY_SLICE])

    async def as_bytes(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        return bytes(self._view)


# ---------------------------------------------------------------------------- errors

#: Error code (or HTTP status as a string) -> (exception class, what to tell the user), over
#: the statuses every HTTP store shares.
_ERROR_TABLE = transport.ErrorTable(
    {
        "NoSuchKey": (errors.NotFoundError, "does not exist"),
        "NotFound": (errors.NotFoundError, "does not exist"),
        "NoSuchBucket": (
            errors.NotFoundError,
            "the bucket does not exist; create it or fix the URL",
        ),
        "NoSuchUpload": (
            errors.NotFoundError,
            "the multipart upload was aborted or already completed",
        ),
        "PreconditionFailed": (errors.AlreadyExistsError, "already exists"),
        "InvalidRange": (
            errors.InvalidRangeError,
            "the byte range lies past the end of the object",
        ),
        "AccessDenied": (
            errors.StoreError,
            "access denied; check the credentials (options, AWS_* environment, profile) and the "
            "bucket policy",
        ),
        "403": (errors.StoreError, "forbidden; check the credentials and the bucket policy"),
        "InvalidAccessKeyId": (
            errors.StoreError,
            "the access key id is unknown to this endpoint; check AWS_ACCESS_KEY_ID, the profile, "
            "or the access_key_id option",
        ),
        "SignatureDoesNotMatch": (
            errors.StoreError,
            "the request signature was rejected; check the secret key and the region",
        ),
        "ExpiredToken": (
            errors.StoreError,
            "the session token has expired; refresh the credentials",
        ),
        "SlowDown": (
            errors.StoreError,
            "the server kept throttling (503 SlowDown) after every retry",
        ),
        "BadDigest": (
            errors.StoreError,
            "the server kept receiving bytes that fail their checksum",
        ),
        "ConditionalRequestConflict": (
            errors.StoreError,
            "a concurrent conditional write kept conflicting (409) after every retry",
        ),
    },
    extends=transport.HTTP_ERRORS,
)

#: Error codes worth another attempt: throttling, timeouts and internal errors (the codes
#: botocore's standard retry mode knows), a conditional write that met a concurrent one
#: (409), and a body the server received damaged (BadDigest).
_RETRY_CODES = frozenset(
    {
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottledException",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "RequestThrottled",
        "SlowDown",
        "PriorRequestNotComplete",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ConditionalRequestConflict",
        "BadDigest",
    }
)
#: HTTP statuses worth another attempt, whatever the code.
_RETRY_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})


def _transient(exc: BaseException) -> bool:
    """Whether a failed call is worth another attempt."""
    if isinstance(exc, errors.CkptStoreError):
        return False  # decided already (a range past the end, a closed store)
    if isinstance(exc, bx.ClientError):
        code, status = _error_code(exc)
        return code in _RETRY_CODES or status in _RETRY_STATUS
    if isinstance(exc, bx.SSLError | bx.NoCredentialsError | bx.PartialCredentialsError):
        return False  # another attempt meets the same certificate or the same missing keys
    return isinstance(exc, bx.HTTPClientError | bx.ConnectionError | _BodyError | OSError)


def _error_code(exc: BaseException) -> tuple[str, int]:
    response = getattr(exc, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return code, status


def _precondition_failed(exc: bx.ClientError) -> bool:
    """Whether a conditional request lost: 412 / PreconditionFailed (``If-None-Match: *``
    met an existing object)."""
    code, status = _error_code(exc)
    return status == 412 or code == "PreconditionFailed"


def _retry_attempts(exc: BaseException) -> int:
    response = getattr(exc, "response", None) or {}
    return int(response.get("ResponseMetadata", {}).get("RetryAttempts", 0) or 0)


class _BodyError(Exception):
    """A response body ended early or broke off; the request is retried."""


# ---------------------------------------------------------------------------- options


class _Secret:
    """A credential string that never shows itself in a repr, a log line or an error."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "<redacted>"

    __str__ = __repr__


@dataclass(frozen=True, slots=True)
class StaleUpload:
    """A multipart upload that was started and neither completed nor aborted.

    Attributes:
        key: the key relative to the store root.
        upload_id: S3's id of the upload.
        initiated: when it was started, seconds since the epoch.
    """

    key: str
    upload_id: str
    initiated: float


# ---------------------------------------------------------------------------- the store


class S3Store(base.Store):
    """Objects under ``s3://bucket/prefix`` of Amazon S3 or any S3-compatible server.

    Args:
        bucket: the bucket name.
        prefix: key prefix inside the bucket that is this store's root (``""`` for the bucket).
        endpoint_url: the server, e.g. ``http://127.0.0.1:8333``; AWS if omitted.
        region: the signing region (default: from the AWS config, else ``us-east-1``).
        path_style: address buckets as ``endpoint/bucket`` rather than ``bucket.endpoint``;
            most self-hosted servers need it (default: on when ``endpoint_url`` is given).
        profile: an AWS profile from ``~/.aws/config`` / ``credentials``.
        access_key_id, secret_access_key, session_token: explicit credentials; otherwise the
            usual AWS chain (environment, profile, instance metadata) applies.
        anonymous: send unsigned requests (public buckets, anonymous test servers).
        verify: ``False`` to skip TLS verification, or the path of a CA bundle (self-signed
            test servers).
        single_writer: promise that no other process writes this prefix; lets
            ``mode="create"`` work on a server that ignores ``If-None-Match`` (non-atomic).
        retry_mode: botocore retry mode, ``"standard"`` or ``"adaptive"`` (client-side rate
            limiting on throttling). The attempts and delays are ``settings``'
            ``retry_attempts``, ``retry_delay`` and ``retry_max_delay``; ``from_url`` still
            takes the old option ``max_attempts`` for ``retry_attempts``.
        connect_timeout, read_timeout: seconds.
        settings: part size, concurrency, retries and the other tunables.
    """

    schemes: ClassVar[tuple[str, ...]] = ("s3",)
    url_query_options: ClassVar[bool] = True
    hashes_while_reading: ClassVar[bool] = True
    #: Keys per ListObjectsV2 page (S3's maximum; tests lower it to exercise pagination).
    list_page_size: int = 1000

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        path_style: bool | None = None,
        profile: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        session_token: str | None = None,
        anonymous: bool = False,
        verify: bool | str | None = None,
        single_writer: bool = False,
        retry_mode: str = "standard",
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        settings: Settings | None = None,
    ) -> None:
        super().__init__(settings=settings)
        if not bucket or "/" in bucket:
            raise errors.InvalidURLError(f"invalid S3 bucket name {bucket!r}")
        prefix = prefix.strip("/")
        if prefix:
            base.validate_key(prefix)
        if retry_mode not in ("standard", "adaptive", "legacy"):
            raise ValueError(f"retry_mode must be 'standard' or 'adaptive', got {retry_mode!r}")
        if (access_key_id is None) != (secret_access_key is None):
            raise ValueError("give both access_key_id and secret_access_key, or neither")
        self.bucket = bucket
        self.prefix = prefix
        self._root = prefix + "/" if prefix else ""
        self.endpoint_url = (
            transport.check_endpoint_url(endpoint_url) if endpoint_url is not None else None
        )
        self.region = region
        self.path_style = endpoint_url is not None if path_style is None else path_style
        self.profile = profile
        self.anonymous = anonymous
        self.verify = verify
        self.single_writer = single_writer
        self.retry_mode = retry_mode
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self._access_key_id = _Secret(access_key_id) if access_key_id is not None else None
        self._secret_access_key = (
            _Secret(secret_access_key) if secret_access_key is not None else None
        )
        self._session_token = _Secret(session_token) if session_token is not None else None
        self._client: Any = None
        self._client_cm: Any = None
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self._client_ready: asyncio.Future[Any] | None = None
        self._transport = transport.Transport(
            lambda: self.settings, self.endpoint_url or "AWS S3", _log
        )
        # None: not probed yet; True/False: whether If-None-Match is honoured
        self._conditional: dict[str, bool] = {}
        # None: not probed yet; whether the server refuses a body that fails its crc32c
        self._checks_crc: bool | None = None
        self._probe_lock: asyncio.Lock | None = None
        self._closed = False
        self._bucket_exists = False

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_url(cls, url: str, **options: Any) -> S3Store:
        # docstring inherited
        settings, rest = split_settings(options, {"max_attempts": ("retry_attempts", int)})
        parts = urlsplit(url)
        if parts.scheme.lower() != "s3":
            raise errors.InvalidURLError(f"not an s3:// URL: {transport.redact_url(url)!r}")
        if parts.username or parts.password:
            raise errors.InvalidURLError(
                "credentials do not belong in an s3:// URL; pass access_key_id/"
                "secret_access_key options or use the AWS environment or a profile"
            )
        if not parts.netloc:
            raise errors.InvalidURLError(
                f"{transport.redact_url(url)!r} names no bucket (s3://bucket/prefix)"
            )
        kwargs: dict[str, Any] = {}
        for name in ("endpoint_url", "region", "profile", "retry_mode"):
            if name in rest:
                kwargs[name] = str(rest.pop(name))
        for name in ("access_key_id", "secret_access_key", "session_token"):
            if name in rest:
                kwargs[name] = rest.pop(name)
        for name in ("path_style", "anonymous", "single_writer"):
            if name in rest:
                kwargs[name] = parse_bool(name, rest.pop(name))
        for name in ("connect_timeout", "read_timeout"):
            if name in rest:
                kwargs[name] = float(rest.pop(name))
        if "verify" in rest:
            verify = rest.pop("verify")
            if isinstance(verify, str) and verify.lower() in {"0", "1", "true", "false"}:
                verify = parse_bool("verify", verify)
            kwargs["verify"] = verify
        if rest:
            raise TypeError(
                f"S3Store: unknown options {sorted(rest)}; known: endpoint_url, region, "
                "path_style, profile, access_key_id, secret_access_key, session_token, "
                "anonymous, verify, single_writer, retry_mode, connect_timeout, read_timeout, "
                "max_attempts (the old name of retry_attempts) and the Settings fields"
            )
        return cls(parts.netloc, parts.path, settings=settings, **kwargs)

    @property
    def url(self) -> str:
        # docstring inherited
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")

    @property
    def capabilities(self) -> base.Capabilities:
        # docstring inherited
        return base.Capabilities(
            atomic_create=True,  # checked by a probe on first use; see _require_conditional
            multipart=True,
            min_part_size=_MIN_PART,
            max_part_size=_MAX_PART,
            max_parts=_MAX_PARTS,
        )

    def __repr__(self) -> str:
        endpoint = transport.redact_url(self.endpoint_url) if self.endpoint_url else ""
        where = f", endpoint_url={endpoint!r}" if endpoint else ""
        return f"S3Store({self.url!r}{where})"

    def _where(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._root}{key}"

    # ------------------------------------------------------------------ client

    def _config(self) -> Any:
        extra: dict[str, Any] = {}
        if self.anonymous:
            extra["signature_version"] = botocore.UNSIGNED
        return AioConfig(
            region_name=self.region,
            max_pool_connections=self.settings.transport.max_concurrency + 4,
            connect_timeout=self.connect_timeout,
            read_timeout=self.read_timeout,
            # one attempt per botocore call: the transport policy retries (see the module doc)
            retries={"mode": self.retry_mode, "total_max_attempts": 1},
            s3={
                "addressing_style": "path" if self.path_style else "auto",
                "payload_signing_enabled": False,
            },
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            parameter_validation=False,  # lets a memoryview through as a body
            tcp_keepalive=True,
            **extra,
        )

    async def _get_client(self) -> Any:
        loop = asyncio.get_running_loop()
        if self._closed:
            raise errors.StoreError(f"{self.url}: the store is closed")
        if self._client_ready is not None:
            if self._client_loop is not loop:
                raise errors.StoreError(
                    f"{self.url}: this store's client belongs to another event loop; open one "
                    "store per loop (sync callers share ckptstore.background's loop)"
                )
            return await asyncio.shield(self._client_ready)
        self._client_loop = loop
        self._client_ready = loop.create_future()
        try:
            client = await self._open_client()
        except BaseException as exc:
            self._client_ready.set_exception(exc)
            self._client_ready.exception()  # mark retrieved; the caller raises it
            self._client_ready = None
            raise
        self._client_ready.set_result(client)
        return client

    async def _open_client(self) -> Any:
        transport.guard_client_loggers()
        session = AioSession(profile=self.profile) if self.profile else AioSession()
        kwargs: dict[str, Any] = {"config": self._config()}
        if self.endpoint_url:
            kwargs["endpoint_url"] = self.endpoint_url
        region = self.region or session.get_config_variable("region") or "us-east-1"
        kwargs["region_name"] = region
        if self._access_key_id is not None and self._secret_access_key is not None:
            kwargs["aws_access_key_id"] = self._access_key_id.reveal()
            kwargs["aws_secret_access_key"] = self._secret_access_key.reveal()
            if self._session_token is not None:
                kwargs["aws_session_token"] = self._session_token.reveal()
        if self.verify is not None:
            kwargs["verify"] = self.verify
        self._client_cm = session.create_client("s3", **kwargs)
        self._client = await self._client_cm.__aenter__()
        return self._client

    async def writes_verified(self) -> bool:
        """Whether the server refuses a PutObject or UploadPart body that fails the
        ``x-amz-checksum-crc32c`` sent with it (AWS S3, SeaweedFS, MinIO do; moto 5 stores
        it): probed once per store by sending each a scratch body with a wrong crc32c."""
        if self._checks_crc is None:
            if self._probe_lock is None:
                self._probe_lock = asyncio.Lock()
            async with self._probe_lock:
                if self._checks_crc is None:
                    self._checks_crc = await self._probe_crc_checks()
                    _log.info(
                        "%s %s a body that fails its x-amz-checksum-crc32c%s",
                        self.endpoint_url or "AWS S3",
                        "refuses" if self._checks_crc else "does not refuse",
                        "" if self._checks_crc else "; copies to it are read back to verify",
                    )
        return self._checks_crc

    async def _probe_crc_checks(self) -> bool:
        """One PutObject and one UploadPart of a scratch body with a crc32c that is not its
        own; True only if both are refused with BadDigest. Any other answer, an error or no
        answer within ``Settings.request_deadline`` included, says no: the copy then reads
        back, which is always safe."""
        client = await self._get_client()
        full = self._root + f"{base.TEMP_PREFIX}probe-{uuid.uuid4().hex}"
        body = b"ckptstore crc32c probe"
        wrong = b64_crc32c(_crc32c.crc32c(body) ^ 1)
        upload_id: str | None = None

        async def refused(call: Callable[..., Awaitable[Any]], **params: Any) -> bool:
            try:
                await call(Bucket=self.bucket, Key=full, Body=body, ChecksumCRC32C=wrong, **params)
            except bx.ClientError as exc:
                return _error_code(exc)[0] == "BadDigest"
            return False

        try:
            async with asyncio.timeout(self.settings.transport.request_deadline):
                if not await refused(client.put_object):
                    return False
                created = await client.create_multipart_upload(
                    Bucket=self.bucket, Key=full, ChecksumAlgorithm="CRC32C"
                )
                upload_id = created["UploadId"]
                return await refused(client.upload_part, UploadId=upload_id, PartNumber=1)
        except (TimeoutError, bx.BotoCoreError, bx.ClientError, OSError):
            return False
        finally:  # the scratch object and upload go; a server that stalls is not waited on
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.settings.transport.request_deadline):
                    if upload_id is not None:
                        await client.abort_multipart_upload(
                            Bucket=self.bucket, Key=full, UploadId=upload_id
                        )
                    await client.delete_object(Bucket=self.bucket, Key=full)

    async def settle(self) -> None:
        # docstring inherited
        await self._transport.settle()

    async def close(self) -> None:
        # docstring inherited
        self._closed = True
        cm, self._client_cm, self._client = self._client_cm, None, None
        self._client_ready = None
        if cm is not None:
            await cm.__aexit__(None, None, None)

    # ------------------------------------------------------------------ requests and errors

    def _translate(self, exc: BaseException, op: str, key: str) -> errors.CkptStoreError:
        """Map a botocore/aiohttp exception to ckptstore's tree (never echoing credentials)."""
        if isinstance(exc, errors.CkptStoreError):
            return exc  # translated already (a first contact that found no server)
        where = self._where(key) if key else f"s3://{self.bucket}/{self._root}"
        tries = transport.attempts_made(exc)
        if isinstance(exc, bx.ClientError):
            code, status = _error_code(exc)
            if op == "list" and status >= 400 and code == str(status):
                # Every S3 server answers a failed ListObjectsV2 with an XML error document
                # (NoSuchBucket, AccessDenied...); botocore names the error by its status only
                # when there was none: a web server, SeaweedFS's filer or master port.
                return transport.NotAnEndpoint(
                    f"{op} {where}: {self._transport.endpoint} answered HTTP {status} without "
                    "an S3 error document: it does not look like an S3 API endpoint (a "
                    "filer, master or web port?); check endpoint_url (SeaweedFS: the "
                    "-s3.port, 8333 by default)"
                )
            entry = _ERROR_TABLE.lookup(code, status)
            message = str(exc.response.get("Error", {}).get("Message", "") or "")
            if entry is not None:
                if code == "NoSuchBucket" or (entry.error is errors.NotFoundError and op == "list"):
                    return errors.BucketNotFoundError(
                        f"{op} {where}: bucket {self.bucket!r}: {entry.hint}"
                    )
                return entry.error(f"{op} {where}: {entry.hint} ({code or status})")
            return errors.StoreError(
                f"{op} {where} failed after {tries} attempt(s): HTTP {status} {code}: "
                f"{transport.redact(message)}"
            )
        if isinstance(exc, bx.NoCredentialsError | bx.PartialCredentialsError):
            return errors.StoreError(
                f"{op} {where}: no S3 credentials found; set AWS_ACCESS_KEY_ID/"
                "AWS_SECRET_ACCESS_KEY, choose a profile, pass access_key_id/secret_access_key, "
                "or anonymous=True for a public bucket"
            )
        failure = transport.wire_failure(exc)
        if failure is not None and not isinstance(exc, _BodyError):
            fix = "; check endpoint_url and the network" if failure.never_connected else ""
            return errors.StoreError(
                f"{op} {where} failed after {tries} attempt(s): {failure.phrase} "
                f"({self._transport.endpoint}){fix}"
            )
        return errors.StoreError(
            f"{op} {where} failed after {tries} attempt(s): {type(exc).__name__}: "
            f"{transport.redact(str(exc))}"
        )

    def _raise(self, exc: BaseException, op: str, key: str) -> NoReturn:
        raise self._translate(exc, op, key) from None

    async def _call(
        self,
        op: str,
        key: str,
        fn: Callable[..., Awaitable[_T]],
        /,
        *,
        body_bytes: int = 0,
        **params: Any,
    ) -> _T:
        """One API call under the transport policy's retries; the last raw botocore
        exception propagates (callers translate it, some inspect it first), but for a body
        botocore cannot parse as S3's, raised as :class:`~ckptstore.store.transport.NotAnEndpoint`
        (botocore's parse error lies outside its error tree). ``body_bytes``:
        the size of a body sent in one request, which scales its deadline
        (:meth:`~ckptstore.store.transport.Transport.run`)."""
        try:
            return await self._transport.run(
                lambda: fn(**params),
                transient=_transient,
                what=f"{op} {self._where(key)}",
                body_bytes=body_bytes,
            )
        except ResponseParserError as exc:
            # botocore raises this outside its own error tree, so it passed every caller's
            # except clause raw: a SeaweedFS filer port answers a PutObject with JSON
            raise transport.NotAnEndpoint(
                f"{op} {self._where(key)}: {self._transport.endpoint} answered with a body "
                "that is not an S3 response, so it does not look like an S3 API endpoint (a "
                "filer or web port?) or something between altered the answer; check "
                f"endpoint_url ({transport.redact(str(exc).splitlines()[0])})"
            ) from None

    async def _request(
        self, op: str, key: str, fn: Callable[..., Awaitable[_T]], /, **params: Any
    ) -> _T:
        """:meth:`_call`, with every failure translated into ckptstore's error tree (for
        callers that need not look at the raw botocore error first)."""
        try:
            return await self._call(op, key, fn, **params)
        except (bx.BotoCoreError, bx.ClientError, OSError) as exc:
            self._raise(exc, op, key)

    async def _abort_upload_id(self, key: str, upload_id: str) -> bool:
        """AbortMultipartUpload of ``upload_id`` at ``key``; False if S3 no longer knows the
        upload (already completed or aborted)."""
        client = await self._get_client()
        try:
            await self._call(
                "abort_multipart",
                key,
                client.abort_multipart_upload,
                Bucket=self.bucket,
                Key=self._root + key,
                UploadId=upload_id,
            )
        except bx.ClientError as exc:
            if _error_code(exc)[0] == "NoSuchUpload":
                return False
            self._raise(exc, "abort_multipart", key)
        except (bx.BotoCoreError, OSError) as exc:
            self._raise(exc, "abort_multipart", key)
        return True

    async def _list_v2_pages(
        self, prefix: str, delimiter: str | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """The ListObjectsV2 pages under ``prefix`` (grouped by ``delimiter`` if given)."""
        client = await self._get_client()
        params: dict[str, Any] = {
            "Bucket": self.bucket,
            "Prefix": self._root + prefix,
            "MaxKeys": self.list_page_size,
        }
        if delimiter is not None:
            params["Delimiter"] = delimiter
        while True:
            page = await self._request("list", prefix, client.list_objects_v2, **params)
            yield page
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return
            params["ContinuationToken"] = token

    # ------------------------------------------------------------------ put-if-absent

    async def _require_conditional(self, kind: str) -> bool:
        """Whether ``If-None-Match`` is honoured for ``kind`` ("put" or "multipart"); probe
        once per store. Raise if it is not and the user did not declare single_writer."""
        if kind not in self._conditional:
            if self._probe_lock is None:
                self._probe_lock = asyncio.Lock()
            async with self._probe_lock:
                if kind not in self._conditional:
                    self._conditional[kind] = await self._probe(kind)
                    if not self._conditional[kind]:
                        _log.warning(
                            "%s ignores If-None-Match on %s; put-if-absent is not atomic there",
                            self.endpoint_url or "the S3 endpoint",
                            "PutObject" if kind == "put" else "CompleteMultipartUpload",
                        )
        if self._conditional[kind] or self.single_writer:
            return self._conditional[kind]
        raise errors.NotSupportedError(
            "put(mode='create')",
            "S3Store",
            f"the server at {self.endpoint_url or 'AWS S3'} ignored If-None-Match: * on "
            f"{'PutObject' if kind == 'put' else 'CompleteMultipartUpload'} (a probe wrote one "
            "scratch object twice and both writes succeeded), so two writers could both "
            "commit. Use a server that supports conditional writes, or pass "
            "single_writer=True if only one process ever writes under "
            f"{self.url}",
        )

    async def _probe(self, kind: str) -> bool:
        client = await self._get_client()
        name = f"{base.TEMP_PREFIX}probe-{uuid.uuid4().hex}"
        full = self._root + name
        try:
            for attempt in range(2):
                try:
                    if kind == "put":
                        await self._call(
                            "put",
                            name,
                            client.put_object,
                            Bucket=self.bucket,
                            Key=full,
                            Body=b"probe",
                            IfNoneMatch="*",
                        )
                    else:
                        await self._probe_multipart(client, name)
                except bx.ClientError as exc:
                    if _precondition_failed(exc):
                        if attempt == 1:
                            return True
                        continue  # the key is ours alone: a lost reply, the write landed
                    self._raise(exc, "probe conditional write", name)
            return False
        finally:
            with contextlib.suppress(Exception):
                await client.delete_object(Bucket=self.bucket, Key=full)

    async def _probe_multipart(self, client: Any, name: str) -> None:
        full = self._root + name
        what = "probe conditional write"
        created = await self._call(
            what, name, client.create_multipart_upload, Bucket=self.bucket, Key=full
        )
        upload_id = created["UploadId"]
        try:
            part = await self._call(
                what,
                name,
                client.upload_part,
                Bucket=self.bucket,
                Key=full,
                UploadId=upload_id,
                PartNumber=1,
                Body=b"probe",
            )
            await self._complete_probe(client, name, upload_id, part["ETag"])
        except BaseException:
            with contextlib.suppress(Exception):
                await client.abort_multipart_upload(
                    Bucket=self.bucket, Key=full, UploadId=upload_id
                )
            raise

    async def _complete_probe(self, client: Any, name: str, upload_id: str, etag: str) -> None:
        try:
            await self._call(
                "probe conditional write",
                name,
                client.complete_multipart_upload,
                Bucket=self.bucket,
                Key=self._root + name,
                UploadId=upload_id,
                MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": etag}]},
                IfNoneMatch="*",
            )
        except bx.ClientError as exc:
            if _error_code(exc)[0] != "NoSuchUpload":
                raise
            # a retry after a lost reply: the first Complete landed (the key is ours alone)

    async def _landed(
        self, key: str, size: int, expected_etag: Callable[[], Awaitable[str]]
    ) -> bool:
        """Whether ``key`` now holds the object of ``size`` bytes whose ETag we expect (our own
        earlier attempt landed and only its response was lost). The ETag is computed only if
        the size matches."""
        try:
            meta = await self._head(key)
        except errors.NotFoundError:
            return False
        if meta.size != size or meta.etag is None:
            return False
        return meta.etag.strip('"') == await expected_etag()

    # ------------------------------------------------------------------ writes

    async def _checksum(self, data: memoryview) -> str:
        return b64_crc32c(await request_crc32c(data))

    @property
    def sends_checksums(self) -> bool:
        # docstring inherited: every PutObject and UploadPart carries x-amz-checksum-crc32c
        return True

    async def _put(self, key: str, data: memoryview, mode: base.PutMode) -> None:
        # docstring inherited
        client = await self._get_client()
        params: dict[str, Any] = {
            "Bucket": self.bucket,
            "Key": self._root + key,
            "Body": _ViewBody(data),
            "ChecksumCRC32C": await self._checksum(data),
        }
        if mode == "create":
            if await self._require_conditional("put"):
                params["IfNoneMatch"] = "*"
            elif await self._exists_raw(key):  # single_writer on a server without conditions
                raise errors.AlreadyExistsError(f"{self._where(key)} already exists")
        try:
            await self._call("put", key, client.put_object, body_bytes=len(data), **params)
        except bx.ClientError as exc:
            if mode == "create" and _precondition_failed(exc):
                # A retried request (botocore's, or aiohttp's own resend on a dropped
                # keep-alive connection, which botocore never sees) may meet the object its
                # first attempt wrote: the same bytes under the key mean this put landed.
                if await self._landed(key, len(data), lambda: asyncio.to_thread(_md5_hex, data)):
                    _log.info(
                        "put %s: met 412, but the object holds exactly the bytes sent; an "
                        "earlier attempt landed and its response was lost",
                        self._where(key),
                    )
                    return
                raise errors.AlreadyExistsError(
                    f"{self._where(key)} already exists (put-if-absent lost to another writer)"
                ) from None
            self._raise(exc, "put", key)
        except (bx.BotoCoreError, OSError) as exc:
            self._raise(exc, "put", key)

    async def _exists_raw(self, key: str) -> bool:
        try:
            await self._head(key)
        except errors.NotFoundError:
            return False
        return True

    async def _put_parallel(self, key: str, view: memoryview, mode: base.PutMode) -> None:
        # Put-if-absent of a large object stays one PutObject (up to 5 GiB): a conditional
        # PutObject was atomic under races on every server measured, a conditional
        # CompleteMultipartUpload was not (moto 5.2.1, SeaweedFS 4.48: several winners).
        if mode == "create":
            if len(view) > _MAX_PART:
                raise errors.NotSupportedError(
                    f"put(mode='create') of {len(view)} bytes",
                    "S3Store",
                    "one PutObject holds at most 5 GiB; use create_multipart(mode='create')",
                )
            await self._put_one(key, view, mode)
            return
        await super()._put_parallel(key, view, mode)

    async def _create_multipart(
        self, key: str, part_size: int, mode: base.PutMode
    ) -> base.MultipartUpload:
        # docstring inherited
        client = await self._get_client()
        conditional = False
        lock: str | None = None
        if mode == "create":
            conditional = await self._require_conditional("multipart")
            if not conditional and await self._exists_raw(key):
                raise errors.AlreadyExistsError(f"{self._where(key)} already exists")
            if await self._require_conditional("put"):
                lock = await self._claim_create_lock(key)
        try:
            created = await self._call(
                "create_multipart",
                key,
                client.create_multipart_upload,
                Bucket=self.bucket,
                Key=self._root + key,
                ChecksumAlgorithm="CRC32C",
            )
        except (bx.BotoCoreError, bx.ClientError, OSError) as exc:
            if lock is not None:
                await self._release_create_lock(lock)
            self._raise(exc, "create_multipart", key)
        return _S3Upload(self, key, created["UploadId"], part_size, mode, conditional, lock)

    async def _claim_create_lock(self, key: str) -> str:
        """Claim the right to create ``key`` by multipart upload; return the lock's key.

        Servers measured here check ``If-None-Match`` on CompleteMultipartUpload
        non-atomically, so racing multipart creators could all "win". The lock is a scratch
        object beside the key written with a conditional PutObject (atomic on those servers):
        one racer gets it, the others fail at once. The winner's conditional complete still
        guards against an object that already exists, and the lock is removed when the
        upload completes or aborts; a crashed writer's lock is removed by
        :meth:`abort_stale_uploads`.
        """
        parent, _, name = key.rpartition("/")
        lock = (parent + "/" if parent else "") + f"{base.TEMP_PREFIX}create-lock.{name}"
        client = await self._get_client()
        try:
            await self._call(
                "put",
                lock,
                client.put_object,
                Bucket=self.bucket,
                Key=self._root + lock,
                Body=str(time.time()).encode(),
                IfNoneMatch="*",
            )
        except bx.ClientError as exc:
            if _precondition_failed(exc):
                raise errors.AlreadyExistsError(
                    f"{self._where(key)} is being created by another writer (it holds "
                    f"{self._where(lock)}; if that writer crashed, abort_stale_uploads removes "
                    "the lock)"
                ) from None
            self._raise(exc, "put", lock)
        except (bx.BotoCoreError, OSError) as exc:
            self._raise(exc, "put", lock)
        return lock

    async def _release_create_lock(self, lock: str) -> None:
        client = await self._get_client()
        await self._request(
            "delete", lock, client.delete_object, Bucket=self.bucket, Key=self._root + lock
        )

    # ------------------------------------------------------------------ reads

    async def _get(self, key: str) -> bytes:
        # docstring inherited
        holder: builtins.list[bytearray] = []
        await self._retrying_read(key, 0, None, holder)
        return bytes(holder[0])

    async def _read_into(self, key: str, start: int, out: memoryview) -> None:
        # docstring inherited
        await self._read_range(key, start, out, checksum=False)

    async def _read_into_crc32c(self, key: str, start: int, out: memoryview) -> int:
        # docstring inherited
        return await self._read_range(key, start, out, checksum=True)

    async def _read_range(self, key: str, start: int, out: memoryview, *, checksum: bool) -> int:
        """One ranged GET into ``out``; with ``checksum``, returns the crc32c of the bytes
        (else 0)."""
        if len(out) == 0:
            await self._head(key)
            return 0
        return await self._retrying_read(key, start, out, [], checksum=checksum)

    async def _retrying_read(
        self,
        key: str,
        start: int,
        out: memoryview | None,
        whole: builtins.list[bytearray],
        *,
        checksum: bool = False,
    ) -> int:
        """GET ``[start, start + len(out))`` into ``out`` (or, with ``out=None``, the whole
        object into a new buffer put in ``whole``), restarting on broken bodies. With
        ``checksum``, returns the crc32c of the bytes (of the attempt that succeeded)."""
        client = await self._get_client()
        try:
            # A ranged read of an immutable object may be hedged (transport.Hedger).
            return await self._transport.run(
                lambda: self._fetch(client, key, start, out, whole, checksum),
                transient=_transient,
                what=f"read {self._where(key)}",
                hedge_bytes=None if out is None else len(out),
            )
        except bx.ClientError as exc:
            code, status = _error_code(exc)
            if out is not None and (code == "InvalidRange" or status == 416):
                raise errors.InvalidRangeError(
                    f"range [{start}, {start + len(out)}) reaches past the end of "
                    f"{self._where(key)}"
                ) from None
            if status == 404 and code != "NoSuchKey":
                await self._raise_missing_bucket(client, key)
            self._raise(exc, "read", key)
        except (_BodyError, bx.BotoCoreError, OSError) as exc:
            self._raise(exc, "read", key)

    async def _fetch(
        self,
        client: Any,
        key: str,
        start: int,
        out: memoryview | None,
        whole: builtins.list[bytearray],
        checksum: bool,
    ) -> int:
        params: dict[str, Any] = {"Bucket": self.bucket, "Key": self._root + key}
        if out is not None:
            params["Range"] = f"bytes={start}-{start + len(out) - 1}"
        response = await client.get_object(**params)
        body = response["Body"]
        try:
            length = response.get("ContentLength")
            if out is None:
                if not isinstance(length, int):
                    raise _BodyError("the server announced no Content-Length")
                whole[:] = [bytearray(length)]
                out = memoryview(whole[0])
            else:
                end = start + len(out)
                total = _total_size(response.get("ContentRange"))
                if total is not None and total < end:
                    raise errors.InvalidRangeError(
                        f"range [{start}, {end}) reaches past the end of {self._where(key)} "
                        f"({total} bytes)"
                    )
            if length != len(out):
                raise _BodyError(f"asked for {len(out)} bytes, the server announced {length}")
            stream = body.raw_stream.content
            got = crc = 0
            try:
                while got < len(out):
                    chunk = await stream.read(min(_READ_CHUNK, len(out) - got))
                    if not chunk:
                        break
                    if checksum:  # now, while the chunk is in cache, not in a second pass
                        crc = _crc32c.crc32c(chunk, crc)
                    out[got : got + len(chunk)] = chunk
                    got += len(chunk)
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
                raise _BodyError(f"the body broke off after {got} bytes: {exc}") from None
            if got != len(out):
                raise _BodyError(f"the body ended after {got} of {len(out)} bytes")
        finally:
            body.close()
        return crc

    async def _head(self, key: str) -> base.ObjectMeta:
        # docstring inherited
        client = await self._get_client()
        try:
            response = await self._call(
                "head", key, client.head_object, Bucket=self.bucket, Key=self._root + key
            )
        except bx.ClientError as exc:
            if _error_code(exc)[1] == 404:
                await self._raise_missing_bucket(client, key)
            self._raise(exc, "head", key)
        except (bx.BotoCoreError, OSError) as exc:
            self._raise(exc, "head", key)
        modified = response.get("LastModified")
        return base.ObjectMeta(
            key,
            int(response["ContentLength"]),
            response.get("ETag"),
            modified.timestamp() if modified is not None else None,
        )

    async def _raise_missing_bucket(self, client: Any, key: str) -> None:
        """A 404 without an error code (HEAD has no body) may mean a missing bucket rather
        than a missing key: ask once, and remember a bucket that exists."""
        if self._bucket_exists:
            return
        try:
            await client.head_bucket(Bucket=self.bucket)
        except bx.ClientError as exc:
            if _error_code(exc)[1] == 404:
                raise errors.BucketNotFoundError(
                    f"{self._where(key)}: bucket {self.bucket!r} does not exist at "
                    f"{self.endpoint_url or 'AWS S3'}; create it or fix the URL"
                ) from None
            return
        except (bx.BotoCoreError, OSError):
            return
        self._bucket_exists = True

    # ------------------------------------------------------------------ listing, deletes

    async def _list(self, prefix: str) -> AsyncIterator[base.ObjectMeta]:
        # docstring inherited
        # S3 lists in UTF-8 byte order, but not every S3-compatible server does: SeaweedFS
        # walks its directory tree, so "a/b" comes before "a.x". The pages are gathered and
        # sorted (one pass to check, a sort only if needed) to keep the contract's order.
        found: builtins.list[base.ObjectMeta] = []
        ordered = True
        async for meta in self._list_pages(prefix):
            if found and meta.key < found[-1].key:
                ordered = False
            found.append(meta)
        if not ordered:
            found.sort(key=lambda meta: meta.key)
        for meta in found:
            yield meta

    async def _list_pages(self, prefix: str) -> AsyncIterator[base.ObjectMeta]:
        cut = len(self._root)
        async for page in self._list_v2_pages(prefix):
            for item in page.get("Contents", ()):
                key = item["Key"][cut:]
                if not _listable(key):
                    continue
                modified = item.get("LastModified")
                yield base.ObjectMeta(
                    key,
                    int(item["Size"]),
                    item.get("ETag"),
                    modified.timestamp() if modified is not None else None,
                )

    async def _list_prefixes(self, prefix: str) -> builtins.list[str]:
        # docstring inherited
        cut = len(self._root)
        found: builtins.list[str] = []
        async for page in self._list_v2_pages(prefix, delimiter="/"):
            for item in page.get("CommonPrefixes", ()):
                name = item["Prefix"][cut:]
                if name.strip("/") and _listable(name.rstrip("/")):
                    found.append(name)
        return sorted(set(found))

    async def _delete(self, keys: builtins.list[str]) -> None:
        # docstring inherited
        client = await self._get_client()
        failed: builtins.list[str] = []
        for i in range(0, len(keys), _DELETE_BATCH):
            batch = keys[i : i + _DELETE_BATCH]
            response = await self._request(
                "delete",
                batch[0],
                client.delete_objects,
                Bucket=self.bucket,
                Delete={"Objects": [{"Key": self._root + k} for k in batch], "Quiet": True},
            )
            for error in response.get("Errors", ()):
                if error.get("Code") == "NoSuchKey":
                    continue
                failed.append(f"{error.get('Key', '?')[len(self._root) :]} ({error.get('Code')})")
        if failed:
            shown = ", ".join(failed[:5]) + (
                f" and {len(failed) - 5} more" if len(failed) > 5 else ""
            )
            raise errors.StoreError(
                f"delete under s3://{self.bucket}/{self._root}: {len(failed)} key(s) were not "
                f"deleted: {shown}"
            )

    # ------------------------------------------------------------------ multipart upkeep

    async def multipart_uploads(self, prefix: str = "") -> builtins.list[StaleUpload]:
        """Multipart uploads under ``prefix`` that were started and not yet completed or
        aborted (ListMultipartUploads, paginated)."""
        client = await self._get_client()
        found: builtins.list[StaleUpload] = []
        params: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self._root + prefix}
        while True:
            page = await self._request(
                "list multipart uploads", prefix, client.list_multipart_uploads, **params
            )
            for item in page.get("Uploads", ()):
                found.append(
                    StaleUpload(
                        item["Key"][len(self._root) :],
                        item["UploadId"],
                        item["Initiated"].timestamp(),
                    )
                )
            if not page.get("IsTruncated"):
                return found
            params["KeyMarker"] = page.get("NextKeyMarker", "")
            params["UploadIdMarker"] = page.get("NextUploadIdMarker", "")

    async def abort_stale_uploads(self, prefix: str = "", older_than: float = 86400.0) -> int:
        """Abort multipart uploads under ``prefix`` started more than ``older_than`` seconds
        ago (a crashed writer's parts, which S3 bills for until aborted), and remove the
        create locks such writers left. Returns how many uploads were aborted. Younger ones
        may belong to a running save and are kept."""
        return await self._remove_before(prefix, time.time() - older_than, count_locks=False)

    async def remove_stale_writes(self, prefix: str = "", *, older_than: float) -> int:
        # docstring inherited
        base.validate_prefix(prefix)
        return await self._remove_before(prefix, older_than, count_locks=True)

    async def _remove_before(self, prefix: str, cutoff: float, *, count_locks: bool) -> int:
        """Abort uploads under ``prefix`` initiated before ``cutoff`` (seconds since the epoch)
        and delete create locks written before it; return how many uploads (and, with
        ``count_locks``, locks) were removed."""
        aborted = 0
        for upload in await self.multipart_uploads(prefix):
            if upload.initiated <= cutoff and await self._abort_upload_id(
                upload.key, upload.upload_id
            ):
                aborted += 1
        # create locks of multipart creators that crashed (see _claim_create_lock)
        stale_locks = [
            key
            async for key, modified in self._scratch_objects(prefix)
            if f"{base.TEMP_PREFIX}create-lock." in key and modified <= cutoff
        ]
        if stale_locks:
            await self._delete(stale_locks)
        return aborted + (len(stale_locks) if count_locks else 0)

    async def _scratch_objects(self, prefix: str) -> AsyncIterator[tuple[str, float]]:
        """Our scratch objects (probe, create locks) under ``prefix``, with their mtimes."""
        cut = len(self._root)
        async for page in self._list_v2_pages(prefix):
            for item in page.get("Contents", ()):
                key = item["Key"][cut:]
                if base.TEMP_PREFIX in key:
                    yield key, item["LastModified"].timestamp()


def _listable(key: str) -> bool:
    """Keys this store shows: valid keys that are not our in-progress scratch objects."""
    if not key or key.endswith("/"):
        return False
    return not any(segment.startswith(base.TEMP_PREFIX) for segment in key.split("/"))


def _total_size(content_range: str | None) -> int | None:
    if not content_range or "/" not in content_range:
        return None
    total = content_range.rsplit("/", 1)[1]
    return int(total) if total.isdigit() else None


def _async_value(value: str) -> Callable[[], Awaitable[str]]:
    async def get() -> str:
        return value

    return get


def _md5_hex(data: memoryview) -> str:
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


def _multipart_etag(part_etags: builtins.list[str]) -> str:
    """The ETag S3 gives a multipart object: md5 of the parts' binary md5s, dash, count."""
    joined = b"".join(binascii.unhexlify(etag.strip('"')) for etag in part_etags)
    return f"{hashlib.md5(joined, usedforsecurity=False).hexdigest()}-{len(part_etags)}"


class _S3Upload(base.MultipartUpload):
    """One S3 multipart upload; parts carry their crc32c, complete may be conditional."""

    def __init__(
        self,
        store: S3Store,
        key: str,
        upload_id: str,
        part_size: int,
        mode: base.PutMode,
        conditional: bool,
        lock: str | None = None,
    ) -> None:
        super().__init__(key, part_size, mode)
        self._store = store
        self._upload_id = upload_id
        self._conditional = conditional
        self._lock = lock
        self._parts: dict[int, tuple[str, str]] = {}  # index -> (ETag, crc32c)
        self._finished = False

    def __repr__(self) -> str:
        return f"<S3 multipart upload of {self._store._where(self.key)}>"

    async def _put_part(self, index: int, data: memoryview) -> None:
        if index >= _MAX_PARTS:
            raise ValueError(f"part index {index} is over S3's limit of {_MAX_PARTS} parts")
        store = self._store
        client = await store._get_client()
        crc = await store._checksum(data)
        response = await store._request(
            f"put_part {index} of",
            self.key,
            client.upload_part,
            Bucket=store.bucket,
            Key=store._root + self.key,
            UploadId=self._upload_id,
            PartNumber=index + 1,
            Body=_ViewBody(data),
            ChecksumCRC32C=crc,
            body_bytes=len(data),  # part_size_for may grow a part past part_size
        )
        self._parts[index] = (response["ETag"], crc)

    async def _complete(self, part_count: int, size: int) -> base.ObjectMeta:
        meta = await self._complete_upload(part_count, size)
        await self._release_lock()
        return meta

    async def _release_lock(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            await self._store._release_create_lock(lock)

    async def _complete_upload(self, part_count: int, size: int) -> base.ObjectMeta:
        store = self._store
        client = await store._get_client()
        if part_count == 0:  # S3 refuses an upload without parts; an empty object is one put
            await self._abort()
            await store._put(self.key, memoryview(b""), self.mode)
            return await store._head(self.key)
        etags = [self._parts[i][0] for i in range(part_count)]
        params: dict[str, Any] = {
            "Bucket": store.bucket,
            "Key": store._root + self.key,
            "UploadId": self._upload_id,
            "MultipartUpload": {
                "Parts": [
                    {"PartNumber": i + 1, "ETag": etag, "ChecksumCRC32C": self._parts[i][1]}
                    for i, etag in enumerate(etags)
                ]
            },
        }
        if self.mode == "create" and self._conditional:
            params["IfNoneMatch"] = "*"
        try:
            response = await store._call(
                "complete_multipart", self.key, client.complete_multipart_upload, **params
            )
        except bx.ClientError as exc:
            lost = _precondition_failed(exc) or _error_code(exc)[0] == "NoSuchUpload"
            # a retry after a lost response: the first Complete may have landed
            if lost and await store._landed(self.key, size, _async_value(_multipart_etag(etags))):
                self._finished = True
                return await store._head(self.key)
            if self.mode == "create" and _precondition_failed(exc):
                raise errors.AlreadyExistsError(
                    f"{store._where(self.key)} already exists (put-if-absent lost to another "
                    "writer)"
                ) from None
            store._raise(exc, "complete_multipart", self.key)
        except (bx.BotoCoreError, OSError) as exc:
            store._raise(exc, "complete_multipart", self.key)
        self._finished = True
        return base.ObjectMeta(self.key, size, response.get("ETag"))

    async def _abort(self) -> None:
        try:
            await self._abort_upload()
        finally:
            await self._release_lock()

    async def _abort_upload(self) -> None:
        if self._finished:
            return
        await self._store._abort_upload_id(self.key, self._upload_id)
        self._finished = True
        self._parts.clear()
