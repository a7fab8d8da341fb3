"""ckptstore as Lightning's ``CheckpointIO``: checkpoints on any ckptstore URL.

``Trainer(plugins=[StoreCheckpointIO()], callbacks=[ModelCheckpoint(dirpath="s3://b/run")])``
saves each Lightning checkpoint as a ckptstore checkpoint at the path Lightning chooses
(``s3://b/run/epoch=0-step=100.ckpt`` becomes a prefix, not one file):

* every tensor of the checkpoint dict is stored as raw bytes, small ones packed together and
  large ones uploaded in parallel parts, each with a crc32c that is verified on load;
* the rest of the dict (its structure, counters, hyper-parameters), with each tensor replaced
  by a ``{"__ckptstore_tensor__": i}`` marker, is one small ``torch.save`` blob, loaded back with
  ``torch.load`` honouring Lightning's ``weights_only`` (restricted unpickling by default);
* ``manifest.json`` (versioned JSON: objects, tensors, the blob, all with lengths and crc32c)
  is written last with one put-if-absent, so a checkpoint is visible only once every byte is
  durable; ``remove_checkpoint`` deletes the manifest first, so a half-removed checkpoint is
  invisible rather than corrupt.

Wrapped in Lightning's ``AsyncCheckpointIO``, saves run in its background thread.

Lightning itself still asks fsspec whether paths exist (``ModelCheckpoint``, ``ckpt_path``):
for an ``s3://`` directory, s3fs must be able to reach the same bucket (for a custom endpoint,
set ``FSSPEC_S3_ENDPOINT_URL`` or Lightning's storage options).
"""

from __future__ import annotations

import asyncio
import io
import json
import math
import os
import time
import uuid
from typing import Any

import numpy as np
import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from ckptstore import background
from ckptstore.errors import CorruptCheckpointError, NotFoundError
from ckptstore.integrations.dcp_manifest import (
    ManifestChecker,
    check_no_overlap,
    decode_objects,
    dtype_from_name,
    dtype_name,
)
from ckptstore.integrations.tensor_objects import (
    Packer,
    Placed,
    StoreHandle,
    UploadBatch,
    crc32c,
    tensor_bytes,
)
from ckptstore.store.base import Store

__all__ = ["StoreCheckpointIO"]

FORMAT = "ckptstore.lightning"
VERSION = 1
MANIFEST_KEY = "manifest.json"
MAX_MANIFEST_BYTES = 64 << 20
_MARKER = "__ckptstore_tensor__"
_SKELETON = -1  # token of the skeleton blob among the packed items


class StoreCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves to, loads from and removes at ckptstore URLs.

    Args:
        pack_threshold: tensors smaller than this many bytes are packed together.
        pack_size: target size of one pack object, in bytes.
        **options: store options and Settings fields, as for :func:`ckptstore.open_store`,
            applied to every path.
    """

    def __init__(
        self, *, pack_threshold: int = 8 << 20, pack_size: int = 64 << 20, **options: Any
    ) -> None:
        super().__init__()
        self.pack_threshold = pack_threshold
        self.pack_size = pack_size
        self.options = options

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike[str], storage_options: Any = None
    ) -> None:
        """Store ``checkpoint`` at ``path``; returns once it is committed.

        Raises:
            AlreadyExistsError: ``path`` already holds a committed checkpoint (remove it first).
        """
        if storage_options is not None:
            raise TypeError("StoreCheckpointIO takes store options in its constructor")
        handle = StoreHandle(path, dict(self.options))
        try:
            _save(handle.store, checkpoint, self.pack_threshold, self.pack_size)
        finally:
            handle.close()

    def load_checkpoint(
        self,
        path: str | os.PathLike[str],
        map_location: Any = None,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load the checkpoint at ``path``, verifying every tensor's crc32c.

        Tensors are created on the CPU; a ``map_location`` that is a device (or its name)
        moves them there, and is passed to ``torch.load`` for the rest of the dict.

        Raises:
            FileNotFoundError: no committed checkpoint at ``path``.
            CorruptCheckpointError: the manifest or any byte fails verification.
        """
        handle = StoreHandle(path, dict(self.options))
        try:
            checkpoint = _load(handle.store, weights_only, map_location)
        finally:
            handle.close()
        if not isinstance(checkpoint, dict):
            raise CorruptCheckpointError(f"{path}: the checkpoint is not a dict")
        return checkpoint

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Remove the checkpoint at ``path``: its manifest first, then its objects."""
        handle = StoreHandle(path, dict(self.options))
        try:
            background.run(_remove(handle.store))
        finally:
            handle.close()


# --------------------------------------------------------------------------- save


def _save(store: Store, checkpoint: dict[str, Any], pack_threshold: int, pack_size: int) -> None:
    tensors: list[torch.Tensor] = []
    skeleton = _strip_tensors(checkpoint, tensors)
    blob = io.BytesIO()
    torch.save(skeleton, blob)
    attempt = uuid.uuid4().hex
    batch = UploadBatch(store, f"{attempt}/r0")
    packer: Packer[int] = Packer(batch, pack_size)
    placed: list[Placed[int]] = []
    for index, tensor in enumerate(tensors):
        owner, data = tensor_bytes(tensor)
        tensors[index] = owner
        if len(data) >= pack_threshold:
            placed.append(batch.single(index, data, owner))
        else:
            placed.extend(packer.add(index, data))
    placed.extend(packer.add(_SKELETON, blob.getbuffer()))
    placed.extend(packer.flush())
    batch.wait()

    by_token = {p.token: p for p in placed}
    record = {
        "format": FORMAT,
        "version": VERSION,
        "attempt": attempt,
        "created": time.time(),
        "objects": {p.key: {"size": p.object_size, "crc32c": p.object_crc32c} for p in placed},
        "tensors": [
            {
                **_span(by_token[i]),
                "dtype": dtype_name(t.dtype),
                "shape": list(t.shape),
            }
            for i, t in enumerate(tensors)
        ],
        "skeleton": _span(by_token[_SKELETON]),
    }
    manifest = json.dumps(record, separators=(",", ":")).encode()
    background.run(store.put(MANIFEST_KEY, manifest, mode="create"))


def _span(p: Placed[int]) -> dict[str, Any]:
    return {"key": p.key, "start": p.start, "length": p.length, "crc32c": p.crc32c}


def _strip_tensors(value: Any, tensors: list[torch.Tensor]) -> Any:
    """``value`` with every tensor inside dicts, lists and tuples replaced by a marker."""
    if isinstance(value, torch.Tensor) and value.layout == torch.strided:
        tensors.append(value)
        return {_MARKER: len(tensors) - 1}
    if isinstance(value, dict):
        stripped = {k: _strip_tensors(v, tensors) for k, v in value.items()}
        return stripped if type(value) is dict else _same_type(value, stripped)
    if isinstance(value, list) and type(value) is list:
        return [_strip_tensors(v, tensors) for v in value]
    if isinstance(value, tuple) and type(value) is tuple:
        return tuple(_strip_tensors(v, tensors) for v in value)
    return value


def _same_type(original: dict[Any, Any], items: dict[Any, Any]) -> Any:
    try:
        return type(original)(items)
    except TypeError:
        return items


# --------------------------------------------------------------------------- load


def _load(store: Store, weights_only: bool | None, map_location: Any) -> Any:
    spans, skeleton_span = _decode(
        background.run(_read_manifest(store)), f"{store.url}/{MANIFEST_KEY}"
    )
    buffers = [np.empty(length, dtype=np.uint8) for _, _, length, _, _, _ in spans]
    skeleton = np.empty(skeleton_span[2], dtype=np.uint8)
    per_object: dict[str, list[tuple[int, Any]]] = {}
    for (key, start, length, _, _, _), buffer in zip(spans, buffers, strict=True):
        if length:
            per_object.setdefault(key, []).append((start, buffer))
    per_object.setdefault(skeleton_span[0], []).append((skeleton_span[1], skeleton))
    background.run(_read_all(store, per_object))

    if crc32c(skeleton) != skeleton_span[3]:
        raise CorruptCheckpointError(f"{store.url}: the checkpoint's structure fails its crc32c")
    tensors = []
    device = map_location if isinstance(map_location, str | torch.device) else None
    for (key, start, _, crc, dtype, shape), buffer in zip(spans, buffers, strict=True):
        if crc32c(buffer) != crc:
            raise CorruptCheckpointError(
                f"{store.url}/{key}: tensor at byte {start} fails its crc32c check"
            )
        tensor = (
            torch.from_numpy(buffer).view(dtype).reshape(shape)
            if buffer.size
            else torch.empty(shape, dtype=dtype)
        )
        tensors.append(tensor.to(device) if device is not None else tensor)
    structure = torch.load(
        io.BytesIO(skeleton.tobytes()), map_location=map_location, weights_only=weights_only
    )
    return _restore_tensors(structure, tensors)


async def _read_manifest(store: Store) -> bytes:
    try:
        meta = await store.head(MANIFEST_KEY)
    except NotFoundError:
        raise NotFoundError(f"{store.url} holds no committed ckptstore checkpoint") from None
    if meta.size > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(f"{store.url}/{MANIFEST_KEY} is over the size cap")
    return await store.get(MANIFEST_KEY)


async def _read_all(store: Store, per_object: dict[str, list[tuple[int, Any]]]) -> None:
    """Every object's ranges at once; each object's ranges are merged and fetched in parallel."""
    await asyncio.gather(
        *(store.read_ranges_into(key, requests) for key, requests in per_object.items())
    )


_Span = tuple[str, int, int, int, torch.dtype, tuple[int, ...]]


def _decode(data: bytes, source: str) -> tuple[list[_Span], tuple[str, int, int, int]]:
    """Validate a Lightning manifest; returns tensor spans and the skeleton's span."""
    check = ManifestChecker(source)
    try:
        record = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise check.fail(f"manifest is not valid JSON: {exc}") from None
    check.is_type(record, dict, "manifest")
    if record.get("format") != FORMAT or record.get("version") != VERSION:
        raise check.fail(
            f"not a version {VERSION} ckptstore Lightning manifest "
            f"(format {record.get('format')!r}, version {record.get('version')!r})"
        )
    attempt = check.is_type(record.get("attempt"), str, "attempt")
    if "/" in attempt:
        raise check.fail(f"attempt id {attempt!r} contains '/'")
    objects = decode_objects(check, record.get("objects"), attempt)
    used: dict[str, list[tuple[int, int]]] = {}

    def span(raw: Any, where: str) -> tuple[str, int, int, int]:
        check.is_type(raw, dict, where)
        key = check.is_type(raw.get("key"), str, f"{where}.key")
        if key not in objects:
            raise check.fail(f"{where} names object {key!r}, which the manifest does not list")
        start = check.count(raw.get("start"), f"{where}.start")
        length = check.count(raw.get("length"), f"{where}.length")
        if start + length > objects[key][0]:
            raise check.fail(f"{where} runs past the end of {key!r}")
        used.setdefault(key, []).append((start, start + length))
        return key, start, length, check.count(raw.get("crc32c"), f"{where}.crc32c")

    spans: list[_Span] = []
    for n, raw in enumerate(check.is_type(record.get("tensors"), list, "tensors")):
        key, start, length, crc = span(raw, f"tensors[{n}]")
        dtype = dtype_from_name(raw.get("dtype"), f"{source} tensors[{n}]")
        shape = check.ints(raw.get("shape"), f"tensors[{n}].shape")
        if math.prod(shape) * dtype.itemsize != length:
            raise check.fail(f"tensors[{n}]: shape {list(shape)} does not match {length} bytes")
        spans.append((key, start, length, crc, dtype, shape))
    skeleton = span(record.get("skeleton"), "skeleton")
    check_no_overlap(check, used)
    return spans, skeleton


def _restore_tensors(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, dict):
        if len(value) == 1 and _MARKER in value:
            index = value[_MARKER]
            if not isinstance(index, int) or not 0 <= index < len(tensors):
                raise CorruptCheckpointError(f"tensor marker {index!r} names no stored tensor")
            return tensors[index]
        items = {k: _restore_tensors(v, tensors) for k, v in value.items()}
        return items if type(value) is dict else _same_type(value, items)
    if isinstance(value, list) and type(value) is list:
        return [_restore_tensors(v, tensors) for v in value]
    if isinstance(value, tuple) and type(value) is tuple:
        return tuple(_restore_tensors(v, tensors) for v in value)
    return value


# --------------------------------------------------------------------------- remove


async def _remove(store: Store) -> None:
    await store.delete([MANIFEST_KEY])  # invisible first, then the objects
    keys = await store.list_keys()
    await store.delete(keys)
