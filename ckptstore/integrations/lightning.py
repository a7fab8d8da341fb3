"""ckptstore as Lightning's ``CheckpointIO``: checkpoints on any ckptstore URL.

``Trainer(plugins=[StoreCheckpointIO()], callbacks=[ModelCheckpoint(dirpath="s3://b/run")])``
saves each Lightning checkpoint as a ckptstore checkpoint at the path Lightning chooses
(``s3://b/run/epoch=0-step=100.ckpt`` becomes a prefix, not one file):

* it is an ordinary ckptstore checkpoint, step 0 of the root at that path (or step N if the
  path ends in a step number), written by the one save pipeline
  (:mod:`ckptstore.pipeline.save`): the checkpoint dict is staged and flattened like any state
  (:mod:`ckptstore.stage`, :mod:`ckptstore.layout.tree`, the one codec every face uses), so
  every tensor is a leaf named by its path (``state_dict/layer.weight``), small tensors are
  packed together, large ones uploaded in parallel parts, every leaf has a crc32c that is
  verified on load, and the manifest is written last with one put-if-absent. Loading is the
  restore path of :mod:`ckptstore.pipeline.restore`; ``ckptstore.load`` and
  ``CheckpointManager.restore`` read the same checkpoint (torch dtypes and devices then
  appear as their names);
* the rest of the dict (structure, counters, hyper-parameters) is JSON in the manifest's tree:
  dicts with str or int keys, lists, tuples, JSON scalars (nan and infinities too). What the
  tree cannot say, Lightning's part of the manifest metadata records: which values were torch
  dtypes or devices, and which dicts were ``OrderedDict`` s, so they come back as such.
  Nothing is pickled, so nothing is unpickled on load and Lightning's ``weights_only``
  changes nothing; a value of any other type (say a ``Namespace`` in the hyper-parameters)
  is refused on save with an error naming its path. Checkpoints of the earlier format
  (``ckptstore.lightning/2``: one tagged-JSON leaf for the structure) are still read;
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
import os
import re
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from ckptstore import background
from ckptstore.errors import CorruptCheckpointError, NotFoundError
from ckptstore.integrations.dcp_manifest import FORMAT as DCP_FORMAT
from ckptstore.integrations.tensor_objects import CheckpointTarget
from ckptstore.layout.commit import delete_step
from ckptstore.layout.keys import manifest_key
from ckptstore.layout.tree import map_leaves
from ckptstore.pipeline import save as save_path
from ckptstore.pipeline.restore import Selection, read, rebuild, request
from ckptstore.pipeline.root import aopened, check_options
from ckptstore.stage import Stager
from ckptstore.stage.stager import rebuild_leaf
from ckptstore.stage.torch import tensor_from_numpy
from ckptstore.stage.tree import expand
from ckptstore.store.base import Store

__all__ = ["StoreCheckpointIO", "last_checkpoint", "load_from_checkpoint"]

#: Lightning's names for the ``save_last`` checkpoint: ``last.ckpt``, ``last-v1.ckpt``...
_LAST = re.compile(r"^last(-v?\d+)?\.ckpt$")

#: Marks a manifest's ``metadata`` as holding a Lightning checkpoint, and its version.
FORMAT = "ckptstore.lightning/3"


class StoreCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves to, loads from and removes at ckptstore URLs.

    Args:
        **options: store options and Settings fields (``pack_threshold``, ``part_size``...),
            as for :func:`ckptstore.open_store`, applied to every path.
    """

    def __init__(self, **options: Any) -> None:
        super().__init__()
        check_options(None, options)  # the Settings among them; a backend checks its own
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
        moves them there. A checkpoint another face saved at ``path`` (``ckptstore.save``,
        ``CheckpointManager``) is read too, if it holds a dict.
        ``weights_only`` is accepted for Lightning's interface and has no effect: nothing
        stored is pickled (see the module docstring).

        Raises:
            FileNotFoundError: no committed checkpoint at ``path``.
            CorruptCheckpointError: the manifest or any byte fails verification.
            CheckpointFormatError: a DCP checkpoint (read it with ``dcp.load``).
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
    plain, extras = _encode(checkpoint)
    stager = Stager(leaf_alignment=store.settings.leaf_alignment)
    try:
        # copy=False: CPU tensors are written from their own memory, as the save blocks
        staged = save_path.stage(stager, plain, copy=False)
        try:
            metadata = {"format": FORMAT, **extras}
            background.run(save_path.save_staged(store, staged, step=step, metadata=metadata))
        finally:
            staged.release()
    finally:
        stager.close()


def _encode(checkpoint: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The checkpoint with torch dtypes and devices as their names, and what the manifest's
    metadata must say to put them (and the ``OrderedDict`` s) back on load."""
    values: dict[str, list[str]] = {}
    ordered: list[str] = []

    def value(path: str, leaf: Any) -> Any:
        if isinstance(leaf, torch.dtype):
            values[path] = ["dtype", str(leaf).removeprefix("torch.")]
            return values[path][1]
        if isinstance(leaf, torch.device):
            values[path] = ["device", str(leaf)]
            return values[path][1]
        return leaf

    def container(path: str, node: Any) -> Any:
        if type(node) is collections.OrderedDict:
            ordered.append(path)
        return node

    plain = map_leaves(value, checkpoint, expand=expand, on_branch=container)
    return plain, {"values": values, "ordered": ordered}


# --------------------------------------------------------------------------- load


def _load(store: Store, step: int, map_location: Any) -> Any:
    source = f"{store.url} step {step}"
    try:
        selection = background.run(read(store, step, request()))
    except NotFoundError:
        raise NotFoundError(f"{source}: no committed ckptstore checkpoint") from None
    meta = selection.manifest.metadata
    form = meta.get("format") if isinstance(meta, dict) else None
    if form == _FORMAT_V2:
        return _load_v2(selection, source, map_location)
    device = map_location if isinstance(map_location, str | torch.device) else None

    # A leaf without attrs is a plain numpy array, except in a DCP checkpoint, whose items
    # carry none and are tensors.
    bare = ("torch", None) if form == DCP_FORMAT else ("torch",)

    def tensor(array: np.ndarray[Any, Any], path: str, attrs: dict[str, Any] | None) -> Any:
        if (attrs or {}).get("framework") not in bare:
            return rebuild_leaf(array, attrs or {}, None, None)
        out = tensor_from_numpy(array)  # on the CPU, as Lightning's own loader gives them
        return out.to(device) if device is not None else out

    state = rebuild(selection, leaf=tensor)
    # A checkpoint another face saved is read too; only this plug-in's records typed values.
    return _decode(state, meta, source) if form == FORMAT else state


def _decode(state: Any, meta: dict[str, Any], source: str) -> Any:
    """Put back what :func:`_encode` recorded in the metadata; anything else there is a
    corrupt checkpoint."""
    values, ordered = meta.get("values"), meta.get("ordered")
    if not isinstance(values, dict) or not isinstance(ordered, list):
        raise CorruptCheckpointError(f"{source}: malformed Lightning metadata")
    wanted = set(ordered)

    def value(path: str, leaf: Any) -> Any:
        entry = values.get(path)
        if entry is None:
            return leaf
        if entry == ["device", leaf] and isinstance(leaf, str):
            return torch.device(leaf)
        if (
            entry == ["dtype", leaf]
            and isinstance(leaf, str)
            and isinstance(getattr(torch, leaf, None), torch.dtype)
        ):
            return getattr(torch, leaf)
        raise CorruptCheckpointError(f"{source}: unknown value {entry!r} at {path!r}")

    def container(path: str, node: Any) -> Any:
        return collections.OrderedDict(node) if path in wanted and type(node) is dict else node

    return map_leaves(value, state, on_branch=container)


# ------------------------------------------------------------------ format 2, read only

#: The format before Lightning checkpoints were ordinary ckptstore trees: every tensor one
#: leaf ``tensors/<i>``, the rest one leaf ``structure`` of tagged JSON. Never written now;
#: read so that checkpoints saved by earlier versions still load.
_FORMAT_V2 = "ckptstore.lightning/2"


def _load_v2(selection: Selection, source: str, map_location: Any) -> Any:
    manifest, arrays = selection.manifest, selection.arrays
    n = len(manifest.paths) - 1
    expected = {"d": ["tensors", "structure"], "c": [{"l": list(range(n))}, n]}
    if n < 0 or manifest.tree != expected:
        raise CorruptCheckpointError(f"{source}: unexpected tree for a Lightning checkpoint")
    device = map_location if isinstance(map_location, str | torch.device) else None
    tensors = []
    for leaf in range(n):
        tensor = tensor_from_numpy(arrays[leaf])
        tensors.append(tensor.to(device) if device is not None else tensor)
    try:
        structure = json.loads(arrays[n].tobytes())
    except ValueError as exc:
        raise CorruptCheckpointError(f"{source}: the checkpoint's structure is not JSON") from exc
    return _decode_v2(structure, tensors)


def _decode_v2(value: Any, tensors: list[torch.Tensor]) -> Any:
    """The tagged JSON of format 2; a tag it does not know is a corrupt checkpoint."""
    if isinstance(value, list):
        return [_decode_v2(v, tensors) for v in value]
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
        return tuple(_decode_v2(v, tensors) for v in body)
    if tag in ("d", "od") and isinstance(body, list):
        if not all(isinstance(kv, list) and len(kv) == 2 for kv in body):
            raise CorruptCheckpointError("malformed dict in a Lightning checkpoint")
        pairs = [(_decode_v2(k, tensors), _decode_v2(v, tensors)) for k, v in body]
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


def last_checkpoint(dirpath: str | os.PathLike[str], **options: Any) -> str | None:
    """The checkpoint ``ckpt_path="last"`` means, under a ``ModelCheckpoint`` ``dirpath`` on
    any backend: of the committed ``last*.ckpt`` checkpoints (``save_last=True``), the one
    committed last; ``None`` when there is none (a first run).

    Pass it as ``trainer.fit(model, ckpt_path=last_checkpoint(dirpath))``. Lightning's own
    ``"last"`` lookup works on a local ``dirpath`` but not on ``s3://`` or ``gs://``: it lists
    the directory with fsspec, drops the scheme from what it lists, and then looks for
    ``bucket/...`` on the local disk, so the run silently starts from step 0.

    Args:
        dirpath: the ``ModelCheckpoint``'s ``dirpath``.
        **options: store options, as for :class:`StoreCheckpointIO`.
    """

    async def newest() -> str | None:
        async with aopened(os.fspath(dirpath), options) as store:
            names = [
                p.rstrip("/") for p in await store.list_prefixes("") if _LAST.match(p.rstrip("/"))
            ]
            when: dict[str, float] = {}
            for name in names:
                try:
                    meta = await store.head(f"{name}/{manifest_key(0)}")
                except NotFoundError:
                    continue  # not committed (a save in flight, or removed meanwhile)
                when[name] = meta.last_modified or 0.0
        if not when:
            return None
        base = os.fspath(dirpath)
        path, mark, query = base.partition("?")
        return f"{path.rstrip('/')}/{max(when, key=lambda n: (when[n], n))}{mark}{query}"

    return background.run(newest())


def load_from_checkpoint(
    cls: type[Any],
    path: str | os.PathLike[str],
    *,
    map_location: Any = None,
    store_options: dict[str, Any] | None = None,
    **kwargs: Any,
) -> Any:
    """``cls.load_from_checkpoint`` for a checkpoint :class:`StoreCheckpointIO` saved.

    Lightning's ``LightningModule.load_from_checkpoint(path)`` reads ``path`` as one file with
    ``torch.load`` and fails on a ckptstore checkpoint (``EOFError`` on s3://,
    ``IsADirectoryError`` on a local disk). This reads it with :class:`StoreCheckpointIO`,
    every byte verified, and hands the checkpoint to ``cls.load_from_checkpoint`` as an
    in-memory file, so hyperparameters, ``on_load_checkpoint`` and ``strict`` work as
    Lightning defines them. Memory: the checkpoint is held twice while it is handed over.

    Args:
        cls: the ``LightningModule`` (or ``LightningDataModule``) class.
        path: the checkpoint's URL or path.
        map_location, **kwargs: what ``cls.load_from_checkpoint`` takes (``strict``,
            ``hparams_file``, hyperparameters to override).
        store_options: store options, as for :class:`StoreCheckpointIO`.
    """
    import io

    checkpoint = StoreCheckpointIO(**(store_options or {})).load_checkpoint(path)
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    del checkpoint
    buffer.seek(0)
    return cls.load_from_checkpoint(buffer, map_location=map_location, **kwargs)
