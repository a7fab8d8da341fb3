"""A fault-injecting HTTP proxy for tests of the object-store backends.

:class:`FaultProxy` listens on 127.0.0.1 and forwards HTTP/1.1 requests to one upstream
server (moto, SeaweedFS, fake-gcs-server). Point a client's ``endpoint_url`` at
:attr:`FaultProxy.endpoint` and it sees the upstream server, except that chosen requests, or a
seeded random share of them, fail the way real networks and object stores fail:

===================  ==========================================================================
``"503"``, ``"429"``  any 4xx or 5xx status: not forwarded; answered with that status and the
                     error body the dialect's clients parse (S3 XML such as ``SlowDown``, or
                     GCS JSON)
``"reset"``          a request with a body is read and not forwarded, then the connection is
                     reset (the client saw its upload break); a request without a body is
                     forwarded and the response is cut by a TCP reset after ``nbytes`` of its
                     body
``"truncate"``       forwarded; the response head announces the full length but the
                     connection closes after ``nbytes`` of the body (or half of it)
``"corrupt"``        forwarded; the first byte of the response body is flipped, as a body
                     damaged on the way would be
``"corrupt_request"`` forwarded with the middle byte of the request body flipped (an upload
                     damaged on the way: the server must refuse it, or the client notice)
``"drop_checksum"``  forwarded; the response's JSON body loses its ``crc32c`` field (a GCS
                     server that does not report the checksum of what it stored)
``"drop_response"``  forwarded and carried out upstream; the response is discarded and the
                     connection closed, as when a commit succeeds and its reply is lost
``"strip_header"``   forwarded without the request header ``header`` (a server that ignores
                     a condition such as ``If-None-Match``)
``"stall"``          read and not forwarded; never answered, the connection held open and
                     silent until the client gives up (a server that accepts and hangs)
``"trickle"``        forwarded; the response head is sent, then its body one byte every
                     ``seconds`` (a server or link that answers one byte a second)
``"stall_body"``     forwarded; the head and ``nbytes`` of the body (or half of it) are sent,
                     then nothing more, the connection held open (a body that stops)
``"delay"``          forwarded, and answered whole ``seconds`` later (a slow straggler)
===================  ==========================================================================

One proxy serves both object-store dialects: ``dialect="s3"`` (the default) names requests
with :func:`classify_s3` and answers injected statuses with S3's XML errors; ``dialect="gcs"``
uses :func:`classify_gcs` and the JSON API's error bodies. Rules select requests by those
operation names, by the request target and by the request body.

The proxy runs its own event loop in a thread, so synchronous and asynchronous tests use it
alike, and it speaks raw HTTP/1.1 rather than going through an HTTP library, so what reaches
the server and the client is exactly what the rule says (a body cut at a chosen byte, a reset
rather than a clean close). It records what passed: :attr:`FaultProxy.requests` counts
requests by operation, :attr:`FaultProxy.log` holds each one (:class:`Recorded`), and
:attr:`FaultProxy.injected` counts the faults injected, by kind.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import json
import random
import re
import socket
import struct
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal, Self
from urllib.parse import parse_qsl, urlsplit

from ckptstore.testing.servers import Stoppable

__all__ = [
    "FAULT_KINDS",
    "FaultProxy",
    "ProxyFault",
    "Recorded",
    "classify_gcs",
    "classify_s3",
]

#: The damage a rule can do besides answering with an error status (any 4xx or 5xx, given as
#: its digits, such as ``"503"``).
FAULT_KINDS = (
    "503",
    "500",
    "reset",
    "truncate",
    "corrupt",
    "corrupt_request",
    "drop_checksum",
    "drop_response",
    "strip_header",
    "stall",
    "trickle",
    "stall_body",
    "delay",
)

Dialect = Literal["s3", "gcs"]

_S3_ERROR_CODES = {
    500: ("InternalError", "We encountered an internal error."),
    503: ("SlowDown", "Please reduce your request rate."),
}


def _is_status(kind: str) -> bool:
    return kind.isdigit() and len(kind) == 3 and 400 <= int(kind) <= 599


def classify_s3(method: str, target: str) -> str:
    """The S3 operation an HTTP request performs, by method and query string.

    One of ``put_object``, ``upload_part``, ``create_multipart``, ``complete_multipart``,
    ``abort_multipart``, ``list_uploads``, ``delete_objects``, ``get``, ``head``, ``list``,
    ``delete``, ``other``.
    """
    path, _, query = target.partition("?")
    params = {p.split("=", 1)[0] for p in query.split("&") if p}
    in_bucket = path.strip("/").count("/") >= 1  # path style: /bucket/key
    if method == "PUT":
        if "partNumber" in params:
            return "upload_part"
        return "put_object" if in_bucket else "other"
    if method == "POST":
        if "uploads" in params:
            return "create_multipart"
        if "uploadId" in params:
            return "complete_multipart"
        if "delete" in params:
            return "delete_objects"
        return "other"
    if method == "DELETE":
        return "abort_multipart" if "uploadId" in params else "delete"
    if method == "HEAD":
        return "head"
    if method == "GET":
        if "uploads" in params:
            return "list_uploads"
        return "get" if in_bucket else "list"
    return "other"


def classify_gcs(method: str, target: str) -> str:
    """The GCS JSON API operation an HTTP request performs, by method and path.

    One of ``upload`` (``POST /upload/...``), ``download`` (``GET /download/...`` or
    ``alt=media``), ``compose``, ``metadata`` (``GET`` of one object), ``list``, ``delete``,
    ``other``.
    """
    path, _, query = target.partition("?")
    if path.startswith("/upload/"):
        return "upload"
    if path.startswith("/download/") or (method == "GET" and "alt=media" in query):
        return "download"
    if method == "POST" and path.endswith("/compose"):
        return "compose"
    objects = re.match(r"^/storage/v1/b/[^/]+/o(/.*)?$", path)
    if objects is None:
        return "other"
    if method == "DELETE":
        return "delete"
    if method == "GET":
        return "list" if objects.group(1) is None else "metadata"
    return "other"


@dataclass(frozen=True, slots=True)
class ProxyFault:
    """One rule: which requests fail, and how.

    Attributes:
        kind: an HTTP error status (``"503"``, ``"429"``, any 4xx or 5xx) or one of
            :data:`FAULT_KINDS` (the module's table says what each does).
        ops: operation names (:func:`classify_s3` or :func:`classify_gcs`, by the proxy's
            dialect) the rule applies to; empty: every request.
        rate: probability that a matching request is hit (the proxy's seeded RNG draws).
        every: hit every ``every``-th matching request instead of drawing (``None``: draw by
            ``rate``). The count of hits then depends only on how many requests match, not on
            the order concurrent requests arrive in, so a test that asserts how many faults
            it met cannot fail by chance.
        after: let this many matching requests through first.
        times: hit at most this many requests (``None``: no limit).
        path: a regular expression the request target (path and query) must contain a
            match of.
        body: bytes the request body must contain (GCS uploads name their object in the
            body, not in the target).
        nbytes: for ``reset`` and ``truncate``, bytes of the response body sent before the
            cut (``None``: half of the body).
        header: for ``strip_header``, the request header to remove (case-insensitive).
        seconds: for ``trickle``, the pause before each byte of the body; for ``delay``, the
            pause before the answer.
    """

    kind: str
    ops: frozenset[str] = frozenset()
    rate: float = 1.0
    every: int | None = None
    after: int = 0
    times: int | None = None
    path: str | None = None
    body: bytes | None = None
    nbytes: int | None = None
    header: str = "if-none-match"
    seconds: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS and not _is_status(self.kind):
            raise ValueError(
                f"unknown fault kind {self.kind!r}; known: an HTTP error status or {FAULT_KINDS}"
            )
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"rate must be in [0, 1], got {self.rate}")
        if self.every is not None:
            if self.every < 1:
                raise ValueError(f"every must be at least 1, got {self.every}")
            if self.rate < 1.0:
                raise ValueError("give a fault either rate= or every=, not both")

    def selects(self, op: str, target: str, body: bytes) -> bool:
        """Whether a request with this operation, target and body is one this rule is for
        (before ``after``, ``times`` and ``rate`` decide whether it is hit)."""
        return (
            (not self.ops or op in self.ops)
            and (self.path is None or re.search(self.path, target) is not None)
            and (self.body is None or self.body in body)
        )


@dataclass
class _RuleCounts:
    """How many requests a rule selected and how many of them it hit."""

    selected: int = 0
    hit: int = 0

    def admits(self, fault: ProxyFault, rng: random.Random) -> bool:
        """Count one selected request; whether the rule hits it."""
        self.selected += 1
        spent = fault.times is not None and self.hit >= fault.times
        if self.selected <= fault.after or spent:
            return False
        if fault.every is not None and (self.selected - fault.after) % fault.every:
            return False
        if fault.rate < 1.0 and rng.random() >= fault.rate:
            return False
        self.hit += 1
        return True


@dataclass(frozen=True, slots=True)
class Recorded:
    """One request that reached the proxy, and the fault it got (``None``: passed through)."""

    method: str
    target: str
    op: str
    fault: str | None
    authorization: str | None

    @property
    def path(self) -> str:
        return self.target.partition("?")[0]

    @property
    def query(self) -> dict[str, str]:
        """The query parameters (the last value of a repeated one)."""
        return dict(parse_qsl(self.target.partition("?")[2], keep_blank_values=True))


@dataclass
class _Message:
    head: bytes  # start line and headers, without the blank line
    headers: dict[str, str]  # lower-cased names
    body: bytes = field(default=b"")


class _Closed(Exception):
    """The peer closed the connection between requests."""


async def _read_head(reader: asyncio.StreamReader) -> tuple[bytes, dict[str, str]]:
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        raise _Closed from exc
    head = raw[:-4]
    headers: dict[str, str] = {}
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return head, headers


def _is_chunked(headers: dict[str, str]) -> bool:
    return "chunked" in headers.get("transfer-encoding", "").lower()


async def _read_body(
    reader: asyncio.StreamReader, headers: dict[str, str], *, until_eof: bool
) -> bytes:
    """The body as it came on the wire (chunked framing kept)."""
    if _is_chunked(headers):
        out = bytearray()
        while True:
            size_line = await reader.readuntil(b"\r\n")
            out += size_line
            size = int(size_line.split(b";")[0].strip(), 16)
            if size == 0:
                while True:  # trailers, then the blank line
                    line = await reader.readuntil(b"\r\n")
                    out += line
                    if line == b"\r\n":
                        return bytes(out)
            out += await reader.readexactly(size + 2)
    if "content-length" in headers:
        return await reader.readexactly(int(headers["content-length"]))
    return await reader.read() if until_eof else b""


def _dechunk(raw: bytes) -> bytes:
    """The payload of a chunked body."""
    out = bytearray()
    pos = 0
    while True:
        end = raw.index(b"\r\n", pos)
        size = int(raw[pos:end].split(b";")[0].strip(), 16)
        if size == 0:
            return bytes(out)
        out += raw[end + 2 : end + 2 + size]
        pos = end + 2 + size + 2


def _without_header(head: bytes, name: str) -> bytes:
    lines = head.split(b"\r\n")
    keep = [lines[0]] + [
        line for line in lines[1:] if line.split(b":", 1)[0].strip().lower() != name.encode()
    ]
    return b"\r\n".join(keep)


def _without_checksum(response: _Message) -> _Message:
    """``response`` with the ``crc32c`` field of its JSON body removed."""
    payload = _dechunk(response.body) if _is_chunked(response.headers) else response.body
    try:
        doc = json.loads(payload)
    except ValueError:
        return response  # not JSON: nothing to drop
    if isinstance(doc, dict):
        doc.pop("crc32c", None)
    payload = json.dumps(doc).encode()
    return _Message(_with_length(response.head, len(payload)), response.headers, payload)


def _damaged(request: _Message) -> _Message:
    """``request`` with the middle byte of its body flipped, framed by a Content-Length."""
    payload = _dechunk(request.body) if _is_chunked(request.headers) else request.body
    at = len(payload) // 2
    payload = payload[:at] + bytes([payload[at] ^ 0xFF]) + payload[at + 1 :]
    return _Message(_with_length(request.head, len(payload)), request.headers, payload)


def _with_length(head: bytes, length: int) -> bytes:
    """``head`` with its framing replaced by a Content-Length (for a body we rewrite)."""
    head = _without_header(_without_header(head, "transfer-encoding"), "content-length")
    return head + b"\r\nContent-Length: " + str(length).encode()


async def _hold(reader: asyncio.StreamReader) -> None:
    """Say nothing until the client closes the connection (or the proxy stops)."""
    with contextlib.suppress(ConnectionError, OSError):
        while await reader.read(1 << 16):
            pass


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST rather than a FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def _error_response(status: int, dialect: Dialect) -> bytes:
    """A whole HTTP response with ``status`` and the error body the dialect's clients parse."""
    reason = http.HTTPStatus(status).phrase
    message = "injected by the ckptstore test proxy"
    if dialect == "gcs":
        payload = json.dumps({"error": {"code": status, "message": message}}).encode()
        content_type = b"application/json"
    else:
        code, text = _S3_ERROR_CODES.get(status, (reason.replace(" ", ""), message))
        payload = f"<Error><Code>{code}</Code><Message>{text}</Message></Error>".encode()
        content_type = b"application/xml"
    return (
        f"HTTP/1.1 {status} {reason}\r\n".encode()
        + b"Content-Type: "
        + content_type
        + b"\r\nContent-Length: "
        + str(len(payload)).encode()
        + b"\r\n\r\n"
        + payload
    )


class FaultProxy(Stoppable):
    """An HTTP/1.1 proxy on 127.0.0.1 in front of ``upstream`` that injects faults.

    Args:
        upstream: ``http://host:port`` of the real server (loopback only).
        faults: rules, checked in order for each request; the first that hits applies.
        seed: seed of the draws for ``rate``, so a failing run replays.
        dialect: ``"s3"`` or ``"gcs"``: how requests are named and errors answered.

    Use as a context manager, or call :meth:`start` and :meth:`stop`. Rules may be replaced
    (:meth:`set_faults`) or added (:meth:`add`) while the proxy runs.
    """

    def __init__(
        self,
        upstream: str,
        faults: list[ProxyFault] | None = None,
        *,
        seed: int = 0,
        dialect: Dialect = "s3",
    ):
        parts = urlsplit(upstream)
        if parts.scheme != "http" or parts.hostname not in ("127.0.0.1", "localhost"):
            raise ValueError(f"upstream must be an http:// loopback address, got {upstream!r}")
        if dialect not in ("s3", "gcs"):
            raise ValueError(f"dialect must be 's3' or 'gcs', got {dialect!r}")
        self.upstream_host = parts.hostname
        self.upstream_port = parts.port or 80
        self.dialect: Dialect = dialect
        self._classify = classify_gcs if dialect == "gcs" else classify_s3
        self.faults: list[ProxyFault] = []
        self._counts: list[_RuleCounts] = []
        self.seed = seed
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        #: faults injected, by kind
        self.injected: Counter[str] = Counter()
        #: faults injected, by ``"kind op"``
        self.injected_ops: Counter[str] = Counter()
        #: requests seen, by operation
        self.requests: Counter[str] = Counter()
        #: Bytes of response bodies sent to clients (what a client downloaded through it).
        self.body_bytes = 0
        #: every request seen, in order of arrival
        self.log: list[Recorded] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._clients: set[asyncio.StreamWriter] = set()
        self.port = 0
        self.set_faults(list(faults or []))

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:PORT`` to give clients as their endpoint."""
        return f"http://127.0.0.1:{self.port}"

    def set_faults(self, faults: list[ProxyFault], *, seed: int | None = None) -> None:
        """Replace the rules (and reset their counters)."""
        with self._lock:
            self.faults = list(faults)
            self._counts = [_RuleCounts() for _ in self.faults]
            if seed is not None:
                self._rng = random.Random(seed)

    def add(self, *faults: ProxyFault) -> None:
        """Add rules after the existing ones (whose counters keep running)."""
        with self._lock:
            self.faults.extend(faults)
            self._counts.extend(_RuleCounts() for _ in faults)

    def calls(self, *ops: str) -> list[Recorded]:
        """The recorded requests of these operations (all of them if none are named)."""
        with self._lock:
            return [r for r in self.log if not ops or r.op in ops]

    # ------------------------------------------------------------------ life cycle

    def start(self) -> Self:
        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self._loop = loop
            try:
                self._server = loop.run_until_complete(
                    asyncio.start_server(self._serve, "127.0.0.1", 0, limit=1 << 20)
                )
                self.port = self._server.sockets[0].getsockname()[1]
            except BaseException as exc:
                errors.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            loop.run_forever()
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()

        self._thread = threading.Thread(target=run, name="ckptstore-fault-proxy", daemon=True)
        self._thread.start()
        ready.wait()
        if errors:
            raise errors[0]
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            loop = self._loop
            server = self._server

            def shutdown() -> None:
                if server is not None:
                    server.close()
                for client in list(self._clients):
                    client.transport.abort()
                loop.stop()

            loop.call_soon_threadsafe(shutdown)
            self._thread.join(timeout=10)
        self._loop = self._thread = self._server = None

    def __enter__(self) -> Self:
        return self.start()

    # ------------------------------------------------------------------ serving

    def _choose(self, request: _Message) -> ProxyFault | None:
        """The rule that hits ``request`` (if any), with the request recorded and counted."""
        method, target = (p.decode("latin-1") for p in request.head.split(b" ", 2)[:2])
        op = self._classify(method, target)
        with self._lock:
            chosen = next(
                (
                    rule
                    for rule, counts in zip(self.faults, self._counts, strict=True)
                    if rule.selects(op, target, request.body) and counts.admits(rule, self._rng)
                ),
                None,
            )
            self.requests[op] += 1
            self.log.append(
                Recorded(
                    method,
                    target,
                    op,
                    None if chosen is None else chosen.kind,
                    request.headers.get("authorization"),
                )
            )
            if chosen is not None:
                self.injected[chosen.kind] += 1
                self.injected_ops[f"{chosen.kind} {op}"] += 1
            return chosen

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._clients.add(writer)
        try:
            while True:
                try:
                    head, headers = await _read_head(reader)
                except _Closed:
                    return
                if headers.get("expect", "").lower() == "100-continue":
                    head = _without_header(head, "expect")
                    writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                body = await _read_body(reader, headers, until_eof=False)
                request = _Message(head, headers, body)
                fault = self._choose(request)
                kind = None if fault is None else fault.kind
                if kind is not None and _is_status(kind):
                    writer.write(_error_response(int(kind), self.dialect))
                    await writer.drain()
                    continue
                if kind == "reset" and body:
                    _reset(writer)
                    return
                if kind == "stall":
                    await _hold(reader)
                    return
                if fault is not None and kind == "strip_header":
                    request.head = _without_header(request.head, fault.header.lower())
                if kind == "corrupt_request" and body:
                    request = _damaged(request)
                if upstream is None:
                    upstream = await asyncio.open_connection(
                        self.upstream_host, self.upstream_port, limit=1 << 20
                    )
                response = await self._forward(request, upstream)
                if kind == "drop_response":
                    writer.close()
                    return
                if kind == "drop_checksum":
                    response = _without_checksum(response)
                if fault is not None and kind in ("reset", "truncate", "corrupt"):
                    if not await self._damage(writer, response, fault):
                        return
                    continue
                if fault is not None and kind in ("trickle", "stall_body"):
                    await self._slow(reader, writer, response, fault)
                    return
                if fault is not None and kind == "delay":
                    await asyncio.sleep(fault.seconds)
                writer.write(response.head + b"\r\n\r\n" + response.body)
                await writer.drain()
                with self._lock:
                    self.body_bytes += len(response.body)
                closes = "close" in response.headers.get("connection", "").lower()
                if closes or "close" in headers.get("connection", "").lower():
                    return
        except (ConnectionError, asyncio.IncompleteReadError, _Closed):
            return
        finally:
            self._clients.discard(writer)
            if upstream is not None:
                upstream[1].close()
            if not writer.is_closing():
                writer.close()

    @staticmethod
    async def _forward(
        request: _Message, upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter]
    ) -> _Message:
        """Send ``request`` upstream and read the whole response."""
        up_reader, up_writer = upstream
        up_writer.write(request.head + b"\r\n\r\n" + request.body)
        await up_writer.drain()
        head, headers = await _read_head(up_reader)
        status = int(head.split(b" ", 2)[1])
        method = request.head.split(b" ", 1)[0]
        no_body = method == b"HEAD" or status in (204, 304) or status < 200
        closes = "close" in headers.get("connection", "").lower()
        body = b"" if no_body else await _read_body(up_reader, headers, until_eof=closes)
        return _Message(head, headers, body)

    @staticmethod
    async def _slow(
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        response: _Message,
        fault: ProxyFault,
    ) -> None:
        """Send ``response`` a byte at a time (``trickle``) or stop part-way and hold the
        connection (``stall_body``), until the body ends or the client gives up."""
        payload = _dechunk(response.body) if _is_chunked(response.headers) else response.body
        writer.write(_with_length(response.head, len(payload)) + b"\r\n\r\n")
        if fault.kind == "stall_body":
            cut = fault.nbytes if fault.nbytes is not None else len(payload) // 2
            writer.write(payload[:cut])
            await writer.drain()
            await _hold(reader)
            return
        for at in range(len(payload)):
            await writer.drain()
            await asyncio.sleep(fault.seconds)
            if writer.is_closing() or reader.at_eof():
                return
            writer.write(payload[at : at + 1])
        await writer.drain()

    @staticmethod
    async def _damage(writer: asyncio.StreamWriter, response: _Message, fault: ProxyFault) -> bool:
        """Send ``response`` damaged as ``fault`` says; whether the connection stays open."""
        payload = _dechunk(response.body) if _is_chunked(response.headers) else response.body
        head = _with_length(response.head, len(payload))
        if fault.kind == "corrupt":
            if payload:
                payload = bytes([payload[0] ^ 0xFF]) + payload[1:]
            writer.write(head + b"\r\n\r\n" + payload)
            await writer.drain()
            return "close" not in response.headers.get("connection", "").lower()
        if not payload:  # nothing to cut: the whole reply is lost
            writer.close()
            return False
        cut = fault.nbytes if fault.nbytes is not None else len(payload) // 2
        writer.write(head + b"\r\n\r\n" + payload[:cut])
        await writer.drain()
        if fault.kind == "reset":
            _reset(writer)
        else:
            writer.close()
        return False
