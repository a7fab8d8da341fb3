"""The transport policy every network backend follows, written once.

Each network backend (S3, GCS, the generic fsspec one) talks to its server through a
different client library, but what happens around a request is the same for all of them and
lives here:

* **Retries.** :class:`Transport` runs one request at a time with the retry policy of
  :class:`ckptstore.Settings` (``retry_attempts``, ``retry_delay``, ``retry_max_delay``):
  the delay doubles per attempt with equal jitter (a uniform draw between half the cap and the
  cap), so many clients throttled together do not return together. A backend says which of
  its client's failures are transient; everything else is raised at once.
* **First contact.** A wrong ``endpoint_url`` is the most common setup mistake, and retrying a
  refused connection ten times with backoff made ``ckptstore ls`` sit silent for a minute
  before saying so. Until a store has had one response from its server, a refused connection
  or a host name that does not resolve is not retried: the store fails at once with
  :class:`Unreachable`, which names the endpoint and the fix. Once the server has answered,
  the same failures are transient (a server restarting) and are retried like any other.
* **Saying what happened.** :func:`wire_failure` tells a refused connection from a reset in
  the middle of a body, a timeout or a name that does not resolve, by walking the chain of
  causes the client library wrapped around the socket error; messages say that, not "cannot
  reach" for every one of them.
* **The in-flight byte budget** (:class:`ByteBudget`), held by the base :class:`Store` for
  every backend, network or not.
* **The error table** (:class:`ErrorTable`): each backend maps its client's error codes,
  HTTP statuses or exception types to ckptstore's error tree in one table of this shape.
* **Secrets.** :func:`redact` is the one function that removes credentials from text shown to
  anyone: URL userinfo passwords, query parameters and options whose names look secret
  (``secret_access_key=``, ``token=``, ``X-Amz-Signature=``...), and the literal values of
  every secret option a store was opened with (:func:`remember_secrets`), so that a client
  library's message that echoes a value is scrubbed too. Store reprs, error messages, log
  records (:func:`store_logger`) and the CLI's output all pass through it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import logging
import random
import re
import socket
import statistics
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

from ckptstore import errors
from ckptstore.config import Settings

__all__ = [
    "ByteBudget",
    "ErrorEntry",
    "HTTP_ERRORS",
    "ErrorTable",
    "Transport",
    "Unreachable",
    "WireFailure",
    "attempts_made",
    "check_endpoint_url",
    "guard_client_loggers",
    "is_secret_name",
    "redact",
    "redact_data",
    "redact_url",
    "remember_secrets",
    "store_logger",
    "wire_failure",
]

_T = TypeVar("_T")

# ---------------------------------------------------------------------------- secrets

#: Option and query-parameter names whose values are credentials. Matched against the name
#: lowered, with '-' read as '_': ``secret_access_key``, ``token``, ``X-Amz-Signature``,
#: ``X-Amz-Credential``, ``session_token``, ``password``, ``sig`` (Azure SAS), ``secret``
#: (s3fs), ``api_key``, ``client_secret``, ``private_key``... A bare ``key`` is not among
#: them: it names object keys throughout ckptstore's own messages and output.
_SECRET_NAME = re.compile(
    r"(secret|token|passw|pwd|credential|signature|private|auth|cookie|session|"
    r"api_?key|access_?key|account_?key|^sig$|^sas$)"
)
_SHOWN = "***"
#: Values shorter than this are not scrubbed as literals: "1" or "abc" would blank out
#: unrelated text, and no real credential is that short.
_MIN_LITERAL = 6
_known: set[str] = set()
_known_lock = threading.Lock()
#: ``name=value`` and ``name: value`` pairs in free text (query strings, option dumps,
#: ``repr`` of a dict), the value up to a separator or a closing quote; ``scheme://`` is
#: not a pair, so a URL's query is still searched.
_PAIR = re.compile(
    r"""(?P<name>[A-Za-z][\w.-]*)(?P<sep>['"]?\s*(?:=|:(?!//))\s*['"]?)"""
    r"""(?P<value>[^\s&'",;)}\]]+)"""
)
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][\w+.-]*://)(?P<user>[^/@\s:]*):(?P<pw>[^/@\s]*)@")


def is_secret_name(name: str) -> bool:
    """Whether an option or query parameter called ``name`` carries a credential."""
    return bool(_SECRET_NAME.search(name.lower().replace("-", "_")))


def remember_secrets(options: Mapping[str, Any]) -> None:
    """Note the values of ``options`` whose names are secret, so that :func:`redact` scrubs
    them from any text later, wherever a client library echoes them. Values nested in a
    dict (``storage_options={...}``) count too."""
    found: list[str] = []
    for name, value in options.items():
        if isinstance(value, Mapping):
            remember_secrets(value)
        elif isinstance(value, str) and is_secret_name(name) and len(value) >= _MIN_LITERAL:
            found.append(value)
    if found:
        with _known_lock:
            _known.update(found)


def redact_url(url: str) -> str:
    """``url`` with a userinfo password and secret-looking query values replaced by ``***``.

    The rest (scheme, host, path, other options) stays, so a message still says which store
    it means. Anything that does not parse as a URL is redacted as free text.
    """
    try:
        parts = urlsplit(url)
    except ValueError:
        return redact(url)
    shown = url
    if "@" in parts.netloc:
        userinfo, _, host = parts.netloc.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        if colon:
            shown = shown.replace(parts.netloc, f"{user}:{_SHOWN}@{host}", 1)
    if parts.query:
        query = "&".join(_redact_field(field) for field in parts.query.split("&"))
        shown = shown.replace(f"?{parts.query}", f"?{query}", 1)
    return _scrub_literals(shown)


def _redact_field(field: str) -> str:
    """One ``name=value`` of a query string, its value hidden if the name is secret."""
    name, sep, _ = field.partition("=")
    return f"{name}={_SHOWN}" if sep and is_secret_name(unquote(name)) else field


def redact(text: str) -> str:
    """``text`` with every credential removed: userinfo passwords of URLs in it,
    ``name=value`` pairs whose name is secret, and the literal value of every secret option
    seen by :func:`remember_secrets`. The one function every message, repr, log record and
    CLI output goes through."""
    text = _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:{_SHOWN}@", text)
    text = _PAIR.sub(
        lambda m: f"{m['name']}{m['sep']}{_SHOWN}" if is_secret_name(m["name"]) else m[0], text
    )
    return _scrub_literals(text)


def redact_data(value: Any) -> Any:
    """A copy of JSON-like ``value`` with :func:`redact` applied to every string in it and the
    value of every secret-named key hidden (for ``--json`` output)."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, Mapping):
        return {
            k: _SHOWN if isinstance(k, str) and is_secret_name(k) else redact_data(v)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [redact_data(v) for v in value]
    return value


def _scrub_literals(text: str) -> str:
    with _known_lock:
        known = sorted(_known, key=len, reverse=True)  # a secret containing another goes first
    for value in known:
        if value in text:
            text = text.replace(value, _SHOWN)
    return text


class _RedactingFilter(logging.Filter):
    """Formats a record's message and arguments once and redacts the result."""

    def filter(self, record: logging.LogRecord) -> bool:
        with contextlib.suppress(Exception):  # a malformed record is logging's to report
            record.msg = redact(record.getMessage())
            record.args = None
        return True


_FILTER = _RedactingFilter()


def store_logger(name: str) -> logging.Logger:
    """The logger ``name`` (under ``ckptstore.``), with every record it emits redacted."""
    logger = logging.getLogger(name)
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
    return logger


#: The loggers of the client libraries the backends drive. At DEBUG, botocore logs every
#: request's canonical form, session token header included, and the drivers log their
#: parameters; :func:`guard_client_loggers` redacts what they emit too.
CLIENT_LOGGERS = ("botocore", "aiobotocore", "s3fs", "gcsfs", "fsspec", "aiohttp", "urllib3")


def guard_client_loggers(prefixes: Iterable[str] = CLIENT_LOGGERS) -> None:
    """Redact every record of the client libraries' loggers that exist now (called when a
    backend opens its client, by which time the library has made its loggers)."""
    roots = tuple(prefixes)
    for name in list(logging.Logger.manager.loggerDict):
        if name.split(".", 1)[0] in roots:
            store_logger(name)
    for name in roots:
        store_logger(name)


def check_endpoint_url(value: object, option: str = "endpoint_url") -> str:
    """Validate an endpoint URL at open time: ``http(s)://host[:port][/path]``, no
    credentials in it. Returns it without a trailing ``/``.

    Raises:
        errors.InvalidURLError: anything else, with the value redacted.
    """
    text = str(value).strip()
    try:
        parts = urlsplit(text)
        port = parts.port  # raises for a port that is not a number or out of range
    except ValueError as exc:
        raise errors.InvalidURLError(f"{option}={redact_url(text)!r} is not a URL: {exc}") from None
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise errors.InvalidURLError(
            f"{option}={redact_url(text)!r} is not an http(s) URL; give it as "
            "http://host:port or https://host"
        )
    if parts.query or parts.fragment:
        raise errors.InvalidURLError(
            f"{option}={redact_url(text)!r} takes no ?query or #fragment; give it as "
            "http://host:port"
        )
    if parts.username is not None or parts.password is not None:
        raise errors.InvalidURLError(
            f"{option}={redact_url(text)!r} carries credentials; pass them as options or "
            "through the environment instead, never inside the URL"
        )
    del port
    return text.rstrip("/")


# ---------------------------------------------------------------------------- errors


@dataclass(frozen=True, slots=True)
class ErrorEntry:
    """What one client error becomes: the ckptstore error class and what to tell the user."""

    error: type[errors.CkptStoreError]
    hint: str


class ErrorTable:
    """A backend's translation of its client's errors: keys are error codes, HTTP statuses
    (as strings) or exception class names, looked up in the order a backend gives them.

    Args:
        entries: key -> (ckptstore error class, what to tell the user).
        extends: a table whose entries this one inherits unless it names the same key
            (:data:`HTTP_ERRORS`, for the statuses every HTTP store shares).
    """

    def __init__(
        self,
        entries: Mapping[str, tuple[type[errors.CkptStoreError], str]],
        *,
        extends: ErrorTable | None = None,
    ) -> None:
        inherited = dict(extends._entries) if extends is not None else {}
        self._entries: dict[str, ErrorEntry] = inherited | {
            key: ErrorEntry(*value) for key, value in entries.items()
        }

    def lookup(self, *keys: object) -> ErrorEntry | None:
        """The entry of the first of ``keys`` the table knows (empty keys are skipped)."""
        for key in keys:
            if key not in (None, "", 0) and (entry := self._entries.get(str(key))) is not None:
                return entry
        return None

    def lookup_exception(self, exc: BaseException) -> ErrorEntry | None:
        """The entry of the nearest class in ``exc``'s MRO that the table names."""
        return self.lookup(*(cls.__name__ for cls in type(exc).__mro__))


#: The HTTP statuses every object store means the same by.
HTTP_ERRORS = ErrorTable(
    {
        "404": (errors.NotFoundError, "does not exist"),
        "412": (errors.AlreadyExistsError, "already exists"),
        "416": (errors.InvalidRangeError, "the byte range lies past the end of the object"),
        "401": (errors.StoreError, "not authenticated; check the credentials"),
        "403": (
            errors.StoreError,
            "permission denied; check the credentials and the access policy",
        ),
    }
)


# ---------------------------------------------------------------------------- the wire


@dataclass(frozen=True, slots=True)
class WireFailure:
    """A failure of the connection itself, as :func:`wire_failure` reads it.

    Attributes:
        kind: ``"refused"``, ``"unresolved"``, ``"connect-timeout"`` (no connection was made
            in time), ``"reset"``, ``"timeout"`` (a made connection went quiet) or
            ``"closed"``.
        phrase: what happened, in words for a message.
    """

    kind: str
    phrase: str

    @property
    def never_connected(self) -> bool:
        """Whether no connection was made at all (nothing listens, or no such host)."""
        return self.kind in ("refused", "unresolved", "connect-timeout")


_RESET_ERRNOS = frozenset({errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED})


def _causes(exc: BaseException) -> Iterable[BaseException]:
    """``exc`` and what it wraps: ``__cause__``/``__context__``, and the attributes client
    libraries keep the socket error in (botocore ``kwargs["error"]``, aiohttp ``os_error``)."""
    seen: set[int] = set()
    stack = [exc]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        kwargs = getattr(current, "kwargs", None)
        inner = [
            kwargs.get("error") if isinstance(kwargs, dict) else None,
            getattr(current, "os_error", None),
            current.__cause__,
            current.__context__,
        ]
        stack.extend(e for e in inner if isinstance(e, BaseException))


def wire_failure(exc: BaseException) -> WireFailure | None:
    """What went wrong on the connection under ``exc``, or None if it was not a connection
    failure (an HTTP error response, bad credentials...)."""
    found: WireFailure | None = None
    for cause in _causes(exc):
        if isinstance(cause, ConnectionRefusedError):
            return WireFailure("refused", "connection refused (nothing listens there)")
        if isinstance(cause, socket.gaierror):
            return WireFailure("unresolved", "the host name does not resolve")
        if found is not None:
            continue
        name = type(cause).__name__
        if "ConnectTimeout" in name or "ConnectionTimeout" in name:
            found = WireFailure("connect-timeout", "no connection could be made in time")
            continue
        if isinstance(cause, ConnectionResetError | BrokenPipeError | ConnectionAbortedError) or (
            isinstance(cause, OSError) and cause.errno in _RESET_ERRNOS
        ):
            found = WireFailure("reset", "the connection was reset by the server")
        elif isinstance(cause, TimeoutError) or "Timeout" in name:
            found = WireFailure("timeout", "the server did not answer in time")
        elif name in (
            "ServerDisconnectedError",
            "ConnectionClosedError",
            "ClientPayloadError",
            "IncompleteRead",
        ):
            found = WireFailure("closed", "the server closed the connection mid-request")
    return found


def speaks_no_http(exc: BaseException) -> bool:
    """Whether ``exc`` shows that the server answered with something that is not HTTP/1.x:
    the binary frames of an HTTP/2-only or gRPC port (aiohttp: ``Bad status line ... Expected
    HTTP/``)."""
    for cause in _causes(exc):
        text = str(cause)
        # binary: the frames start with NUL bytes (a stray text line, say the body of an
        # answer to HEAD that should have had none, is a broken response, not another
        # protocol)
        if "Bad status line" in text and "Expected HTTP/" in text and "\\x00" in text:
            return True
    return False


class Hedger:
    """Hedged reads: a read that takes much longer than its peers is sent again, on another
    connection; the first answer wins and the other is cancelled.

    One slow request out of hundreds (a busy disk, a server's GC pause, a lost packet's
    retransmit timeout) sets the pace of a parallel restore; asking twice costs a few
    percent of bytes and cuts that tail (the technique of Dean and Barroso, "The Tail at
    Scale", 2013). A read is hedged when it has taken ``factor`` (2) times the median time per
    MiB of the last :data:`WINDOW` reads (sizes below 1 MiB count as 1 MiB), and not less than
    ``floor`` seconds; at most ``share`` of the reads, plus one, are hedged, so hedges add
    at most about that share of the bytes. Only idempotent reads of immutable objects are
    hedged: both answers carry the same bytes, and each is verified on its own.

    Args:
        share: the largest fraction of reads hedged (``Settings.hedged_reads``; 0: none).
        factor: how many times a peer's time a read may take before it is hedged.
        floor: seconds below which no read is hedged.
    """

    #: Reads whose times make the median.
    WINDOW = 64
    #: Reads timed before any is hedged.
    WARMUP = 8

    def __init__(self, share: float, *, factor: float = 2.0, floor: float = 0.05) -> None:
        self.share = share
        self.factor = factor
        self.floor = floor
        self._per_mib: collections.deque[float] = collections.deque(maxlen=self.WINDOW)
        self.reads = 0
        self.hedged = 0
        self.won = 0  # hedges that answered first

    def _patience(self, nbytes: int) -> float | None:
        """Seconds a read of ``nbytes`` may take before it is hedged, by the reads timed so
        far; None while fewer than :data:`WARMUP` are."""
        if len(self._per_mib) < self.WARMUP:
            return None
        per_mib = statistics.median(self._per_mib)
        return max(self.floor, self.factor * per_mib * max(nbytes / (1 << 20), 1.0))

    def _may_hedge(self) -> bool:
        return self.hedged + 1 <= self.share * self.reads + 1

    async def run(self, read: Callable[[], Awaitable[_T]], nbytes: int) -> _T:
        """``await read()``, hedged by a second ``read()`` if it is slow."""
        self.reads += 1
        began = time.monotonic()
        if self.share <= 0:
            return await read()
        racers = [asyncio.ensure_future(read())]
        try:
            while True:
                # The patience is asked again while the read runs: the first reads of a
                # restore start together, before any peer has been timed.
                patience = self._patience(nbytes)
                waited = time.monotonic() - began
                if patience is not None and waited >= patience:
                    if self._may_hedge():
                        break
                    return await racers[0]  # the budget is spent: wait for it
                timeout = 0.05 if patience is None else max(patience - waited, 0.05)
                done, _ = await asyncio.wait(racers, timeout=timeout)
                if done:
                    result = racers[0].result()
                    self._timed(began, nbytes)
                    return result
            self.hedged += 1
            racers.append(asyncio.ensure_future(read()))
            pending = set(racers)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if not task.cancelled() and task.exception() is None:
                        self.won += task is racers[1]
                        return task.result()
            return racers[0].result()  # both failed: the first one's error
        finally:  # the loser (or both, if the caller was cancelled) stops here
            for task in racers:
                task.cancel()
            await asyncio.gather(*racers, return_exceptions=True)

    def _timed(self, began: float, nbytes: int) -> None:
        self._per_mib.append((time.monotonic() - began) / max(nbytes / (1 << 20), 1.0))


class NotAnEndpoint(errors.StoreError):
    """The endpoint answered, but not as the store's API does (binary frames of a gRPC port,
    a 404 without the API's error document): raised at once, without retries."""


class Unreachable(errors.StoreError):
    """A store's first request found no server: nothing listens at the endpoint, or its host
    name does not resolve. Raised at once, without retries."""


# ---------------------------------------------------------------------------- retries


class Transport:
    """The retry policy of one store, and whether its server has answered yet.

    Args:
        settings: returns the store's current Settings, where ``retry_attempts``,
            ``retry_delay`` and ``retry_max_delay`` are read at each request (a store's
            settings may be replaced after it is opened).
        endpoint: the server, for messages (redacted here).
        log: the backend's logger, for a line per retry at DEBUG.
    """

    def __init__(
        self, settings: Callable[[], Settings], endpoint: str, log: logging.Logger
    ) -> None:
        self._settings = settings
        self.endpoint = redact_url(endpoint)
        self.contacted = False
        self._log = log
        self._running: set[asyncio.Future[Any]] = set()
        #: Hedged reads of this store (``run(..., hedge_bytes=...)``).
        self.hedger = Hedger(settings().transport.hedged_reads)

    @property
    def attempts(self) -> int:
        """Attempts per request, the first included."""
        return self._settings().transport.retry_attempts

    def backoff(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (from 1): the delay doubled per
        retry up to ``retry_max_delay``, drawn between half of that and all of it."""
        settings = self._settings()
        cap = min(
            settings.transport.retry_max_delay, settings.transport.retry_delay * (2 ** (retry - 1))
        )
        return random.uniform(cap / 2, cap)

    async def pause(self, retry: int) -> None:
        """Sleep :meth:`backoff` seconds."""
        await asyncio.sleep(self.backoff(retry))

    def answered(self) -> None:
        """Record that the server responded (any HTTP status counts)."""
        self.contacted = True

    def check_reachable(self, exc: BaseException, what: str) -> None:
        """Raise :class:`Unreachable` if ``exc`` shows the server was never reached on this
        store's first contact, :class:`NotAnEndpoint` if it answered that first contact in
        something other than HTTP (no retry makes a gRPC port speak HTTP/1.1)."""
        if not self.contacted and speaks_no_http(exc):
            raise NotAnEndpoint(
                f"{what}: {self.endpoint} does not answer in HTTP/1.1 (it sent binary frames, "
                "as a gRPC or HTTP/2-only port does): it is not the object store's API "
                "endpoint; check endpoint_url (SeaweedFS: the -s3.port, 8333 by default)"
            ) from None
        failure = wire_failure(exc)
        if not self.contacted and failure is not None and failure.never_connected:
            raise Unreachable(
                f"{what}: cannot connect to {self.endpoint}: {failure.phrase}; check "
                "endpoint_url and that the server is running"
            ) from None

    async def run(
        self,
        request: Callable[[], Awaitable[_T]],
        *,
        transient: Callable[[BaseException], bool],
        what: str,
        hedge_bytes: int | None = None,
        body_bytes: int = 0,
    ) -> _T:
        """Await ``request()`` until it succeeds, retrying failures ``transient`` accepts.

        The last failure is raised as it is (the backend translates it); it carries the
        number of attempts made, for :func:`attempts_made`. A first contact that finds no
        server raises :class:`Unreachable` instead. The tries and the pauses between them
        share one deadline (``Settings.request_deadline``): past it, the try in flight is
        cancelled and :class:`~ckptstore.errors.DeadlineExceededError` is raised; a request
        that sends a body of ``body_bytes`` in one piece gets that deadline once per
        ``part_size`` of it. A read of ``hedge_bytes`` bytes of an immutable object may be
        hedged (:class:`Hedger`): a try that is slow against its peers is sent a second
        time, and the first answer wins.
        """
        if hedge_bytes is not None:
            hedger = self.hedger
            hedger.share = self._settings().transport.hedged_reads
            plain = request

            def request() -> Awaitable[_T]:
                return hedger.run(plain, hedge_bytes)

        # A request runs as a task of its own that a cancelled caller does not cancel: an
        # upload whose body the server has may still create its object, and cleanup after an
        # interrupt (settle, then delete) must come after it. It ends by its deadline.
        work = asyncio.ensure_future(self._bounded(request, transient, what, body_bytes))
        self._running.add(work)
        work.add_done_callback(self._ended)
        return await asyncio.shield(work)

    def _ended(self, work: asyncio.Future[Any]) -> None:
        self._running.discard(work)
        if not work.cancelled():
            work.exception()  # retrieved: a caller that was cancelled never will

    async def settle(self) -> None:
        """Wait until every request in flight now has ended, its callers cancelled or not."""
        if self._running:
            await asyncio.wait(list(self._running))

    async def _bounded(
        self,
        request: Callable[[], Awaitable[_T]],
        transient: Callable[[BaseException], bool],
        what: str,
        body_bytes: int,
    ) -> _T:
        settings = self._settings().transport
        parts = max(1, -(-body_bytes // settings.part_size))
        limit = settings.request_deadline * parts
        tries: list[BaseException] = []
        timeout = asyncio.timeout(limit)
        try:
            async with timeout:
                return await self._tries(request, transient, what, tries)
        except TimeoutError:
            if not timeout.expired():
                raise  # a timeout of the client's own, raised by the last try
            last = f"; the last try failed with {tries[-1]}" if tries else ""
            scaled = (
                f", {settings.request_deadline:g} s per part_size of its {body_bytes:,}-byte body"
                if parts > 1
                else ""
            )
            raise errors.DeadlineExceededError(
                f"{what}: no complete answer within the request deadline of {limit:g} s "
                f"(Settings.request_deadline{scaled}) after {len(tries) + 1} tries{last}; the "
                f"server at {self.endpoint} accepts but does not answer, or answers too "
                "slowly"
            ) from None

    async def _tries(
        self,
        request: Callable[[], Awaitable[_T]],
        transient: Callable[[BaseException], bool],
        what: str,
        failures: list[BaseException],
    ) -> _T:
        attempt = 0
        began = time.monotonic()
        while True:
            attempt += 1
            try:
                result = await request()
            except Exception as exc:
                self.check_reachable(exc, what)
                failure = wire_failure(exc)
                if failure is None or not failure.never_connected:
                    self.contacted = True  # an answer, even an error, means it is there
                attempts = self.attempts
                if attempt >= attempts or not transient(exc):
                    exc.ckptstore_attempts = attempt  # type: ignore[attr-defined]
                    raise
                failures.append(exc)
                self._log.debug("%s: %s, retry %d of %d", what, exc, attempt, attempts - 1)
                await self.pause(attempt)
                continue
            self.contacted = True
            if self._log.isEnabledFor(logging.DEBUG):
                tries = f" after {attempt} tries" if attempt > 1 else ""
                self._log.debug("%s: done in %.3f s%s", what, time.monotonic() - began, tries)
            return result


def attempts_made(exc: BaseException, default: int = 1) -> int:
    """How many attempts :meth:`Transport.run` made before raising ``exc``."""
    return int(getattr(exc, "ckptstore_attempts", default))


# ---------------------------------------------------------------------------- byte budget


class ByteBudget:
    """At most ``limit`` bytes of bodies in flight; a request larger than the limit runs
    alone (it waits until nothing else is in flight)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0
        self._changed: asyncio.Condition | None = None

    @contextlib.asynccontextmanager
    async def hold(self, nbytes: int) -> AsyncIterator[None]:
        """Wait until ``nbytes`` fit, count them as in flight for the body of the block."""
        if self._changed is None:  # created on first use, on the loop that uses it
            self._changed = asyncio.Condition()
        changed = self._changed
        need = min(nbytes, self.limit)
        async with changed:
            await changed.wait_for(lambda: self.in_flight + need <= self.limit)
            self.in_flight += need
        try:
            yield
        finally:
            async with changed:
                self.in_flight -= need
                changed.notify_all()
