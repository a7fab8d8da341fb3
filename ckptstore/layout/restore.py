"""Reading leaves back, verifying every byte read.

Per data object, in parallel:

* an object holding one leaf is read straight into that leaf's array (a fresh one or the
  caller's ``into`` array), in parallel ranges, and its crc32c checked;
* a pack whose leaves are all wanted (and none goes to a caller's array) is read whole into
  one buffer, checked against the object's crc32c, and its leaves are returned as views into
  that buffer (no copy; offsets are aligned for every dtype);
* otherwise only the wanted leaves' byte ranges are read (``Store.read_ranges_into``, which
  merges close ranges), each into its destination array, and each leaf's crc32c is checked.

A mismatch, a short object or a missing one raises
:class:`~ckptstore.errors.CorruptCheckpointError` naming the leaf and the object.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ckptstore.errors import CorruptCheckpointError, InvalidRangeError, NotFoundError
from ckptstore.layout.commit import gather_all
from ckptstore.layout.manifest import Manifest
from ckptstore.store.base import Store
from ckptstore.store.checksum import acrc32c, as_uint8, crc32c

__all__ = ["read_leaves"]


#: Fresh arrays at least this large start on a page boundary, so stores that read with
#: O_DIRECT (local directories) can read straight into them without a bounce copy.
_ALIGN_MIN = 1 << 20
_PAGE = 4096


def _empty(shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes < _ALIGN_MIN:
        return np.empty(shape, dtype)
    raw = np.empty(nbytes + _PAGE, np.uint8)
    start = -raw.ctypes.data % _PAGE
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def _destination(
    manifest: Manifest, leaf: int, into: Mapping[int, np.ndarray[Any, Any]]
) -> np.ndarray[Any, Any]:
    dtype, shape = manifest.dtype(leaf), tuple(manifest.shapes[leaf])
    out = into.get(leaf)
    if out is None:
        return _empty(shape, dtype)
    path = manifest.paths[leaf]
    if out.dtype != dtype or out.shape != shape:
        raise ValueError(
            f"into[{path!r}] is {out.dtype}{list(out.shape)}, but the checkpoint holds "
            f"{dtype}{list(shape)}"
        )
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"into[{path!r}] must be a writable C-contiguous array")
    return out


async def read_leaves(
    store: Store,
    manifest: Manifest,
    leaves: Sequence[int],
    into: Mapping[int, np.ndarray[Any, Any]] | None = None,
) -> dict[int, np.ndarray[Any, Any]]:
    """Read the given leaves of a validated manifest; returns arrays by leaf index.

    Args:
        store: the store the manifest was read from.
        manifest: a validated manifest.
        leaves: leaf indices to read.
        into: caller arrays to fill, by leaf index (dtype and shape must match exactly).
    """
    into = into or {}
    out: dict[int, np.ndarray[Any, Any]] = {}
    by_object: dict[int, list[int]] = defaultdict(list)
    for leaf in leaves:
        obj = manifest.leaf_object[leaf]
        if obj < 0:
            out[leaf] = _destination(manifest, leaf, into)
        else:
            by_object[obj].append(leaf)
    members: dict[int, int] = defaultdict(int)
    if by_object:
        for obj in manifest.leaf_object:
            if obj >= 0:
                members[obj] += 1

    def corrupt(obj: int, leaf: int | None, what: str) -> CorruptCheckpointError:
        key = manifest.object_key(obj)
        name = f"leaf {manifest.paths[leaf]!r} in " if leaf is not None else ""
        return CorruptCheckpointError(f"{store.url}: {name}object {key!r}: {what}")

    async def read_object(obj: int, wanted: list[int]) -> None:
        key = manifest.object_key(obj)
        length = manifest.object_lengths[obj]
        try:
            if len(wanted) == members[obj] == 1 and manifest.leaf_length[wanted[0]] == length:
                await read_single(obj, key, wanted[0])
            elif len(wanted) == members[obj] and not any(leaf in into for leaf in wanted):
                await read_whole(obj, key, length, wanted)
            else:
                await read_parts(obj, key, wanted)
        except NotFoundError:
            raise corrupt(obj, None, "is missing") from None
        except InvalidRangeError as exc:
            raise corrupt(obj, None, f"is shorter than the manifest says ({exc})") from None

    async def read_single(obj: int, key: str, leaf: int) -> None:
        dest = _destination(manifest, leaf, into)
        crc = await store.read_into_crc32c(key, 0, as_uint8(dest))
        if crc != manifest.leaf_crc[leaf] or crc != manifest.object_crcs[obj]:
            raise corrupt(
                obj, leaf, f"crc32c mismatch (expected {manifest.leaf_crc[leaf]}, read {crc})"
            )
        out[leaf] = dest

    async def read_whole(obj: int, key: str, length: int, wanted: list[int]) -> None:
        buf = _empty((length,), np.dtype(np.uint8))
        crc = await store.read_into_crc32c(key, 0, buf)
        if crc != manifest.object_crcs[obj]:
            # Name the first damaged leaf, if the damage is inside one.
            for leaf in wanted:
                start = manifest.leaf_offset[leaf]
                if (
                    crc32c(buf[start : start + manifest.leaf_length[leaf]])
                    != manifest.leaf_crc[leaf]
                ):
                    raise corrupt(obj, leaf, "crc32c mismatch")
            raise corrupt(obj, None, "crc32c mismatch (in the padding between leaves)")
        offsets, shapes, names = manifest.leaf_offset, manifest.shapes, manifest.dtypes
        dtypes = {name: manifest.dtype(leaf) for leaf, name in ((w, names[w]) for w in wanted)}
        for leaf in wanted:
            out[leaf] = np.ndarray(shapes[leaf], dtypes[names[leaf]], buf, offsets[leaf])

    async def read_parts(obj: int, key: str, wanted: list[int]) -> None:
        dests = [_destination(manifest, leaf, into) for leaf in wanted]
        views = [as_uint8(d) for d in dests]
        await store.read_ranges_into(
            key, [(manifest.leaf_offset[leaf], v) for leaf, v in zip(wanted, views, strict=True)]
        )
        for leaf, dest, view in zip(wanted, dests, views, strict=True):
            crc = await acrc32c(view)
            if crc != manifest.leaf_crc[leaf]:
                raise corrupt(
                    obj, leaf, f"crc32c mismatch (expected {manifest.leaf_crc[leaf]}, read {crc})"
                )
            out[leaf] = dest

    await gather_all(read_object(obj, wanted) for obj, wanted in by_object.items())
    return out
