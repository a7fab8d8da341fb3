"""A fault-injecting HTTP proxy for tests of the object-store backends.

:class:`FaultProxy` listens on 127.0.0.1 and forwards HTTP/1.1 requests to one upstream
server (moto, SeaweedFS, fake-gcs-server). Point a client's ``endpoint_url`` at
:attr:`FaultProxy.endpoint` and it sees the upstream server, except that chosen requests, or a
seeded random share of them, fail the way real networks and object stores fail:

===================  ==========================================================================
``"503"``            not forwarded; answered ``503 SlowDown`` (S3's throttling reply)
``"500"``            not forwarded; answered ``500 InternalError``
``"reset"``          a request with a body is read and not forwarded, then the connection is
                     reset (the client saw its upload break); a request without a body is
                     forwarded and the response is cut by a TCP reset after ``nbytes`` of its
                     body
``"truncate"``       forwarded; the response head announces the full length but the
                     connection closes after ``nbytes`` of the body (or half of it)
``"drop_response"``  forwarded and carried out upstream; the response is discarded and the
                     connection closed, as when a commit succeeds and its reply is lost
``"strip_header"``   forwarded without the request header ``header`` (a server that ignores
                     a condition such as ``If-None-Match``)
===================  ==========================================================================

The proxy runs its own event loop in a thread, so synchronous and asynchronous tests use it
alike. Each request is classified into an operation name (:func:`classify_s3`) that rules can
select; :attr:`FaultProxy.injected` counts the faults injected, by kind.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import socket
import struct
import threading
from collections import Counter
from dataclasses import dataclass
from types import TracebackType
from typing import Self
from urllib.parse import urlsplit

__all__ = ["FAULT_KINDS", "FaultProxy", "ProxyFault", "classify_s3"]

FAULT_KINDS = ("503", "500", "reset", "truncate", "drop_response", "strip_header")

_ERROR_BODIES = {
    "503": (
        b"503 Slow Down",
        b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>",
    ),
    "500": (
        b"500 Internal Server Error",
        b"<Error><Code>InternalError</Code><Message>We encountered an internal error."
        b"</Message></Error>",
    ),
}


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


@dataclass(frozen=True, slots=True)
class ProxyFault:
    """One rule: which requests fail, and how.

    Attributes:
        kind: one of :data:`FAULT_KINDS`.
        ops: operation names (:func:`classify_s3`) the rule applies to; empty: every request.
        rate: probability that a matching request is hit (the proxy's seeded RNG draws).
        after: let this many matching requests through first.
        times: hit at most this many requests (``None``: no limit).
        path: a regular expression the request target must contain a match of.
        nbytes: for ``reset`` and ``truncate``, bytes of the response body sent before the
            cut (``None``: half of the body).
        header: for ``strip_header``, the request header to remove (case-insensitive).
    """

    kind: str
    ops: frozenset[str] = frozenset()
    rate: float = 1.0
    after: int = 0
    times: int | None = None
    path: str | None = None
    nbytes: int | None = None
    header: str = "if-none-match"

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; known: {FAULT_KINDS}")
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"rate must be in [0, 1], got {self.rate}")


@dataclass
class _Message:
    head: bytes  # start line and headers, without the blank line
    headers: dict[str, str]  # lower-cased names
    body: bytes

    def header_bytes(self) -> bytes:
        return self.head + b"\r\n\r\n"


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


async def _read_body(
    reader: asyncio.StreamReader, headers: dict[str, str], *, until_eof: bool
) -> bytes:
    if "chunked" in headers.get("transfer-encoding", "").lower():
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


def _without_header(head: bytes, name: str) -> bytes:
    lines = head.split(b"\r\n")
    keep = [lines[0]] + [
        line for line in lines[1:] if line.split(b":", 1)[0].strip().lower() != name.encode()
    ]
    return b"\r\n".join(keep)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST rather than a FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class FaultProxy:
    """An HTTP/1.1 proxy on 127.0.0.1 in front of ``upstream`` that injects faults.

    Args:
        upstream: ``http://host:port`` of the real server (loopback only).
        faults: rules, checked in order for each request; the first that hits applies.
        seed: seed of the draws for ``rate``, so a failing run replays.

    Use as a context manager, or call :meth:`start` and :meth:`stop`. :attr:`faults` may be
    replaced while the proxy runs.
    """

    def __init__(self, upstream: str, faults: list[ProxyFault] | None = None, *, seed: int = 0):
        parts = urlsplit(upstream)
        if parts.scheme != "http" or parts.hostname not in ("127.0.0.1", "localhost"):
            raise ValueError(f"upstream must be an http:// loopback address, got {upstream!r}")
        self.upstream_host = parts.hostname
        self.upstream_port = parts.port or 80
        self.faults = list(faults or [])
        self.seed = seed
        self._rng = random.Random(seed)
        self._seen: Counter[int] = Counter()
        self._hits: Counter[int] = Counter()
        self._lock = threading.Lock()
        #: faults injected, by kind
        self.injected: Counter[str] = Counter()
        #: faults injected, by ``"kind op"``
        self.injected_ops: Counter[str] = Counter()
        #: requests seen, by operation
        self.requests: Counter[str] = Counter()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._clients: set[asyncio.StreamWriter] = set()
        self.port = 0

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:PORT`` to give clients as their endpoint."""
        return f"http://127.0.0.1:{self.port}"

    def set_faults(self, faults: list[ProxyFault], *, seed: int | None = None) -> None:
        """Replace the rules (and reset their counters)."""
        with self._lock:
            self.faults = list(faults)
            self._seen.clear()
            self._hits.clear()
            if seed is not None:
                self._rng = random.Random(seed)

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

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ------------------------------------------------------------------ serving

    def _choose(self, op: str, target: str) -> ProxyFault | None:
        with self._lock:
            self.requests[op] += 1
            for index, fault in enumerate(self.faults):
                if fault.ops and op not in fault.ops:
                    continue
                if fault.path is not None and not re.search(fault.path, target):
                    continue
                self._seen[index] += 1
                if self._seen[index] <= fault.after:
                    continue
                if fault.times is not None and self._hits[index] >= fault.times:
                    continue
                if fault.rate < 1.0 and self._rng.random() >= fault.rate:
                    continue
                self._hits[index] += 1
                self.injected[fault.kind] += 1
                self.injected_ops[f"{fault.kind} {op}"] += 1
                return fault
            return None

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
                method, target = head.split(b" ", 2)[:2]
                op = classify_s3(method.decode(), target.decode("latin-1"))
                fault = self._choose(op, target.decode("latin-1"))
                request = _Message(head, headers, body)
                if fault is not None and fault.kind in _ERROR_BODIES:
                    status, payload = _ERROR_BODIES[fault.kind]
                    writer.write(
                        b"HTTP/1.1 " + status + b"\r\nContent-Type: application/xml\r\n"
                        b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload
                    )
                    await writer.drain()
                    continue
                if fault is not None and fault.kind == "reset" and body:
                    _reset(writer)
                    return
                if fault is not None and fault.kind == "strip_header":
                    request.head = _without_header(request.head, fault.header.lower())
                if upstream is None:
                    upstream = await asyncio.open_connection(
                        self.upstream_host, self.upstream_port, limit=1 << 20
                    )
                up_reader, up_writer = upstream
                up_writer.write(request.header_bytes() + request.body)
                await up_writer.drain()
                response_head, response_headers = await _read_head(up_reader)
                status_code = int(response_head.split(b" ", 2)[1])
                no_body = method == b"HEAD" or status_code in (204, 304) or status_code < 200
                closes = "close" in response_headers.get("connection", "").lower()
                response_body = (
                    b""
                    if no_body
                    else await _read_body(up_reader, response_headers, until_eof=closes)
                )
                if fault is not None and fault.kind == "drop_response":
                    writer.close()
                    return
                if fault is not None and fault.kind in ("reset", "truncate"):
                    if not response_body:  # nothing to cut: the whole reply is lost
                        writer.close()
                        return
                    cut = fault.nbytes if fault.nbytes is not None else len(response_body) // 2
                    writer.write(response_head + b"\r\n\r\n" + response_body[:cut])
                    await writer.drain()
                    if fault.kind == "reset":
                        _reset(writer)
                    else:
                        writer.close()
                    return
                writer.write(response_head + b"\r\n\r\n" + response_body)
                await writer.drain()
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
