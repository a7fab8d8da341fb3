"""The transport policy every network backend follows (ckptstore/store/transport.py).

One retry policy (``Settings.retry_*``) with its documented old option names, the first-contact
rule (a refused connection fails at once, later ones are retried), messages that say what
happened on the wire, ``endpoint_url`` validated at open, the in-flight byte budget on every
backend, and sessions closed on every error path. Real servers throughout: moto, fake-gcs-server
and the fault proxy in front of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import socket
import subprocess
import sys
import uuid
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptstore import Settings, open_store
from ckptstore.errors import CkptStoreError, InvalidURLError, NotFoundError, StoreError
from ckptstore.store.base import MultipartUpload, Store
from ckptstore.store.transport import ByteBudget, Unreachable
from ckptstore.testing.proxy import FaultProxy, ProxyFault
from tests.children import python_path
from tests.servers.fakegcs import FakeGCS
from tests.servers.moto import MotoS3


def closed_port() -> int:
    """A loopback port nothing listens on (bound once to find it free, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def gcs_url(bucket: str) -> str:
    return f"gs://{bucket}/t-{uuid.uuid4().hex[:12]}"


def s3_url(bucket: str) -> str:
    return f"s3://{bucket}/t-{uuid.uuid4().hex[:12]}"


def moto_via(proxy: FaultProxy, moto: MotoS3, attempts: int) -> Store:
    """A store on moto, through ``proxy``, making ``attempts`` attempts per request."""
    return open_store(
        s3_url(moto.bucket),
        endpoint_url=proxy.endpoint,
        region=moto.region,
        retry_attempts=attempts,
        retry_delay=0.01,
    )


# ---------------------------------------------------------------------- one set of knobs


def test_retry_settings_are_overridable_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptstore.config import default_settings

    monkeypatch.setenv("CKPTSTORE_RETRY_ATTEMPTS", "4")
    monkeypatch.setenv("CKPTSTORE_RETRY_DELAY", "0.5")
    monkeypatch.setenv("CKPTSTORE_RETRY_MAX_DELAY", "2s")
    default_settings.cache_clear()
    try:
        settings = default_settings()
    finally:
        default_settings.cache_clear()
    assert (
        settings.transport.retry_attempts,
        settings.transport.retry_delay,
        settings.transport.retry_max_delay,
    ) == (4, 0.5, 2)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"retry_attempts": 0}, "retry_attempts must be >= 1"),
        ({"retry_delay": -1.0}, "0 <= retry_delay <= retry_max_delay"),
        ({"retry_delay": 9.0, "retry_max_delay": 1.0}, "0 <= retry_delay <= retry_max_delay"),
        ({"retry_delay": "soon"}, "not a number of seconds"),
        ({"retry_attempts": "many"}, "not a whole number"),
    ],
)
def test_bad_retry_settings_are_refused(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Settings().replace(**changes)


def test_old_option_names_set_the_one_knob() -> None:
    s3 = open_store("s3://bkt/x?max_attempts=4", endpoint_url="http://127.0.0.1:9")
    gcs = open_store("gs://bkt/x?retries=2&retry_delay=0.5", token="anon")
    assert s3.settings.transport.retry_attempts == 4
    assert (gcs.settings.transport.retry_attempts, gcs.settings.transport.retry_delay) == (3, 0.5)


@pytest.mark.parametrize(
    "url",
    ["s3://bkt/x?max_attempts=4&retry_attempts=3", "gs://bkt/x?retries=2&retry_attempts=3"],
)
def test_old_and_new_name_together_are_refused(url: str) -> None:
    with pytest.raises(TypeError, match="old name of 'retry_attempts'"):
        open_store(url, token="anon") if url.startswith("gs") else open_store(url)


def test_old_option_with_a_bad_value_names_it() -> None:
    with pytest.raises(ValueError, match="retries='-1'"):
        open_store("gs://bkt/x?retries=-1", token="anon")


# ---------------------------------------------------------------------- endpoint_url at open


@pytest.mark.parametrize("scheme", ["s3", "gs", "fsspec+s3"])
@pytest.mark.parametrize(
    ("endpoint", "reason"),
    [
        ("notaurl", "is not an http"),
        ("ftp://127.0.0.1:9", "is not an http"),
        ("http://127.0.0.1:notaport", "is not a URL"),
        ("http://user:pw@127.0.0.1:9", "carries credentials"),
        ("http://127.0.0.1:9/?x=1", "takes no ?query"),
    ],
)
def test_bad_endpoint_url_is_refused_at_open(scheme: str, endpoint: str, reason: str) -> None:
    options = {"token": "anon"} if scheme == "gs" else {}
    with pytest.raises(InvalidURLError, match=reason.replace("?", r"\?")) as info:
        open_store(f"{scheme}://bkt/x", endpoint_url=endpoint, **options)
    assert "pw@" not in str(info.value)


# ---------------------------------------------------------------------- the first contact


@pytest.mark.parametrize("scheme", ["s3", "gs", "fsspec+s3"])
async def test_refused_first_contact_fails_without_retrying(scheme: str) -> None:
    # With a 30 s delay before any retry, one retry would outlast the deadline below.
    endpoint = f"http://127.0.0.1:{closed_port()}"
    options: dict[str, Any] = {"endpoint_url": endpoint, "retry_delay": 30, "retry_max_delay": 30}
    options.update({"token": "anon"} if scheme == "gs" else {"anon": True})
    if scheme == "s3":
        options["anonymous"] = options.pop("anon")
    store = open_store(f"{scheme}://bkt/x", **options)
    async with store:
        with pytest.raises(Unreachable, match="connection refused") as info:
            await asyncio.wait_for(store.get("k"), 25)
    message = str(info.value)
    assert endpoint in message
    assert "check endpoint_url" in message


async def test_refused_connection_after_contact_is_retried(moto_s3: MotoS3) -> None:
    proxy = FaultProxy(moto_s3.endpoint).start()
    try:
        async with moto_via(proxy, moto_s3, 3) as store:
            await store.put("k", b"v")  # the server answered: a later refusal is transient
            proxy.stop()
            with pytest.raises(StoreError, match=r"failed after 3 attempt\(s\)") as info:
                await store.get("k")
            assert not isinstance(info.value, Unreachable)
    finally:
        proxy.stop()


def test_cli_ls_against_a_closed_port_fails_at_once_in_one_line(tmp_path: Path) -> None:
    endpoint = f"http://127.0.0.1:{closed_port()}"
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "PYTHONPATH": python_path(),
        # a retry would wait 60 s, well past the subprocess timeout
        "CKPTSTORE_RETRY_DELAY": "60",
        "CKPTSTORE_RETRY_MAX_DELAY": "60",
    }
    argv = [sys.executable, "-m", "ckptstore", "ls", "s3://bkt/run", "-o", "anonymous=true"]
    done = subprocess.run(
        [*argv, "-o", f"endpoint_url={endpoint}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
        check=False,
    )
    assert done.returncode == 1
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("ckptstore ls: error: ")
    assert f"cannot connect to {endpoint}: connection refused" in lines[0]
    assert "check endpoint_url" in lines[0]


# ---------------------------------------------------------------------- saying what happened


async def test_s3_reset_mid_upload_says_so(moto_s3: MotoS3) -> None:
    with FaultProxy(moto_s3.endpoint, [ProxyFault("reset", ops=frozenset({"put_object"}))]) as px:
        async with moto_via(px, moto_s3, 2) as store:
            await store.list_keys()  # first contact made
            with pytest.raises(StoreError) as info:
                await store.put("k", b"x" * 100_000)
    message = str(info.value)
    assert "the connection was reset by the server" in message
    assert "after 2 attempt(s)" in message
    assert "cannot reach" not in message
    assert "check endpoint_url" not in message


async def test_gcs_reset_mid_upload_says_so(fake_gcs: FakeGCS, gcs_bucket: str) -> None:
    with FaultProxy(fake_gcs.endpoint, [ProxyFault("reset", path="/upload/")]) as px:
        store = open_store(
            gcs_url(gcs_bucket),
            endpoint_url=px.endpoint,
            token="anon",
            retry_attempts=2,
            retry_delay=0.01,
        )
        async with store:
            await store.list_keys()
            with pytest.raises(StoreError) as info:
                await store.put("k", b"x" * 100_000)
    message = str(info.value)
    assert "after 2 attempt(s)" in message
    assert "reset" in message or "closed the connection" in message
    assert "check endpoint_url" not in message


async def test_fsspec_s3_errors_are_ckptstore_errors(moto_s3: MotoS3) -> None:
    store = open_store(
        f"fsspec+s3://{moto_s3.bucket}/run",
        endpoint_url=moto_s3.endpoint,
        client_kwargs={"region_name": moto_s3.region},
    )
    async with store:
        with pytest.raises(NotFoundError, match="does not exist"):
            await store.get("missing")
        await store.put("k", b"v")
        assert await store.get("k") == b"v"
    missing = open_store(
        "fsspec+s3://no-such-bucket-here/run",
        endpoint_url=moto_s3.endpoint,
        client_kwargs={"region_name": moto_s3.region},
    )
    async with missing:
        with pytest.raises(CkptStoreError):
            await missing.put("k", b"v")


# ---------------------------------------------------------------------- sessions closed


@contextlib.contextmanager
def no_unclosed_sessions(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Fail if a client session or connector is left for the garbage collector: aiohttp
    warns (ResourceWarning) and logs "Unclosed client session" through asyncio."""
    caplog.set_level(logging.ERROR, logger="asyncio")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
        gc.collect()
    unclosed = [str(w.message) for w in caught if "nclosed" in str(w.message)]
    unclosed += [r.getMessage() for r in caplog.records if "nclosed" in r.getMessage()]
    assert unclosed == []


@pytest.mark.parametrize(
    "scheme",
    [
        "s3",
        "gs",
        "fsspec+s3",
        # gcsfs retries a refused connection itself, six times with up to 32 s between
        pytest.param("fsspec+gs", marks=pytest.mark.slow),
    ],
)
def test_error_paths_close_their_sessions(scheme: str, caplog: pytest.LogCaptureFixture) -> None:
    endpoint = f"http://127.0.0.1:{closed_port()}"
    options: dict[str, Any] = {"endpoint_url": endpoint, "retry_attempts": 1}
    options.update({"anonymous": True} if scheme == "s3" else {})
    options.update({"token": "anon"} if scheme.endswith("gs") else {})
    options.update({"anon": True} if scheme == "fsspec+s3" else {})

    async def fail_then_close() -> None:
        store = open_store(f"{scheme}://bkt/x", **options)
        async with store:
            calls = [store.get("k")]
            if not scheme.startswith("fsspec"):  # the drivers retry each call for seconds
                calls += [store.put("k", b"v"), store.list_keys()]
            for call in calls:
                with pytest.raises(CkptStoreError):
                    await call

    with no_unclosed_sessions(caplog):
        asyncio.run(fail_then_close())


# ---------------------------------------------------------------------- the byte budget


async def test_byte_budget_bounds_bytes_in_flight() -> None:
    budget = ByteBudget(10)
    peak = 0

    async def request(n: int) -> None:
        nonlocal peak
        async with budget.hold(n):
            peak = max(peak, budget.in_flight)
            await asyncio.sleep(0.001)

    await asyncio.gather(*(request(n) for n in [4, 4, 4, 6, 3, 25, 1]))
    assert peak == 10  # 25 alone is held as 10 (the limit): it runs alone, nothing overshoots
    assert budget.in_flight == 0


class InFlight:
    """Watches the bytes a store's primitives carry at once, at the backend itself: every
    single put, uploaded part and ranged read is counted while it runs."""

    def __init__(self, store: Store) -> None:
        self.now = 0
        self.peak = 0
        self.calls = 0
        # where the bytes are among each primitive's arguments: _put(key, data, mode),
        # _read_into(key, start, out), _put_part(index, data)
        for name, where in (("_put", 1), ("_read_into", 2), ("_read_into_crc32c", 2)):
            setattr(store, name, self._counting(getattr(store, name), where))
        create = store._create_multipart

        async def create_multipart(key: str, part_size: int, mode: Any) -> MultipartUpload:
            upload = await create(key, part_size, mode)
            upload._put_part = self._counting(upload._put_part, 1)  # type: ignore[method-assign]
            return upload

        store._create_multipart = create_multipart  # type: ignore[method-assign]

    def _counting(
        self, fn: Callable[..., Awaitable[Any]], where: int
    ) -> Callable[..., Awaitable[Any]]:
        async def counted(*args: Any) -> Any:
            nbytes = len(args[where])
            self.now += nbytes
            self.calls += 1
            self.peak = max(self.peak, self.now)
            try:
                await asyncio.sleep(0)  # let the others start: overlap is what is measured
                return await fn(*args)
            finally:
                self.now -= nbytes

        return counted


@contextlib.asynccontextmanager
async def budget_store(
    kind: str, part: int, limit: int, request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[Store]:
    settings = {
        "part_size": part,
        "multipart_threshold": part,
        "max_inflight_bytes": limit,
        "max_concurrency": 8,
    }
    if kind == "local":
        store = open_store(str(tmp_path / "store"), durable=False, **settings)
    elif kind == "s3":
        moto: MotoS3 = request.getfixturevalue("moto_s3")
        store = open_store(s3_url(moto.bucket), **moto.options(), **settings)
    else:
        fake: FakeGCS = request.getfixturevalue("fake_gcs")
        bucket: str = request.getfixturevalue("gcs_bucket")
        store = open_store(gcs_url(bucket), endpoint_url=fake.endpoint, token="anon", **settings)
    async with store:
        yield store


_PARTS = {"local": 64 << 10, "s3": 5 << 20, "gcs": 256 << 10}


@pytest.mark.parametrize("kind", ["local", "s3", "gcs"])
@pytest.mark.parametrize("budget_parts", [2, 8])
async def test_max_inflight_bytes_bounds_every_backend(
    kind: str, budget_parts: int, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    part = _PARTS[kind]
    limit = budget_parts * part
    async with budget_store(kind, part, limit, request, tmp_path) as store:
        watch = InFlight(store)
        data = bytes(range(256)) * (5 * part // 256)
        small = [bytes([i]) * (part // 2) for i in range(6)]
        await asyncio.gather(
            store.put("big", data), *(store.put(f"small/{i}", b) for i, b in enumerate(small))
        )
        out = bytearray(len(data))
        pieces = [bytearray(len(b)) for b in small]
        await asyncio.gather(
            store.read_into("big", 0, out),
            *(store.read_into(f"small/{i}", 0, p) for i, p in enumerate(pieces)),
        )
    assert out == data
    assert pieces == small
    assert watch.calls >= 2 * (5 + 6)  # every part, put and range went through the watch
    assert watch.peak <= limit
    if budget_parts == 2:
        assert watch.peak > part  # requests did overlap, up to the budget
    else:
        assert watch.peak > 2 * part  # a larger budget lets more through: it is the bound
