"""DCP's checkpoint metadata in a ckptstore manifest: commit record, JSON, no pickle.

DCP's own file writer commits by renaming a pickled ``.metadata`` file, and its reader unpickles
whatever it finds there. Neither step is safe on an object store: S3 has no atomic rename, and
unpickling bytes from a bucket executes them. Here a DCP checkpoint is an ordinary ckptstore
checkpoint (:class:`ckptstore.layout.Manifest`, committed with one put-if-absent): every stored
DCP item (a tensor chunk, or the bytes DCP serialised for a non-tensor value) is one leaf of
the manifest, with its object, offset, length, dtype, shape and crc32c, and DCP's
:class:`Metadata` (state-dict metadata, planner data, storage meta) is plain JSON in the
manifest's ``metadata``. The layout validates the whole record before any data read; this
module validates the DCP part and rebuilds DCP's ``Metadata`` from it. Nothing read back is
unpickled by ckptstore. (DCP's planner still deserialises the non-tensor values of a state
dict, which it serialised itself, with ``torch.load``; that is DCP's format, not ours.)

The manifest's tree names each leaf by its DCP fully qualified name and, for a tensor chunk,
the chunk's offsets: ``{"d": [fqn, ...], "c": [<bytes leaf index> | {"d": ["0,0", "512,0"],
"c": [<leaf>, <leaf>]}, ...]}``, so ``ckptstore show`` lists ``model.weight/512,0``.

``planner_data`` is whatever the DCP planner put there; it is encoded with tags for tuples and
for dicts (whose keys need not be strings), and anything else is refused when saving rather than
pickled.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
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
from ckptstore.integrations.tensor_objects import numpy_dtype, torch_dtype
from ckptstore.pipeline import codec
from ckptstore.pipeline.save import ManifestDraft
from ckptstore.pipeline.steps import Manifest
from ckptstore.pipeline.tensors import dtype_table
from ckptstore.store.transport import redact_url

__all__ = [
    "FORMAT",
    "ItemLocation",
    "ManifestChecker",
    "build_manifest",
    "dtype_from_name",
    "dtype_name",
    "is_dcp_manifest",
    "leaf_dtype",
    "leaf_path",
    "numpy_dtype",
    "read_dcp_metadata",
    "torch_dtype",
]

#: Marks a manifest's ``metadata`` as holding a DCP checkpoint, and its version.
FORMAT = "ckptstore.dcp/1"

#: DCP metadata names a tensor's dtype by torch's name; the allowed ones are the dtypes of the
#: one table (:func:`ckptstore.stage.torch.dtype_table`).
_DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype for dtype in dtype_table()
}
_BYTES_DTYPE = np.dtype(np.uint8)


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
        hash: xxh3-128 of its bytes, recorded by an incremental save for the next to
            compare with, or ``None``.
        step: the step whose attempt wrote the object when that is an earlier step (an
            unchanged item of an incremental save references it), else ``None``.
    """

    key: str
    start: int
    length: int
    crc32c: int
    object_size: int
    object_crc32c: int
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    hash: str | None = None
    step: int | None = None

    @classmethod
    def of_leaf(
        cls,
        manifest: Manifest,
        leaf: int,
        dtype: str | None,
        shape: tuple[int, ...] | None,
        *,
        hash: str | None = None,
        referenced: bool = False,
    ) -> ItemLocation:
        """Where leaf ``leaf`` of ``manifest`` lies (keys relative to the store root); with
        ``referenced``, as a later save that references it records it (its object's step)."""
        obj = manifest.leaf_object[leaf]
        return cls(
            manifest.object_key(obj) if obj >= 0 else "",
            manifest.leaf_offset[leaf],
            manifest.leaf_length[leaf],
            manifest.leaf_crc[leaf],
            manifest.object_lengths[obj] if obj >= 0 else 0,
            manifest.object_crcs[obj] if obj >= 0 else 0,
            dtype,
            shape,
            hash=hash,
            step=manifest.object_step(obj) if referenced and obj >= 0 else None,
        )


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


# --------------------------------------------------------------------------- writing


def is_dcp_manifest(manifest: Manifest) -> bool:
    """Whether ``manifest`` commits a DCP checkpoint written by :func:`build_manifest`."""
    meta = manifest.metadata
    return isinstance(meta, dict) and meta.get("format") == FORMAT


def _chunk_name(index: MetadataIndex) -> str:
    """The name of a tensor chunk below its DCP name in the tree: its offsets (``512,0``)."""
    return ",".join(str(o) for o in (index.offset or ()))


def leaf_path(index: MetadataIndex, tensor: bool) -> str:
    """The manifest path of a DCP item: its escaped name, and for a tensor chunk the chunk's
    name below it (``model.weight/512,0``)."""
    if not tensor:
        return codec.escape_key(index.fqn)
    return f"{codec.escape_key(index.fqn)}/{codec.escape_key(_chunk_name(index))}"


def leaf_dtype(dtype: str | None) -> str:
    """The manifest dtype name of an item of DCP dtype name ``dtype`` (``None``: bytes)."""
    np_dtype = _BYTES_DTYPE if dtype is None else numpy_dtype(_DTYPES[dtype])
    name = codec.dtype_name(np_dtype)
    assert name is not None  # every entry of the one table is allowed
    return name


def build_manifest(
    step: int,
    attempt: str,
    metadata: Metadata,
    locations: Mapping[MetadataIndex, ItemLocation],
    object_prefix: str,
) -> Manifest:
    """The manifest committing one DCP save attempt.

    Args:
        step: the step the checkpoint is stored as.
        attempt: the attempt id (``ckptstore.layout.keys.new_attempt_id``).
        metadata: DCP's global metadata, from ``finish``.
        locations: where every item of every rank landed; keys relative to the store root.
            An item at an earlier step's object (its ``step`` set) is a reference to it.
        object_prefix: what to strip from the keys of this save's own objects to make them
            relative to the step.
    """
    items = list(locations.items())
    draft = ManifestDraft.of_leaves(
        step,
        attempt,
        [leaf_path(index, tensor=loc.dtype is not None) for index, loc in items],
        [leaf_dtype(loc.dtype) for _, loc in items],
        [[loc.length] if loc.dtype is None else list(loc.shape or ()) for _, loc in items],
        [loc.length for _, loc in items],
    )
    objects: dict[str, int] = {}
    children: dict[str, Any] = {}
    for leaf, (index, loc) in enumerate(items):
        if loc.key and loc.key not in objects:  # an empty item has no object (key "")
            own = loc.step is None
            objects[loc.key] = draft.add_objects(
                [loc.key.removeprefix(object_prefix if own else f"{loc.step}/")],
                [loc.object_size],
                [loc.object_crc32c],
                step=loc.step,
            )
        draft.place(leaf, objects[loc.key] if loc.key else -1, loc.start, loc.crc32c)
        if loc.dtype is None:
            children[index.fqn] = leaf
        else:
            node = children.setdefault(index.fqn, {"d": [], "c": []})
            node["d"].append(_chunk_name(index))
            node["c"].append(leaf)
    draft.set_hashes((leaf, loc.hash) for leaf, (_, loc) in enumerate(items))
    return draft.build(
        tree={"d": list(children), "c": list(children.values())},
        metadata={"format": FORMAT, "dcp": _encode_metadata(metadata)},
    )


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
            # a URL may carry credentials in its query: the bucket must never hold them
            "checkpoint_id": None
            if meta.checkpoint_id is None
            else redact_url(str(meta.checkpoint_id)),
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


# --------------------------------------------------------------------------- reading


def read_dcp_metadata(manifest: Manifest, source: str) -> Metadata:
    """Rebuild DCP's ``Metadata`` from a validated manifest.

    Its ``storage_data`` maps each :class:`MetadataIndex` to the :class:`ItemLocation` of the
    stored item (keys relative to the store root).

    Raises:
        CorruptCheckpointError: the manifest is not a DCP checkpoint, or its DCP part is
            malformed or disagrees with its leaves.
    """
    check = ManifestChecker(source)
    meta = manifest.metadata
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise check.fail(
            f"not a DCP checkpoint written by ckptstore (metadata format {found!r}); "
            "load it with ckptstore.load"
        )
    metadata = _decode_metadata(check, meta.get("dcp"))
    locations = _locations(check, manifest)
    _check_complete(check, metadata, locations)
    metadata.storage_data = locations
    return metadata


def _locations(check: ManifestChecker, manifest: Manifest) -> dict[MetadataIndex, ItemLocation]:
    tree = manifest.tree
    if not isinstance(tree, dict) or "d" not in tree:
        raise check.fail("the tree is not a dict of DCP names")
    locations: dict[MetadataIndex, ItemLocation] = {}

    def place(leaf: Any, index: MetadataIndex, tensor: bool) -> None:
        if type(leaf) is not int:
            raise check.fail(f"{index.fqn}: a DCP item is not an array leaf")
        np_dtype = manifest.dtype(leaf)
        shape = tuple(manifest.shapes[leaf])
        dtype: str | None = None
        if tensor:
            dtype = dtype_name(torch_dtype(np_dtype, f"{check.source} {index.fqn}"))
        elif np_dtype != _BYTES_DTYPE or len(shape) != 1:
            raise check.fail(f"{index.fqn}: a bytes item is stored as {np_dtype} {list(shape)}")
        locations[index] = ItemLocation.of_leaf(manifest, leaf, dtype, shape if tensor else None)

    for fqn, node in zip(tree["d"], tree["c"], strict=True):
        if not isinstance(fqn, str):
            raise check.fail(f"DCP name {fqn!r} is not a string")
        if type(node) is int:
            place(node, MetadataIndex(fqn), tensor=False)
            continue
        if not isinstance(node, dict) or "d" not in node:
            raise check.fail(f"{fqn}: tree node is neither a bytes leaf nor a chunk dict")
        for chunk, leaf in zip(node["d"], node["c"], strict=True):
            try:
                offsets = [int(o) for o in chunk.split(",")] if chunk else []
            except (AttributeError, ValueError):
                raise check.fail(f"{fqn}: chunk name {chunk!r} is not a list of offsets") from None
            place(leaf, MetadataIndex(fqn, offsets), tensor=True)
    return locations


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
