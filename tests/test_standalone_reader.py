"""scripts/read_checkpoint.py reads what ckptstore writes, bit-exact, without ckptstore.

Checkpoints are written here by ckptstore itself (packed and whole-leaf objects, every stored
dtype in both byte orders, an incremental chain, a sharded save of two ranks); the reader
loads each in a child process where importing ckptstore fails, and the parent compares what
it loaded with ``ckptstore.load``: container types, keys, plain values, and the dtype, shape
and bytes of every array. Damaged checkpoints must fail with the leaf, object or manifest
named.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import json
import math
import os
import pickle
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import crc32c as crc32c_package
import ml_dtypes
import numpy as np
import pytest

import ckptstore
from ckptstore.distributed import LocalGroup, Shard
from ckptstore.distributed import save as save_ranks
from ckptstore.layout.dtypes import dtype_from_name, known_dtype_names
from ckptstore.layout.manifest import Manifest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
READER = SCRIPTS / "read_checkpoint.py"
#: Small leaves under 64 KiB are packed, into packs of at most 256 KiB.
PACKING = {"pack_threshold": "64KiB", "pack_size": "256KiB", "part_size": "4MiB"}

# Run in a child process: the reader must load with ckptstore unimportable, and have
# imported nothing of it afterwards. Arrays travel as (dtype, shape, bytes): numpy 2.4's
# pickle of an array brings some big-endian ones back in native order (">c32" even with
# protocol 5), while a dtype pickles exactly.
CHILD = r"""
import importlib.abc, json, pickle, sys
import numpy as np

class NoCkptstore(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "ckptstore" or name.startswith("ckptstore."):
            raise ImportError(f"the stand-alone reader imported {name}")
        return None

args = json.loads(sys.argv[1])
sys.meta_path.insert(0, NoCkptstore())
if not args["ml_dtypes"]:
    sys.modules["ml_dtypes"] = None  # import ml_dtypes now raises ImportError
sys.path.insert(0, args["scripts"])
import read_checkpoint

state = read_checkpoint.load(args["root"], args["step"])
body = read_checkpoint.read_manifest(args["root"], args["step"])
assert not any(m == "ckptstore" or m.startswith("ckptstore.") for m in sys.modules)
assert args["ml_dtypes"] or sys.modules.get("ml_dtypes") is None

ARRAY, TYPED, ORDERED = "<array>", "<typed>", "<ordered>"

def portable(node):
    if isinstance(node, np.ndarray | np.generic):
        array = np.asarray(node)
        return {ARRAY: (array.dtype, array.shape, array.tobytes(), isinstance(node, np.generic))}
    if type(node) is read_checkpoint.TypedValue:
        return {TYPED: (node.kind, node.name)}
    if type(node) is dict:
        return {key: portable(value) for key, value in node.items()}
    if isinstance(node, dict):  # an OrderedDict
        return {ORDERED: [(key, portable(value)) for key, value in node.items()]}
    if type(node) in (list, tuple):
        return type(node)(portable(value) for value in node)
    return node

with open(args["out"], "wb") as file:
    pickle.dump({"state": portable(state), "version": body["version"]}, file)
"""
# the child's stand-ins for an array, a typed value and an OrderedDict
ARRAY, TYPED, ORDERED = "<array>", "<typed>", "<ordered>"


class Typed(NamedTuple):
    """A typed value as the reader gives it (its ``TypedValue``, which only the child can
    import): kind and name."""

    kind: str
    name: str


def from_child(node: Any) -> Any:
    """A state the child sent, its arrays rebuilt."""
    if type(node) is dict and ARRAY in node:
        dtype, shape, data, scalar = node[ARRAY]
        array = np.frombuffer(data, dtype).reshape(shape).copy()
        return array[()] if scalar else array
    if type(node) is dict and TYPED in node:
        return Typed(*node[TYPED])
    if type(node) is dict and ORDERED in node:
        return collections.OrderedDict((k, from_child(v)) for k, v in node[ORDERED])
    if type(node) is dict:
        return {key: from_child(value) for key, value in node.items()}
    if type(node) in (list, tuple):
        return type(node)(from_child(value) for value in node)
    return node


def read_in_child(root: Path, step: int, *, with_ml_dtypes: bool = True) -> tuple[Any, int]:
    """``(state, format version)`` as the reader loads them in a process without ckptstore."""
    out = root.parent / f"read-{root.name}-{step}-{with_ml_dtypes}.pickle"
    args = {
        "scripts": str(SCRIPTS),
        "root": str(root),
        "step": step,
        "out": str(out),
        "ml_dtypes": with_ml_dtypes,
    }
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(args)],
        cwd=root.parent,  # not the repository: nothing of ckptstore on sys.path by accident
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    with out.open("rb") as file:
        loaded = pickle.load(file)
    return from_child(loaded["state"]), loaded["version"]


@pytest.fixture(scope="module")
def reader() -> ModuleType:
    """The script, imported in this process for the tests of its errors."""
    spec = importlib.util.spec_from_file_location("read_checkpoint", READER)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_same(got: Any, want: Any, path: str = "") -> None:
    """Equal containers of the same types and key order, arrays of the same dtype (byte
    order included), shape and bytes, equal plain values (nan matching nan)."""
    assert type(got) is type(want), f"{path}: {type(got)} is not {type(want)}"
    if isinstance(want, dict):
        assert [(type(k), k) for k in got] == [(type(k), k) for k in want], path
        for key in want:
            assert_same(got[key], want[key], f"{path}/{key}")
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), path
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same(a, b, f"{path}/{i}")
    elif isinstance(want, np.ndarray | np.generic):
        assert got.dtype == want.dtype, path
        assert got.dtype.str == want.dtype.str, path  # the byte order too
        assert got.shape == want.shape, path
        assert got.tobytes() == want.tobytes(), path
    elif isinstance(want, float) and math.isnan(want):
        assert math.isnan(got), path
    else:
        assert got == want, path


def random_array(rng: np.random.Generator, dtype: np.dtype[Any], shape: tuple[int, ...]) -> Any:
    """Any bit pattern (NaN payloads, padding of long doubles), but bools of 0 and 1."""
    count = math.prod(shape)
    if dtype.kind == "b":
        return rng.integers(0, 2, count).astype(dtype).reshape(shape)
    raw = rng.integers(0, 256, count * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


Point = collections.namedtuple("Point", "x y")


def full_state(rng: np.random.Generator) -> dict[Any, Any]:
    """Every kind of leaf and container a checkpoint holds."""
    return {
        "dtypes": {
            name: random_array(rng, dtype_from_name(name), (2, 3))  # type: ignore[arg-type]
            for name in sorted(known_dtype_names())
        },
        "nested": {
            "list": [np.arange(3), {"deep": (np.ones(2, np.float16), [np.int8(-5)])}],
            "tuple": (1, "two", np.zeros((2, 2))),
            "empty": {"dict": {}, "list": [], "tuple": ()},
        },
        "optim": {0: {"step": 7, "exp_avg": np.ones(4)}, 1: {"step": 8}, "2": "str key"},
        "odd/key~name": {"a~/b": np.arange(4, dtype=">u2"), "~0": np.float64(1.5), "": 0},
        "values": {
            "none": None,
            "true": True,
            "false": False,
            "int": -12,
            "big": 2**62,
            "float": 0.25,
            "nan": float("nan"),
            "inf": float("inf"),
            "-inf": float("-inf"),
            "str": 'h\u00e9llo / ~ " \\ \n',
            "empty": "",
        },
        "scalars": {
            "f32": np.float32(2.5),
            "i64": np.int64(-3),
            "be": np.array(7, ">i4")[()],
            "bf16": ml_dtypes.bfloat16(1.5),
            "c128": np.complex128(1 + 2j),
            "bool": np.bool_(True),
        },
        "zero_d": np.array(3.25, dtype=">f8"),
        "empty": {
            "1d": np.zeros(0, np.float32),
            "2d": np.zeros((3, 0), ">i4"),
            "bf16": np.zeros((0, 2), ml_dtypes.bfloat16),
        },
        "many": {i: random_array(rng, np.dtype(np.float32), (4096,)) for i in range(20)},
        "large": {
            # tens of MB, an object of its own, written in parts
            "f64": rng.standard_normal(3 << 20),
            # big-endian and transposed: saved in C order
            "strided": np.arange(300_000, dtype=">f8").reshape(600, 500).T,
        },
        "point": Point(np.arange(2), 3),
    }


def test_every_leaf_kind_loads_bit_exact_without_ckptstore(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    ckptstore.save(root, full_state(np.random.default_rng(0)), step=5, **PACKING)
    manifest = ckptstore.read_manifest(root, 5)
    names = [key.rsplit("/", 1)[1] for key in manifest.object_keys]
    assert sum(name.startswith("pack-") for name in names) >= 2
    assert sum(name.startswith("leaf-") for name in names) >= 2

    got, version = read_in_child(root, 5)

    assert version == 2  # a save records every leaf's hash
    assert_same(got, ckptstore.load(root, 5))
    assert got["large"]["f64"].nbytes == 24 << 20
    assert got["point"] == (got["point"][0], 3)  # a named tuple comes back a tuple


def test_ml_dtypes_leaves_are_raw_bytes_without_ml_dtypes(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    rng = np.random.default_rng(1)
    state = {
        "bf16": random_array(rng, np.dtype(ml_dtypes.bfloat16), (3, 4)),
        "f8": random_array(rng, np.dtype(ml_dtypes.float8_e4m3fn), (5,)),
        "c32": random_array(rng, np.dtype(ml_dtypes.complex32), (2,)),
        "empty": np.zeros((0, 3), ml_dtypes.bfloat16),
        "scalar": ml_dtypes.bfloat16(2.0),
        "f32": np.ones(3, np.float32),
    }
    ckptstore.save(root, state, step=1)

    got, _ = read_in_child(root, 1, with_ml_dtypes=False)

    want = ckptstore.load(root, 1)
    for key, itemsize in (("bf16", 2), ("f8", 1), ("c32", 4), ("empty", 2), ("scalar", 2)):
        raw, typed = got[key], np.asarray(want[key])
        assert raw.dtype == np.uint8, key
        assert raw.shape == (*typed.shape, itemsize), key
        assert raw.tobytes() == typed.tobytes(), key
    assert_same(got["f32"], want["f32"])


def test_the_reader_allows_the_typed_values_ckptstore_allows(reader: ModuleType) -> None:
    """The reader imports nothing of ckptstore, so it keeps its own copy of the typed-value
    table (docs/format.md); the two must say the same."""
    from ckptstore.layout.tree import VALUE_KINDS

    assert {kind: pattern.pattern for kind, pattern in reader.TYPED_VALUE_NAMES.items()} == {
        name: kind.pattern.pattern for name, kind in VALUE_KINDS.items()
    }


def test_a_version_1_manifest_loads(tmp_path: Path, reader: ModuleType) -> None:
    root = tmp_path / "ckpt"
    ckptstore.save(root, {"w": np.arange(10.0), "n": 3}, step=1)
    # ckptstore writes version 1 for a manifest with neither references nor hashes
    path = root / "1" / "manifest.json"
    manifest = Manifest.parse(path.read_bytes(), step=1)
    path.write_bytes(dataclasses.replace(manifest, leaf_hash=None).encode())

    got, version = read_in_child(root, 1)

    assert version == 1
    assert "hash" not in reader.read_manifest(root, 1)["leaves"]
    assert_same(got, ckptstore.load(root, 1))


def test_an_incremental_chain_reads_the_objects_of_earlier_steps(
    tmp_path: Path, reader: ModuleType
) -> None:
    root = tmp_path / "ckpt"
    rng = np.random.default_rng(2)
    frozen = {
        "embed": rng.standard_normal(100_000),  # 800 KB: an object of its own
        "norms": {i: np.full(16, i, np.float32) for i in range(5)},
    }
    ckptstore.save(root, {"frozen": frozen, "head": np.zeros(100), "epoch": 1}, step=1, **PACKING)
    ckptstore.save(root, {"frozen": frozen, "head": np.ones(100), "epoch": 2}, step=2, **PACKING)

    body = reader.read_manifest(root)  # the newest step
    assert body["step"] == 2
    assert body["version"] == 2
    referenced = [
        key
        for key, step in zip(body["objects"]["key"], body["objects"]["step"], strict=True)
        if step == 1
    ]
    assert referenced  # the frozen leaves' objects are step 1's
    assert all((root / "1" / key).is_file() for key in referenced)

    for step in (1, 2):
        got, _ = read_in_child(root, step)
        assert_same(got, ckptstore.load(root, step))

    # Step 1 deleted: its attempt stays, committed by its committed.json, while 2 uses it.
    ckptstore.delete_step(root, 1)
    assert reader.list_steps(root) == [2]
    assert list((root / "1").glob("attempt-*/committed.json"))
    got, _ = read_in_child(root, 2)
    assert_same(got, ckptstore.load(root, 2))


def test_a_reference_to_an_attempt_without_a_record_is_refused(
    tmp_path: Path, reader: ModuleType
) -> None:
    root = tmp_path / "ckpt"
    big = np.arange(200_000.0)
    ckptstore.save(root, {"big": big, "head": np.zeros(4)}, step=1, **PACKING)
    ckptstore.save(root, {"big": big, "head": np.ones(4)}, step=2, **PACKING)
    (root / "1" / "manifest.json").unlink()  # as if step 1 vanished without its record

    with pytest.raises(ValueError, match="is not a committed attempt"):
        reader.load(root, 2)


def save_sharded(root: Path) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Step 3 from two ranks (threads): a 2 MiB leaf split by rows (a chunk object per rank)
    and a small big-endian one split by columns (packed beside whole leaves), rank-own and
    replicated leaves, a plain value."""
    big = np.arange(512 * 1024, dtype=np.float32).reshape(512, 1024)
    small = np.arange(64 * 48, dtype=">i4").reshape(64, 48)

    def rank(number: int) -> Any:
        part = {
            "big": Shard(
                big[256 * number : 256 * (number + 1)],
                offsets=(256 * number, 0),
                global_shape=big.shape,
            ),
            "small": Shard(
                small[:, 24 * number : 24 * (number + 1)],
                offsets=(0, 24 * number),
                global_shape=small.shape,
            ),
            f"own{number}": np.full(3, number),
            "replicated": np.ones(5),
            "step": 3,
        }
        return save_ranks(root, part, step=3, comm=group.member(number), chunk_block_size=4096)

    group = LocalGroup(2, timeout=60)
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(rank, range(2)))
    assert all(isinstance(r, ckptstore.CommitInfo) for r in results), results
    return big, small


def test_a_sharded_checkpoint_loads_whole(tmp_path: Path, reader: ModuleType) -> None:
    root = tmp_path / "ckpt"
    big, small = save_sharded(root)
    body = reader.read_manifest(root, 3)
    assert body["version"] == 3
    assert len(body["chunks"]["leaf"]) == 4
    assert max(len(crcs) for crcs in body["chunks"]["crc32c"]) == 256  # 4 KiB blocks

    got, _ = read_in_child(root, 3)

    assert_same(got, ckptstore.load(root, 3))
    np.testing.assert_array_equal(got["big"], big)
    assert got["small"].dtype.str == ">i4"
    np.testing.assert_array_equal(got["small"], small)


# ------------------------------------------------------------------------------ damage


def flip(path: Path, offset: int) -> None:
    path.chmod(0o644)
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def leaf_place(root: Path, step: int, leaf_path: str) -> tuple[Path, int, int]:
    """``(object file, offset, recorded crc32c)`` of a leaf, as ckptstore's manifest has it."""
    manifest = ckptstore.read_manifest(root, step)
    leaf = manifest.paths.index(leaf_path)
    file = root / manifest.object_key(manifest.leaf_object[leaf])
    return file, manifest.leaf_offset[leaf], manifest.leaf_crc[leaf]


def test_a_damaged_leaf_is_named_with_both_crcs(tmp_path: Path, reader: ModuleType) -> None:
    root = tmp_path / "ckpt"
    ckptstore.save(root, {"a": np.arange(10.0), "b/c": np.arange(100.0)}, step=1)
    file, offset, recorded = leaf_place(root, 1, "b~1c")
    flip(file, offset + 5)
    computed = crc32c_package.crc32c(file.read_bytes()[offset : offset + 800])

    with pytest.raises(ValueError, match="leaf 'b~1c'") as failure:
        reader.load(root, 1)

    assert f"recorded {recorded}, computed {computed}" in str(failure.value)
    with pytest.raises(ckptstore.CorruptCheckpointError):  # ckptstore agrees
        ckptstore.load(root, 1)


def test_damage_between_leaves_fails_the_objects_crc(tmp_path: Path, reader: ModuleType) -> None:
    root = tmp_path / "ckpt"
    ckptstore.save(root, {"a": np.arange(5.0), "b": np.arange(5.0)}, step=1)  # 40 B, at 0 and 64
    file, offset, _ = leaf_place(root, 1, "a")
    assert leaf_place(root, 1, "b")[0] == file
    flip(file, offset + 50)

    with pytest.raises(ValueError, match=r"object '1/attempt-[0-9a-f-]+/pack-\d+': crc32c"):
        reader.load(root, 1)


def test_a_damaged_chunk_block_is_named(tmp_path: Path, reader: ModuleType) -> None:
    root = tmp_path / "ckpt"
    save_sharded(root)
    body = reader.read_manifest(root, 3)
    chunks = body["chunks"]
    second = chunks["start"].index([256, 0])  # rank 1's rows of "big"
    key = body["objects"]["key"][chunks["object"][second]]
    flip(root / "3" / key, chunks["offset"][second] + 3 * 4096 + 7)

    with pytest.raises(ValueError, match=r"leaf 'big': chunk at \[256, 0\], block 3 in object"):
        reader.load(root, 3)


def test_a_missing_or_short_object_is_named(tmp_path: Path, reader: ModuleType) -> None:
    root = tmp_path / "ckpt"
    ckptstore.save(root, {"a": np.arange(10.0)}, step=1)
    file, _, _ = leaf_place(root, 1, "a")
    file.write_bytes(file.read_bytes()[:-1])
    with pytest.raises(ValueError, match="is 79 bytes, but the manifest says 80"):
        reader.load(root, 1)
    file.unlink()
    with pytest.raises(ValueError, match="is missing"):
        reader.load(root, 1)


def test_a_damaged_manifest_is_refused(tmp_path: Path, reader: ModuleType) -> None:
    root = tmp_path / "ckpt"
    ckptstore.save(root, {"a": np.arange(10.0)}, step=1)
    path = root / "1" / "manifest.json"
    flip(path, len(path.read_bytes()) // 2)

    with pytest.raises(ValueError, match=r"manifest\.json: invalid manifest: crc32c mismatch"):
        reader.read_manifest(root, 1)
    with pytest.raises(ValueError, match="crc32c mismatch"):
        reader.load(root, 1)


def test_an_unknown_version_or_envelope_is_refused(tmp_path: Path, reader: ModuleType) -> None:
    root = tmp_path / "ckpt"
    ckptstore.save(root, {"a": np.arange(10.0)}, step=1)
    path = root / "1" / "manifest.json"
    data = path.read_bytes()
    path.write_bytes(data.replace(b'"version":2,', b'"version":99,', 1))
    with pytest.raises(ValueError, match="format version 99; this reader reads versions 1, 2, 3"):
        reader.read_manifest(root, 1)
    path.write_bytes(data.replace(b'"format":"ckptstore"', b'"format":"other"', 1))
    with pytest.raises(ValueError, match="unrecognised envelope"):
        reader.read_manifest(root, 1)


def rewrite_body(path: Path, change: Any) -> None:
    """Apply ``change`` to a manifest's body and write it back with a valid crc32c, as a
    hostile writer would."""
    data = path.read_bytes()
    head, _, rest = data.partition(b',"body":')
    body = json.loads(rest[:-1])
    change(body)
    encoded = json.dumps(body, separators=(",", ":")).encode()
    version = head.split(b'"version":')[1].split(b",")[0]
    path.write_bytes(
        b'{"format":"ckptstore","version":'
        + version
        + b',"crc32c":'
        + str(crc32c_package.crc32c(encoded)).encode()
        + b',"body":'
        + encoded
        + b"}"
    )


def leave_the_root(body: dict[str, Any]) -> None:
    body["objects"]["key"][0] = body["attempt"] + "/../../../etc/passwd"


def reach_past_the_end(body: dict[str, Any]) -> None:
    body["leaves"]["offset"][1] = body["objects"]["length"][0] - 8


def overlap(body: dict[str, Any]) -> None:
    body["leaves"]["offset"][1] = 8


def pickled_dtype(body: dict[str, Any]) -> None:
    body["leaves"]["dtype"][0] = "|O"


def other_shape(body: dict[str, Any]) -> None:
    body["leaves"]["shape"][0] = [11]


def other_tree(body: dict[str, Any]) -> None:
    body["tree"]["d"][0] = "z"


def unknown_column(body: dict[str, Any]) -> None:
    body["leaves"]["device"] = ["cpu", "cpu"]


HOSTILE = {
    "a key leaving the root": (leave_the_root, "is not a valid key"),
    "a leaf past its object's end": (reach_past_the_end, "reaches past the end of its object"),
    "overlapping leaves": (overlap, "leaf 'a' and leaf 'b' overlap"),
    "a dtype not allowed": (pickled_dtype, "dtype '|O' is not allowed"),
    "a shape of another length": (other_shape, "is not 80 bytes"),
    "a tree naming other paths": (other_tree, "the tree and the leaf paths disagree"),
    "an unknown column": (unknown_column, r"unknown fields \['device'\]"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_body_is_refused(tmp_path: Path, reader: ModuleType, case: str) -> None:
    root = tmp_path / "ckpt"
    # two leaves in one pack: "a" at 0 (80 B), "b" after it (16 B)
    ckptstore.save(root, {"a": np.arange(10.0), "b": np.arange(2.0)}, step=1)
    change, message = HOSTILE[case]
    rewrite_body(root / "1" / "manifest.json", change)

    with pytest.raises(ValueError, match=message):
        reader.read_manifest(root, 1)


def test_a_chunk_grid_with_a_gap_is_refused(tmp_path: Path, reader: ModuleType) -> None:
    root = tmp_path / "ckpt"
    save_sharded(root)

    def gap(body: dict[str, Any]) -> None:
        second = body["chunks"]["start"].index([256, 0])
        body["chunks"]["start"][second] = [255, 0]

    rewrite_body(root / "3" / "manifest.json", gap)
    with pytest.raises(ValueError, match="chunks leave a gap or overlap at 256 along dimension 0"):
        reader.read_manifest(root, 3)


# ------------------------------------------------------------------------- the rest


def test_steps_and_the_newest_manifest(tmp_path: Path, reader: ModuleType) -> None:
    root = tmp_path / "ckpt"
    with pytest.raises(FileNotFoundError, match="no committed checkpoint"):
        reader.read_manifest(root)
    for step in (10, 2, 100):
        ckptstore.save(root, {"s": step}, step=step, metadata={"loss": 0.5})
    (root / "7").mkdir()  # a step directory without a manifest is not committed
    assert reader.list_steps(root) == [2, 10, 100]
    body = reader.read_manifest(root)
    assert (body["step"], body["metadata"]) == (100, {"loss": 0.5})
    assert reader.load(root, 10) == {"s": 10}
    with pytest.raises(FileNotFoundError, match="step 7 is not committed"):
        reader.load(root, 7)


def test_the_command_line_lists_every_leaf_verified(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    ckptstore.save(root, {"w": np.zeros((2, 3), ">f4"), "opt": {0: np.int64(1)}}, step=4)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(READER), str(root), *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    done = run("--step", "4")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "w  >f4  [2, 3]  verified" in lines
    assert "opt/0  <i8  []  verified" in lines
    assert lines[-1].startswith("step 4 (format version 2): 2 array leaves")

    file, offset, _ = leaf_place(root, 4, "w")
    flip(file, offset)
    done = run()
    assert done.returncode == 1
    assert "leaf 'w'" in done.stderr
    assert "crc32c mismatch" in done.stderr


@pytest.mark.parametrize("size", [0, 1, 3, 255, 256, 4096, 65_541, (1 << 20) + 7, 5 << 20])
def test_crc32c_matches_the_crc32c_package(reader: ModuleType, size: int) -> None:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    assert reader.crc32c(data) == crc32c_package.crc32c(data.tobytes())
    assert reader.crc32c(data.tobytes(), 0xDEADBEEF) == crc32c_package.crc32c(
        data.tobytes(), 0xDEADBEEF
    )
    assert reader.crc32c(data[1:]) == crc32c_package.crc32c(data[1:].tobytes())  # unaligned
