"""ckptstore as Lightning's ``CheckpointIO``: checkpoints on any ckptstore URL.

``Trainer(plugins=[StoreCheckpointIO()], callbacks=[ModelCheckpoint(dirpath="s3://b/run")])``
saves each Lightning checkpoint as a ckptstore checkpoint at the path Lightning chooses
(``s3://b/run/epoch=0-step=100.ckpt`` becomes a prefix, not one file):

* it is an ordinary ckptstore checkpoint, step 0 of the root at that path (or step N if the
  path ends in a step number), written by the one save pipeline
  (:func:`ckptstore.pipeline.save.save_flat`), with every dtype the manager stores: small
  tensors packed together, large ones uploaded in parallel parts, every leaf with a crc32c
  that is verified on load, and the manifest written last with one put-if-absent, so a
  checkpoint is visible only once every byte is durable;
* every tensor of the checkpoint dict is one leaf (``tensors/<i>``); the rest of the dict (its
  structure, counters, hyper-parameters), with each tensor replaced by a marker, is one more
  leaf (``structure``) of tagged JSON: dicts (any keys, OrderedDict kept), lists, tuples,
  JSON scalars (nan and infinities too), torch dtypes and devices. Nothing is pickled, so
  nothing is unpickled on load and Lightning's ``weights_only`` changes nothing; a value of
  any other type (say a ``Namespace`` in the hyper-parameters) is refused on save with an
  error naming where it is, and dict subclasses other than OrderedDict load as plain dicts;
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

import collections
import contextlib
import json
import math
import os
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from ckptstore import background
from ckptstore.errors import CorruptCheckpointError, NotFoundError
from ckptstore.integrations.tensor_objects import CheckpointTarget, host_array, torch_dtype
from ckptstore.layout.commit import delete_step, read_manifest
from ckptstore.layout.keys import manifest_key
from ckptstore.layout.restore import read_leaves
from ckptstore.layout.tree import FlatState
from ckptstore.pipeline import save as save_path
from ckptstore.store.base import Store

__all__ = ["StoreCheckpointIO"]

#: Marks a manifest's ``metadata`` as holding a Lightning checkpoint, and its version.
FORMAT = "ckptstore.lightning/2"


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
        moves them there.
        ``weights_only`` is accepted for Lightning's interface and has no effect: nothing
        stored is pickled (see the module docstring).

        Raises:
            FileNotFoundError: no committed checkpoint at ``path``.
            CorruptCheckpointError: the manifest or any byte fails verification.
        """
        target = CheckpointTarget(path, None, dict(self.options))
        try:
            checkpoint = _load(target.store, target.step, map_location)
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
    blob = json.dumps(_encode(checkpoint, tensors), allow_nan=False).encode()
    arrays = [host_array(t) for t in tensors]
    arrays.append(np.frombuffer(blob, dtype=np.uint8))
    n = len(tensors)
    flat = FlatState(
        tree={"d": ["tensors", "structure"], "c": [{"l": list(range(n))}, n]},
        paths=[*(f"tensors/{i}" for i in range(n)), "structure"],
        arrays=arrays,
        attrs=[None] * (n + 1),
    )
    background.run(save_path.save_flat(store, flat, step=step, metadata={"format": FORMAT}))


def _encode(value: Any, tensors: list[torch.Tensor], where: str = "checkpoint") -> Any:
    """``value`` as JSON: every tensor becomes a ``{"t": index}`` marker into ``tensors``,
    containers become tagged objects (``{"d": [[key, value]...]}``, ``{"tuple": [...]}``...),
    so any JSON object in the result is a tag. Anything else is refused, naming where it is:
    ckptstore never pickles, so it never has to unpickle on load."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided:
            raise TypeError(f"{where}: a {value.layout} tensor cannot be stored; make it dense")
        tensors.append(value)
        return {"t": len(tensors) - 1}
    if isinstance(value, list):
        return [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"tuple": [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, dict):
        items = [
            [_encode(k, tensors, f"{where} key {k!r}"), _encode(v, tensors, f"{where}[{k!r}]")]
            for k, v in value.items()
        ]
        return {"od" if isinstance(value, collections.OrderedDict) else "d": items}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    raise TypeError(
        f"{where}: {type(value).__name__} cannot be stored in a ckptstore checkpoint (only "
        "tensors, JSON values, lists, tuples, dicts, torch dtypes and devices; nothing is "
        "pickled)"
    )


# --------------------------------------------------------------------------- load


def _load(store: Store, step: int, map_location: Any) -> Any:
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
    try:
        structure = json.loads(arrays[n].tobytes())
    except ValueError as exc:
        raise CorruptCheckpointError(f"{source}: the checkpoint's structure is not JSON") from exc
    return _decode(structure, tensors)


def _as_tensor(array: np.ndarray[Any, Any], where: str) -> torch.Tensor:
    dtype = torch_dtype(array.dtype, where)
    if array.size == 0:
        return torch.empty(array.shape, dtype=dtype)
    raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    if not raw.flags.writeable:
        raw = raw.copy()
    return torch.from_numpy(raw).view(dtype).reshape(array.shape)


def _decode(value: Any, tensors: list[torch.Tensor]) -> Any:
    """Invert :func:`_encode`; a tag it does not write is a corrupt checkpoint."""
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) != 1:
        raise CorruptCheckpointError(f"unknown entry {value!r} in a Lightning checkpoint")
    ((tag, body),) = value.items()
    if tag == "t":
        if not isinstance(body, int) or isinstance(body, bool) or not 0 <= body < len(tensors):
            raise CorruptCheckpointError(f"tensor marker {body!r} names no stored tensor")
        return tensors[body]
    if tag == "float" and body in ("nan", "inf", "-inf"):
        return float(body)
    if tag == "tuple" and isinstance(body, list):
        return tuple(_decode(v, tensors) for v in body)
    if tag in ("d", "od") and isinstance(body, list):
        if not all(isinstance(kv, list) and len(kv) == 2 for kv in body):
            raise CorruptCheckpointError("malformed dict in a Lightning checkpoint")
        pairs = [(_decode(k, tensors), _decode(v, tensors)) for k, v in body]
        return collections.OrderedDict(pairs) if tag == "od" else dict(pairs)
    if (
        tag == "dtype"
        and isinstance(body, str)
        and isinstance(getattr(torch, body, None), torch.dtype)
    ):
        return getattr(torch, body)
    if tag == "device" and isinstance(body, str):
        return torch.device(body)
    raise CorruptCheckpointError(f"unknown entry {value!r} in a Lightning checkpoint")
