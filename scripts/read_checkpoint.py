"""Read a ckptstore checkpoint from a local directory with the standard library and numpy only.

This is the proof that the checkpoint format (docs/format.md) can be read without ckptstore's
code: everything here follows from the format's facts, and nothing imports ckptstore::

    python scripts/read_checkpoint.py ROOT [--step N]     # every leaf, verified

    from read_checkpoint import list_steps, read_manifest, load   # scripts/ on sys.path
    state = load("./run1")          # the newest committed step, every byte verified

What it checks, before returning anything:

* the manifest: the envelope (``{"format":"ckptstore","version":N,"crc32c":C,"body":...}``),
  a version this reader knows (1 to 4), the crc32c of the body's exact bytes, a size under
  :data:`MANIFEST_MAX_BYTES`, and the body's structure: the columns of each version and
  nothing else, one length per table, the step it was read as, attempt-shaped object keys
  (so no key leaves the root), dtypes from the allow-list, ``prod(shape) * itemsize ==
  length``, every leaf and chunk inside its object and none overlapping another, the chunks
  of each sharded leaf tiling it exactly once as a grid, and a tree that places every array
  exactly once at the path the leaf table gives it, its typed values (version 4) of a known
  kind and well-formed name;
* references to earlier steps' objects (version 2): each referenced attempt is committed
  (``<step>/manifest.json`` names it, or it holds ``committed.json``) and that record lists
  the object with the same length and crc32c;
* the data: every object's size on disk, every leaf's crc32c (an empty leaf's too: 0), every
  block crc32c of every chunk of a sharded leaf (version 3), and, since every object is read
  whole, every object's crc32c (after its leaves', so damage inside a leaf names the leaf).

What it does not do:

* stores other than a local directory (copy an S3/GCS root to disk first), partial loads
  (ckptstore's ``keys=``) or reads of a box of a sharded leaf: every object is read whole,
  into memory, and the arrays returned are views into those buffers;
* frameworks: arrays come back as numpy arrays whatever saved them (torch, JAX), and the
  leaves' ``attrs`` (a tensor's device, ``requires_grad``) are not interpreted; named tuples
  come back as tuples, dataclasses and pytree nodes as dicts (ckptstore's ``target=``
  rebuilds those types, which a manifest does not name); a checkpoint of the DCP
  integration loads as DCP's flattened items; a typed value (version 4: a ``torch.dtype``,
  a ``torch.device``) comes back as a :class:`TypedValue` of its kind and name, without
  importing torch; an ordered dict (version 4) as a ``collections.OrderedDict``;
* the ``hash`` column (xxh3-128 of each leaf, what an incremental save compares) is checked
  for its shape but not recomputed: the crc32c checks guard the bytes;
* leases, gc markers and anything else a running save or collector writes: a step deleted
  while it is being read fails with a missing object.

Dtypes: numpy's numeric types are named by ``dtype.str`` (``"<f4"``, ``">i8"``, ``"|b1"``) and
come back in the byte order they were saved in. The ml_dtypes types (``bfloat16``, the
float8/float6/float4 families, ``int4``...) are named by ``dtype.name``; with ml_dtypes
installed they come back as those types. Without it, a leaf of one of them comes back as a
raw ``uint8`` array of shape ``shape + (itemsize,)`` (each element's bytes, native order), so
its byte length is the leaf's; ``np.frombuffer(raw, ml_dtypes.bfloat16).reshape(shape)``
turns it into the typed array later.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import math
import os
import re
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "MANIFEST_MAX_BYTES",
    "VERSIONS",
    "TypedValue",
    "crc32c",
    "list_steps",
    "load",
    "read_manifest",
]

#: Manifest format versions this reader reads: 1 (plain), 2 (references to earlier steps'
#: objects, per-leaf hashes), 3 (leaves sharded across ranks, stored as chunks) and 4 (typed
#: values and ordered dicts in the tree).
VERSIONS = (1, 2, 3, 4)

#: The kinds of typed value (version 4) and the names each may have (docs/format.md).
TYPED_VALUE_NAMES = {
    "torch.dtype": re.compile(r"[a-z][a-z0-9_]{0,39}"),
    "torch.device": re.compile(r"[a-z][a-z0-9_]{0,19}(:[0-9]{1,6})?"),
}


class TypedValue(NamedTuple):
    """A typed value of the tree (version 4), as this reader returns it: its kind
    (``"torch.dtype"``) and its name (``"bfloat16"``)."""

    kind: str
    name: str


#: A manifest larger than this is refused before it is read (ckptstore's default cap,
#: ``Settings.manifest_max_bytes``).
MANIFEST_MAX_BYTES = 256 << 20

MANIFEST_NAME = "manifest.json"
#: The manifest of a deleted step that later steps still reference, inside its attempt.
RECORD_NAME = "committed.json"
_MAX_STEP = (1 << 63) - 1
_MAX_BYTES = 1 << 60  # no leaf, chunk or object claims more
_MAX_DEPTH = 200  # deepest tree a manifest may hold
_STEP_RE = re.compile(r"0|[1-9][0-9]{0,18}")
_ATTEMPT_RE = re.compile(r"attempt-[0-9a-f]{12}-[0-9a-f]{16}")
_HASH_RE = re.compile(r"[0-9a-f]{32}")
_ENVELOPE = re.compile(rb'\{"format":"ckptstore","version":(\d{1,6}),"crc32c":(\d{1,10}),"body":')
_TEMP_PREFIX = ".ckptstore-tmp"  # a writer's temp file, never a committed object

# ---------------------------------------------------------------------------------- crc32c
#
# crc32c (Castagnoli, bit-reflected polynomial 0x82F63B78, initial value and final xor
# 0xFFFFFFFF). A byte-at-a-time loop in Python runs at a few MB/s, so large buffers are cut
# into equal lanes hashed side by side with numpy (4 bytes per step through two 65536-entry
# tables), and the lanes' checksums are then joined pairwise. The join uses linearity: the
# raw (un-inverted) crc of A + B is the crc of A carried over len(B) zero bytes, xor that of
# B; carrying over zero bytes is a linear map of the 32-bit state, held as 4 x 256 tables.

_POLY = 0x82F63B78
_MASK = 0xFFFFFFFF
_LANES = 1 << 14  # lanes hashed side by side, at most
_SMALL = 256  # buffers shorter than this take the byte loop


def _byte_table() -> np.ndarray[Any, np.dtype[np.uint32]]:
    table = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        table = np.where(table & 1, (table >> 1) ^ np.uint32(_POLY), table >> 1)
    return table


_BYTE = _byte_table()
_BYTE_LIST = [int(v) for v in _BYTE]


def _through_zeros(states: np.ndarray[Any, Any], count: int) -> np.ndarray[Any, Any]:
    """Raw crc states carried over ``count`` zero bytes, one byte at a time."""
    for _ in range(count):
        states = _BYTE[states & 0xFF] ^ (states >> 8)
    return states


_HALVES = np.arange(1 << 16, dtype=np.uint32)
# A state xor the next 4 data bytes (little-endian), carried over 4 zero bytes, is the state
# after those bytes; the low and high 16 bits of it contribute independently.
_WORD_LOW = _through_zeros(_HALVES, 4)
_WORD_HIGH = _through_zeros(_HALVES << 16, 4)
# Every byte value at each of the 4 byte positions of a state: a linear map of the state is
# its image of these, as a 4 x 256 table.
_BYTE_BASIS = (
    np.arange(256, dtype=np.uint32)[None, :] << (8 * np.arange(4, dtype=np.uint32))[:, None]
)


def _apply(table: np.ndarray[Any, Any], states: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The linear map ``table`` (4 x 256) applied to every state in ``states``."""
    mapped: np.ndarray[Any, Any] = (
        table[0][states & 0xFF]
        ^ table[1][(states >> 8) & 0xFF]
        ^ table[2][(states >> 16) & 0xFF]
        ^ table[3][states >> 24]
    )
    return mapped


@functools.lru_cache(maxsize=1024)
def _zeros_map(nbytes: int) -> np.ndarray[Any, Any]:
    """The map carrying a raw crc state over ``nbytes`` (>= 1) zero bytes, by squaring."""
    if nbytes == 1:
        return _through_zeros(_BYTE_BASIS, 1)
    half = _zeros_map(nbytes // 2)
    twice = _apply(half, half)
    return twice if nbytes % 2 == 0 else _apply(_zeros_map(1), twice)


def _lanes(state: int, data: np.ndarray[Any, Any], lane: int) -> int:
    """The raw crc state after ``data`` (a whole number of ``lane``-byte lanes) from
    ``state``."""
    count = len(data) // lane
    words = data.view("<u4").reshape(count, lane // 4).T.copy()  # a row per step, lanes across
    crcs = np.zeros(count, np.uint32)
    crcs[0] = state  # the other lanes start from 0: their crc is joined in below
    for row in words:
        mixed = crcs ^ row
        crcs = _WORD_LOW[mixed & 0xFFFF] ^ _WORD_HIGH[mixed >> 16]
    span = lane
    while len(crcs) > 1:
        if len(crcs) % 2:
            # a leading lane whose crc is 0 adds nothing, whatever it is carried over
            crcs = np.concatenate([np.zeros(1, np.uint32), crcs])
        crcs = _apply(_zeros_map(span), crcs[0::2]) ^ crcs[1::2]
        span *= 2
    return int(crcs[0])


def crc32c(data: Any, crc: int = 0) -> int:
    """The crc32c of a contiguous buffer (bytes, memoryview, numpy array), or ``crc``
    extended over it (the crc32c of the earlier bytes followed by ``data``)."""
    if isinstance(data, np.ndarray):
        view = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    else:
        view = np.frombuffer(data, np.uint8)
    state = crc ^ _MASK
    while len(view) >= _SMALL:
        lane = max(64, len(view) // _LANES // 4 * 4)
        whole = len(view) // lane * lane
        state = _lanes(state, view[:whole], lane)
        view = view[whole:]
    for byte in view.tobytes():
        state = _BYTE_LIST[(state ^ byte) & 0xFF] ^ (state >> 8)
    return state ^ _MASK


# ---------------------------------------------------------------------------------- dtypes

# numpy's numeric type codes (bool, ints, floats with float16 and long double, complex), in
# both byte orders, named by dtype.str; "l" before "q", as a manifest's "<i8" is int64.
_NUMPY_CODES = "?bBhHiIlLqQefdgFDG"
# The ml_dtypes types, by dtype.name, with their item sizes: read as raw bytes without it.
_EXTENSION_ITEMSIZES = {
    "bfloat16": 2,
    "complex32": 4,
    "bcomplex32": 4,
    **dict.fromkeys(
        (
            *("float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fn"),
            *("float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu"),
            *("float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn"),
            *("int1", "int2", "int4", "uint1", "uint2", "uint4"),
        ),
        1,
    ),
}
_USER_DTYPE_NUM = 256  # numpy numbers registered dtypes (ml_dtypes' among them) from here up


def _allowed_dtypes() -> dict[str, np.dtype[Any]]:
    """Every dtype name a manifest may carry, with the dtype a leaf of it is read as."""
    by_name: dict[str, np.dtype[Any]] = {}
    for code in _NUMPY_CODES:
        for dtype in (np.dtype(code).newbyteorder("<"), np.dtype(code).newbyteorder(">")):
            by_name.setdefault(dtype.str, dtype)
    for name, itemsize in _EXTENSION_ITEMSIZES.items():
        by_name[name] = np.dtype((np.uint8, (itemsize,)))  # raw bytes: shape + (itemsize,)
    try:
        import ml_dtypes
    except ImportError:
        return by_name
    for attr in dir(ml_dtypes):
        kind = getattr(ml_dtypes, attr)
        if isinstance(kind, type) and issubclass(kind, np.generic):
            dtype = np.dtype(kind)
            if dtype.num >= _USER_DTYPE_NUM:
                by_name[dtype.name] = dtype
    return by_name


_DTYPES = _allowed_dtypes()


# -------------------------------------------------------------------------------- manifest


class _Invalid(Exception):
    """A manifest problem; raised as a ValueError naming the file."""


def list_steps(root: str | os.PathLike[str]) -> list[int]:
    """The committed steps under ``root``, ascending: step directories holding a manifest.

    A manifest is not validated here; :func:`read_manifest` does that.
    """
    root = os.fspath(root)
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted(
        int(name)
        for name in names
        if _STEP_RE.fullmatch(name)
        and int(name) <= _MAX_STEP
        and os.path.isfile(os.path.join(root, name, MANIFEST_NAME))
    )


def read_manifest(root: str | os.PathLike[str], step: int | None = None) -> dict[str, Any]:
    """The validated manifest body of ``step`` (``None``: the newest committed step).

    Returns:
        The body (``step``, ``attempt``, ``created``, ``metadata``, ``tree``, ``objects``,
        ``leaves`` and, in version 3, ``chunks``), with the envelope's ``version`` added.

    Raises:
        FileNotFoundError: nothing is committed under ``root``, or not that step.
        ValueError: naming the file and the problem: a bad envelope, an unknown version, a
            crc32c mismatch, a body that breaks the format's rules.
    """
    root = os.fspath(root)
    if step is None:
        steps = list_steps(root)
        if not steps:
            raise FileNotFoundError(f"{root}: no committed checkpoint (no <step>/{MANIFEST_NAME})")
        step = steps[-1]
    if type(step) is not int or not 0 <= step <= _MAX_STEP:
        raise ValueError(f"step {step!r} is not a step number (an int in [0, 2**63))")
    path = os.path.join(root, str(step), MANIFEST_NAME)
    try:
        data = _read_capped(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{root}: step {step} is not committed (no {path})") from None
    return _parse(data, path, step)


def _read_capped(path: str) -> bytes:
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        if size > MANIFEST_MAX_BYTES:
            raise ValueError(
                f"{path}: invalid manifest: {size} bytes is over the {MANIFEST_MAX_BYTES}-byte cap"
            )
        return file.read()


def _parse(data: bytes, source: str, step: int) -> dict[str, Any]:
    """Check a manifest's envelope and crc32c, then validate its body."""

    def reject(reason: str) -> ValueError:
        return ValueError(f"{source}: invalid manifest: {reason}")

    match = _ENVELOPE.match(data)
    if match is None:
        raise reject("not a ckptstore manifest (unrecognised envelope)")
    version = int(match.group(1))
    if version not in VERSIONS:
        raise reject(
            f"format version {version}; this reader reads versions {', '.join(map(str, VERSIONS))}"
        )
    if not data.endswith(b"}"):
        raise reject("truncated (no closing brace)")
    body = data[match.end() : -1]
    recorded, computed = int(match.group(2)), crc32c(body)
    if recorded != computed:
        raise reject(f"crc32c mismatch (recorded {recorded}, computed {computed})")
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise reject(f"body is not valid JSON ({str(exc)[:200]})") from None
    try:
        _validate(doc, version, step)
    except _Invalid as exc:
        raise reject(str(exc)) from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, RecursionError) as exc:
        raise reject(f"unexpected structure ({type(exc).__name__}: {exc})") from None
    return {**doc, "version": version}


def _require(ok: bool, reason: str) -> None:
    if not ok:
        raise _Invalid(reason)


def _ints(column: Any, name: str, n: int, low: int, high: int) -> list[int]:
    """Check a column of ``n`` ints in ``[low, high]``."""
    _require(type(column) is list and len(column) == n, f"{name} does not have {n} entries")
    _require(
        all(type(v) is int and low <= v <= high for v in column),
        f"{name} holds a value that is not an integer in [{low}, {high}]",
    )
    return column  # type: ignore[no-any-return]  # checked just above


def _table(
    value: Any, name: str, required: Sequence[str], optional: Sequence[str]
) -> dict[str, Any]:
    """Check a column table: the required columns are lists, optional ones lists or null."""
    _require(type(value) is dict, f"{name} is not an object")
    unknown = set(value) - {*required, *optional}
    _require(not unknown, f"{name} has unknown fields {sorted(unknown)[:5]}")
    for column in required:
        _require(type(value.get(column)) is list, f"{name}.{column} is missing or not a list")
    for column in optional:
        _require(
            value.get(column) is None or type(value[column]) is list,
            f"{name}.{column} is not a list",
        )
    return value  # type: ignore[no-any-return]  # checked just above


def _check_key(key: str, name: str) -> None:
    """A key whose segments are plain file names (so no key leaves the root)."""
    for segment in key.split("/"):
        _require(
            segment not in ("", ".", "..")
            and not segment.startswith(_TEMP_PREFIX)
            and "\\" not in segment
            and "\x00" not in segment,
            f"object key {name!r} is not a valid key",
        )


def _validate(doc: Any, version: int, expected_step: int) -> None:
    """Raise :class:`_Invalid` unless ``doc`` is a valid manifest body of ``version``."""
    _require(type(doc) is dict, "body is not a JSON object")
    _require("chunks" not in doc or version >= 3, f"a version-{version} manifest has chunks")
    step = doc.get("step")
    _require(type(step) is int and 0 <= step <= _MAX_STEP, f"step {step!r} is not a step number")
    _require(step == expected_step, f"it commits step {step}, but was read as {expected_step}")
    attempt = doc.get("attempt")
    _require(
        type(attempt) is str and _ATTEMPT_RE.fullmatch(attempt) is not None,
        f"attempt {attempt!r} is not an attempt id",
    )
    _require(type(doc.get("created")) in (int, float), "created is not a number")
    newer = version >= 2  # the objects.step and leaves.hash columns
    objects = _table(
        doc.get("objects"), "objects", ("key", "length", "crc32c"), ("step",) if newer else ()
    )
    leaves = _table(
        doc.get("leaves"),
        "leaves",
        ("path", "dtype", "shape", "object", "offset", "length", "crc32c"),
        ("attrs", "hash") if newer else ("attrs",),
    )

    # objects: own ones under this attempt, references right under another step's attempt
    keys = objects["key"]
    nobj = len(keys)
    steps = objects.get("step") or [step] * nobj
    _ints(steps, "objects.step", nobj, 0, _MAX_STEP)
    olen = _ints(objects["length"], "objects.length", nobj, 0, _MAX_BYTES)
    _ints(objects["crc32c"], "objects.crc32c", nobj, 0, _MASK)
    for where, key in zip(steps, keys, strict=True):
        _require(type(key) is str, "an object key is not a string")
        if where == step:
            _require(key.startswith(attempt + "/"), f"object {key!r} is not under {attempt}/")
        else:
            head, _, name = key.partition("/")
            _require(
                _ATTEMPT_RE.fullmatch(head) is not None and name != "" and "/" not in name,
                f"referenced object {where}/{key!r} is not right under an attempt",
            )
        _check_key(key, f"{where}/{key}")
    _require(len(set(zip(steps, keys, strict=True))) == nobj, "object keys repeat")

    # leaves
    paths = leaves["path"]
    n = len(paths)
    _require(all(type(p) is str for p in paths), "a leaf path is not a string")
    _require(len(set(paths)) == n, "leaf paths repeat")
    dtypes = leaves["dtype"]
    shapes = leaves["shape"]
    _require(len(dtypes) == n and len(shapes) == n, "leaves.dtype or .shape is not one per leaf")
    lobj = _ints(leaves["object"], "leaves.object", n, -1, nobj - 1)
    loff = _ints(leaves["offset"], "leaves.offset", n, 0, _MAX_BYTES)
    llen = _ints(leaves["length"], "leaves.length", n, 0, _MAX_BYTES)
    _ints(leaves["crc32c"], "leaves.crc32c", n, 0, _MASK)
    attrs = leaves.get("attrs")
    _require(
        attrs is None or (len(attrs) == n and all(a is None or type(a) is dict for a in attrs)),
        "leaves.attrs is not one object (or null) per leaf",
    )
    hashes = leaves.get("hash")
    _require(
        hashes is None
        or (
            len(hashes) == n
            and all(h is None or (type(h) is str and _HASH_RE.fullmatch(h)) for h in hashes)
        ),
        "leaves.hash is not 32 hex digits (or null) per leaf",
    )
    for i in range(n):
        dtype = _DTYPES.get(dtypes[i]) if type(dtypes[i]) is str else None
        _require(dtype is not None, f"leaf {paths[i]!r}: dtype {dtypes[i]!r} is not allowed")
        assert dtype is not None
        shape = shapes[i]
        _require(
            type(shape) is list
            and len(shape) <= 64
            and all(type(d) is int and 0 <= d < 1 << 63 for d in shape),
            f"leaf {paths[i]!r}: shape {shape!r} is not a list of dimensions",
        )
        _require(
            math.prod(shape) * dtype.itemsize == llen[i],
            f"leaf {paths[i]!r}: shape {shape} of {dtypes[i]} is not {llen[i]} bytes",
        )
        _require(
            math.prod(d for d in shape if d) * dtype.itemsize <= _MAX_BYTES,
            f"leaf {paths[i]!r}: shape {shape} is too large for any array",
        )

    # where every byte lies: (object, start, length, what) of each leaf and chunk
    chunked = _validate_chunks(doc.get("chunks"), shapes, dtypes, lobj, nobj, paths)
    extents = []
    for i in range(n):
        if i in chunked:
            _require(lobj[i] == -1 and loff[i] == 0, f"chunked leaf {paths[i]!r} has an object")
        elif lobj[i] < 0:
            _require(llen[i] == 0 and loff[i] == 0, f"leaf {paths[i]!r} has no object")
        else:
            extents.append((lobj[i], loff[i], llen[i], f"leaf {paths[i]!r}"))
    chunks = doc.get("chunks")
    if chunks is not None:
        for c, owner in enumerate(chunks["leaf"]):
            length = math.prod(chunks["shape"][c]) * _DTYPES[dtypes[owner]].itemsize
            what = f"leaf {paths[owner]!r} (chunk at {chunks['start'][c]})"
            extents.append((chunks["object"][c], chunks["offset"][c], length, what))
    last: tuple[int, int, str] = (-1, 0, "")
    for obj, start, length, what in sorted(extents):
        _require(start + length <= olen[obj], f"{what} reaches past the end of its object")
        if length:
            _require(
                obj != last[0] or start >= last[1], f"{last[2]} and {what} overlap in an object"
            )
            last = (obj, start + length, what)

    tree_paths = _tree_paths(doc.get("tree"), n, version)
    _require(tree_paths == paths, "the tree and the leaf paths disagree")


_CHUNK_FIELDS = ("block_size", "leaf", "start", "shape", "object", "offset", "crc32c")


def _validate_chunks(
    value: Any,
    shapes: list[list[int]],
    dtypes: list[str],
    lobj: list[int],
    nobj: int,
    paths: list[str],
) -> set[int]:
    """Check a version-3 chunk table against the leaves; return the chunked leaves."""
    if value is None:
        return set()
    _require(
        type(value) is dict and set(value) == set(_CHUNK_FIELDS),
        f"chunks is not an object with exactly the fields {list(_CHUNK_FIELDS)}",
    )
    block = value["block_size"]
    _require(
        type(block) is int and 4 << 10 <= block <= 1 << 30 and block & (block - 1) == 0,
        f"chunks.block_size {block!r} is not a power of two from 4 KiB to 1 GiB",
    )
    leaf = value["leaf"]
    _require(type(leaf) is list, "chunks.leaf is not a list")
    count = len(leaf)
    _ints(leaf, "chunks.leaf", count, 0, len(shapes) - 1)
    _ints(value["object"], "chunks.object", count, 0, nobj - 1)
    _ints(value["offset"], "chunks.offset", count, 0, _MAX_BYTES)
    starts, cshapes, crcs = value["start"], value["shape"], value["crc32c"]
    _require(
        all(type(c) is list and len(c) == count for c in (starts, cshapes, crcs)),
        f"the columns of chunks do not have {count} entries",
    )
    by_leaf: dict[int, list[int]] = {}
    for c in range(count):
        owner = leaf[c]
        ndim = len(shapes[owner])
        for name, row in (("start", starts[c]), ("shape", cshapes[c])):
            _require(
                type(row) is list and len(row) == ndim and all(type(v) is int for v in row),
                f"chunk {c}: {name} {row!r} is not a list of {ndim} ints",
            )
        length = math.prod(cshapes[c]) * _DTYPES[dtypes[owner]].itemsize
        _require(
            all(v > 0 for v in cshapes[c]) and 0 < length <= _MAX_BYTES,
            f"chunk {c}: shape {cshapes[c]} is empty or too large",
        )
        _ints(crcs[c], f"chunk {c}: crc32c", -(-length // block), 0, _MASK)
        by_leaf.setdefault(owner, []).append(c)
    for owner, members in by_leaf.items():
        _require(lobj[owner] == -1, f"leaf {paths[owner]!r} has both an object and chunks")
        _check_grid(shapes[owner], [starts[c] for c in members], [cshapes[c] for c in members])
    return set(by_leaf)


def _check_grid(shape: list[int], starts: list[list[int]], sizes: list[list[int]]) -> None:
    """The boxes cover ``shape`` exactly once, as a grid: along every dimension their extents
    split it into intervals without gap or overlap, and each combination is one box."""
    cells: list[dict[tuple[int, int], int]] = []
    for d, total in enumerate(shape):
        intervals = sorted({(s[d], s[d] + n[d]) for s, n in zip(starts, sizes, strict=True)})
        at = 0
        for low, high in intervals:
            _require(low == at, f"chunks leave a gap or overlap at {at} along dimension {d}")
            at = high
        _require(at == total, f"chunks do not cover [{at}, {total}) along dimension {d}")
        cells.append({interval: i for i, interval in enumerate(intervals)})
    seen = {
        tuple(cells[d][(s[d], s[d] + n[d])] for d in range(len(shape)))
        for s, n in zip(starts, sizes, strict=True)
    }
    _require(
        len(seen) == len(starts) == math.prod(len(c) for c in cells),
        "chunks do not form a grid (a box is covered twice or not at all)",
    )


def _segment(key: Any) -> str:
    """A dict key's segment of a path: ints in decimal, ``~`` and ``/`` escaped."""
    if type(key) is int:
        return str(key)
    return str(key).replace("~", "~0").replace("/", "~1")


def _join(path: str, segment: str, depth: int) -> str:
    """A child's path: the root's children are just their segments."""
    return segment if depth == 0 else f"{path}/{segment}"


def _tree_paths(tree: Any, count: int, version: int) -> list[str | None]:
    """The path of each of ``count`` array leaves the tree places; raise if it is malformed."""
    found: list[str | None] = [None] * count

    def walk(node: Any, path: str, depth: int) -> None:
        _require(depth <= _MAX_DEPTH, f"tree nested deeper than {_MAX_DEPTH} levels")
        if type(node) is int or (type(node) is dict and len(node) == 1 and "s" in node):
            index = node["s"] if isinstance(node, dict) else node  # a numpy scalar, an array
            _require(type(index) is int and 0 <= index < count, f"tree leaf {path!r}: bad index")
            _require(found[index] is None, f"tree places array {index} twice")
            found[index] = path
            return
        _require(type(node) is dict, f"tree node at {path!r} is not an object")
        if len(node) == 1 and "v" in node:
            _require(
                node["v"] is None or type(node["v"]) in (bool, int, float, str),
                f"tree value at {path!r} is not a plain value",
            )
        elif len(node) == 1 and "x" in node:
            _require(version >= 4, f"a version-{version} manifest has a typed value")
            typed = node["x"]
            _require(
                type(typed) is list and len(typed) == 2 and all(type(t) is str for t in typed),
                f"typed value at {path!r} is not a [kind, name] pair",
            )
            names = TYPED_VALUE_NAMES.get(typed[0])
            _require(
                names is not None and names.fullmatch(typed[1]) is not None,
                f"typed value at {path!r} is not a known kind and name",
            )
        elif set(node) == {"d", "c"} or set(node) == {"d", "c", "o"}:
            _require(
                node.get("o", 1) == 1 and type(node.get("o", 1)) is int,
                f"tree dict at {path!r} has a bad ordered flag",
            )
            _require("o" not in node or version >= 4, f"a version-{version} tree orders a dict")
            keys, children = node["d"], node["c"]
            _require(
                type(keys) is list and type(children) is list and len(keys) == len(children),
                f"tree dict at {path!r} has mismatched keys and children",
            )
            _require(all(type(k) in (str, int) for k in keys), f"tree dict at {path!r}: a bad key")
            segments = [_segment(k) for k in keys]
            _require(len(set(segments)) == len(segments), f"tree dict at {path!r} repeats a key")
            for segment, child in zip(segments, children, strict=True):
                walk(child, _join(path, segment, depth), depth + 1)
        elif len(node) == 1 and ("l" in node or "t" in node):
            items = node.get("l", node.get("t"))
            _require(type(items) is list, f"tree sequence at {path!r} is not a list")
            for i, child in enumerate(items):
                walk(child, _join(path, str(i), depth), depth + 1)
        else:
            raise _Invalid(f"tree node at {path!r} has unknown fields {sorted(node)[:5]}")

    walk(tree, "", 0)
    _require(None not in found, "the tree does not place every array")
    return found


# ---------------------------------------------------------------------------------- reading


def load(root: str | os.PathLike[str], step: int | None = None) -> Any:
    """The state saved at ``step`` (``None``: the newest committed step), every byte verified.

    Returns:
        Nested dicts (str or int keys), lists and tuples of numpy arrays, numpy scalars and
        plain values (``None``, bool, int, float, str), as ckptstore's ``load`` returns them
        without a target.

    Raises:
        FileNotFoundError: no such step.
        ValueError: the manifest is invalid, a referenced attempt is not committed, or an
            object is missing, of the wrong size or fails a crc32c (the message names the
            leaf or object and gives the recorded and the computed crc32c).
    """
    root = os.fspath(root)
    body = read_manifest(root, step)
    return _build(body["tree"], _read_arrays(root, body))


def _object_path(root: str, body: dict[str, Any], obj: int) -> tuple[str, str]:
    """``(key relative to root, file path)`` of object ``obj``."""
    objects = body["objects"]
    where = (objects.get("step") or [body["step"]] * len(objects["key"]))[obj]
    key = f"{where}/{objects['key'][obj]}"
    return key, os.path.join(root, *key.split("/"))


def _check_references(root: str, body: dict[str, Any]) -> None:
    """Every referenced object is a committed object of its attempt, with the length and
    crc32c the attempt's own record gives it."""
    objects, step = body["objects"], body["step"]
    by_attempt: dict[tuple[int, str], list[int]] = {}
    for obj, where in enumerate(objects.get("step") or []):
        if where != step:
            attempt = objects["key"][obj].split("/")[0]
            by_attempt.setdefault((where, attempt), []).append(obj)
    for (where, attempt), members in by_attempt.items():
        first = _object_path(root, body, members[0])[0]
        record = _attempt_record(root, where, attempt)
        if record is None:
            raise ValueError(
                f"{root}: step {step} references {first!r}, but {where}/{attempt}/ is not a "
                f"committed attempt (step {where} does not name it and it holds no {RECORD_NAME})"
            )
        theirs = record["objects"]
        own = {
            key: (length, crc)
            for key, length, crc, at in zip(
                theirs["key"],
                theirs["length"],
                theirs["crc32c"],
                theirs.get("step") or [where] * len(theirs["key"]),
                strict=True,
            )
            if at == where
        }
        for obj in members:
            wanted = (objects["length"][obj], objects["crc32c"][obj])
            entry = own.get(objects["key"][obj])
            if entry != wanted:
                raise ValueError(
                    f"{root}: step {step} references {_object_path(root, body, obj)[0]!r}, but "
                    f"the committed record of {where}/{attempt}/ has it as {entry} (length, "
                    f"crc32c), not {wanted}"
                )


def _attempt_record(root: str, step: int, attempt: str) -> dict[str, Any] | None:
    """The manifest committing ``<step>/<attempt>/``: the step's own when it names that
    attempt, else the attempt's ``committed.json``; ``None`` when neither exists."""
    path = os.path.join(root, str(step), MANIFEST_NAME)
    try:
        manifest = _parse(_read_capped(path), path, step)
        if manifest["attempt"] == attempt:
            return manifest
    except FileNotFoundError:
        pass
    path = os.path.join(root, str(step), attempt, RECORD_NAME)
    try:
        record = _parse(_read_capped(path), path, step)
    except FileNotFoundError:
        return None
    if record["attempt"] != attempt:
        raise ValueError(f"{path}: the record names attempt {record['attempt']}, not {attempt}")
    return record


def _read_object(key: str, path: str, length: int) -> np.ndarray[Any, Any]:
    """The whole object, after checking its size on disk."""
    buf = np.empty(length, np.uint8)
    try:
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            if size != length:
                raise ValueError(f"object {key!r} is {size} bytes, but the manifest says {length}")
            view, done = memoryview(buf), 0  # type: ignore[arg-type]  # ndarray is a buffer
            while done < length:
                got = file.readinto(view[done:])
                if not got:
                    raise ValueError(f"object {key!r} ended after {done} of {length} bytes")
                done += got
    except FileNotFoundError:
        raise ValueError(f"object {key!r} is missing ({path})") from None
    return buf


def _read_arrays(root: str, body: dict[str, Any]) -> list[Any]:
    """Every array leaf of a validated manifest, by index, verified."""
    _check_references(root, body)
    objects, leaves, chunks = body["objects"], body["leaves"], body.get("chunks")
    paths, recorded = leaves["path"], leaves["crc32c"]
    dtypes = [_DTYPES[name] for name in leaves["dtype"]]
    where = f"{root}: step {body['step']}"
    arrays: list[Any] = [None] * len(paths)
    by_object: dict[int, list[int]] = {}
    for leaf, obj in enumerate(leaves["object"]):
        by_object.setdefault(obj, []).append(leaf)
    chunks_in: dict[int, list[int]] = {}
    if chunks is not None:
        for c, (obj, owner) in enumerate(zip(chunks["object"], chunks["leaf"], strict=True)):
            chunks_in.setdefault(obj, []).append(c)
            if arrays[owner] is None:
                arrays[owner] = np.empty(leaves["shape"][owner], dtypes[owner])

    for leaf in by_object.get(-1, []):
        if arrays[leaf] is None:  # empty: no bytes, so its crc32c is that of no bytes
            if recorded[leaf] != 0:
                raise ValueError(
                    f"{where}: empty leaf {paths[leaf]!r}: crc32c mismatch "
                    f"(recorded {recorded[leaf]}, computed 0)"
                )
            arrays[leaf] = np.empty(leaves["shape"][leaf], dtypes[leaf])

    for obj, length in enumerate(objects["length"]):
        key, path = _object_path(root, body, obj)
        try:
            buf = _read_object(key, path, length)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        whole = None  # the object's crc32c, once a leaf spanning all of it gave it
        for leaf in by_object.get(obj, []):
            offset, size = leaves["offset"][leaf], leaves["length"][leaf]
            crc = crc32c(buf[offset : offset + size])
            if crc != recorded[leaf]:
                raise ValueError(
                    f"{where}: leaf {paths[leaf]!r} in object {key!r}: crc32c mismatch "
                    f"(recorded {recorded[leaf]}, computed {crc})"
                )
            if offset == 0 and size == length:
                whole = crc
            arrays[leaf] = np.ndarray(leaves["shape"][leaf], dtypes[leaf], buf, offset)
        for c in chunks_in.get(obj, []):
            assert chunks is not None
            owner = chunks["leaf"][c]
            _place_chunk(
                arrays[owner], dtypes[owner], chunks, c, buf, f"{where}: leaf {paths[owner]!r}", key
            )
        whole = crc32c(buf) if whole is None else whole
        if whole != objects["crc32c"][obj]:
            raise ValueError(
                f"{where}: object {key!r}: crc32c mismatch (recorded {objects['crc32c'][obj]}, "
                f"computed {whole}); every leaf and chunk in it matches its own crc32c, so the "
                "damage is in the bytes between them"
            )
    return arrays


def _place_chunk(
    out: np.ndarray[Any, Any],
    dtype: np.dtype[Any],
    chunks: dict[str, Any],
    c: int,
    buf: np.ndarray[Any, Any],
    where: str,
    key: str,
) -> None:
    """Check chunk ``c``'s blocks in its object's bytes ``buf`` and copy it into ``out``, the
    array of its leaf (of ``dtype``)."""
    start, shape = chunks["start"][c], chunks["shape"][c]
    offset, block = chunks["offset"][c], chunks["block_size"]
    end = offset + math.prod(shape) * dtype.itemsize
    for b, recorded in enumerate(chunks["crc32c"][c]):
        at = offset + b * block
        crc = crc32c(buf[at : min(at + block, end)])
        if crc != recorded:
            raise ValueError(
                f"{where}: chunk at {start}, block {b} in object {key!r}: crc32c mismatch "
                f"(recorded {recorded}, computed {crc})"
            )
    box = tuple(slice(s, s + n) for s, n in zip(start, shape, strict=True))
    out[box] = np.ndarray(shape, dtype, buf, offset)


def _build(node: Any, arrays: list[Any]) -> Any:
    """The state a validated tree describes, around the arrays read."""
    if type(node) is int:
        return arrays[node]
    if "s" in node:
        return arrays[node["s"]][()]  # a numpy scalar (raw bytes stay an array)
    if "v" in node:
        return node["v"]
    if "x" in node:
        return TypedValue(*node["x"])
    if "d" in node:
        out = {k: _build(c, arrays) for k, c in zip(node["d"], node["c"], strict=True)}
        return collections.OrderedDict(out) if "o" in node else out
    if "l" in node:
        return [_build(c, arrays) for c in node["l"]]
    return tuple(_build(c, arrays) for c in node["t"])


# -------------------------------------------------------------------------------- command


def main(argv: Sequence[str] | None = None) -> int:
    """Load a step, print every array leaf's path, dtype and shape, and exit 0 if all of it
    verified (1, with the reason on stderr, if not)."""
    parser = argparse.ArgumentParser(
        description="Read and verify a ckptstore checkpoint on a local directory, without "
        "ckptstore."
    )
    parser.add_argument("root", help="the checkpoint root (holds <step>/manifest.json)")
    parser.add_argument("--step", type=int, help="the step to read (default: the newest)")
    args = parser.parse_args(argv)
    try:
        body = read_manifest(args.root, args.step)
        _read_arrays(args.root, body)
    except (OSError, ValueError) as exc:
        print(f"read_checkpoint: error: {exc}", file=sys.stderr)
        return 1
    leaves = body["leaves"]
    chunks: dict[int, int] = {}
    for owner in (body.get("chunks") or {}).get("leaf", []):
        chunks[owner] = chunks.get(owner, 0) + 1
    for i, path in enumerate(leaves["path"]):
        sharded = f" ({chunks[i]} chunks)" if i in chunks else ""
        print(f"{path or '<root>'}  {leaves['dtype'][i]}  {leaves['shape'][i]}{sharded}  verified")
    nbytes = sum(body["objects"]["length"])
    print(
        f"step {body['step']} (format version {body['version']}): {len(leaves['path'])} array "
        f"leaves, {len(body['objects']['key'])} objects, {nbytes} bytes verified"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
