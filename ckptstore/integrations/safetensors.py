"""Hand a checkpoint's weights to the rest of the ecosystem: export one step as safetensors.

``ckptstore.export_safetensors(url, dest, step=..., keys="model")`` (and ``ckptstore export``
on the command line) reads the chosen leaves of a committed step from any backend, verifying
every byte as every restore does, and writes them as safetensors files that ``safetensors``,
``transformers`` (``from_pretrained``), vLLM and the rest load without ckptstore:

* ``model.safetensors``, or, past ``max_shard_size``, ``model-00001-of-0000N.safetensors``
  files and the ``model.safetensors.index.json`` that maps each tensor to its file (the
  Hugging Face layout);
* a tensor's name is its path below ``keys``, nesting joined with ``.``: a state saved as
  ``{"model": model.state_dict(), "optimizer": ...}`` exported with ``keys="model"`` gets the
  state dict's own names, the ones ``load_state_dict`` and ``from_pretrained`` expect;
* the file's ``__metadata__`` holds ``format: pt`` (what ``transformers`` asks of a file) and
  the step and the (redacted) URL it came from.

The format is written here, not through the ``safetensors`` package (which is not needed
to export): an 8-byte little-endian header length, the JSON header (dtype, shape and byte
range of each tensor) padded with spaces to 8 bytes, then the tensors' bytes in header
order. One shard is read at a time, so an export holds at most about ``max_shard_size`` of
arrays; every file is written under a temporary name and made durable, and all are renamed
once the last is written, so a failed export (a damaged byte in the last shard) leaves no file
under a final name.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import struct
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from ckptstore import background
from ckptstore.config import parse_size
from ckptstore.errors import AlreadyExistsError, NotFoundError, UnsupportedTreeError
from ckptstore.manager.functions import aread_manifest
from ckptstore.pipeline.restore import read, request
from ckptstore.pipeline.root import Root, aopened
from ckptstore.store.transport import redact_url

__all__ = ["ExportInfo", "aexport_safetensors", "export_safetensors"]

#: The default largest shard: Hugging Face's default for ``save_pretrained``.
DEFAULT_SHARD_SIZE = 5 << 30

#: safetensors' dtype names, by the manifest's.
DTYPES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "uint16": "U16",
    "int16": "I16",
    "float16": "F16",
    "bfloat16": "BF16",
    "uint32": "U32",
    "int32": "I32",
    "float32": "F32",
    "uint64": "U64",
    "int64": "I64",
    "float64": "F64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}


@dataclasses.dataclass(frozen=True)
class ExportInfo:
    """What an export wrote.

    Attributes:
        step: the step exported.
        files: the safetensors files, in order (and the index file last, when sharded).
        tensors: how many tensors were written.
        nbytes: the tensors' bytes.
    """

    step: int
    files: list[Path]
    tensors: int
    nbytes: int


def export_safetensors(
    root: Root,
    dest: str | os.PathLike[str],
    *,
    step: int | None = None,
    keys: str | None = None,
    max_shard_size: int | str = DEFAULT_SHARD_SIZE,
    overwrite: bool = False,
    **store_options: Any,
) -> ExportInfo:
    """:func:`aexport_safetensors` for synchronous callers."""
    return background.run(
        aexport_safetensors(
            root,
            dest,
            step=step,
            keys=keys,
            max_shard_size=max_shard_size,
            overwrite=overwrite,
            **store_options,
        )
    )


async def aexport_safetensors(
    root: Root,
    dest: str | os.PathLike[str],
    *,
    step: int | None = None,
    keys: str | None = None,
    max_shard_size: int | str = DEFAULT_SHARD_SIZE,
    overwrite: bool = False,
    **store_options: Any,
) -> ExportInfo:
    """Export the array leaves under ``keys`` of ``step`` as safetensors files in ``dest``.

    Args:
        root: URL, path or Store of the run's checkpoint root.
        dest: the directory to write into (made if missing; other files in it stay, so it
            can be a model directory that holds ``config.json``).
        step: the step (default: the newest committed one).
        keys: the subtree to export, e.g. ``"model"`` (default: every array leaf); tensor
            names are paths below it.
        max_shard_size: the largest file, in bytes or as ``"5GB"``; a tensor larger than it
            gets a file of its own.
        overwrite: replace safetensors files of the same names in ``dest``.
        **store_options: options for a URL ``root``, as on every face.

    Raises:
        NotFoundError: no such step, or ``keys`` names no array leaf.
        UnsupportedTreeError: a dtype safetensors has no name for (complex numbers...), or
            two leaves whose names would be the same.
        AlreadyExistsError: ``dest`` holds files of the export's names, without
            ``overwrite``.
        ValueError: ``max_shard_size`` is not a positive size.
        CorruptCheckpointError: any byte read fails verification (nothing is renamed then).
    """
    limit = parse_size(max_shard_size)
    if limit <= 0:
        raise ValueError(f"max_shard_size must be positive, got {max_shard_size!r}")
    target = Path(dest)
    async with aopened(root, store_options) as store:
        manifest = await aread_manifest(store, step)
        chosen = _chosen(manifest.paths, keys)
        if not chosen:
            raise NotFoundError(
                f"{store.url}: step {manifest.step} has no array leaf under {keys!r} to export"
            )
        names = _names(manifest.paths, chosen, keys)
        for i in chosen:
            if _numpy_name(manifest.dtypes[i]) not in DTYPES:
                raise UnsupportedTreeError(
                    f"{manifest.paths[i]!r} is {_numpy_name(manifest.dtypes[i])}, which "
                    f"safetensors cannot hold (it knows {', '.join(sorted(DTYPES))}); export "
                    "other keys"
                )
        shards = _shards(chosen, manifest.leaf_length, limit)
        files = _file_names(len(shards))
        index_name = "model.safetensors.index.json"
        await asyncio.to_thread(_check_dest, target, [*files, index_name], overwrite)
        meta = {
            "format": "pt",
            "ckptstore_step": str(manifest.step),
            "ckptstore_url": redact_url(store.url),
        }
        weight_map: dict[str, str] = {}
        total = 0
        temps: list[tuple[Path, Path]] = []  # (temporary, final): renamed once all are written
        try:
            for shard, name in zip(shards, files, strict=True):
                paths = [manifest.paths[i] for i in shard]
                selection = await read(store, manifest.step, request(paths, None))
                arrays = [(names[i], _host(selection.arrays[i], manifest.paths[i])) for i in shard]
                del selection
                temp = await asyncio.to_thread(_write_file, target / name, arrays, meta)
                temps.append((temp, target / name))
                weight_map.update((tensor, name) for tensor, _ in arrays)
                total += sum(int(a.nbytes) for _, a in arrays)
                del arrays
            if len(files) > 1:
                index = {"metadata": {"total_size": total}, "weight_map": weight_map}
                body = json.dumps(index, indent=2, sort_keys=True).encode()
                temp = await asyncio.to_thread(_write_temp, target / index_name, [body])
                temps.append((temp, target / index_name))
            await asyncio.to_thread(_publish, temps)
        except BaseException:
            for temp, _ in temps:
                temp.unlink(missing_ok=True)
            raise
        written = [final for _, final in temps]
    return ExportInfo(manifest.step, written, len(chosen), total)


def _check_dest(target: Path, names: list[str], overwrite: bool) -> None:
    target.mkdir(parents=True, exist_ok=True)
    taken = [name for name in names if (target / name).exists()]
    if taken and not overwrite:
        raise AlreadyExistsError(
            f"{target} already holds {', '.join(taken)}; export to another directory or pass "
            "overwrite=True (--overwrite)"
        )


def _numpy_name(manifest_dtype: str) -> str:
    """numpy's name of a manifest dtype (``"<f4"`` and ``">f4"`` are ``float32``; the
    extension types are named by their names already)."""
    try:
        return np.dtype(manifest_dtype).name
    except TypeError:
        return manifest_dtype


def _chosen(paths: list[str], keys: str | None) -> list[int]:
    if keys is None or keys == "":
        return list(range(len(paths)))
    prefix = keys.rstrip("/") + "/"
    return [i for i, path in enumerate(paths) if path == keys or path.startswith(prefix)]


def _unescape(segment: str) -> str:
    return segment.replace("~1", "/").replace("~0", "~")


def _names(paths: list[str], chosen: list[int], keys: str | None) -> dict[int, str]:
    """Each chosen leaf's tensor name: its path below ``keys``, segments joined by dots."""
    names: dict[int, str] = {}
    seen: dict[str, str] = {}
    for i in chosen:
        path = paths[i]
        if keys:
            below = path[len(keys) :].lstrip("/") if path != keys else path.rsplit("/", 1)[-1]
        else:
            below = path
        name = ".".join(_unescape(s) for s in below.split("/"))
        if name in seen:
            raise UnsupportedTreeError(
                f"{seen[name]!r} and {path!r} would both be the tensor {name!r}; export them "
                "separately (keys=)"
            )
        seen[name] = path
        names[i] = name
    return names


def _shards(chosen: list[int], lengths: list[int], limit: int) -> list[list[int]]:
    shards: list[list[int]] = [[]]
    size = 0
    for i in chosen:
        if shards[-1] and size + lengths[i] > limit:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += lengths[i]
    return shards


def _file_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{n:05d}-of-{count:05d}.safetensors" for n in range(1, count + 1)]


def _host(found: Any, path: str) -> np.ndarray[Any, Any]:
    if not isinstance(found, np.ndarray):
        raise TypeError(f"{path!r}: the restore gave {type(found).__name__}, not an array")
    array: np.ndarray[Any, Any] = found
    if array.dtype.byteorder == ">":  # safetensors is little-endian
        array = array.astype(array.dtype.newbyteorder("<"))
    if not array.flags.c_contiguous:
        array = array.copy(order="C")  # (np.ascontiguousarray would make a 0-d array 1-d)
    return array


def _write_file(
    path: Path, arrays: list[tuple[str, np.ndarray[Any, Any]]], meta: dict[str, str]
) -> Path:
    """One safetensors file of ``arrays``, under a temporary name beside ``path``."""
    header: dict[str, Any] = {"__metadata__": meta}
    offset = 0
    for name, array in arrays:
        dtype = DTYPES[array.dtype.name]
        header[name] = {
            "dtype": dtype,
            "shape": list(array.shape),
            "data_offsets": [offset, offset + int(array.nbytes)],
        }
        offset += int(array.nbytes)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    chunks: list[bytes | memoryview] = [struct.pack("<Q", len(encoded)), encoded]
    chunks.extend(array.reshape(-1).view(np.uint8).data for _, array in arrays)
    return _write_temp(path, chunks)


def _write_temp(path: Path, chunks: list[bytes | memoryview]) -> Path:
    """Write ``chunks`` durably under a temporary name beside ``path``; return that name."""
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    return Path(temp)


def _publish(temps: list[tuple[Path, Path]]) -> None:
    """Rename every written file to its final name, then make the names durable."""
    for temp, final in temps:
        os.replace(temp, final)
    if temps:
        directory = os.open(temps[0][1].parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
