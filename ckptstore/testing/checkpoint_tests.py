"""The checkpoint round-trip suite, run against every backend.

A backend's test module subclasses :class:`CheckpointTests` and provides one async fixture,
``store`` (a fresh, empty store), exactly as for :class:`~ckptstore.testing.StoreTests`::

    class TestMyStoreCheckpoints(CheckpointTests):
        @pytest.fixture
        async def store(self):
            async with MyStore(...) as s:
                yield s

Every test saves and loads through the public API (``asave``/``aload``...) with the store
object, so the format, the commit protocol and the verified restore are exercised on the
backend's own requests.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import struct
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptstore.errors import (
    CommitConflictError,
    CorruptCheckpointError,
    NotFoundError,
    StoreError,
)
from ckptstore.layout import commit
from ckptstore.layout.keys import manifest_key
from ckptstore.layout.manifest import Manifest
from ckptstore.manager.functions import adelete_step, agc, alist_steps, aload, aread_manifest, asave
from ckptstore.store.base import PutMode, Store
from ckptstore.store.wrappers import CountingStore, Fault, FaultStore, StoreWrapper

__all__ = ["DTYPES", "CheckpointTests", "assert_same_state", "rich_state", "states"]

#: Every dtype a checkpoint holds, both byte orders where numpy has them.
DTYPES: list[np.dtype[Any]] = [
    *(np.dtype(code).newbyteorder(order) for code in "?bBhHiIlLqQefdgFDG" for order in ("<", ">")),
    *(
        np.dtype(getattr(ml_dtypes, name))
        for name in (
            "bfloat16",
            "float8_e4m3fn",
            "float8_e5m2",
            "float8_e4m3fnuz",
            "float8_e5m2fnuz",
            "float8_e4m3b11fnuz",
            "int4",
            "uint4",
        )
        if hasattr(ml_dtypes, name)
    ),
]


def _random_array(rng: np.random.Generator, dtype: np.dtype[Any], shape: tuple[int, ...]) -> Any:
    count = math.prod(shape)
    raw = rng.integers(0, 256, count * dtype.itemsize, dtype=np.uint8).tobytes()
    if dtype.kind == "b":
        raw = bytes(b & 1 for b in raw)
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()


def rich_state(seed: int = 0) -> dict[str, Any]:
    """A state with every leaf kind: all dtypes, 0-d, empty, non-contiguous, big-endian,
    numpy scalars, plain values, int dict keys, tuples, and escaped keys."""
    rng = np.random.default_rng(seed)
    arrays = {
        f"{dt.name}{'>' if dt.byteorder == '>' else ''}": _random_array(rng, dt, (3, 5))
        for dt in DTYPES
    }
    big = _random_array(rng, np.dtype(np.float32), (512, 1024))  # 2 MiB: an object of its own
    return {
        "arrays": arrays,
        "shapes": {
            "scalar0d": np.array(3.25, dtype=np.float64),
            "empty": np.empty((0, 4), np.float32),
            "empty_bf16": np.empty((2, 0), ml_dtypes.bfloat16),
            "noncontig": _random_array(rng, np.dtype(np.int32), (6, 8))[::2, ::-3],
            "fortran": np.asfortranarray(_random_array(rng, np.dtype(np.float64), (4, 3))),
            "big": big,
            "big_strided": big[:, ::2],
        },
        "scalars": [np.float32(1.5), np.int64(-7), np.bool_(True), np.complex64(1 + 2j)],
        "values": {"none": None, "t": True, "i": 2**70, "f": -0.0, "s": "héllo", "nan": math.nan},
        "opt": {0: {"step": 10, "exp_avg": np.ones(4)}, 1: {"step": 10}},
        "tuple": (1, (np.arange(3, dtype=np.uint16), "x")),
        "odd/keys~": {"a/b": np.zeros(2, np.int8), "": np.ones(1, np.uint8)},
        "empty_dict": {},
        "empty_list": [],
    }


def assert_same_state(actual: Any, expected: Any, path: str = "") -> None:
    """Equal structure, container types, dict key order, dtypes, shapes and bits."""
    where = path or "<root>"
    if isinstance(expected, np.ndarray):
        assert isinstance(actual, np.ndarray), f"{where}: {type(actual)} is not an array"
        assert actual.dtype == expected.dtype, f"{where}: {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{where}: {actual.shape} != {expected.shape}"
        assert actual.tobytes() == expected.tobytes(), f"{where}: bits differ"
    elif isinstance(expected, np.generic):
        assert type(actual) is type(expected), f"{where}: {type(actual)} != {type(expected)}"
        assert actual.tobytes() == expected.tobytes(), f"{where}: bits differ"
    elif isinstance(expected, dict):
        assert type(actual) is dict, f"{where}: {type(actual)} is not a dict"
        assert list(actual) == list(expected), f"{where}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert_same_state(actual[key], expected[key], f"{path}/{key}")
    elif isinstance(expected, list | tuple):
        assert type(actual) is type(expected), f"{where}: {type(actual)} != {type(expected)}"
        assert len(actual) == len(expected), f"{where}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same_state(a, e, f"{path}/{i}")
    elif isinstance(expected, float):
        # Plain floats travel as JSON: exact, sign of zero included, but a NaN is just NaN
        # (NaN payloads survive only in arrays).
        assert type(actual) is float, f"{where}: {type(actual)} is not a float"
        if math.isnan(expected):
            assert math.isnan(actual), f"{where}: {actual} is not NaN"
        else:
            assert struct.pack("<d", actual) == struct.pack("<d", expected), f"{where}: {actual}"
    else:
        assert type(actual) is type(expected), f"{where}: {type(actual)} != {type(expected)}"
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


@st.composite
def _arrays(draw: st.DrawFn) -> Any:
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
    seed = draw(st.integers(0, 2**32 - 1))
    array = _random_array(np.random.default_rng(seed), dtype, shape)
    if array.ndim and draw(st.booleans()):
        array = array[::-1]  # negative strides
    return array


_plain = (
    st.none()
    | st.booleans()
    | st.integers(-(2**80), 2**80)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
)
_keys = st.text(alphabet="ab/~é.", max_size=3) | st.integers(1000, 2000)


def states() -> st.SearchStrategy[Any]:
    """Random nested states of arrays (every dtype, any strides) and plain values."""
    leaves = _arrays() | _plain
    return st.recursive(
        leaves,
        lambda children: (
            st.lists(children, max_size=4)
            | st.lists(children, max_size=3).map(tuple)
            | st.dictionaries(_keys, children, max_size=4)
        ),
        max_leaves=24,
    )


_steps = itertools.count(1000)


class _LoseManifestResponse(StoreWrapper):
    """Performs the manifest put, then reports a failure, as a dropped response would."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.lost = 0

    async def _put(self, key: str, data: memoryview, mode: PutMode) -> None:
        await self.inner._put(key, data, mode)
        if key.endswith("/manifest.json") and self.lost == 0:
            self.lost += 1
            raise StoreError(f"connection reset after sending {key}")


class _LaggingLookups(StoreWrapper):
    """Lookups of manifests that lag: until this store's manifest put, reads miss (another
    saver commits after this one checked), and after a refused put the next ``misses`` reads
    miss too, as a FUSE or NFS client's cached negative lookup does. With ``lose_response``
    the first manifest put lands and then reports a failure, as a dropped response would."""

    def __init__(self, inner: Store, misses: int, *, lose_response: bool = False) -> None:
        super().__init__(inner)
        self.misses = misses
        self.lose_response = lose_response
        self.put_tried = False
        self.missed = 0

    async def _put(self, key: str, data: memoryview, mode: PutMode) -> None:
        if not key.endswith("/manifest.json"):
            return await self.inner._put(key, data, mode)
        first, self.put_tried = not self.put_tried, True
        await self.inner._put(key, data, mode)
        if first and self.lose_response:
            raise StoreError(f"connection reset after sending {key}")

    async def _hook(self, op: str, key: str, nbytes: int) -> None:
        if not key.endswith("/manifest.json"):
            return
        if not self.put_tried or self.missed < self.misses:
            self.missed += self.put_tried
            raise NotFoundError(f"{self.url}/{key} does not exist (stale lookup)")


class CheckpointTests:
    """Round trips of the checkpoint format; subclasses provide the ``store`` fixture."""

    #: Leaves in the many-small-leaves test.
    small_leaves: int = 2000

    @pytest.fixture
    def store(self) -> Store:
        raise NotImplementedError("subclasses provide the store fixture")

    async def test_rich_state_round_trip(self, store: Store) -> None:
        state = rich_state()
        info = await asave(store, state, step=1, metadata={"epoch": 3})
        assert info.step == 1
        assert_same_state(await aload(store), state)
        assert_same_state(await aload(store, step=1), state)
        assert (await aread_manifest(store, 1)).metadata == {"epoch": 3}

    @settings(
        max_examples=25,
        deadline=None,
        # One store per test, reused by every example (each saves its own step); the same
        # test runs from each backend's subclass, hence "differing executors".
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,
            HealthCheck.too_slow,
            HealthCheck.differing_executors,
        ],
    )
    @given(state=states())
    async def test_random_states_round_trip(self, store: Store, state: Any) -> None:
        step = next(_steps)
        await asave(store, state, step=step)
        assert_same_state(await aload(store, step=step), state)

    async def test_large_leaf_is_split_into_parallel_parts(self, store: Store) -> None:
        caps = store.capabilities
        part = max(caps.min_part_size, 1 << 20)
        store.settings = store.settings.replace(
            part_size=part, multipart_threshold=2 * part, max_inflight_bytes=max(part, 1 << 30)
        )
        counting = CountingStore(store)
        big = _random_array(np.random.default_rng(5), np.dtype(np.float64), (5 * part // 8 + 3,))
        await asave(counting, {"big": big}, step=2)
        if caps.multipart:
            assert counting.requests["put_part"] == -(
                -big.nbytes // store.part_size_for(big.nbytes)
            )
        assert_same_state(await aload(counting, step=2), {"big": big})

    async def test_small_leaves_are_packed(self, store: Store) -> None:
        rng = np.random.default_rng(1)
        state = {
            f"t{i}": _random_array(rng, np.dtype(np.float32), (1024,))
            for i in range(self.small_leaves)
        }
        counting = CountingStore(store)
        info = await asave(counting, state, step=3)
        nbytes = self.small_leaves * 4096
        objects = counting.requests["put"] + counting.requests["complete_multipart"]
        assert info.objects == -(-nbytes // store.settings.layout.pack_size)
        assert objects == info.objects + 2  # the packs, the save's lease and the manifest
        assert_same_state(await aload(store, step=3), state)

    async def test_keys_reads_only_their_ranges(self, store: Store) -> None:
        store.settings = store.settings.replace(coalesce_gap=0)
        rng = np.random.default_rng(2)
        state = {
            "model": {f"w{i}": _random_array(rng, np.dtype(np.float32), (256,)) for i in range(50)},
            "big": _random_array(rng, np.dtype(np.float64), (300_000,)),
            "meta": {"lr": 0.1},
        }
        await asave(store, state, step=4)
        counting = CountingStore(store)
        out = await aload(counting, step=4, keys=["model/w3", "model/w7", "meta/lr"])
        assert list(out) == ["model", "meta"]
        assert list(out["model"]) == ["w3", "w7"]
        assert_same_state(out["model"]["w7"], state["model"]["w7"])
        assert out["meta"] == {"lr": 0.1}
        read = counting.bytes["read"]
        assert read == 2 * 1024, f"read {read} bytes for two leaves of 1 KiB"
        with pytest.raises(NotFoundError, match="model/w99"):
            await aload(store, step=4, keys=["model/w99"])
        prefix_only = await aload(store, step=4, keys=["model"])
        assert_same_state(prefix_only, {"model": state["model"]})

    async def test_into_fills_caller_arrays_in_place(self, store: Store) -> None:
        rng = np.random.default_rng(3)
        state = {
            "small": _random_array(rng, np.dtype(np.int16), (10, 10)),
            "big": _random_array(rng, np.dtype(np.float32), (600_000,)),
            "n": 5,
        }
        await asave(store, state, step=5)
        target = {"small": np.zeros((10, 10), np.int16), "big": np.zeros(600_000, np.float32)}
        out = await aload(store, step=5, into=target)
        assert out["small"] is target["small"]
        assert out["big"] is target["big"]
        assert_same_state(target["small"], state["small"])
        assert_same_state(target["big"], state["big"])
        assert out["n"] == 5
        with pytest.raises(ValueError, match="small"):
            await aload(store, step=5, into={"small": np.zeros((10, 10), np.int32)})

    async def test_corrupt_byte_names_leaf_and_object(self, store: Store) -> None:
        rng = np.random.default_rng(4)
        state = {
            "a": _random_array(rng, np.dtype(np.float32), (100,)),
            "b": _random_array(rng, np.dtype(np.float32), (400_000,)),
        }
        await asave(store, state, step=6)
        for key_re, leaf in ((r"pack-", "a"), (r"leaf-", "b")):
            for keys in (None, [leaf]):
                faulty = FaultStore(store, [Fault(frozenset({"read"}), corrupt=True, key=key_re)])
                with pytest.raises(CorruptCheckpointError, match=rf"leaf '{leaf}'.*{key_re}"):
                    await aload(faulty, step=6, keys=keys)

    async def test_truncated_read_is_detected(self, store: Store) -> None:
        state = {"a": np.arange(1000, dtype=np.int64)}
        await asave(store, state, step=7)
        faulty = FaultStore(store, [Fault(frozenset({"read"}), truncate=100, key="pack-")])
        with pytest.raises(CorruptCheckpointError, match="'a'"):
            await aload(faulty, step=7)

    async def test_second_save_of_a_step_conflicts(self, store: Store) -> None:
        first = {"x": np.arange(4)}
        await asave(store, first, step=8)
        counting = CountingStore(store)
        with pytest.raises(CommitConflictError, match="already committed"):
            await asave(counting, {"x": np.arange(400_000)}, step=8)
        assert counting.bytes["put"] + counting.bytes["put_part"] == 0  # refused before data
        assert_same_state(await aload(store, step=8), first)

    async def test_concurrent_savers_of_one_step_one_wins(self, store: Store) -> None:
        racers = 6
        states = [{"who": np.full(1000, i, np.int32), "i": i} for i in range(racers)]
        results = await asyncio.gather(
            *(asave(store, s, step=14) for s in states), return_exceptions=True
        )
        winners = [r for r in results if not isinstance(r, BaseException)]
        losers = [r for r in results if isinstance(r, BaseException)]
        assert len(winners) == 1
        assert all(isinstance(r, CommitConflictError) for r in losers), losers
        manifest = await aread_manifest(store, 14)
        assert manifest.attempt == winners[0].attempt
        loaded = await aload(store, step=14)
        assert_same_state(loaded, states[loaded["i"]])
        # Losers removed their own objects: only the winner's attempt remains.
        keys = await store.list_keys("14/")
        assert {k.split("/")[1] for k in keys} == {manifest.attempt, "manifest.json"}

    async def test_lost_manifest_response_is_recognised(self, store: Store) -> None:
        lossy = _LoseManifestResponse(store)
        state = {"x": np.arange(10.0)}
        info = await asave(lossy, state, step=9)
        assert lossy.lost == 1
        assert (await aread_manifest(store, 9)).attempt == info.attempt
        assert_same_state(await aload(store, step=9), state)

    async def test_manifest_lookup_lagging_its_create_still_decides_the_commit(
        self, store: Store
    ) -> None:
        # another attempt holds the step: a conflict (not "step 15 is not committed"), and
        # this attempt's objects are removed
        first = {"x": np.arange(4)}
        winner = await asave(store, first, step=15)
        lagging = _LaggingLookups(store, misses=2)
        with pytest.raises(CommitConflictError, match="committed by attempt"):
            await asave(lagging, {"x": np.arange(5)}, step=15)
        assert lagging.missed == 2
        assert {k.split("/")[1] for k in await store.list_keys("15/")} == {
            winner.attempt,
            "manifest.json",
        }
        assert_same_state(await aload(store, step=15), first)
        # this attempt's own put landed with its response lost: a success, its data kept
        own = _LaggingLookups(store, misses=3, lose_response=True)
        state = {"y": np.arange(6.0)}
        info = await asave(own, state, step=16)
        # (S3 recognises its own retried create by the object's checksum: no read at all)
        assert own.missed in (0, 3), own.missed
        assert (await aread_manifest(store, 16)).attempt == info.attempt
        assert_same_state(await aload(store, step=16), state)

    async def test_manifest_never_readable_after_its_create_leaves_the_data(
        self, store: Store, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(commit, "MANIFEST_REREAD_WAITS", (0.01, 0.01))
        await asave(store, {"x": np.arange(4)}, step=17)
        lagging = _LaggingLookups(store, misses=1000)
        with pytest.raises(StoreError, match="could not be read back") as raised:
            await asave(lagging, {"x": np.arange(5)}, step=17)
        assert not isinstance(raised.value, (CommitConflictError, NotFoundError))
        assert lagging.missed == 3
        attempts = {k.split("/")[1] for k in await store.list_keys("17/")} - {"manifest.json"}
        assert len(attempts) == 2  # the outcome is unknown: this attempt's data is kept

    async def test_failed_data_put_leaves_no_manifest(self, store: Store) -> None:
        faulty = FaultStore(
            store,
            [Fault(frozenset({"put", "put_part"}), _injected, key=r"/attempt-", after=1)],
        )
        state = {f"p{i}": np.full(300_000, i, np.float32) for i in range(3)}
        with pytest.raises(StoreError, match="injected"):
            await asave(faulty, state, step=10)
        assert not await store.exists(manifest_key(10))
        assert await store.list_keys("10/") == []  # the failed attempt cleaned up after itself
        assert 10 not in await alist_steps(store)
        with pytest.raises(NotFoundError):
            await aload(store, step=10)

    async def test_failed_manifest_put_leaves_step_invisible(self, store: Store) -> None:
        await asave(store, {"v": np.ones(3)}, step=11)
        faulty = FaultStore(store, [Fault(frozenset({"put"}), _injected, key="manifest")])
        with pytest.raises(StoreError) as raised:
            await asave(faulty, {"v": np.zeros(3)}, step=12)
        # the store's transport alone retries a put; the commit never puts the manifest again
        assert faulty.injected["put"] == 1
        assert "no manifest of step 12 was found" in "".join(raised.value.__notes__)
        assert len({k.split("/")[1] for k in await store.list_keys("12/")}) == 1  # data kept
        assert await alist_steps(store) == [11]
        assert_same_state(await aload(store), {"v": np.ones(3)})

    async def test_list_latest_and_delete(self, store: Store) -> None:
        with pytest.raises(NotFoundError):
            await aload(store)
        for step in (3, 20, 100):
            await asave(store, {"s": np.array(step)}, step=step)
        await store.put("notes/readme.txt", b"not ours")
        await store.put("20/foreign.bin", b"not ours either")
        assert await alist_steps(store) == [3, 20, 100]
        assert int((await aload(store))["s"]) == 100
        await adelete_step(store, 100)
        assert await alist_steps(store) == [3, 20]
        assert int((await aload(store))["s"]) == 20
        await adelete_step(store, 20)
        assert await store.get("20/foreign.bin") == b"not ours either"
        assert await store.get("notes/readme.txt") == b"not ours"
        with pytest.raises(NotFoundError):
            await adelete_step(store, 20)

    async def test_gc_removes_only_abandoned_attempts(self, store: Store) -> None:
        await asave(store, {"a": np.arange(5)}, step=1)
        kept = await store.list_keys("1/")
        # An abandoned attempt of step 2 and a losing attempt beside step 1's winner.
        await store.put("2/attempt-000000000001-0123456789abcdef/pack-000000", b"x" * 100)
        await store.put("1/attempt-000000000001-fedcba9876543210/pack-000000", b"y" * 100)
        await store.put("2/not-an-attempt/file", b"foreign")
        await store.put("other/thing", b"foreign")
        report = await agc(store, grace=3600.0)
        assert report.removed == []  # the objects were written just now: within the grace
        assert len(report.kept_recent) == 2
        report = await agc(store, grace=0.0)
        assert sorted(report.removed) == [
            "1/attempt-000000000001-fedcba9876543210/",
            "2/attempt-000000000001-0123456789abcdef/",
        ]
        assert await store.list_keys("1/") == kept
        assert await store.list_keys("2/") == ["2/not-an-attempt/file"]
        assert await store.get("other/thing") == b"foreign"
        assert_same_state(await aload(store), {"a": np.arange(5)})

    async def test_manifest_is_validated_before_data_reads(self, store: Store) -> None:
        await asave(store, {"a": np.arange(10)}, step=13)
        manifest = await aread_manifest(store, 13)
        bad = Manifest(**{**_fields(manifest), "leaf_offset": [1 << 40]})
        await store.put(manifest_key(13), bad.encode())
        counting = CountingStore(store)
        with pytest.raises(CorruptCheckpointError, match="past the end"):
            await aload(counting, step=13)
        assert counting.requests["read"] == 0


def _injected(op: str, key: str) -> BaseException:
    return StoreError(f"injected fault in {op} of {key!r}")


def _fields(manifest: Manifest) -> dict[str, Any]:
    return {name: getattr(manifest, name) for name in Manifest.__dataclass_fields__}
