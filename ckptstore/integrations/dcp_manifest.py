"""The commit record of a DCP checkpoint written through ckptstore, as versioned JSON.

DCP's own file writer commits by renaming a pickled ``.metadata`` file, and its reader unpickles
whatever it finds there. Neither step is safe on an object store: S3 has no atomic rename, and
unpickling bytes from a bucket executes them. Here DCP's :class:`Metadata` is turned into plain
JSON and written, together with the location, length and crc32c of every stored item, as one
``manifest.json`` by a single put-if-absent. The reader validates the whole record (keys stay
under the save attempt's prefix, ranges lie inside their objects and do not overlap, tensor
shapes times item sizes equal the stored lengths, dtypes come from an allow-list, the record has
a size cap) before it hands DCP a rebuilt ``Metadata``; nothing read back is ever unpickled by
ckptstore. (DCP's planner still deserialises the non-tensor values of a state dict, which it
stored itself, with ``torch.load``; that is DCP's format, not ours.)

The record::

    {"format": "ckptstore.dcp", "version": 1, "attempt": "<hex>", "created": <unix seconds>,
     "objects": {"<attempt>/r0-0": {"size": n, "crc32c": c}, ...},
     "items": [{"fqn": "...", "offset": [..] | null, "index": i | null, "key": "...",
                "start": s, "length": n, "crc32c": c, "dtype": "float32" | null,
                "shape": [..] | null}, ...],
     "dcp": {"state_dict_metadata": {...}, "planner_data": <tagged JSON>,
             "storage_meta": {...} | null, "version": "..." | null}}

``planner_data`` is whatever the DCP planner put there; it is encoded with tags for tuples and
for dicts (whose keys need not be strings), and anything else is refused when saving rather than
pickled.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ckptstore.errors import CorruptCheckpointError
from ckptstore.store.base import validate_key

__all__ = [
    "FORMAT",
    "MANIFEST_KEY",
    "MAX_MANIFEST_BYTES",
    "VERSION",
    "ItemLocation",
    "ManifestChecker",
    "check_no_overlap",
    "decode_manifest",
    "decode_objects",
    "dtype_from_name",
    "dtype_name",
    "encode_manifest",
]

FORMAT = "ckptstore.dcp"
VERSION = 1
#: The commit marker, relative to the checkpoint URL.
MANIFEST_KEY = "manifest.json"
#: A manifest larger than this is refused before it is parsed.
MAX_MANIFEST_BYTES = 256 << 20

_DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.complex64,
        torch.complex128,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint8,
        torch.uint16,
        torch.uint32,
        torch.uint64,
        torch.bool,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.float8_e4m3fnuz,
        torch.float8_e5m2fnuz,
    )
}
_CRC_MAX = (1 << 32) - 1


@dataclass(frozen=True, slots=True)
class ItemLocation:
    """Where one DCP item (a tensor chunk or a bytes value) lies, and how to check it.

    Attributes:
        key: the object holding it, relative to the checkpoint URL.
        start: byte offset of the item in the object.
        length: its length in bytes.
        crc32c: crc32c of its bytes.
        object_size: size of the whole object.
        object_crc32c: crc32c of the whole object.
        dtype: element type name (``"float32"``) for a tensor chunk, ``None`` for bytes.
        shape: the chunk's shape for a tensor chunk, ``None`` for bytes.
    """

    key: str
    start: int
    length: int
    crc32c: int
    object_size: int
    object_crc32c: int
    dtype: str | None = None
    shape: tuple[int, ...] | None = None


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest name of ``dtype``; refuses dtypes outside the allow-list."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise TypeError(
            f"ckptstore cannot store tensors of dtype {dtype}; supported: {', '.join(_DTYPES)}"
        )
    return name


def dtype_from_name(name: object, where: str) -> torch.dtype:
    """The torch dtype for a manifest dtype name, or CorruptCheckpointError."""
    if not isinstance(name, str) or name not in _DTYPES:
        raise CorruptCheckpointError(f"{where}: dtype {name!r} is not one ckptstore writes")
    return _DTYPES[name]


# --------------------------------------------------------------------------- encoding


def encode_manifest(
    attempt: str, metadata: Metadata, locations: Mapping[MetadataIndex, ItemLocation]
) -> bytes:
    """The JSON manifest of one save attempt: every object, every item, and DCP's metadata."""
    objects: dict[str, dict[str, int]] = {}
    items: list[dict[str, Any]] = []
    for index, loc in locations.items():
        objects[loc.key] = {"size": loc.object_size, "crc32c": loc.object_crc32c}
        items.append(
            {
                "fqn": index.fqn,
                "offset": None if index.offset is None else list(index.offset),
                "index": index.index,
                "key": loc.key,
                "start": loc.start,
                "length": loc.length,
                "crc32c": loc.crc32c,
                "dtype": loc.dtype,
                "shape": None if loc.shape is None else list(loc.shape),
            }
        )
    record = {
        "format": FORMAT,
        "version": VERSION,
        "attempt": attempt,
        "created": time.time(),
        "objects": objects,
        "items": items,
        "dcp": _encode_metadata(metadata),
    }
    return json.dumps(record, separators=(",", ":"), allow_nan=False).encode()


def _encode_metadata(metadata: Metadata) -> dict[str, Any]:
    entries: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            entries[fqn] = {"type": "bytes"}
            continue
        props = md.properties
        if props.layout != torch.strided:
            raise TypeError(f"{fqn}: only strided tensors can be stored, not {props.layout}")
        entries[fqn] = {
            "type": "tensor",
            "dtype": dtype_name(props.dtype),
            "requires_grad": bool(props.requires_grad),
            "size": list(md.size),
            "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks],
        }
    meta = metadata.storage_meta
    return {
        "state_dict_metadata": entries,
        "planner_data": _encode_value(metadata.planner_data, "planner_data"),
        "storage_meta": None
        if meta is None
        else {
            "checkpoint_id": None if meta.checkpoint_id is None else str(meta.checkpoint_id),
            "save_id": meta.save_id,
            "modules": list(meta.modules),
        },
        "version": metadata.version,
    }


def _encode_value(value: Any, where: str) -> Any:
    """Plain JSON for scalars and lists; tagged objects for tuples and dicts."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise TypeError(f"{where}: non-finite float {value!r} cannot be stored as JSON")
        return value
    if isinstance(value, list):
        return [_encode_value(v, where) for v in value]
    if isinstance(value, tuple):  # includes torch.Size
        return {"__tuple__": [_encode_value(v, where) for v in value]}
    if isinstance(value, dict):
        return {
            "__dict__": [
                [_encode_value(k, where), _encode_value(v, where)] for k, v in value.items()
            ]
        }
    raise TypeError(
        f"{where}: a {type(value).__name__} cannot be stored in a ckptstore manifest (JSON "
        "only: None, bool, int, float, str, list, tuple, dict); use a planner whose "
        "planner_data is plain data"
    )


# --------------------------------------------------------------------------- decoding


def decode_manifest(data: bytes, source: str) -> tuple[str, Metadata]:
    """Validate a manifest and rebuild DCP's ``Metadata`` from it.

    Returns the attempt id and the metadata, whose ``storage_data`` maps each
    :class:`MetadataIndex` to its :class:`ItemLocation`.

    Raises:
        CorruptCheckpointError: the record is too large, not JSON, of an unknown format or
            version, or fails any check listed in the module docstring.
    """
    if len(data) > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(
            f"{source}: manifest of {len(data)} bytes is over the {MAX_MANIFEST_BYTES} byte cap"
        )
    try:
        record = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpointError(f"{source}: manifest is not valid JSON: {exc}") from None
    check = ManifestChecker(source)
    check.is_type(record, dict, "manifest")
    if record.get("format") != FORMAT:
        raise CorruptCheckpointError(
            f"{source}: not a ckptstore DCP manifest (format {record.get('format')!r})"
        )
    if record.get("version") != VERSION:
        raise CorruptCheckpointError(
            f"{source}: manifest version {record.get('version')!r} is not {VERSION}; "
            "it was written by another ckptstore version"
        )
    attempt = check.is_type(record.get("attempt"), str, "attempt")
    if "/" in attempt:
        raise CorruptCheckpointError(f"{source}: attempt id {attempt!r} contains '/'")
    check.key(attempt)
    objects = decode_objects(check, record.get("objects"), attempt)
    locations = _decode_items(check, record.get("items"), objects)
    metadata = _decode_metadata(check, record.get("dcp"))
    _check_complete(check, metadata, locations)
    metadata.storage_data = locations
    return attempt, metadata


class ManifestChecker:
    """Raises CorruptCheckpointError naming the manifest and the offending field."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, message: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.source}: {message}")

    def is_type(self, value: Any, kind: type, field: str) -> Any:
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise self.fail(f"{field} should be {kind.__name__}, got {value!r:.80}")
        return value

    def count(self, value: Any, field: str, *, maximum: int = 1 << 62) -> int:
        number = self.is_type(value, int, field)
        if not 0 <= number <= maximum:
            raise self.fail(f"{field} = {number} is out of range")
        return int(number)

    def ints(self, value: Any, field: str) -> tuple[int, ...]:
        self.is_type(value, list, field)
        return tuple(self.count(v, field) for v in value)

    def key(self, key: str) -> str:
        try:
            return validate_key(key)
        except ValueError as exc:
            raise self.fail(str(exc)) from None


def decode_objects(check: ManifestChecker, raw: Any, attempt: str) -> dict[str, tuple[int, int]]:
    check.is_type(raw, dict, "objects")
    objects: dict[str, tuple[int, int]] = {}
    for key, entry in raw.items():
        check.key(key)
        if not key.startswith(attempt + "/"):
            raise check.fail(f"object {key!r} lies outside the attempt prefix {attempt}/")
        check.is_type(entry, dict, f"objects[{key!r}]")
        size = check.count(entry.get("size"), f"objects[{key!r}].size")
        crc = check.count(entry.get("crc32c"), f"objects[{key!r}].crc32c", maximum=_CRC_MAX)
        objects[key] = (size, crc)
    return objects


def _decode_items(
    check: ManifestChecker, raw: Any, objects: dict[str, tuple[int, int]]
) -> dict[MetadataIndex, ItemLocation]:
    check.is_type(raw, list, "items")
    locations: dict[MetadataIndex, ItemLocation] = {}
    spans: dict[str, list[tuple[int, int]]] = {}
    for n, item in enumerate(raw):
        where = f"items[{n}]"
        check.is_type(item, dict, where)
        fqn = check.is_type(item.get("fqn"), str, f"{where}.fqn")
        offset = None if item.get("offset") is None else check.ints(item["offset"], where)
        hint = None if item.get("index") is None else check.count(item["index"], where)
        key = check.is_type(item.get("key"), str, f"{where}.key")
        if key not in objects:
            raise check.fail(f"{where} names object {key!r}, which the manifest does not list")
        size, object_crc = objects[key]
        start = check.count(item.get("start"), f"{where}.start")
        length = check.count(item.get("length"), f"{where}.length")
        if start + length > size:
            raise check.fail(f"{where} [{start}, {start + length}) runs past {key!r} ({size})")
        crc = check.count(item.get("crc32c"), f"{where}.crc32c", maximum=_CRC_MAX)
        dtype: str | None = None
        shape: tuple[int, ...] | None = None
        if item.get("dtype") is not None:
            torch_dtype = dtype_from_name(item["dtype"], f"{check.source} {where}")
            dtype = item["dtype"]
            shape = check.ints(item.get("shape"), f"{where}.shape")
            expected = math.prod(shape) * torch_dtype.itemsize
            if expected != length:
                raise check.fail(
                    f"{where} ({fqn}): shape {list(shape)} of {dtype} is {expected} bytes, "
                    f"but {length} are stored"
                )
        index = MetadataIndex(fqn, offset, hint)
        if index in locations:
            raise check.fail(f"{where} ({fqn}, {offset}) is listed twice")
        locations[index] = ItemLocation(key, start, length, crc, size, object_crc, dtype, shape)
        spans.setdefault(key, []).append((start, start + length))
    check_no_overlap(check, spans)
    return locations


def check_no_overlap(check: ManifestChecker, spans: dict[str, list[tuple[int, int]]]) -> None:
    """Raise if two ``[start, end)`` spans of one object overlap."""
    for key, ranges in spans.items():
        ranges.sort()
        for (_, prev_end), (start, _) in itertools.pairwise(ranges):
            if start < prev_end:
                raise check.fail(f"items overlap in {key!r} at byte {start}")


def _decode_metadata(check: ManifestChecker, raw: Any) -> Metadata:
    check.is_type(raw, dict, "dcp")
    entries = check.is_type(raw.get("state_dict_metadata"), dict, "dcp.state_dict_metadata")
    state: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    for fqn, entry in entries.items():
        where = f"dcp.state_dict_metadata[{fqn!r}]"
        check.is_type(entry, dict, where)
        if entry.get("type") == "bytes":
            state[fqn] = BytesStorageMetadata()
            continue
        if entry.get("type") != "tensor":
            raise check.fail(f"{where}.type is {entry.get('type')!r}")
        props = TensorProperties(
            dtype=dtype_from_name(entry.get("dtype"), f"{check.source} {where}"),
            requires_grad=bool(check.is_type(entry.get("requires_grad"), bool, where)),
        )
        size = check.ints(entry.get("size"), f"{where}.size")
        chunks = []
        for c in check.is_type(entry.get("chunks"), list, f"{where}.chunks"):
            check.is_type(c, dict, f"{where}.chunks")
            offsets = check.ints(c.get("offsets"), f"{where}.chunks.offsets")
            sizes = check.ints(c.get("sizes"), f"{where}.chunks.sizes")
            if len(offsets) != len(size) or len(sizes) != len(size):
                raise check.fail(f"{where}: a chunk's rank differs from the tensor's")
            if any(o + s > d for o, s, d in zip(offsets, sizes, size, strict=True)):
                raise check.fail(f"{where}: chunk {list(offsets)}+{list(sizes)} exceeds {size}")
            chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
        state[fqn] = TensorStorageMetadata(props, torch.Size(size), chunks)
    storage_meta = None
    if raw.get("storage_meta") is not None:
        sm = check.is_type(raw["storage_meta"], dict, "dcp.storage_meta")
        modules = check.is_type(sm.get("modules", []), list, "dcp.storage_meta.modules")
        storage_meta = StorageMeta(
            checkpoint_id=_optional_str(check, sm.get("checkpoint_id"), "checkpoint_id"),
            save_id=_optional_str(check, sm.get("save_id"), "save_id"),
            modules=[check.is_type(m, str, "dcp.storage_meta.modules") for m in modules],
        )
    return Metadata(
        state_dict_metadata=state,
        planner_data=_decode_value(check, raw.get("planner_data"), 0),
        storage_meta=storage_meta,
        version=_optional_str(check, raw.get("version"), "version"),
    )


def _optional_str(check: ManifestChecker, value: Any, field: str) -> str | None:
    return None if value is None else check.is_type(value, str, f"dcp.{field}")


def _decode_value(check: ManifestChecker, value: Any, depth: int) -> Any:
    if depth > 64:
        raise check.fail("dcp.planner_data is nested too deeply")
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list):
        return [_decode_value(check, v, depth + 1) for v in value]
    if isinstance(value, dict) and len(value) == 1:
        if "__tuple__" in value:
            items = check.is_type(value["__tuple__"], list, "dcp.planner_data tuple")
            return tuple(_decode_value(check, v, depth + 1) for v in items)
        if "__dict__" in value:
            out: dict[Any, Any] = {}
            for pair in check.is_type(value["__dict__"], list, "dcp.planner_data dict"):
                if not isinstance(pair, list) or len(pair) != 2:
                    raise check.fail("dcp.planner_data: a dict entry is not a [key, value] pair")
                key = _decode_value(check, pair[0], depth + 1)
                try:
                    out[key] = _decode_value(check, pair[1], depth + 1)
                except TypeError:
                    raise check.fail(f"dcp.planner_data: unhashable dict key {key!r}") from None
            return out
    raise check.fail(f"dcp.planner_data holds an unknown value {value!r:.80}")


def _check_complete(
    check: ManifestChecker, metadata: Metadata, locations: dict[MetadataIndex, ItemLocation]
) -> None:
    """Every chunk and bytes value DCP may ask for has a location of matching type and shape."""
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            loc = locations.get(MetadataIndex(fqn))
            if loc is None or loc.dtype is not None:
                raise check.fail(f"{fqn}: no stored bytes for this value")
            continue
        expected = dtype_name(md.properties.dtype)
        for chunk in md.chunks:
            loc = locations.get(MetadataIndex(fqn, chunk.offsets))
            if loc is None:
                raise check.fail(f"{fqn}: no stored chunk at offset {list(chunk.offsets)}")
            if loc.dtype != expected or loc.shape != tuple(chunk.sizes):
                raise check.fail(
                    f"{fqn}: chunk at {list(chunk.offsets)} is stored as {loc.dtype} "
                    f"{loc.shape}, metadata says {expected} {tuple(chunk.sizes)}"
                )
