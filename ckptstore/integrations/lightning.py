"""ckptstore as Lightning's ``CheckpointIO``: checkpoints on any ckptstore URL.

``Trainer(plugins=[StoreCheckpointIO()], callbacks=[ModelCheckpoint(dirpath="s3://b/run")])``
saves each Lightning checkpoint as a ckptstore checkpoint at the path Lightning chooses
(``s3://b/run/epoch=0-step=100.ckpt`` becomes a prefix, not one file):

* it is an ordinary ckptstore checkpoint, step 0 of the root at that path (or step N if the
  path ends in a step number), written by :func:`ckptstore.layout.write_checkpoint`: small
  tensors packed together, large ones uploaded in parallel parts, every leaf with a crc32c
  that is verified on load, and the manifest written last with one put-if-absent, so a
  checkpoint is visible only once every byte is durable;
* every tensor of the checkpoint dict is one leaf (``tensors/<i>``); the rest of the dict (its
  structure, counters, hyper-parameters), with each tensor replaced by a
  ``{"__ckptstore_tensor__": i}`` marker, is one more leaf (``structure``), a small
  ``torch.save`` blob loaded back with ``torch.load(weights_only=True)`` always: ckptstore
  never runs the full unpickler on stored bytes, so Lightning's ``weights_only=False`` is not
  honoured here (objects outside torch's allow-list fail to load instead of executing);
* ``remove_checkpoint`` deletes the manifest first, so a half-removed checkpoint is invisible
  rather than corrupt.

Wrapped in Lightning's ``AsyncCheckpointIO``, saves run in its background thread while
Lightning calls ``remove_checkpoint`` from the training thread, sometimes for a path whose save
is still running (top-k retention). The plugin serialises operations on one path: a removal
waits for that path's save to finish and then removes it, so it never deletes the objects of a
save in flight (which would fail that save, or worse, let it commit a manifest over deleted
data). A removal that comes before the queued save has started finds nothing and returns; that
save then lands, as it would with Lightning's own file IO.

Lightning itself still asks fsspec whether paths exist (``ModelCheckpoint``, ``ckpt_path``):
for an ``s3://`` directory, s3fs must be able to reach the same bucket (for a custom endpoint,
set ``FSSPEC_S3_ENDPOINT_URL`` or Lightning's storage options).
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from ckptstore import background
from ckptstore.errors import CorruptCheckpointError, NotFoundError
from ckptstore.integrations.tensor_objects import CheckpointTarget, numpy_dtype, torch_dtype
from ckptstore.layout.commit import delete_step, read_manifest, write_checkpoint
from ckptstore.layout.keys import manifest_key
from ckptstore.layout.restore import read_leaves
from ckptstore.layout.tree import FlatState
from ckptstore.store.base import Store

__all__ = ["StoreCheckpointIO"]

#: Marks a manifest's ``metadata`` as holding a Lightning checkpoint, and its version.
FORMAT = "ckptstore.lightning/1"
_MARKER = "__ckptstore_tensor__"


class StoreCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves to, loads from and removes at ckptstore URLs.

    Args:
        **options: store options and Settings fields (``pack_threshold``, ``part_size``...),
            as for :func:`ckptstore.open_store`, applied to every path.
    """

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.options = options
        self._guard = threading.Lock()
        self._busy: dict[str, threading.Lock] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_guard"], state["_busy"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._guard = threading.Lock()
        self._busy = {}

    @contextlib.contextmanager
    def _exclusive(self, path: str | os.PathLike[str]) -> Iterator[None]:
        """Hold ``path`` against other saves and removals of it from this plugin."""
        name = os.fspath(path)
        with self._guard:
            lock = self._busy.setdefault(name, threading.Lock())
        with lock:
            yield

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike[str], storage_options: Any = None
    ) -> None:
        """Store ``checkpoint`` at ``path``; returns once it is committed.

        A checkpoint already at ``path`` is replaced, as Lightning expects of a file path
        (``last.ckpt`` is saved over and over): it is deleted first, manifest first, so until
        the new one commits there is no checkpoint at ``path``, never a mixed one.
        """
        if storage_options is not None:
            raise TypeError("StoreCheckpointIO takes store options in its constructor")
        target = CheckpointTarget(path, None, dict(self.options))
        try:
            with self._exclusive(path):
                if background.run(target.store.exists(manifest_key(target.step))):
                    background.run(delete_step(target.store, target.step))
                _save(target.store, target.step, checkpoint)
        finally:
            target.handle.close()

    def load_checkpoint(
        self,
        path: str | os.PathLike[str],
        map_location: Any = None,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load the checkpoint at ``path``, verifying every tensor's crc32c.

        Tensors are created on the CPU; a ``map_location`` that is a device (or its name)
        moves them there, and is passed to ``torch.load`` for the rest of the dict.
        ``weights_only`` is accepted for Lightning's interface but the rest of the dict is
        always loaded with torch's restricted unpickler (see the module docstring).

        Raises:
            FileNotFoundError: no committed checkpoint at ``path``.
            CorruptCheckpointError: the manifest or any byte fails verification.
        """
        target = CheckpointTarget(path, None, dict(self.options))
        try:
            checkpoint = _load(target.store, target.step, weights_only, map_location)
        finally:
            target.handle.close()
        if not isinstance(checkpoint, dict):
            raise CorruptCheckpointError(f"{path}: the checkpoint is not a dict")
        return checkpoint

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Remove the checkpoint at ``path``: its manifest first, then its objects.

        A save of ``path`` still running (under ``AsyncCheckpointIO``) is waited for first.
        Nothing at ``path`` is not an error: Lightning may ask to remove a checkpoint whose
        save is still queued (its own file IO ignores that too).
        """
        target = CheckpointTarget(path, None, dict(self.options))
        try:
            with self._exclusive(path), contextlib.suppress(NotFoundError):
                background.run(delete_step(target.store, target.step))
        finally:
            target.handle.close()


# --------------------------------------------------------------------------- save


def _save(store: Store, step: int, checkpoint: dict[str, Any]) -> None:
    tensors: list[torch.Tensor] = []
    skeleton = _strip_tensors(checkpoint, tensors)
    blob = io.BytesIO()
    torch.save(skeleton, blob)
    arrays = [_as_numpy(t) for t in tensors]
    arrays.append(np.frombuffer(blob.getbuffer(), dtype=np.uint8))
    n = len(tensors)
    flat = FlatState(
        tree={"d": ["tensors", "structure"], "c": [{"l": list(range(n))}, n]},
        paths=[*(f"tensors/{i}" for i in range(n)), "structure"],
        arrays=arrays,
        attrs=[None] * (n + 1),
    )
    background.run(write_checkpoint(store, flat, step=step, metadata={"format": FORMAT}))


def _as_numpy(tensor: torch.Tensor) -> np.ndarray[Any, Any]:
    """A numpy view of a CPU copy-free version of ``tensor``, bfloat16 and float8 included."""
    tensor = tensor.detach().cpu().resolve_conj().resolve_neg().contiguous()
    dtype = numpy_dtype(tensor.dtype)
    if tensor.numel() == 0:
        return np.empty(tuple(tensor.shape), dtype=dtype)
    raw = tensor.reshape(-1).view(torch.uint8).numpy()
    return raw.view(dtype).reshape(tuple(tensor.shape))


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


def _load(store: Store, step: int, weights_only: bool | None, map_location: Any) -> Any:
    source = f"{store.url} step {step}"
    try:
        manifest = background.run(read_manifest(store, step))
    except NotFoundError:
        raise NotFoundError(f"{source}: no committed ckptstore checkpoint") from None
    meta = manifest.metadata
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CorruptCheckpointError(f"{source}: not a Lightning checkpoint written by ckptstore")
    tree = manifest.tree
    n = len(manifest.paths) - 1
    expected = {"d": ["tensors", "structure"], "c": [{"l": list(range(n))}, n]}
    if n < 0 or tree != expected:
        raise CorruptCheckpointError(f"{source}: unexpected tree for a Lightning checkpoint")
    arrays = background.run(read_leaves(store, manifest, range(n + 1)))
    device = map_location if isinstance(map_location, str | torch.device) else None
    tensors = []
    for leaf in range(n):
        tensor = _as_tensor(arrays[leaf], f"{source} {manifest.paths[leaf]}")
        tensors.append(tensor.to(device) if device is not None else tensor)
    structure = torch.load(
        io.BytesIO(arrays[n].tobytes()), map_location=map_location, weights_only=True
    )
    return _restore_tensors(structure, tensors)


def _as_tensor(array: np.ndarray[Any, Any], where: str) -> torch.Tensor:
    dtype = torch_dtype(array.dtype, where)
    if array.size == 0:
        return torch.empty(array.shape, dtype=dtype)
    raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    if not raw.flags.writeable:
        raw = raw.copy()
    return torch.from_numpy(raw).view(dtype).reshape(array.shape)


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
