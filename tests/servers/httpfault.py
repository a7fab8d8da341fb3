"""A small HTTP proxy that records requests and injects faults, for testing retry paths.

It forwards every request to an upstream server (fake-gcs-server) unless a rule matches, in
which case it answers with an error status, or forwards and then damages the response:
cuts the body short and drops the connection (as a reset mid-body does), or flips one byte
(as a corrupted body does). It runs on the test's own event loop on a free loopback port.
"""

from __future__ import annotations

import io
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import pytest
import yarl
from aiohttp import web

__all__ = ["FaultProxy", "Recorded", "Rule", "fault_proxy"]

_HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "content-encoding"}


@dataclass
class Rule:
    """Requests whose ``METHOD path?query`` matches ``pattern`` get ``action``.

    Attributes:
        pattern: regular expression searched in e.g. ``"POST /upload/storage/v1/b/x/o?..."``.
        action: an HTTP status to answer with, ``"truncate"`` or ``"corrupt"``.
        times: how many matching requests to hit (``None``: all of them).
    """

    pattern: str
    action: int | str
    times: int | None = 1
    hits: int = 0

    def take(self, line: str) -> bool:
        if self.times is not None and self.hits >= self.times:
            return False
        if re.search(self.pattern, line) is None:
            return False
        self.hits += 1
        return True


@dataclass(frozen=True)
class Recorded:
    method: str
    path: str
    query: dict[str, str]
    fault: int | str | None
    authorization: str | None

    @property
    def line(self) -> str:
        return f"{self.method} {self.path}"


@dataclass
class FaultProxy:
    upstream: str
    endpoint: str = ""
    rules: list[Rule] = field(default_factory=list)
    requests: list[Recorded] = field(default_factory=list)

    def add(self, pattern: str, action: int | str, times: int | None = 1) -> Rule:
        rule = Rule(pattern, action, times)
        self.rules.append(rule)
        return rule

    def matching(self, pattern: str) -> list[Recorded]:
        return [r for r in self.requests if re.search(pattern, r.line)]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        line = f"{request.method} {request.raw_path}"
        rule = next((r for r in self.rules if r.take(line)), None)
        action = rule.action if rule is not None else None
        self.requests.append(
            Recorded(
                request.method,
                request.raw_path,
                dict(request.query),
                action,
                request.headers.get("Authorization"),
            )
        )
        body = await request.read()
        if isinstance(action, int):
            return web.json_response(
                {"error": {"code": action, "message": "injected by the test proxy"}},
                status=action,
            )
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        async with (
            aiohttp.ClientSession(auto_decompress=False) as session,
            session.request(
                request.method,
                yarl.URL(self.upstream + request.raw_path, encoded=True),
                headers=headers,
                data=io.BytesIO(body),
            ) as upstream,
        ):
            payload = await upstream.read()
            out_headers = {
                k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS
            }
            status = upstream.status
        if action == "corrupt" and payload:
            payload = bytes([payload[0] ^ 0xFF]) + payload[1:]
        if action == "truncate" and len(payload) > 1:
            response = web.StreamResponse(status=status, headers=out_headers)
            response.content_length = len(payload)
            await response.prepare(request)
            await response.write(payload[: len(payload) // 2])
            assert request.transport is not None
            request.transport.abort()  # the peer sees the body end early
            return response
        return web.Response(status=status, headers=out_headers, body=payload)


@pytest.fixture
async def fault_proxy(fake_gcs: object) -> AsyncIterator[FaultProxy]:
    """A recording, fault-injecting proxy in front of the session's fake-gcs-server."""
    proxy = FaultProxy(upstream=fake_gcs.endpoint)  # type: ignore[attr-defined]
    app = web.Application(client_max_size=1 << 30)
    app.router.add_route("*", "/{tail:.*}", proxy.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    proxy.endpoint = f"http://127.0.0.1:{port}"
    try:
        yield proxy
    finally:
        await runner.cleanup()
