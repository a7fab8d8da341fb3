"""Hostile manifests are refused before any data is read (DESIGN.md invariant 6)."""

from __future__ import annotations

import asyncio
import collections
import copy
import json
import math
import os
import random
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptstore.errors import CorruptCheckpointError
from ckptstore.layout.dtypes import dtype_from_name, known_dtype_names
from ckptstore.layout.keys import manifest_key
from ckptstore.layout.manifest import Manifest
from ckptstore.manager.checkpoint_manager import CheckpointManager
from ckptstore.manager.functions import aload, asave, save
from ckptstore.store.checksum import crc32c
from ckptstore.store.memory import MemoryStore
from ckptstore.store.wrappers import CountingStore
from ckptstore.testing.checkpoint_tests import assert_same_state

STEP = 1
STATE = {
    "a": np.arange(4, dtype=np.float32),
    "b": np.arange(3, dtype=np.int64),
    "big": np.arange(300_000, dtype=np.float64),  # an object of its own
    "e": np.empty((0, 2), np.uint8),
    "v": {"lr": 0.5},
}


def envelope(body: bytes, *, version: int = 2, crc: int | None = None) -> bytes:
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
    # typed values and ordered dicts came with version 4; these manifests say version 2
    "typed value before version 4": _set("tree", "c", 4, {"x": ["torch.dtype", "float32"]}),
    "ordered dict before version 4": _set("tree", "o", 1),
}

#: Trees a version-4 manifest may not hold: each is refused before any data is read.
HOSTILE_V4: dict[str, Callable[[dict[str, Any]], None]] = {
    "typed value of an unknown kind": _set("tree", "c", 4, {"x": ["os.system", "ls"]}),
    "typed value naming code": _set("tree", "c", 4, {"x": ["torch.dtype", "__import__('os')"]}),
    "typed device naming code": _set("tree", "c", 4, {"x": ["torch.device", "cpu;rm"]}),
    "typed value not a pair": _set("tree", "c", 4, {"x": ["torch.dtype"]}),
    "typed value not strings": _set("tree", "c", 4, {"x": ["torch.dtype", 7]}),
    "typed value with extra fields": _set("tree", "c", 4, {"x": ["torch.dtype", "int8"], "v": 1}),
    "ordered flag not 1": _set("tree", "o", 2),
    "ordered flag a bool": _set("tree", "o", True),
    "ordered flag on a list": _set("tree", "c", 4, {"l": [], "o": 1}),
}


VERSIONED = {
    **{c: (m, 2) for c, m in HOSTILE.items()},
    **{c: (m, 4) for c, m in HOSTILE_V4.items()},
}


@pytest.mark.parametrize("case", sorted(VERSIONED))
async def test_hostile_manifest_rejected_before_data(
    base: tuple[MemoryStore, dict[str, Any]], case: str
) -> None:
    store, doc = base
    doc = copy.deepcopy(doc)
    mutate, version = VERSIONED[case]
    mutate(doc)
    await store.put(
        manifest_key(STEP),
        envelope(json.dumps(doc, separators=(",", ":")).encode(), version=version),
    )
    counting = CountingStore(store)
    with pytest.raises(CorruptCheckpointError, match="invalid manifest"):
        await aload(counting, step=STEP)
    assert _data_reads(counting) == 0


async def test_a_version_4_tree_of_typed_values_and_ordered_dicts_loads(
    base: tuple[MemoryStore, dict[str, Any]],
) -> None:
    """The control of the cases above: the same manifest with well-formed version-4 nodes."""
    torch = pytest.importorskip("torch")
    store, doc = base
    doc = copy.deepcopy(doc)
    doc["tree"]["c"][4] = {"x": ["torch.dtype", "bfloat16"]}
    doc["tree"]["o"] = 1
    await store.put(
        manifest_key(STEP), envelope(json.dumps(doc, separators=(",", ":")).encode(), version=4)
    )
    out = await aload(store, step=STEP)
    assert type(out) is collections.OrderedDict
    assert out[doc["tree"]["d"][4]] is torch.bfloat16


def _data_reads(counting: CountingStore) -> int:
    return counting.requests["read"] + counting.requests["get"] - 1  # minus the manifest get


@pytest.mark.parametrize(
    ("case", "raw"),
    [
        ("truncated", lambda good: good[: len(good) // 2]),
        ("missing closing brace", lambda good: good[:-1]),
        ("empty", lambda good: b""),
        ("not json", lambda good: b"\x80\x04\x95pickle"),
        ("flipped body byte", lambda good: good[:-20] + bytes([good[-20] ^ 1]) + good[-19:]),
        ("wrong crc", lambda good: good.replace(b'"crc32c":', b'"crc32c":1', 1)),
        ("future version", lambda good: good.replace(b'"version":2', b'"version":5', 1)),
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


@pytest.mark.parametrize("leaf", ["a", "big"])
async def test_wrong_leaf_checksum_fails_whole_and_partial_reads_alike(
    base: tuple[MemoryStore, dict[str, Any]], leaf: str
) -> None:
    """The object's bytes and crc32c are intact; only the leaf's recorded crc32c lies. Both
    ways of reading the leaf refuse it (layout/restore.py: one checksum rule)."""
    store, doc = base
    doc = copy.deepcopy(doc)
    index = doc["leaves"]["path"].index(leaf)
    doc["leaves"]["crc32c"][index] ^= 1
    await store.put(manifest_key(STEP), encode(doc))
    name = doc["objects"]["key"][doc["leaves"]["object"][index]]
    recorded = doc["leaves"]["crc32c"][index]
    message = rf"leaf '{leaf}' in object '1/{name}': crc32c mismatch \(recorded {recorded}, "
    with pytest.raises(CorruptCheckpointError, match=message):
        await aload(store, step=STEP)  # the pack is read whole
    with pytest.raises(CorruptCheckpointError, match=message):
        await aload(store, step=STEP, keys=[leaf])  # only the leaf's range is read


async def test_object_checksum_mismatch_names_two_different_numbers(
    base: tuple[MemoryStore, dict[str, Any]],
) -> None:
    """A single-leaf object whose bytes match the leaf's crc32c but not the object's: the
    message shows what was read and what the object records, not one number twice."""
    store, doc = base
    doc = copy.deepcopy(doc)
    index = doc["leaves"]["path"].index("big")
    obj = doc["leaves"]["object"][index]
    doc["objects"]["crc32c"][obj] ^= 1
    await store.put(manifest_key(STEP), encode(doc))
    with pytest.raises(CorruptCheckpointError) as info:
        await aload(store, step=STEP, keys=["big"])
    numbers = re.findall(r"\((\d+)\)", str(info.value))
    assert numbers == [str(doc["leaves"]["crc32c"][index]), str(doc["objects"]["crc32c"][obj])]
    assert numbers[0] != numbers[1]


async def test_damaged_padding_is_reported_as_such(
    base: tuple[MemoryStore, dict[str, Any]],
) -> None:
    store, doc = base
    a, b = _pack_leaves(doc)
    key = f"{STEP}/{doc['objects']['key'][doc['leaves']['object'][a]]}"
    data = bytearray(await store.get(key))
    gap = doc["leaves"]["offset"][a] + doc["leaves"]["length"][a]
    assert gap < doc["leaves"]["offset"][b]  # a float32[4] leaf leaves a gap before the next
    data[gap] ^= 0xFF
    await store.put(key, bytes(data))
    with pytest.raises(CorruptCheckpointError, match="damage is in the padding") as info:
        await aload(store, step=STEP)
    recorded, read = re.findall(r"recorded (\d+), read (\d+)", str(info.value))[0]
    assert recorded != read
    assert_same_state((await aload(store, step=STEP, keys=["a"]))["a"], STATE["a"])


@pytest.mark.parametrize("change", [-1, 1, 4096])
async def test_object_of_another_size_is_refused_before_reading(
    base: tuple[MemoryStore, dict[str, Any]], change: int
) -> None:
    store, doc = base
    index = doc["leaves"]["path"].index("big")
    key = f"{STEP}/{doc['objects']['key'][doc['leaves']['object'][index]]}"
    data = await store.get(key)
    resized = data[:change] if change < 0 else data + bytes(change)
    await store.put(key, resized)
    counting = CountingStore(store)
    for keys in (None, ["big"]):
        with pytest.raises(
            CorruptCheckpointError,
            match=f"{key}'.* is {len(resized)} bytes, but the manifest says {len(data)}",
        ):
            await aload(counting, step=STEP, keys=keys)
    assert counting.bytes["read"] + counting.bytes["get"] < len(data)  # not the big one


@pytest.mark.parametrize(
    ("leaf", "attrs", "message"),
    [
        ("a", {"framework": "torch", "device": "cuda:x"}, "device='cuda:x' is not a torch"),
        ("a", {"framework": "torch", "device": 7}, "device='7' is not a torch device"),
        ("b", {"framework": "torch", "requires_grad": True}, "requires_grad=true on a torch.int64"),
        ("a", {"framework": "torch", "parameter": "yes"}, "parameter='yes' is not a boolean"),
        ("a", {"framework": "mlx"}, "framework='mlx' names no array framework"),
        ("a", {"framework": ["torch"]}, "framework=\"\\['torch'\\]\" names no"),
    ],
)
async def test_hostile_leaf_attributes_are_checkpoint_errors(
    base: tuple[MemoryStore, dict[str, Any]], leaf: str, attrs: dict[str, Any], message: str
) -> None:
    """Attributes a stager hands to torch or JAX on restore are checked first."""
    pytest.importorskip("torch")
    store, doc = base
    doc = copy.deepcopy(doc)
    doc["leaves"]["attrs"] = [None] * len(doc["leaves"]["path"])
    doc["leaves"]["attrs"][doc["leaves"]["path"].index(leaf)] = attrs
    await store.put(manifest_key(STEP), encode(doc))
    manager = CheckpointManager(store, async_save=False)
    with pytest.raises(CorruptCheckpointError, match=rf"leaf '{leaf}': .*{message}"):
        await asyncio.to_thread(manager.restore, STEP)


@pytest.mark.parametrize("dtype", [">f4", "<f16", "float6_e2m3fn"])
async def test_a_dtype_the_named_framework_lacks_is_a_checkpoint_error(
    base: tuple[MemoryStore, dict[str, Any]], dtype: str
) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    store, doc = base
    doc = copy.deepcopy(doc)
    index = doc["leaves"]["path"].index("a")  # float32[4]: 16 bytes, a whole number of each
    doc["leaves"]["dtype"][index] = dtype
    doc["leaves"]["shape"][index] = [16 // _itemsize(dtype)]
    for framework in ("torch", "jax"):
        doc["leaves"]["attrs"] = [None] * len(doc["leaves"]["path"])
        doc["leaves"]["attrs"][index] = {"framework": framework}
        await store.put(manifest_key(STEP), encode(doc))
        manager = CheckpointManager(store, async_save=False)
        with pytest.raises(CorruptCheckpointError, match=f"(?i)a leaf saved as a {framework}"):
            await asyncio.to_thread(manager.restore, STEP)


def _leaf(path: str, column: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        doc["leaves"][column][doc["leaves"]["path"].index(path)] = value

    return mutate


def _wrapping_length(doc: dict[str, Any]) -> None:
    """A complex128 leaf of 2**60 + 1 elements claiming 16 bytes, which its length is in
    int64: (2**60 + 1) * 16 wraps to 16."""
    index = doc["leaves"]["path"].index("a")
    doc["leaves"]["dtype"][index] = "<c16"
    doc["leaves"]["shape"][index] = [(1 << 60) + 1]


def _one_rank_wrapping(doc: dict[str, Any]) -> None:
    """Every shape of rank 2 (the elements counted in bulk, in int64), leaf ``a`` claiming 16
    bytes of uint8 with a shape of 2**64 + 16 elements, which is 16 in int64."""
    shapes = doc["leaves"]["shape"]
    for i, shape in enumerate(shapes):
        shapes[i] = [shape[0] if shape else 1, math.prod(shape[1:])]
    index = doc["leaves"]["path"].index("a")
    doc["leaves"]["dtype"][index] = "|u1"
    shapes[index] = [16 * ((1 << 20) + 1), (1 << 40) - (1 << 20) + 1]


def _hashes(value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        doc["leaves"]["hash"] = ["0" * 32] * len(doc["leaves"]["path"])
        doc["leaves"]["hash"][doc["leaves"]["path"].index("b")] = value

    return mutate


#: Shapes and leaf hashes are checked over all leaves at once, and, where that fails, leaf by
#: leaf for the message (layout/manifest.py): each refusal names its leaf.
NAMED: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "bool dim": (_leaf("a", "shape", [True, 4]), r"leaf 'a': shape \[True, 4\] is not a list"),
    "float dim": (_leaf("b", "shape", [3.0]), r"leaf 'b': shape \[3.0\] is not a list of ints"),
    "shape not a list": (_leaf("b", "shape", {"0": 3}), r"leaf 'b': shape \{'0': 3\} is not"),
    "65 dims": (_leaf("a", "shape", [1] * 61 + [2, 2] + [1, 1]), r"leaf 'a': shape .* is invalid"),
    "dim of 2**63": (_leaf("e", "shape", [0, 1 << 63]), r"leaf 'e': shape .* is invalid"),
    "negative dim": (_leaf("b", "shape", [-3]), r"leaf 'b': shape \[-3\] is invalid"),
    "one element short": (_leaf("big", "shape", [299_999]), r"leaf 'big': shape \[299999\] "),
    "empty, too large": (_leaf("e", "shape", [0, 1 << 62]), "leaf 'e': .* too large for any"),
    "wraps in int64": (_wrapping_length, r"leaf 'a': shape \[1152921504606846977\] of <c16 is"),
    "one rank, wraps in int64": (
        _one_rank_wrapping,
        r"leaf 'a': shape \[16777232, 1099510579201\] of \|u1 is not 16 bytes",
    ),
    **{
        f"hash {name}": (_hashes(value), re.escape(f"leaf hash {value!r} is not 32 hex digits"))
        for name, value in [
            ("too short", "ab"),
            ("in capitals", "A" * 32),
            ("not a string", 7),
            ("of 32 accented letters", "\u00e9" * 32),
            ("of 32 lone surrogates", "\ud800" * 32),
            ("with a space", "0" * 31 + " "),
        ]
    },
}


@pytest.mark.parametrize("case", sorted(NAMED))
async def test_a_bad_shape_or_hash_is_refused_naming_its_leaf(
    base: tuple[MemoryStore, dict[str, Any]], case: str
) -> None:
    _store, doc = base
    mutate, message = NAMED[case]
    doc = copy.deepcopy(doc)
    mutate(doc)
    with pytest.raises(CorruptCheckpointError, match=f"invalid manifest: {message}"):
        Manifest.parse(encode(doc), step=STEP)


def test_shapes_and_hashes_of_many_leaves_are_accepted() -> None:
    """The bulk checks accept what they should: 0-d, empty and 64-dim shapes, every hash
    present or absent, beside leaves whose shapes hold a zero."""
    state = {
        "scalar": np.float64(2.5),
        "zero_d": np.array(3, np.int16),
        "empty": np.empty((0, 7, 0), np.complex128),
        "deep": np.ones([1] * 62 + [2, 3], np.uint8),
        "rows": [np.full((i, 3), i, np.float32) for i in range(40)],
    }
    store = MemoryStore()
    asyncio.run(asave(store, state, step=STEP))
    assert_same_state(asyncio.run(aload(store, step=STEP)), state)


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


# Claims far beyond the loader's address-space headroom: a load that allocates what one of
# them claims fails with MemoryError in the capped loader.
_HUGE_COUNTS = [1 << 31, 1 << 36, 3 << 40, 1 << 50]
LOADER = Path(__file__).with_name("hostile_loader.py")
#: Address space the loader may add after its imports and one honest restore: the state is
#: under 3 MB, every claim in _HUGE_COUNTS is at least 2 GiB.
HEADROOM = 512 << 20


def _claim_size(
    doc: dict[str, Any], leaf: int, count: int, *, split: int = 1, slack: int = 0
) -> dict[str, Any]:
    """A coherent lie: ``leaf`` claims ``count`` elements; its length, the offsets of the
    leaves after it and its object's length (plus ``slack``) agree, so validation passes and
    only the object's real size can tell."""
    doc = copy.deepcopy(doc)
    leaves, objects = doc["leaves"], doc["objects"]
    obj = leaves["object"][leaf]
    itemsize = _itemsize(leaves["dtype"][leaf])
    leaves["shape"][leaf] = [count] if split == 1 else [count // split, split]
    growth = (count // split) * split * itemsize - leaves["length"][leaf]
    leaves["length"][leaf] += growth
    for j, other in enumerate(leaves["object"]):
        if other == obj and leaves["offset"][j] > leaves["offset"][leaf]:
            leaves["offset"][j] += growth
    objects["length"][obj] += growth + slack
    return doc


def _random_size_claim(doc: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    placed = [i for i, obj in enumerate(doc["leaves"]["object"]) if obj >= 0]
    return _claim_size(
        doc,
        rng.choice(placed),
        rng.choice(_HUGE_COUNTS),
        split=rng.choice([1, 2, 1024]),
        slack=rng.choice([0, 0, 64, 1 << 30]),
    )


def _itemsize(name: str) -> int:
    dtype = dtype_from_name(name)
    assert dtype is not None
    return dtype.itemsize


def _claim_reference(doc: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """Point leaves, objects or the tree somewhere else than where their bytes are."""
    doc = copy.deepcopy(doc)
    leaves, objects = doc["leaves"], doc["objects"]
    n, nobj = len(leaves["path"]), len(objects["key"])
    kind = rng.randrange(6)
    if kind == 0:  # two objects swap keys (lengths and checksums stay)
        objects["key"].reverse()
    elif kind == 1:  # two objects swap everything but their keys
        for column in ("length", "crc32c"):
            objects[column].reverse()
    elif kind == 2:  # a leaf moves to another object, at its start
        i = rng.randrange(n)
        leaves["object"][i] = rng.randrange(nobj)
        leaves["offset"][i] = rng.choice([0, leaves["offset"][i], 64])
    elif kind == 3:  # two leaves swap a column
        i, j = rng.sample(range(n), 2)
        column = rng.choice(["object", "offset", "crc32c", "dtype", "shape"])
        leaves[column][i], leaves[column][j] = leaves[column][j], leaves[column][i]
    elif kind == 4:  # a leaf reinterprets its bytes as another dtype of the same size
        i = rng.randrange(n)
        same = [d for d in known_dtype_names() if _itemsize(d) == 8]
        if leaves["dtype"][i] in same:
            leaves["dtype"][i] = rng.choice(sorted(same))
    else:  # the tree's array indices are permuted
        text = json.dumps(doc["tree"])
        numbers = re.findall(r'\{"a": (\d+)\}', text)
        shuffled = rng.sample(numbers, len(numbers))
        for old, new in zip(numbers, shuffled, strict=True):
            text = text.replace(f'{{"a": {old}}}', f'{{"a": #{new}}}', 1)
        doc["tree"] = json.loads(text.replace("#", ""))
    return doc


_ATTR_VALUES: list[Any] = [
    "torch",
    "jax",
    "numpy",
    "mlx",
    "cpu",
    "cuda",
    "cuda:0",
    "cuda:x",
    "cuda:-1",
    "cuda:99999999999999999999",
    "meta",
    "xla:0",
    "mps",
    "bogus",
    "",
    "x" * 500,
    True,
    False,
    None,
    0,
    1,
    -1,
    2**70,
    1.5,
    [],
    ["cpu"],
    {"device": "cpu"},
]
_ATTR_KEYS = ["framework", "device", "requires_grad", "parameter", "scalar", "dtype", "devices"]


def _claim_attrs(doc: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """Leaf attributes from the stagers' vocabulary, with hostile values."""
    doc = copy.deepcopy(doc)
    attrs: list[Any] = []
    for _ in doc["leaves"]["path"]:
        if rng.random() < 0.2:
            attrs.append(None)
            continue
        leaf = {
            "framework": rng.choice(["torch", "torch", "jax", "numpy", rng.choice(_ATTR_VALUES)])
        }
        for key in rng.sample(_ATTR_KEYS, rng.randint(0, len(_ATTR_KEYS))):
            leaf[key] = rng.choice(_ATTR_VALUES)
        attrs.append(leaf)
    doc["leaves"]["attrs"] = attrs
    return doc


def _run_loader(root: Path, cases: dict[str, bytes], workdir: Path) -> list[dict[str, Any]]:
    """Load each manifest in the capped loader process; its outcome per case."""
    workdir.mkdir()
    for name, raw in cases.items():
        (workdir / f"{name}.json").write_bytes(raw)
    done = subprocess.run(
        [sys.executable, str(LOADER), str(root), str(workdir), str(HEADROOM)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "MALLOC_ARENA_MAX": "2"},  # see hostile_loader.py
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(results) == len(cases), done.stderr[-3000:]
    return results


@pytest.fixture
def on_disk(tmp_path: Path) -> tuple[Path, dict[str, Any], bytes]:
    """STATE saved under a local root: the root, the manifest body, the manifest bytes."""
    root = tmp_path / "run"
    save(root, STATE, step=STEP)
    raw = (root / manifest_key(STEP)).read_bytes()
    return root, json.loads(raw[raw.index(b'"body":') + 7 : -1]), raw


def test_size_claims_are_refused_before_allocating(
    on_disk: tuple[Path, dict[str, Any], bytes], tmp_path: Path
) -> None:
    """Each stored leaf in turn claims each huge size, coherently: only the store's real
    object sizes tell, and the capped loader proves nothing was allocated first."""
    root, doc, _raw = on_disk
    cases = {
        f"{path}-{count}": encode(_claim_size(doc, i, count))
        for i, path in enumerate(doc["leaves"]["path"])
        if doc["leaves"]["object"][i] >= 0
        for count in _HUGE_COUNTS
    }
    for result in _run_loader(root, cases, tmp_path / "cases"):
        assert result["outcome"] == "refused", result
        assert "but the manifest says" in result["error"], result


@pytest.mark.parametrize(
    "budget",
    [
        pytest.param(1500, id="1500 cases"),
        pytest.param(8000, id="8000 cases", marks=pytest.mark.slow),
    ],
)
def test_fuzzed_manifests_never_crash_allocate_or_escape(
    on_disk: tuple[Path, dict[str, Any], bytes], tmp_path: Path, budget: int
) -> None:
    """Random damage to the structure, and targeted lies about sizes, references and leaf
    attributes. Whatever validation lets through is loaded in a process with capped address
    space: it must load or fail with a ckptstore error, allocate nothing it was merely told
    about, and read only keys of this step's attempt."""
    root, doc, good = on_disk
    allowed_prefix = f"{STEP}/{doc['attempt']}/"
    rng = random.Random(20240611)
    rejected = 0
    unforeseen: list[tuple[int, str]] = []
    accepted: dict[str, bytes] = {}
    kinds: dict[str, str] = {}
    for case in range(budget):
        kind = ["raw", "structure", "size", "reference", "attrs"][case % 5]
        if kind == "raw":
            raw = _raw_damage(good, rng)
        elif kind == "structure":
            raw = encode(_mutate(doc, rng))
        else:
            lie = {
                "size": _random_size_claim,
                "reference": _claim_reference,
                "attrs": _claim_attrs,
            }
            raw = encode(lie[kind](doc, rng))
        try:
            Manifest.parse(raw, step=STEP, source="fuzz")
        except CorruptCheckpointError as exc:
            unforeseen.extend([(case, str(exc))] if "unexpected structure" in str(exc) else [])
            rejected += 1
            continue
        accepted[f"{case:05d}"] = raw
        kinds[f"{case:05d}.json"] = kind
    assert unforeseen == []  # every rejection came from an explicit check
    results = _run_loader(root, accepted, tmp_path / "cases")
    escaped = [r for r in results if r["outcome"] == "escaped"]
    assert escaped == []
    for result in results:
        outside = [k for k in result["keys"] if k != manifest_key(STEP)]
        assert all(k.startswith(allowed_prefix) for k in outside), result
    outcomes = {(kinds[r["case"]], r["outcome"]) for r in results}
    # Each targeted lie reached the loader and was refused there at least once: the fuzzing
    # exercised the checks it is meant to exercise.
    for kind in ("size", "reference", "attrs"):
        assert (kind, "refused") in outcomes, outcomes
    assert ("attrs", "loaded") in outcomes  # ...and harmless attributes still load
    # The random damage (two cases in five) is nearly all refused by validation.
    assert rejected > budget // 3, (rejected, len(accepted))
