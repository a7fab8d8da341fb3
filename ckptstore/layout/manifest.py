"""The manifest: one JSON document that describes, checksums and commits a checkpoint.

Its bytes are::

    {"format":"ckptstore","version":1,"crc32c":<crc of BODY>,"body":BODY}

where BODY is a JSON object. The envelope has a fixed spelling, so a reader checks the
version and the crc32c of BODY's exact bytes before parsing it: a truncated, bit-flipped or
foreign file is refused without trusting a byte of it. BODY holds the step, the attempt id,
the user's metadata, the tree (see :mod:`ckptstore.layout.tree`), and two tables stored by
column (a list per field rather than an object per row, so 100,000 leaves parse as a few
long lists)::

    "objects": {"key": [...], "length": [...], "crc32c": [...]}
    "leaves":  {"path": [...], "dtype": [...], "shape": [...], "object": [...],
                "offset": [...], "length": [...], "crc32c": [...], "attrs": [...]}

Object keys are relative to the step (``<attempt>/pack-000000``). A leaf's ``object`` is an
index into the object table, ``-1`` for an empty leaf.

:meth:`Manifest.parse` validates all of it before the caller reads any data: keys stay under
the attempt prefix of their own step, every leaf lies inside its object and no two leaves
overlap, ``prod(shape) * itemsize == length`` (in Python integers, so nothing overflows) and
no shape, not even an empty one, claims more than :data:`MAX_LEAF_BYTES`, dtypes come from the
allow-list, the tree places every array exactly once and agrees with
the paths, and the whole document is under ``Settings.manifest_max_bytes``.

Version 3 adds an optional ``chunks`` table to the body: a leaf sharded across ranks is one
leaf of its global shape whose bytes live in chunks, each with a crc32c per block
(:mod:`ckptstore.layout.chunks`, which validates it: the chunks of a leaf tile it exactly,
as a grid). A manifest without chunks is written as version 2 or 1, as before.

Version 4 lets the tree hold typed values (a ``torch.dtype``, a ``torch.device``) and mark a
dict as an ``OrderedDict`` (:mod:`ckptstore.layout.tree`); a manifest whose tree has neither
is written with the version its tables need, as before.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from ckptstore.errors import CorruptCheckpointError, InvalidKeyError
from ckptstore.layout.chunks import Chunks, parse_chunks
from ckptstore.layout.dtypes import dtype_from_name
from ckptstore.layout.keys import ATTEMPT_RE, MAX_STEP
from ckptstore.layout.tree import tree_paths, uses_version_4
from ckptstore.store.base import validate_key
from ckptstore.store.checksum import crc32c
from ckptstore.threads import collection_paused

__all__ = ["FORMAT_VERSION", "MAX_LEAF_BYTES", "Manifest"]

FORMAT_VERSION = 4
#: Versions this release reads: 1 (no references, no hashes), 2 (references and hashes),
#: 3 (chunked leaves) and 4 (typed values and ordered dicts in the tree).
READABLE_VERSIONS = (1, 2, 3, 4)
#: No leaf or object may claim more bytes than this (keeps every sum inside int64).
MAX_LEAF_BYTES = 1 << 60

_ENVELOPE = re.compile(rb'\{"format":"ckptstore","version":(\d{1,6}),"crc32c":(\d{1,10}),"body":')
_OBJECT_FIELDS = ("key", "length", "crc32c", "step")
_LEAF_FIELDS = ("path", "dtype", "shape", "object", "offset", "length", "crc32c", "attrs", "hash")
#: Columns a version-1 manifest does not have.
_V2_COLUMNS = ("step", "hash")
_HASH_RE = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True, slots=True)
class Manifest:
    """A checkpoint's manifest, by column.

    Attributes:
        step: the step it commits.
        attempt: the save attempt whose objects it names.
        created: when the attempt committed (seconds since the epoch).
        metadata: the user's JSON metadata.
        tree: how the leaves nest (the tree of :mod:`ckptstore.layout.tree`).
        object_keys: object keys relative to the step (``<attempt>/<name>``).
        object_lengths: bytes per object.
        object_crcs: crc32c per object.
        paths: path per array leaf.
        dtypes: manifest dtype name per leaf.
        shapes: shape per leaf.
        leaf_object: object index per leaf (``-1``: empty, no object).
        leaf_offset: byte offset inside the object per leaf.
        leaf_length: bytes per leaf.
        leaf_crc: crc32c per leaf.
        attrs: JSON attributes per leaf (a stager's device, requires_grad...), or ``None``.
        value_paths: paths of the plain-value leaves of the tree (filled by :meth:`parse`).
        object_steps: the step each object lives in, or ``None`` when all are the manifest's
            own. An object of another step is a reference to an earlier save's object.
        leaf_hash: xxh3-128 (32 hex digits) of each leaf's bytes, or ``None`` per leaf or
            for all; an incremental save compares against it.
        chunks: where the bytes of leaves sharded across ranks live (version 3), or ``None``.
            Such a leaf has object ``-1`` and its full length.
    """

    step: int
    attempt: str
    created: float
    metadata: Any
    tree: Any
    object_keys: list[str]
    object_lengths: list[int]
    object_crcs: list[int]
    paths: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    leaf_object: list[int]
    leaf_offset: list[int]
    leaf_length: list[int]
    leaf_crc: list[int]
    attrs: list[dict[str, Any] | None]
    value_paths: list[str] = field(default_factory=list)
    object_steps: list[int] | None = None
    leaf_hash: list[str | None] | None = None
    chunks: Chunks | None = None

    # ------------------------------------------------------------------ encoding

    def encode(self) -> bytes:
        """The manifest's bytes (envelope and body).

        A manifest with neither references nor hashes is written as version 1, which older
        releases read too.
        """
        objects: dict[str, Any] = {
            "key": self.object_keys,
            "length": self.object_lengths,
            "crc32c": self.object_crcs,
        }
        leaves: dict[str, Any] = {
            "path": self.paths,
            "dtype": self.dtypes,
            "shape": self.shapes,
            "object": self.leaf_object,
            "offset": self.leaf_offset,
            "length": self.leaf_length,
            "crc32c": self.leaf_crc,
            "attrs": self.attrs if _any_set(self.attrs) else None,
        }
        version = 1
        if self.object_steps is not None and self.references():
            objects["step"], version = self.object_steps, 2
        if self.leaf_hash is not None and _any_set(self.leaf_hash):
            leaves["hash"], version = self.leaf_hash, 2
        doc: dict[str, Any] = {
            "step": self.step,
            "attempt": self.attempt,
            "created": self.created,
            "metadata": self.metadata,
            "tree": self.tree,
            "objects": objects,
            "leaves": leaves,
        }
        if self.chunks is not None and self.chunks.leaf:
            doc["chunks"], version = self.chunks.encode(), 3
        body, tree = _encode_body(doc)
        if uses_version_4(tree):
            version = 4
        crc = 0
        for piece in body:
            crc = crc32c(piece, crc)
        head = f'{{"format":"ckptstore","version":{version},"crc32c":{crc},"body":'
        # Joined once: every join or concatenation of a 20,000-leaf body (1.2 MB) is a fresh
        # allocation whose pages fault in. With four of them, and the tree's type check node
        # by node, that manifest took 8 ms to encode; now 4.
        return b"".join([head.encode(), *body, b"}"])

    # ------------------------------------------------------------------ accessors

    def object_step(self, index: int) -> int:
        """The step object ``index`` lives in (another step's for a reference)."""
        return self.step if self.object_steps is None else self.object_steps[index]

    def object_key(self, index: int) -> str:
        """Key of object ``index`` relative to the store root."""
        return f"{self.object_step(index)}/{self.object_keys[index]}"

    def references(self) -> list[int]:
        """Indices of the objects that live in other steps' attempts."""
        steps = self.object_steps
        if steps is None:
            return []
        return [i for i, s in enumerate(steps) if s != self.step]

    def referenced_attempts(self) -> set[str]:
        """Prefixes (``<step>/<attempt>/``) of the other attempts whose objects it references."""
        return {self.object_key(i).rsplit("/", 1)[0] + "/" for i in self.references()}

    @property
    def own_bytes(self) -> int:
        """Bytes over the objects this step's own attempt wrote."""
        refs = set(self.references())
        return sum(n for i, n in enumerate(self.object_lengths) if i not in refs)

    @property
    def referenced_bytes(self) -> int:
        """Bytes over the objects of earlier steps it references."""
        return sum(self.object_lengths[i] for i in self.references())

    def dtype(self, leaf: int) -> np.dtype[Any]:
        """The numpy dtype of leaf ``leaf``."""
        dt = dtype_from_name(self.dtypes[leaf])
        assert dt is not None  # validated by parse
        return dt

    def is_chunked(self, leaf: int) -> bool:
        """Whether leaf ``leaf`` is stored as chunks (see :mod:`ckptstore.layout.chunks`)."""
        return self.chunks is not None and leaf in self.chunks.by_leaf

    def all_paths(self) -> list[str]:
        """Paths of every leaf: arrays, then plain values."""
        return [*self.paths, *self.value_paths]

    @property
    def nbytes(self) -> int:
        """Bytes over all data objects."""
        return sum(self.object_lengths)

    # ------------------------------------------------------------------ parsing

    @classmethod
    def parse(
        cls,
        data: bytes,
        *,
        step: int | None = None,
        max_bytes: int = 256 << 20,
        source: str = "manifest",
    ) -> Manifest:
        """Parse and validate manifest bytes; nothing in them is trusted before this returns.

        Args:
            data: the manifest's bytes.
            step: the step it was read for; a manifest naming another step is refused.
            max_bytes: size cap.
            source: where it came from, for error messages (its URL).

        Raises:
            CorruptCheckpointError: naming ``source`` and what is wrong.
        """

        def reject(reason: str) -> CorruptCheckpointError:
            return CorruptCheckpointError(f"{source}: invalid manifest: {reason}")

        if len(data) > max_bytes:
            raise reject(f"{len(data)} bytes is over the {max_bytes}-byte cap")
        match = _ENVELOPE.match(data)
        if match is None:
            raise reject("not a ckptstore manifest (unrecognised envelope)")
        version = int(match.group(1))
        if version not in READABLE_VERSIONS:
            raise reject(
                f"format version {version}; this ckptstore reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))} (upgrade ckptstore to read newer "
                "checkpoints)"
            )
        if not data.endswith(b"}"):
            raise reject("truncated (no closing brace)")
        body = data[match.end() : -1]
        expected = int(match.group(2))
        actual = crc32c(body)
        if actual != expected:
            raise reject(f"crc32c mismatch (recorded {expected}, computed {actual})")
        # Without the cyclic collector: a parse makes objects by the leaf (a torch leaf's
        # attrs are a dict each), and in a training process, whose heap is large and old,
        # the full passes they set off took 88 and 91 ms of 4 parses of a 20,000-tensor
        # manifest (3.5 MB), against 45 ms each with the collector paused.
        with collection_paused():
            try:
                doc = _loads(body)
            except (ValueError, RecursionError) as exc:
                raise reject(f"body is not valid JSON ({str(exc)[:200]})") from None
            try:
                return cls._validate(doc, step, version)
            except _Invalid as exc:
                raise reject(str(exc)) from None
            except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
                # A shape of input the checks above did not foresee; still a rejection,
                # never a crash (the fuzz test looks for this message to find such gaps).
                raise reject(f"unexpected structure ({type(exc).__name__}: {exc})") from None

    @classmethod
    def parse_shared(
        cls,
        data: bytes,
        *,
        step: int,
        max_bytes: int = 256 << 20,
        source: str = "manifest",
    ) -> Manifest:
        """:meth:`parse`, for a caller that only reads the manifest: the one parsed from the
        very same bytes for the same step a moment ago, if :data:`SHARED_MANIFESTS` still
        holds it, else a new one it then holds. Its lists and dicts are shared with other
        such callers, so nothing may change them.

        The bytes are always the caller's own, just read from the store: only the parse and
        validation are spared, never a read. A CheckpointManager with ``max_to_keep=2``
        parsed 4 manifests a save (retention reads every kept step's to decide, again after
        marking, and to retire; the next save reads its base's), 1 with this. Each parse of
        a 496-leaf model's 107 KB manifest is 2.5 ms of Python on the event loop's thread,
        which holds the GIL the training thread wants meanwhile.

        Raises:
            CorruptCheckpointError: as :meth:`parse` (a failed parse is never held).
        """
        return SHARED_MANIFESTS.parse(data, step, max_bytes, source)

    @classmethod
    def _validate(cls, doc: Any, expected_step: int | None, version: int) -> Manifest:
        if type(doc) is not dict:
            raise _Invalid("body is not a JSON object")
        if "chunks" in doc and version < 3:
            raise _Invalid(f"a version-{version} manifest has no chunks table")
        step = doc.get("step")
        if type(step) is not int or not 0 <= step <= MAX_STEP:
            raise _Invalid(f"step {step!r} is not a step number")
        if expected_step is not None and step != expected_step:
            raise _Invalid(f"it commits step {step}, but was read as step {expected_step}")
        attempt = doc.get("attempt")
        if type(attempt) is not str or not ATTEMPT_RE.fullmatch(attempt):
            raise _Invalid(f"attempt {attempt!r} is not an attempt id")
        created = doc.get("created")
        if type(created) not in (int, float):
            raise _Invalid("created is not a number")
        newer = () if version >= 2 else _V2_COLUMNS
        objects = _table(
            doc.get("objects"), "objects", _OBJECT_FIELDS, optional=("step",), absent=newer
        )
        leaves = _table(
            doc.get("leaves"), "leaves", _LEAF_FIELDS, optional=("attrs", "hash"), absent=newer
        )

        # ---- objects
        keys = objects["key"]
        nobj = len(keys)
        if set(map(type, keys)) - {str}:
            raise _Invalid("an object key is not a string")
        object_steps = objects.get("step")
        if object_steps is not None:
            _ints(object_steps, "objects.step", nobj, 0, MAX_STEP)
        prefix = attempt + "/"
        for i, key in enumerate(keys):
            where = step if object_steps is None else object_steps[i]
            if where == step:
                if not key.startswith(prefix):
                    raise _Invalid(f"object {key!r} is not under its attempt prefix {prefix!r}")
            elif key.count("/") != 1 or not ATTEMPT_RE.fullmatch(key.split("/", 1)[0]):
                # a reference: an object right under an attempt of another step of this root
                raise _Invalid(f"referenced object {where}/{key!r} is not under an attempt prefix")
            try:
                validate_key(f"{where}/{key}")
            except InvalidKeyError as exc:
                raise _Invalid(f"object key {where}/{key!r}: {exc.reason}") from None
        placed = list(zip(object_steps or [step] * nobj, keys, strict=True))
        if len(set(placed)) != nobj:
            raise _Invalid("object keys repeat")
        olen = _ints(objects["length"], "objects.length", nobj, 0, MAX_LEAF_BYTES)
        _ints(objects["crc32c"], "objects.crc32c", nobj, 0, 0xFFFFFFFF)

        # ---- leaves
        paths = leaves["path"]
        n = len(paths)
        if set(map(type, paths)) - {str}:
            raise _Invalid("a leaf path is not a string")
        if len(set(paths)) != n:
            raise _Invalid("leaf paths repeat")
        dtypes = leaves["dtype"]
        _length(dtypes, "leaves.dtype", n)
        shapes = leaves["shape"]
        _length(shapes, "leaves.shape", n)
        lobj = _ints(leaves["object"], "leaves.object", n, -1, nobj - 1)
        loff = _ints(leaves["offset"], "leaves.offset", n, 0, MAX_LEAF_BYTES)
        llen = _ints(leaves["length"], "leaves.length", n, 0, MAX_LEAF_BYTES)
        _ints(leaves["crc32c"], "leaves.crc32c", n, 0, 0xFFFFFFFF)
        hashes = leaves.get("hash")
        if hashes is not None:
            _length(hashes, "leaves.hash", n)
            _check_hashes(hashes)
        attrs = leaves.get("attrs")
        if attrs is None:
            attrs = [None] * n
        else:
            _length(attrs, "leaves.attrs", n)
            if set(map(type, attrs)) - {dict, type(None)}:
                raise _Invalid("leaf attrs are not objects")

        if set(map(type, dtypes)) - {str}:
            bad = next(d for d in dtypes if type(d) is not str)
            raise _Invalid(f"dtype {bad!r} is not allowed")
        itemsizes: dict[str, int] = {}
        for name in set(dtypes):
            dt = dtype_from_name(name)
            if dt is None:
                raise _Invalid(f"dtype {name!r} is not allowed")
            itemsizes[name] = dt.itemsize
        if not _shapes_fit(shapes, dtypes, itemsizes, llen):
            _check_shapes_slowly(paths, shapes, dtypes, itemsizes, llen)

        chunks: Chunks | None = None
        checked = paths
        if doc.get("chunks") is not None:
            try:
                chunks, extents = parse_chunks(
                    doc["chunks"],
                    shapes=shapes,
                    itemsizes=[itemsizes[name] for name in dtypes],
                    leaf_object=leaves["object"],
                    objects=nobj,
                    max_bytes=MAX_LEAF_BYTES,
                )
            except ValueError as exc:
                raise _Invalid(str(exc)) from None
            # A chunked leaf's bytes are its chunks': they take its place in the extent checks.
            chunked = np.zeros(n, dtype=bool)
            chunked[list(chunks.by_leaf)] = True
            if (loff[chunked] != 0).any():
                raise _Invalid("a chunked leaf has an offset")
            keep = np.flatnonzero(~chunked)
            table = np.array(extents, dtype=np.int64).reshape(-1, 3)
            lobj = np.concatenate([lobj[keep], table[:, 0]])
            loff = np.concatenate([loff[keep], table[:, 1]])
            llen = np.concatenate([llen[keep], table[:, 2]])
            checked = [paths[i] for i in keep] + [
                f"{paths[leaf]} (chunk {k})" for k, leaf in enumerate(chunks.leaf)
            ]
        _check_extents(checked, lobj, loff, llen, olen)

        try:
            leaf_paths, value_paths = tree_paths(doc.get("tree"), n, version_4=version >= 4)
        except ValueError as exc:
            raise _Invalid(str(exc)) from None
        if leaf_paths != paths:
            raise _Invalid("the tree and the leaf paths disagree")
        return cls(
            step=step,
            attempt=attempt,
            created=float(created),  # type: ignore[arg-type]  # checked above
            metadata=doc.get("metadata"),
            tree=doc.get("tree"),
            object_keys=keys,
            object_lengths=objects["length"],
            object_crcs=objects["crc32c"],
            paths=paths,
            dtypes=dtypes,
            shapes=shapes,
            leaf_object=leaves["object"],
            leaf_offset=leaves["offset"],
            leaf_length=leaves["length"],
            leaf_crc=leaves["crc32c"],
            attrs=attrs,
            value_paths=value_paths,
            object_steps=object_steps,
            leaf_hash=hashes,
            chunks=chunks,
        )


class SharedManifests:
    """The manifests :meth:`Manifest.parse_shared` parsed lately, by step and exact bytes:
    at most ``entries`` of them and ``max_bytes`` of manifest bytes in all, the least
    recently used dropped first (a manifest over ``max_bytes`` alone is parsed, not held).
    Thread-safe: the event loops of several managers may share it."""

    def __init__(self, entries: int = 8, max_bytes: int = 4 << 20) -> None:
        self.entries, self.max_bytes = entries, max_bytes
        self._held: OrderedDict[tuple[int, bytes], Manifest] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._held)

    def parse(self, data: bytes, step: int, max_bytes: int, source: str) -> Manifest:
        """See :meth:`Manifest.parse_shared`."""
        key = (step, bytes(data))
        if len(key[1]) > max_bytes:  # over the caller's cap, whatever another's was
            return Manifest.parse(key[1], step=step, max_bytes=max_bytes, source=source)
        with self._lock:
            held = self._held.get(key)
            if held is not None:
                self._held.move_to_end(key)
                return held
        manifest = Manifest.parse(key[1], step=step, max_bytes=max_bytes, source=source)
        if len(key[1]) <= self.max_bytes:
            with self._lock:
                if key not in self._held:
                    self._held[key] = manifest
                    self._bytes += len(key[1])
                while len(self._held) > self.entries or self._bytes > self.max_bytes:
                    (_, dropped), _ = self._held.popitem(last=False)
                    self._bytes -= len(dropped)
        return manifest


#: The process's :class:`SharedManifests`: 8 manifests or 16 MiB of them. A
#: CheckpointManager's retention reads its kept steps' manifests every save, and the next
#: save its base's; the steady state parses only the newest if the cache holds
#: ``max_to_keep + 1``. A 496-leaf model's manifest is 107 KB; one of 20,000 torch tensors is
#: 3.5 MB, of which 4 MiB held one, and a save with ``max_to_keep=2`` parsed three (100-200 ms
#: of the background loop's time, each parse making 60 MiB of short-lived objects). Held, a
#: parsed manifest takes about 5 times its bytes (16.9 MiB for that one): at most about
#: 80 MiB for the process.
SHARED_MANIFESTS = SharedManifests(max_bytes=16 << 20)


class _Invalid(Exception):
    pass


def _check_hashes(hashes: list[Any]) -> None:
    """Every leaf hash is None or 32 lowercase hex digits: checked over all of them at once
    (a regex match per leaf cost 6 ms of a 20,000-leaf restore), the culprit named after."""
    given = [h for h in hashes if h is not None]
    if not set(map(type, given)) - {str} and not set(map(len, given)) - {32}:
        joined = "".join(given).encode("utf-8", "surrogatepass")  # JSON may hold a lone "\ud800"
        if not joined.translate(None, b"0123456789abcdef"):  # nothing but hex digits
            return
    bad = next(h for h in given if not (type(h) is str and _HASH_RE.fullmatch(h)))
    raise _Invalid(f"leaf hash {bad!r} is not 32 hex digits")


def _shapes_fit(
    shapes: list[Any], dtypes: list[str], itemsizes: dict[str, int], llen: np.ndarray[Any, Any]
) -> bool:
    """Whether every shape is a list of at most 64 ints in ``[0, 2**63)`` whose elements fill
    exactly the leaf's bytes: the common case, checked in bulk (a loop over 20,000 leaves
    took 20 ms of their restore). False sends the caller to :func:`_check_shapes_slowly`,
    leaf by leaf."""
    if set(map(type, shapes)) - {list}:
        return False
    dims = list(itertools.chain.from_iterable(shapes))
    if set(map(type, dims)) - {int} or (dims and (min(dims) < 0 or max(dims) >= 1 << 63)):
        return False
    ranks = set(map(len, shapes))
    if ranks and max(ranks) > 64:
        return False
    if len(itemsizes) == 1:  # one dtype: no lookup per leaf
        sizes = np.full(len(dtypes), next(iter(itemsizes.values())), dtype=np.int64)
    else:
        sizes = np.array(list(map(itemsizes.__getitem__, dtypes)), dtype=np.int64)
    largest = int(sizes.max()) if len(sizes) else 0
    if len(ranks) == 1 and (max(dims) if dims else 0) ** (rank := ranks.pop()) < 1 << 63:
        # every shape of one rank, no product reaching 2**63: the products in numpy, exact
        elements = np.array(dims, dtype=np.int64).reshape(len(shapes), rank).prod(axis=1)
        if len(elements) and int(elements.max()) * largest > MAX_LEAF_BYTES:
            return False  # past any leaf's length: leaf by leaf
    else:
        counts = list(map(math.prod, shapes))
        if counts and max(counts) * largest > MAX_LEAF_BYTES:
            return False  # past any leaf's length, or its int64 product could wrap
        elements = np.array(counts, dtype=np.int64)
    if not np.array_equal(elements * sizes, llen):
        return False
    # An empty shape such as [0, 2**62]: numpy refuses to allocate it at all.
    return not any(
        math.prod(d for d in shapes[i] if d) * int(sizes[i]) > MAX_LEAF_BYTES
        for i in np.flatnonzero(llen == 0)
    )


def _check_shapes_slowly(
    paths: list[str],
    shapes: list[Any],
    dtypes: list[str],
    itemsizes: dict[str, int],
    llen: np.ndarray[Any, Any],
) -> None:
    """The per-leaf checks of :func:`_shapes_fit`, which raise naming the first bad leaf."""
    for i, shape in enumerate(shapes):
        if type(shape) is not list or set(map(type, shape)) - {int}:
            raise _Invalid(f"leaf {paths[i]!r}: shape {shape!r} is not a list of ints")
        # a dimension numpy cannot hold is refused even where a zero dimension hides it
        if len(shape) > 64 or any(d < 0 or d >= 1 << 63 for d in shape):
            raise _Invalid(f"leaf {paths[i]!r}: shape {shape!r} is invalid")
        itemsize = itemsizes[dtypes[i]]
        if math.prod(shape) * itemsize != llen[i]:
            raise _Invalid(
                f"leaf {paths[i]!r}: shape {shape} of {dtypes[i]} is not {llen[i]} bytes"
            )
        if not llen[i] and math.prod(d for d in shape if d) * itemsize > MAX_LEAF_BYTES:
            raise _Invalid(f"leaf {paths[i]!r}: shape {shape} is too large for any array")


def _table(
    value: Any,
    name: str,
    fields: Sequence[str],
    optional: Sequence[str] = (),
    absent: Sequence[str] = (),
) -> dict[str, Any]:
    """Check a column table; ``absent`` columns are unknown in this manifest's version."""
    if type(value) is not dict:
        raise _Invalid(f"{name} is not an object")
    unknown = set(value) - (set(fields) - set(absent))
    if unknown:
        raise _Invalid(f"{name} has unknown fields {sorted(unknown)[:5]}")
    for column in fields:
        if column in optional and value.get(column) is None:
            continue
        if column not in value:
            raise _Invalid(f"{name}.{column} is missing")
        if type(value[column]) is not list:
            raise _Invalid(f"{name}.{column} is not a list")
    return value


def _length(column: Any, name: str, n: int) -> None:
    if type(column) is not list or len(column) != n:
        raise _Invalid(f"{name} does not have {n} entries")


def _ints(column: Any, name: str, n: int, low: int, high: int) -> np.ndarray[Any, Any]:
    """Check a column of ints in ``[low, high]``; return it as an int64 array."""
    _length(column, name, n)
    if set(map(type, column)) - {int}:
        raise _Invalid(f"{name} holds a value that is not an integer")
    try:
        array = np.array(column, dtype=np.int64)
    except OverflowError:
        raise _Invalid(f"{name} holds an integer out of range") from None
    if n and (int(array.min()) < low or int(array.max()) > high):
        raise _Invalid(f"{name} holds a value outside [{low}, {high}]")
    return array


def _check_extents(
    paths: list[str],
    lobj: np.ndarray[Any, Any],
    loff: np.ndarray[Any, Any],
    llen: np.ndarray[Any, Any],
    olen: np.ndarray[Any, Any],
) -> None:
    """Every leaf inside its object; no two non-empty leaves of one object overlap."""
    empty = lobj < 0
    bad = np.flatnonzero(empty & ((llen != 0) | (loff != 0)))
    if len(bad):
        raise _Invalid(f"leaf {paths[bad[0]]!r} has no object but is not empty")
    placed = np.flatnonzero(~empty)
    if not len(placed):
        return
    obj = lobj[placed]
    start = loff[placed]
    end = start + llen[placed]  # both <= 2**60: no overflow
    beyond = np.flatnonzero(end > olen[obj])
    if len(beyond):
        leaf = placed[beyond[0]]
        raise _Invalid(
            f"leaf {paths[leaf]!r} [{loff[leaf]}, {loff[leaf] + llen[leaf]}) reaches past the "
            f"end of its object ({olen[lobj[leaf]]} bytes)"
        )
    nonempty = llen[placed] > 0
    obj, start, end, placed = obj[nonempty], start[nonempty], end[nonempty], placed[nonempty]
    order = np.lexsort((start, obj))
    obj, start, end, placed = obj[order], start[order], end[order], placed[order]
    overlap = np.flatnonzero((obj[1:] == obj[:-1]) & (start[1:] < end[:-1]))
    if len(overlap):
        a, b = placed[overlap[0]], placed[overlap[0] + 1]
        raise _Invalid(f"leaves {paths[a]!r} and {paths[b]!r} overlap in one object")


# ---------------------------------------------------------------------- body encoding

#: orjson's extensions refused: it would write a dataclass or a datetime, which the json module
#: refuses, and subclasses of str, int, dict and list by its own rules; refused here, they go
#: to json, which writes or refuses them as it always did.
_ORJSON_OPTIONS = (
    orjson.OPT_PASSTHROUGH_DATACLASS
    | orjson.OPT_PASSTHROUGH_DATETIME
    | orjson.OPT_PASSTHROUGH_SUBCLASS
)


def _json_bytes(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), allow_nan=True).encode()


def _fast_json(value: Any) -> bytes:
    """``value`` as compact JSON: orjson where it spells it as json would, else json.

    orjson encodes a 20,000-leaf manifest's columns ~7x faster than json (6 ms against 40 ms
    on the development machine), and the encoding runs between the last data write and the
    commit of every save. Both write the same document: orjson writes non-ASCII text as UTF-8
    where json escapes it, which any JSON reader reads back equal, and anything orjson
    refuses (a lone surrogate, an int over 64 bits, a type json would refuse) goes to json.
    """
    try:
        return orjson.dumps(value, option=_ORJSON_OPTIONS)
    except orjson.JSONEncodeError:  # a TypeError
        return _json_bytes(value)


#: The types :func:`_only_plain_finite` passes as they are.
_PLAIN_SCALARS = frozenset({int, str, bool, type(None)})
_STR = frozenset({str})


def _any_set(column: list[Any]) -> bool:
    """Whether any entry of ``column`` is not ``None`` (counted at C speed)."""
    return column.count(None) != len(column)


#: Every digit as "0" (a run of digits found with one substring search, ~1.6 ms on a
#: 20,000-leaf body, where a regular expression took 25).
_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")

#: The bytes that may stand right before a number's first digit outside a string: JSON's
#: four whitespace bytes, the three that open a value (``[``, ``,``, ``:``) and a minus.
_BEFORE_A_NUMBER = frozenset(b" \t\n\r[,:-")

#: The shortest run of digits that may spell an integer orjson reads as a float: 19 after a
#: minus (under -2**63), 20 without (over 2**64 - 1).
_WIDE_DIGITS = b"0" * 19


def _wide_int(body: bytes) -> bool:
    """Whether ``body`` may hold an integer literal that orjson reads as an inexact float:
    over 2**64 - 1 (20 digits or more) or under -2**63 (a minus and 19 digits or more).

    A run of digits counts unless the byte before it shows it is inside a string or inside
    a number's fraction or exponent: a hex digest's letter or its opening quote. Without that
    test, a 20,000-leaf manifest nearly always went to json (its 128-bit hex digests hold
    about 20 runs of 20 decimal digits), at twice orjson's time. A run inside a string after
    a space, comma or colon still counts: that only sends the body to json, which is exact.
    """
    digits = body.translate(_DIGITS_AS_ZERO)
    at = digits.find(_WIDE_DIGITS)
    while at != -1:
        start = at
        while start and digits[start - 1] == 0x30:  # back to the run's first digit
            start -= 1
        end = at + len(_WIDE_DIGITS)
        while end < len(digits) and digits[end] == 0x30:
            end += 1
        before = body[start - 1] if start else None
        outside = before is None or before in _BEFORE_A_NUMBER
        if outside and (before == 0x2D or end - start > len(_WIDE_DIGITS)):  # "-" 19, or 20
            return True
        at = digits.find(_WIDE_DIGITS, end)
    return False


def _loads(body: bytes) -> Any:
    """The body's document, as json reads it: by orjson where that is the same (a 20,000-leaf
    manifest's body in 7.8 ms against json's 17), else by json.

    orjson refuses what json's extensions take (NaN and infinities, lone surrogates, a
    byte-order mark), which then goes to json. The one input it reads differently, an
    integer outside 64 bits (as a float), goes to json before orjson sees it.
    """
    if not _wide_int(body):
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError:
            pass  # json says what is wrong, or reads what orjson refuses
    return json.loads(body)


def _only_plain_finite(value: Any) -> bool:
    """``value`` holds only JSON's own types (exactly: no subclass) and no NaN or infinity,
    which orjson would write as ``null``."""
    stack = [value]
    while stack:
        node = stack.pop()
        kind = type(node)
        if kind in _PLAIN_SCALARS:
            continue
        if kind is float:
            if not math.isfinite(node):
                return False
        elif kind is list or kind is tuple:
            # A tree's long lists (a dict's keys, its leaves' numbers) hold such scalars
            # alone: their types are checked in one C-level pass, not one node at a time.
            if not _PLAIN_SCALARS.issuperset(map(type, node)):
                stack.extend(node)
        elif kind is dict:
            if not _STR.issuperset(map(type, node)):
                return False
            stack.extend(node.values())
        else:
            return False
    return True


def _encode_body(doc: dict[str, Any]) -> tuple[list[bytes], bytes]:
    """The body's bytes, as the pieces that joined in order make it (joined once, with the
    envelope, by the caller). The tables (``objects``, ``leaves``, ``chunks``) hold the
    strings and integers this module put there, and the leaves' ``attrs``; the tree holds the
    user's plain values, which may be NaN or infinite (JSON's extension, as json writes it).
    Each part is written by :func:`_fast_json` where that is exact, and the parts are in the
    order json would write them. Returns the pieces and, among them, the tree's bytes."""
    pieces = [b"{"]
    tree = b""
    for name, value in doc.items():
        if name == "tree":
            fast = _only_plain_finite(value)
        elif name == "leaves":
            fast = _only_plain_finite(value["attrs"])
        else:
            fast = name in ("objects", "chunks")
        encoded = _fast_json(value) if fast else _json_bytes(value)
        if name == "tree":
            tree = encoded
        if len(pieces) > 1:
            pieces.append(b",")
        pieces += (_json_bytes(name), b":", encoded)
    pieces.append(b"}")
    return pieces, tree
