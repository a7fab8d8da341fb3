"""Hostile manifests are refused before any data is read (DESIGN.md invariant 6)."""

from __future__ import annotations

import contextlib
import copy
import json
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from ckptstore.errors import CorruptCheckpointError
from ckptstore.layout.keys import manifest_key
from ckptstore.layout.manifest import Manifest
from ckptstore.manager.functions import aload, asave
from ckptstore.store.base import PutMode, Store
from ckptstore.store.checksum import crc32c
from ckptstore.store.memory import MemoryStore
from ckptstore.store.wrappers import CountingStore, StoreWrapper

STEP = 1
STATE = {
    "a": np.arange(4, dtype=np.float32),
    "b": np.arange(3, dtype=np.int64),
    "big": np.arange(300_000, dtype=np.float64),  # an object of its own
    "e": np.empty((0, 2), np.uint8),
    "v": {"lr": 0.5},
}


def envelope(body: bytes, *, version: int = 1, crc: int | None = None) -> bytes:
    crc = crc32c(body) if crc is None else crc
    head = f'{{"format":"ckptstore","version":{version},"crc32c":{crc},"body":'.encode()
    return head + body + b"}"


def encode(doc: Any) -> bytes:
    return envelope(json.dumps(doc, separators=(",", ":")).encode())


@pytest.fixture
async def base() -> tuple[MemoryStore, dict[str, Any]]:
    store = MemoryStore()
    await asave(store, STATE, step=STEP)
    raw = await store.get(manifest_key(STEP))
    doc = json.loads(raw[raw.index(b'"body":') + 7 : -1])
    return store, doc


def _set(*path_and_value: Any) -> Callable[[dict[str, Any]], None]:
    *path, value = path_and_value

    def mutate(doc: dict[str, Any]) -> None:
        node: Any = doc
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = value(doc) if callable(value) else value

    return mutate


def _attempt(doc: dict[str, Any]) -> str:
    return str(doc["attempt"])


def _pack_leaves(doc: dict[str, Any]) -> tuple[int, int]:
    objects = doc["leaves"]["object"]
    a, b = doc["leaves"]["path"].index("a"), doc["leaves"]["path"].index("b")
    assert objects[a] == objects[b]
    return a, b


def _overlap(doc: dict[str, Any]) -> None:
    a, b = _pack_leaves(doc)
    doc["leaves"]["offset"][b] = doc["leaves"]["offset"][a] + 8


def _deep_tree(doc: dict[str, Any]) -> None:
    tree: Any = doc["tree"]
    for _ in range(300):
        tree = {"l": [tree]}
    doc["tree"] = tree


HOSTILE: dict[str, Callable[[dict[str, Any]], None]] = {
    "traversal key": _set("objects", "key", 0, "../../etc/passwd"),
    "traversal inside attempt": _set("objects", "key", 0, lambda d: _attempt(d) + "/../../x"),
    "absolute key": _set("objects", "key", 0, "/etc/passwd"),
    "backslash key": _set("objects", "key", 0, lambda d: _attempt(d) + "\\..\\x"),
    "nul key": _set("objects", "key", 0, lambda d: _attempt(d) + "/x\x00"),
    "foreign attempt": _set("objects", "key", 0, "attempt-000000000000-0000000000000000/x"),
    "key not a string": _set("objects", "key", 0, 7),
    "repeated key": _set("objects", "key", 1, lambda d: d["objects"]["key"][0]),
    "offset past object": _set("leaves", "offset", 0, 1 << 40),
    "negative offset": _set("leaves", "offset", 0, -8),
    "negative length": _set("leaves", "length", 0, -1),
    "overlapping leaves": _overlap,
    "object index out of range": _set("leaves", "object", 0, 99),
    "empty leaf with bytes": _set("leaves", "length", 3, 16),
    "overflowing shape": _set("leaves", "shape", 3, [1 << 32, 1 << 32, 0 + (1 << 32)]),
    "shape wrapping to zero in int64": _set("leaves", "shape", 3, [1 << 63, 2]),
    "negative dim": _set("leaves", "shape", 0, [-4]),
    "shape length mismatch": _set("leaves", "shape", 0, [5]),
    "shape not a list": _set("leaves", "shape", 0, "4"),
    "object dtype": _set("leaves", "dtype", 0, "|O"),
    "string dtype": _set("leaves", "dtype", 0, "<U1"),
    "void dtype": _set("leaves", "dtype", 0, "<V4"),
    "made-up dtype": _set("leaves", "dtype", 0, "float128x"),
    "dtype not a string": _set("leaves", "dtype", 0, None),
    "bool offset": _set("leaves", "offset", 0, True),
    "float offset": _set("leaves", "offset", 0, 0.0),
    "huge int offset": _set("leaves", "offset", 0, 1 << 70),
    "crc out of range": _set("leaves", "crc32c", 0, 1 << 32),
    "object length negative": _set("objects", "length", 0, -1),
    "bad attempt id": _set("attempt", "../.."),
    "other step": _set("step", STEP + 1),
    "negative step": _set("step", -1),
    "missing leaves": lambda d: d.pop("leaves"),
    "missing column": lambda d: d["leaves"].pop("offset"),
    "unknown column": _set("leaves", "pickle", []),
    "short column": lambda d: d["leaves"]["offset"].pop(),
    "repeated path": _set("leaves", "path", 1, "a"),
    "tree disagrees with paths": _set("leaves", "path", 0, "zz"),
    "tree index out of range": _set("tree", "c", 0, 42),
    "tree index twice": _set("tree", "c", 1, 0),
    "tree unknown node": _set("tree", "c", 0, {"pickle": "cos\nsystem"}),
    "tree value not plain": _set("tree", "c", 4, {"v": [1, 2]}),
    "tree too deep": _deep_tree,
    "attrs not objects": _set("leaves", "attrs", [1, 2, 3, 4]),
}


class RecordingStore(StoreWrapper):
    """Records every key a request touched."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.keys: list[tuple[str, str]] = []

    async def _hook(self, op: str, key: str, nbytes: int) -> None:
        self.keys.append((op, key))

    async def _put(self, key: str, data: memoryview, mode: PutMode) -> None:
        raise AssertionError(f"a load wrote {key!r}")


def _data_reads(counting: CountingStore) -> int:
    return counting.requests["read"] + counting.requests["get"] - 1  # minus the manifest get


@pytest.mark.parametrize("case", sorted(HOSTILE))
async def test_hostile_manifest_rejected_before_data(
    base: tuple[MemoryStore, dict[str, Any]], case: str
) -> None:
    store, doc = base
    doc = copy.deepcopy(doc)
    HOSTILE[case](doc)
    await store.put(manifest_key(STEP), encode(doc))
    counting = CountingStore(store)
    with pytest.raises(CorruptCheckpointError, match="invalid manifest"):
        await aload(counting, step=STEP)
    assert _data_reads(counting) == 0


@pytest.mark.parametrize(
    ("case", "raw"),
    [
        ("truncated", lambda good: good[: len(good) // 2]),
        ("missing closing brace", lambda good: good[:-1]),
        ("empty", lambda good: b""),
        ("not json", lambda good: b"\x80\x04\x95pickle"),
        ("flipped body byte", lambda good: good[:-20] + bytes([good[-20] ^ 1]) + good[-19:]),
        ("wrong crc", lambda good: good.replace(b'"crc32c":', b'"crc32c":1', 1)),
        ("future version", lambda good: good.replace(b'"version":1', b'"version":2', 1)),
        ("no envelope", lambda good: good[good.index(b'"body":') + 7 : -1]),
        ("deep json", lambda good: envelope(b"[" * 100_000 + b"]" * 100_000)),
        ("body not object", lambda good: envelope(b"[1,2]")),
    ],
)
async def test_damaged_manifest_bytes_rejected(
    base: tuple[MemoryStore, dict[str, Any]], case: str, raw: Callable[[bytes], bytes]
) -> None:
    store, _doc = base
    good = await store.get(manifest_key(STEP))
    await store.put(manifest_key(STEP), raw(good))
    counting = CountingStore(store)
    with pytest.raises(CorruptCheckpointError, match="invalid manifest"):
        await aload(counting, step=STEP)
    assert _data_reads(counting) == 0


async def test_oversized_manifest_refused_before_reading_it(
    base: tuple[MemoryStore, dict[str, Any]],
) -> None:
    store, _doc = base
    store.settings = store.settings.replace(manifest_max_bytes=200)
    counting = CountingStore(store)
    with pytest.raises(CorruptCheckpointError, match="over the 200-byte cap"):
        await aload(counting, step=STEP)
    assert counting.requests["get"] == 0
    assert counting.requests["read"] == 0


@pytest.mark.parametrize("leaf", ["a", "big"])
async def test_wrong_leaf_checksum_detected_on_read(
    base: tuple[MemoryStore, dict[str, Any]], leaf: str
) -> None:
    store, doc = base
    doc = copy.deepcopy(doc)
    index = doc["leaves"]["path"].index(leaf)
    doc["leaves"]["crc32c"][index] ^= 1
    obj = doc["leaves"]["object"][index]
    doc["objects"]["crc32c"][obj] ^= 1  # consistent lie about the object, too
    await store.put(manifest_key(STEP), encode(doc))
    name = doc["objects"]["key"][obj]
    with pytest.raises(CorruptCheckpointError, match=rf"leaf '{leaf}' in object '1/{name}'"):
        await aload(store, step=STEP)
    with pytest.raises(CorruptCheckpointError, match=rf"leaf '{leaf}'"):
        await aload(store, step=STEP, keys=[leaf])


# ------------------------------------------------------------------------------- fuzzing

_JUNK: list[Any] = [
    -1,
    0,
    1,
    7,
    2**31,
    2**63,
    2**64 + 5,
    -(2**63),
    1.5,
    float("inf"),
    True,
    False,
    None,
    "",
    "../x",
    "/abs",
    "a\\b",
    "x" * 2000,
    "|O",
    "<f4",
    [],
    [1, 2],
    [[1 << 40]],
    {},
    {"v": 1},
    {"d": [], "c": []},
    {"s": 0},
]


def _nodes(doc: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path]
    if isinstance(doc, dict):
        for key, value in doc.items():
            out += _nodes(value, (*path, key))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            out += _nodes(value, (*path, i))
    return out


def _mutate(doc: dict[str, Any], rng: random.Random) -> Any:
    doc = copy.deepcopy(doc)
    for _ in range(rng.randint(1, 3)):
        nodes = [p for p in _nodes(doc) if p]
        path = rng.choice(nodes)
        parent: Any = doc
        for part in path[:-1]:
            parent = parent[part]
        choice = rng.random()
        if choice < 0.6:
            value = rng.choice(_JUNK)
            if isinstance(parent[path[-1]], int) and not isinstance(parent[path[-1]], bool):
                value = rng.choice([value, parent[path[-1]] + rng.randint(-70, 70)])
            parent[path[-1]] = copy.deepcopy(value)
        elif choice < 0.8:
            if isinstance(parent, dict):
                del parent[path[-1]]
            else:
                parent.pop(path[-1])
        elif isinstance(parent, list):
            parent.insert(path[-1], copy.deepcopy(rng.choice(_JUNK)))
        else:
            parent[rng.choice(["x", "path", "c", "d", "s"])] = copy.deepcopy(rng.choice(_JUNK))
    return doc


def _raw_damage(good: bytes, rng: random.Random) -> bytes:
    data = bytearray(good)
    kind = rng.randrange(3)
    if kind == 0:
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
    elif kind == 1:
        del data[rng.randrange(len(data)) :]
    else:
        at = rng.randrange(len(data))
        data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
    return bytes(data)


async def test_fuzzed_manifests_never_crash_hang_or_escape(
    base: tuple[MemoryStore, dict[str, Any]],
) -> None:
    store, doc = base
    good = await store.get(manifest_key(STEP))
    allowed_prefix = f"{STEP}/{doc['attempt']}/"
    rng = random.Random(20240611)
    rejected = accepted = 0
    unforeseen: list[tuple[int, str]] = []
    for case in range(4000):
        raw = encode(_mutate(doc, rng)) if case % 4 else _raw_damage(good, rng)
        try:
            manifest = Manifest.parse(raw, step=STEP, source="fuzz")
        except CorruptCheckpointError as exc:
            unforeseen.extend([(case, str(exc))] if "unexpected structure" in str(exc) else [])
            rejected += 1
            continue
        accepted += 1
        # Whatever validation let through must load or fail cleanly, touching only keys of
        # this step's attempt.
        await store.put(manifest_key(STEP), raw)
        recorder = RecordingStore(store)
        with contextlib.suppress(CorruptCheckpointError):
            await aload(recorder, step=STEP)
        for op, key in recorder.keys:
            if op in ("get", "read") and key != manifest_key(STEP):
                assert key.startswith(allowed_prefix), (case, key)
        del manifest
    assert unforeseen == []  # every rejection came from an explicit check
    assert rejected > 3000, (rejected, accepted)
