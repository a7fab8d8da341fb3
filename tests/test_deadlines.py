"""Nothing hangs (issue 30): a server that accepts and never answers, answers one byte a
second, or stops mid-body fails the request within ``Settings.request_deadline`` plus 10%,
with a DeadlineExceededError naming the operation, the URL and the deadline; retries share
that deadline. Tested through the fault proxy on S3 (moto) and GCS (fake-gcs-server)."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptstore
from ckptstore.config import Settings
from ckptstore.errors import DeadlineExceededError, StoreError
from ckptstore.store.registry import open_store
from ckptstore.store.wrappers import StoreWrapper
from ckptstore.testing.proxy import FaultProxy, ProxyFault

#: The deadline the tests give: long against a try on loopback, short for a test.
DEADLINE = 2.0
#: The slack the issue allows.
SLACK = 1.10

#: Each stall, on the read of an object: the proxy's fault and what it does.
STALLS = {
    "stall": "accepts the request and never answers",
    "trickle": "answers one byte a second",
    "stall_body": "sends half of the body, then nothing",
}


def _store(dialect: str, endpoint: str, bucket: str, **options: Any) -> Any:
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    if dialect == "s3":
        return open_store(f"s3://{bucket}/{prefix}", endpoint_url=endpoint, **options)
    return open_store(f"gs://{bucket}/{prefix}", endpoint_url=endpoint, token="anon", **options)


@pytest.fixture(params=[pytest.param("s3", marks=pytest.mark.s3), pytest.param("gcs")])
def server(request: pytest.FixtureRequest) -> tuple[str, str, str, dict[str, Any]]:
    """``(dialect, endpoint, bucket, options)`` of a real server."""
    if request.param == "s3":
        moto = request.getfixturevalue("moto_s3")
        return "s3", moto.endpoint, moto.bucket, {"region": moto.region}
    fake = request.getfixturevalue("fake_gcs")
    return "gcs", fake.endpoint, request.getfixturevalue("gcs_bucket"), {}


@pytest.mark.gcs
@pytest.mark.parametrize("kind", list(STALLS))
async def test_a_stalled_read_fails_within_its_deadline(
    server: tuple[str, str, str, dict[str, Any]], kind: str
) -> None:
    dialect, endpoint, bucket, options = server
    body = np.random.default_rng(0).integers(0, 255, 64 << 10, dtype=np.uint8).tobytes()
    read = frozenset({"get"} if dialect == "s3" else {"download"})
    with FaultProxy(endpoint, dialect=dialect) as proxy:  # type: ignore[arg-type]
        store = _store(
            dialect, proxy.endpoint, bucket, request_deadline=DEADLINE, retry_delay=0.01, **options
        )
        async with store:
            await store.put("obj", body)
            proxy.set_faults([ProxyFault(kind, ops=read)])  # every try of the read stalls
            began = time.monotonic()
            with pytest.raises(DeadlineExceededError) as raised:
                await store.get("obj")
            took = time.monotonic() - began
            proxy.set_faults([])
            assert await store.get("obj") == body  # the store is still usable
    assert took <= DEADLINE * SLACK, f"{kind}: {took:.2f} s"
    message = str(raised.value)
    assert f"request deadline of {DEADLINE:g} s (Settings.request_deadline)" in message
    assert store.url.split("://")[0] in message
    assert "/obj" in message
    assert isinstance(raised.value, TimeoutError)
    assert isinstance(raised.value, StoreError)


@pytest.mark.gcs
async def test_a_put_in_one_request_gets_a_deadline_per_part(
    server: tuple[str, str, str, dict[str, Any]],
) -> None:
    """A put under ``multipart_threshold`` sends its whole body in one request, which may be
    larger than a part: its deadline counts once per ``part_size`` of the body, so a large
    put on a slow link is not failed by a deadline meant for one part."""
    dialect, endpoint, bucket, options = server
    put = frozenset({"put_object"} if dialect == "s3" else {"upload"})
    big = np.arange(1 << 20, dtype=np.float32)  # 4 MiB: four parts, one request
    delay = ProxyFault("delay", ops=put, seconds=0.8)  # over one deadline, under four
    with FaultProxy(endpoint, [delay], dialect=dialect) as proxy:  # type: ignore[arg-type]
        store = _store(
            dialect,
            proxy.endpoint,
            bucket,
            request_deadline=0.5,
            part_size="1MiB",
            multipart_threshold="16MiB",
            retry_attempts=1,
            **options,
        )
        async with store:
            await store.put("big", big)
            assert len(proxy.calls(*put)) == 1  # the whole body in one request
            with pytest.raises(DeadlineExceededError) as raised:
                await store.put("small", np.zeros(1 << 18, np.float32))  # 1 MiB: one part
            proxy.set_faults([])
            assert await store.get("big") == big.tobytes()
    assert "request deadline of 0.5 s (Settings.request_deadline) after" in str(raised.value)


@pytest.mark.s3
async def test_a_part_grown_past_part_size_gets_a_deadline_per_part_size(moto_s3: Any) -> None:
    """S3 refuses parts under 5 MiB, so a smaller ``part_size`` uploads 5 MiB parts (and
    objects over ``max_parts`` parts grow theirs too): each part's deadline counts once per
    ``part_size`` of that part, as a put in one request does."""
    delay = ProxyFault("delay", ops=frozenset({"upload_part"}), seconds=0.8)
    with FaultProxy(moto_s3.endpoint, [delay]) as proxy:
        store = _store(
            "s3",
            proxy.endpoint,
            moto_s3.bucket,
            region=moto_s3.region,
            request_deadline=0.5,  # over the delay for 5 MiB, under it for one part_size
            part_size="1MiB",
            multipart_threshold="6MiB",
            retry_attempts=1,
        )
        async with store:
            assert store.part_size_for(10 << 20) == 5 << 20
            body = np.arange(10 << 18, dtype=np.float32)  # 10 MiB: two parts of 5 MiB
            await store.put("big", body)
            assert len(proxy.calls("upload_part")) == 2
            proxy.set_faults([])
            assert await store.get("big") == body.tobytes()


@pytest.mark.s3
async def test_retries_stop_at_the_deadline_with_the_last_failure_named(moto_s3: Any) -> None:
    """A server answering 503 to every try would be retried 10 times with pauses of up to
    5 s; the deadline cuts the tries and the pauses short and names the last failure."""
    with FaultProxy(moto_s3.endpoint, [ProxyFault("503", ops=frozenset({"get"}))]) as proxy:
        store = _store(
            "s3",
            proxy.endpoint,
            moto_s3.bucket,
            region=moto_s3.region,
            request_deadline=1.0,
            retry_attempts=1000,
            retry_delay=0.2,
            retry_max_delay=0.2,
        )
        async with store:
            await store.put("obj", b"x")
            began = time.monotonic()
            with pytest.raises(DeadlineExceededError, match="the last try failed with"):
                await store.get("obj")
            assert time.monotonic() - began <= 1.0 * SLACK
            assert 3 <= proxy.injected["503"] <= 8  # tries 0.2 s apart, then the deadline


@pytest.mark.s3
def test_a_load_through_a_stalling_server_names_the_deadline(moto_s3: Any) -> None:
    state = {"w": np.arange(1 << 16, dtype=np.float32)}
    with FaultProxy(moto_s3.endpoint) as proxy:
        url = f"s3://{moto_s3.bucket}/deadline-{uuid.uuid4().hex[:8]}"
        options = {"endpoint_url": proxy.endpoint, "region": moto_s3.region}
        ckptstore.save(url, state, step=1, **options)
        proxy.set_faults([ProxyFault("stall_body", ops=frozenset({"get"}), path="/1/attempt-")])
        began = time.monotonic()
        with pytest.raises(DeadlineExceededError, match=r"read s3://.*/1/attempt-"):
            ckptstore.load(url, request_deadline=DEADLINE, **options)
        assert time.monotonic() - began <= DEADLINE * SLACK + 1.0  # + the manifest's reads


@pytest.mark.gcs
async def test_gcs_gives_up_on_a_silent_server_at_its_read_timeout(
    fake_gcs: Any, gcs_bucket: str
) -> None:
    """aiohttp without sock_read waited for a silent server until request_deadline (or for
    ever, before it): a try now gives up at read_timeout, as on S3."""
    with FaultProxy(fake_gcs.endpoint, dialect="gcs") as proxy:
        store = _store("gcs", proxy.endpoint, gcs_bucket, read_timeout=1.0, retry_attempts=1)
        async with store:
            await store.put("obj", b"x" * 1000)
            proxy.set_faults([ProxyFault("stall", ops=frozenset({"download"}))])
            began = time.monotonic()
            with pytest.raises(StoreError, match="did not answer in time") as raised:
                await store.get("obj")
            assert time.monotonic() - began <= 1.0 * SLACK + 0.2
            assert not isinstance(raised.value, DeadlineExceededError)
    with pytest.raises(ValueError, match="read_timeout must be > 0"):
        _store("gcs", fake_gcs.endpoint, gcs_bucket, read_timeout=0)


def test_the_deadline_is_a_setting_with_a_default_and_refuses_nonsense() -> None:
    assert Settings().transport.request_deadline == 300.0
    assert Settings().replace(request_deadline="45s").transport.request_deadline == 45.0
    with pytest.raises(ValueError, match="request_deadline must be > 0"):
        Settings(request_deadline=0)


@pytest.mark.gcs
@pytest.mark.parametrize("share", [0.05, 0.0])
async def test_a_straggling_read_is_hedged_and_the_first_answer_wins(
    server: tuple[str, str, str, dict[str, Any]], share: float
) -> None:
    """One ranged GET answered 2 s late: with hedging, a second GET answers it in
    milliseconds; with ``hedged_reads=0`` the read waits the 2 s."""
    dialect, endpoint, bucket, options = server
    read = frozenset({"get"} if dialect == "s3" else {"download"})
    body = np.random.default_rng(1).integers(0, 255, 4 << 20, dtype=np.uint8)
    with FaultProxy(endpoint, dialect=dialect) as proxy:  # type: ignore[arg-type]
        store = _store(dialect, proxy.endpoint, bucket, hedged_reads=share, **options)
        async with store:
            await store.put("obj", body.tobytes())
            out = np.empty(256 << 10, np.uint8)
            for i in range(10):  # peers to compare with
                await store.read_into("obj", i * len(out), memoryview(out))
            proxy.set_faults([ProxyFault("delay", ops=read, times=1, seconds=2)])
            began = time.monotonic()
            await store.read_into("obj", 3 * len(out), memoryview(out))
            took = time.monotonic() - began
            hedger = store._transport.hedger
    assert out.tobytes() == body[3 * len(out) : 4 * len(out)].tobytes()
    if share:
        assert took < 1.0, took
        assert (hedger.hedged, hedger.won) == (1, 1)
    else:
        assert took >= 2.0
        assert hedger.hedged == 0


@pytest.mark.gcs
@pytest.mark.parametrize("kind", ["stall", "stall_body"])
async def test_an_fsspec_store_stalled_fails_within_its_deadline(
    fake_gcs: Any, gcs_bucket: str, kind: str
) -> None:
    """fsspec drivers keep their own timeouts (gcsfs has none for a silent server); the
    transport's request deadline bounds them all the same."""
    body = np.random.default_rng(2).integers(0, 255, 64 << 10, dtype=np.uint8).tobytes()
    with FaultProxy(fake_gcs.endpoint, dialect="gcs") as proxy:
        store = open_store(
            f"fsspec+gs://{gcs_bucket}/t-{uuid.uuid4().hex[:12]}",
            endpoint_url=proxy.endpoint,
            token="anon",
            request_deadline=DEADLINE,
            retry_delay=0.01,
        )
        async with store:
            await store.put("obj", body)
            proxy.set_faults([ProxyFault(kind, ops=frozenset({"download"}))])
            began = time.monotonic()
            with pytest.raises(DeadlineExceededError, match=r"Settings\.request_deadline"):
                await store.get("obj")
            took = time.monotonic() - began
            proxy.set_faults([])
            assert await store.get("obj") == body
    assert took <= DEADLINE * SLACK, f"{kind}: {took:.2f} s"


class _Hung(StoreWrapper):
    """A disk whose writes (or reads) never return, as a hung NFS mount's: the thread that
    makes one waits until the test lets it go, and no cancellation stops it."""

    def __init__(self, inner: Any, ops: frozenset[str]) -> None:
        super().__init__(inner)
        self.ops = ops
        self.go = threading.Event()
        self.hung = threading.Event()

    async def _hook(self, op: str, key: str, nbytes: int) -> None:
        if op in self.ops and "/attempt-" in key and "lease" not in key:
            self.hung.set()
            await asyncio.to_thread(self.go.wait, 60)

    def deadline_of(self, call: Any) -> tuple[str, float]:
        """Run ``call``, which must fail with DeadlineExceededError; then let the hung
        threads go. Its message, and how long it took."""
        began = time.monotonic()
        try:
            with pytest.raises(DeadlineExceededError) as raised:
                call()
            return str(raised.value), time.monotonic() - began
        finally:
            self.go.set()


WHOLE = 1.0  # the whole-operation deadline the tests give


@pytest.mark.parametrize("face", ["save", "manager"])
def test_a_save_that_hangs_fails_at_the_save_deadline_and_leaves_nothing(
    tmp_path: Path, face: str
) -> None:
    """Requests to a local disk have no request deadline (the kernel bounds them, or not):
    the save deadline does, and the hung save's attempt is abandoned."""
    inner = open_store(str(tmp_path / "root"), save_deadline=WHOLE)
    store = _Hung(inner, frozenset({"put", "create_multipart"}))
    state = {"w": np.arange(1 << 18, dtype=np.float32), "b": np.ones(10, np.int8)}

    def save() -> None:
        if face == "save":
            ckptstore.save(store, state, step=7)
            return
        with ckptstore.CheckpointManager(store) as mgr:
            mgr.save(7, state)
            mgr.wait_until_finished()

    message, took = store.deadline_of(save)
    assert store.hung.is_set()
    assert took <= WHOLE + 2.0, took
    assert f"save of step 7 to {inner.url}" in message, message
    assert f"deadline of {WHOLE:g} s (Settings.save_deadline)" in message, message
    assert ckptstore.list_steps(inner) == []
    deadline = time.monotonic() + 10
    while any((tmp_path / "root").rglob("*pack*")) and time.monotonic() < deadline:
        time.sleep(0.05)  # the abandoned attempt's cleanup ends once the hung write does
    assert not any(p.is_file() for p in (tmp_path / "root").rglob("attempt-*/*"))
    ckptstore.save(inner, state, step=7)  # the step is free: nothing of the hung one stays
    np.testing.assert_array_equal(ckptstore.load(inner, step=7)["w"], state["w"])


@pytest.mark.parametrize("face", ["load", "manager"])
def test_a_restore_that_hangs_fails_at_the_restore_deadline(tmp_path: Path, face: str) -> None:
    inner = open_store(str(tmp_path / "root"), restore_deadline=WHOLE)
    state = {"w": np.arange(1 << 18, dtype=np.float32)}
    ckptstore.save(inner, state, step=3)
    store = _Hung(inner, frozenset({"get", "read"}))

    def restore() -> None:
        if face == "load":
            ckptstore.load(store)
            return
        with ckptstore.CheckpointManager(store) as mgr:
            mgr.restore(3)

    message, took = store.deadline_of(restore)
    assert took <= WHOLE + 1.0, took
    assert f"restore of step 3 from {inner.url}" in message or face == "load", message
    assert f"restore of the newest step from {inner.url}" in message or face != "load", message
    assert "(Settings.restore_deadline)" in message, message
    np.testing.assert_array_equal(ckptstore.load(inner, step=3)["w"], state["w"])


def test_the_whole_operation_deadlines_are_settings() -> None:
    assert Settings().layout.save_deadline == 3600.0
    assert Settings().layout.restore_deadline == 3600.0
    assert Settings().replace(save_deadline="90s").layout.save_deadline == 90.0
    for name in ("save_deadline", "restore_deadline"):
        with pytest.raises(ValueError, match=f"{name} must be > 0"):
            Settings().replace(**{name: -1.0})
