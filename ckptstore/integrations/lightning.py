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
  ``CheckpointManager.restore`` read the same checkpoint, alike;
* the rest of the dict (structure, counters, hyper-parameters) is in the manifest's tree, as
  in every checkpoint: dicts with str or int keys (an ``OrderedDict`` stays one), lists,
  tuples, JSON scalars (nan and infinities too), torch dtypes and devices. Nothing is
  pickled, so nothing is unpickled on load and Lightning's ``weights_only`` changes nothing;
  a value of any other type (say a ``Namespace`` in the hyper-parameters) is refused on save
  with an error naming its path. Checkpoints of the earlier formats are still read:
  ``ckptstore.lightning/3`` recorded the dtypes, devices and ``OrderedDict`` s in the
  manifest's metadata (before the tree could hold them), ``ckptstore.lightning/2`` kept the
  structure in one tagged-JSON leaf;
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
import logging
import os
import re
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException

from ckptstore import background
from ckptstore.errors import (
    CheckpointFormatError,
    CommitConflictError,
    CorruptCheckpointError,
    NotFoundError,
)
from ckptstore.integrations.dcp_manifest import FORMAT as DCP_FORMAT
from ckptstore.integrations.tensor_objects import CheckpointTarget
from ckptstore.pipeline import save as save_path
from ckptstore.pipeline.codec import map_leaves, rebuild_leaf
from ckptstore.pipeline.restore import Selection, read, rebuild, request
from ckptstore.pipeline.root import aopened, check_options
from ckptstore.pipeline.save import Stager
from ckptstore.pipeline.steps import (
    Manifest,
    delete_step,
    manifest_key,
    read_manifest,
    set_aside_step,
)
from ckptstore.pipeline.tensors import tensor_from_numpy
from ckptstore.store.base import Store
from ckptstore.store.transport import redact_url

__all__ = [
    "SaveOnPreemption",
    "StoreCheckpointIO",
    "checkpoints",
    "last_checkpoint",
    "load_from_checkpoint",
    "roll_back",
]

#: Lightning's names for the ``save_last`` checkpoint: ``last.ckpt``, ``last-v1.ckpt``...
_LAST = re.compile(r"^last(-v?\d+)?\.ckpt$")

_log = logging.getLogger("ckptstore.lightning")

#: Marks a manifest's ``metadata`` as holding a Lightning checkpoint, and its version.
FORMAT = "ckptstore.lightning/4"


class StoreCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves to, loads from and removes at ckptstore URLs.

    A training step is saved once, in increasing order, as on every face: a save whose
    ``global_step`` is below the newest committed checkpoint's in the same directory (a
    script run again from scratch), or equal to it (unless it is a ``last*.ckpt``, or a
    second checkpoint of a step this plugin saved), is refused before anything is written,
    with a :class:`CommitConflictError` naming the newest step and how to resume or roll
    back. Lightning would otherwise write the rerun's
    checkpoints beside the first run's (``step=2-v1.ckpt``), and its ``"last"`` would
    then be whichever was written last. Each directory is read once, at its first save.

    Args:
        rollback: loading a checkpoint (``trainer.fit(ckpt_path=...)``) makes it the newest:
            every committed checkpoint of its directory at a higher ``global_step``
            (``last.ckpt`` included) is set aside first (:func:`roll_back`), so the run
            saves those steps again.
        **options: store options and Settings fields (``pack_threshold``, ``part_size``...),
            as for :func:`ckptstore.open_store`, applied to every path.
    """

    def __init__(self, *, rollback: bool = False, **options: Any) -> None:
        super().__init__()
        check_options(None, options)  # the Settings among them; a backend checks its own
        self.options = options
        self.rollback = rollback
        self._guard = threading.Lock()
        self._busy: dict[str, threading.Lock] = {}
        #: the newest committed global step of each directory saved to, once read
        self._newest: dict[str, int | None] = {}
        #: the global steps this plugin saved, by directory
        self._saved: dict[str, set[int]] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_guard"], state["_busy"], state["_newest"], state["_saved"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._guard = threading.Lock()
        self._busy = {}
        self._newest = {}
        self._saved = {}

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
        found = checkpoint.get("global_step")
        step = found if isinstance(found, int) and not isinstance(found, bool) else None
        if step is not None:
            self._check_step(path, step)
        target = CheckpointTarget(path, None, dict(self.options))
        try:
            with self._exclusive(path):
                if background.run(target.store.exists(manifest_key(target.step))):
                    background.run(delete_step(target.store, target.step))
                _save(target.store, target.step, checkpoint)
        finally:
            target.handle.close()
        if step is not None:
            directory = _split_name(path)[0]
            with self._guard:
                newest = self._newest.get(directory)
                self._newest[directory] = step if newest is None else max(step, newest)
                self._saved.setdefault(directory, set()).add(step)

    def _check_step(self, path: str | os.PathLike[str], step: int) -> None:
        directory, name = _split_name(path)
        with self._guard:
            known = directory in self._newest
        if not known:
            found = checkpoints(directory, **self.options)
            with self._guard:
                self._newest.setdefault(directory, max(found.values(), default=None))
        with self._guard:
            newest = self._newest[directory]
            mine = step in self._saved.get(directory, ())
        # A step is saved again only as last*.ckpt, or by this plugin (Lightning may save
        # several checkpoints of one step: two ModelCheckpoints, an epoch's end)
        if newest is None or step > newest or (step == newest and (_LAST.match(name) or mine)):
            return
        raise CommitConflictError(
            f"{redact_url(os.fspath(path))}: cannot save step {step}: the newest step of this "
            f"root is {newest} (a Lightning checkpoint in {redact_url(directory)}), and a step "
            "is saved once, in increasing order. Resume with trainer.fit(..., "
            "ckpt_path=ckptstore.lightning.last_checkpoint(dirpath)); to go back to an older "
            "step, StoreCheckpointIO(rollback=True) and fit(..., ckpt_path=<its checkpoint>); "
            "or save to a new dirpath"
        )

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
        if self.rollback:
            roll_back(path, **self.options)
            with self._guard:  # read again at the next save
                self._newest.pop(_split_name(path)[0], None)
                self._saved.pop(_split_name(path)[0], None)
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


class SaveOnPreemption(Callback):
    """A last checkpoint when the job is told to stop: Lightning's own SIGTERM handling,
    made a save and a status a scheduler can act on.

    On SIGTERM Lightning finishes the training step it is in and raises
    ``SIGTERMException``, a ``SystemExit`` with status 0, without saving. With this callback
    (beside a ``ModelCheckpoint`` whose ``dirpath`` is a ckptstore URL and
    :class:`StoreCheckpointIO`), that step is saved as the ``ModelCheckpoint`` names it
    (unless it saved that step already), waited for (``AsyncCheckpointIO`` included), and the
    exit status becomes 143 (``128 + SIGTERM``, as for a process the signal killed), so the
    restart (``ckpt_path=last_checkpoint(dirpath)``) resumes from that step. Lightning
    broadcasts the notice to every rank, which all save.

    Args:
        status: the exit status to give the ``SIGTERMException``.
    """

    def __init__(self, status: int = 143) -> None:
        self.status = status

    @staticmethod
    def _parts(trainer: Trainer) -> tuple[ModelCheckpoint, StoreCheckpointIO]:
        found = trainer.checkpoint_callback
        if not isinstance(found, ModelCheckpoint) or found.dirpath is None:
            raise ValueError("SaveOnPreemption needs a ModelCheckpoint with a dirpath")
        io = trainer.strategy.checkpoint_io
        inner = io.checkpoint_io if isinstance(io, AsyncCheckpointIO) else io
        if not isinstance(inner, StoreCheckpointIO):
            raise TypeError(
                "SaveOnPreemption needs StoreCheckpointIO (or AsyncCheckpointIO over it) as the "
                f"Trainer's checkpoint plugin, not {type(inner).__name__}"
            )
        return found, inner

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._parts(trainer)  # refused when fit starts, not at the notice

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        if not isinstance(exception, SIGTERMException):
            return
        found, inner = self._parts(trainer)
        assert found.dirpath is not None
        step = trainer.global_step
        io = trainer.strategy.checkpoint_io
        if step not in checkpoints(found.dirpath, **inner.options).values():
            metrics = {
                **trainer.callback_metrics,
                "epoch": torch.tensor(trainer.current_epoch),
                "step": torch.tensor(step),
            }
            path = found.format_checkpoint_name(metrics)
            trainer.save_checkpoint(path)
            if isinstance(io, AsyncCheckpointIO):
                io.teardown()  # joins its thread: the save is committed, or raises here
        exception.code = self.status
        _log.warning(
            "%s: step %d is durable; stopping on SIGTERM (exit status %d)",
            redact_url(os.fspath(found.dirpath)),
            step,
            self.status,
        )


# --------------------------------------------------------------------------- save


def _save(store: Store, step: int, checkpoint: dict[str, Any]) -> None:
    stager = Stager(leaf_alignment=store.settings.layout.leaf_alignment)
    try:
        # copy=False: CPU tensors are written from their own memory, as the save blocks
        staged = save_path.stage(stager, checkpoint, copy=False)
        try:
            metadata = {"format": FORMAT}
            background.run(save_path.save_staged(store, staged, step=step, metadata=metadata))
        finally:
            staged.release()
    finally:
        stager.close()


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
    # A checkpoint another face saved is read too; only format 3 recorded values aside.
    return _decode_v3(state, meta, source) if form == _FORMAT_V3 else state


# ------------------------------------------------------------------ format 3, read only

#: The format before the tree held torch dtypes, devices and ``OrderedDict`` s: the
#: checkpoint was saved with those as their names (plain dicts), and the manifest's metadata
#: recorded which they were. Never written now; read so that its checkpoints still load.
_FORMAT_V3 = "ckptstore.lightning/3"


def _decode_v3(state: Any, meta: dict[str, Any], source: str) -> Any:
    """Put back what format 3 recorded in the metadata; anything else there is a corrupt
    checkpoint."""
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


# --------------------------------------------------------------- a directory's checkpoints


def _split_name(path: str | os.PathLike[str]) -> tuple[str, str]:
    """A checkpoint path's directory (with the path's query, if any) and name."""
    base, mark, query = os.fspath(path).partition("?")
    directory, _, name = base.rstrip("/").rpartition("/")
    return directory + mark + query, name


def _join(dirpath: str | os.PathLike[str], name: str) -> str:
    base, mark, query = os.fspath(dirpath).partition("?")
    return f"{base.rstrip('/')}/{name}{mark}{query}"


def _global_step(manifest: Manifest) -> int | None:
    """The ``global_step`` a Lightning checkpoint's tree holds as a plain value, if any."""
    tree = manifest.tree
    if not isinstance(tree, dict) or not isinstance(tree.get("d"), list):
        return None
    keys, children = tree["d"], tree.get("c")
    if "global_step" not in keys or not isinstance(children, list):
        return None
    child = children[keys.index("global_step")] if len(children) == len(keys) else None
    value = child.get("v") if isinstance(child, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


async def _acheckpoints(store: Store) -> dict[str, tuple[int, float]]:
    """The committed Lightning checkpoints under ``store``: name -> (global step, when it
    committed)."""
    found: dict[str, tuple[int, float]] = {}
    for prefix in await store.list_prefixes(""):
        name = prefix.rstrip("/")
        if not name.endswith(".ckpt"):
            continue
        try:
            manifest = await read_manifest(store, 0, under=prefix)
        except NotFoundError:
            continue  # not committed: a save in flight, removed, or set aside
        if (step := _global_step(manifest)) is not None:
            found[name] = (step, manifest.created)
    return found


def _newest(found: dict[str, tuple[int, float]]) -> str | None:
    """Of ``found``, the highest step; among equals a ``last*.ckpt``, then the latest."""
    return max(
        found, key=lambda n: (found[n][0], bool(_LAST.match(n)), found[n][1], n), default=None
    )


def checkpoints(dirpath: str | os.PathLike[str], **options: Any) -> dict[str, int]:
    """The committed Lightning checkpoints directly under ``dirpath`` (a ``ModelCheckpoint``'s
    ``dirpath``, on any backend), by name, with the ``global_step`` each holds. Checkpoints
    set aside by :func:`roll_back` and saves still in flight are not among them.

    Args:
        **options: store options, as for :class:`StoreCheckpointIO`.
    """

    async def scan() -> dict[str, tuple[int, float]]:
        async with aopened(os.fspath(dirpath), options) as store:
            return await _acheckpoints(store)

    return {name: step for name, (step, _) in sorted(background.run(scan()).items())}


def roll_back(ckpt_path: str | os.PathLike[str], **options: Any) -> list[str]:
    """Make the checkpoint at ``ckpt_path`` the newest of its directory: every committed
    checkpoint there at a higher ``global_step`` (``last.ckpt`` included) is set aside,
    newest first, as :func:`ckptstore.rollback` sets steps aside: invisible to every face and
    to :func:`last_checkpoint`, its data kept until ``ckptstore gc`` removes it, and
    recoverable with ``ckptstore.recover_step(f"{dirpath}/{name}", 0)``. Then
    ``trainer.fit(model, ckpt_path=ckpt_path)`` trains the newer steps again.
    (``StoreCheckpointIO(rollback=True)`` calls it when Lightning loads the checkpoint.)
    Lightning names a new checkpoint ``step=6-v1.ckpt`` while the set-aside one's data is
    still at ``step=6.ckpt``.

    Returns:
        The names set aside, newest step first.

    Raises:
        NotFoundError: nothing is committed at ``ckpt_path``; nothing is set aside.
        CheckpointFormatError: the checkpoint holds no ``global_step``.
    """
    directory, name = _split_name(ckpt_path)

    async def run() -> list[str]:
        async with aopened(directory, options) as store:
            found = {n: step for n, (step, _) in (await _acheckpoints(store)).items()}
            if name not in found:
                await read_manifest(store, 0, under=f"{name}/")  # NotFoundError if missing
                raise CheckpointFormatError(
                    f"{redact_url(os.fspath(ckpt_path))}: holds no global_step to roll back to"
                )
            newer = sorted(
                (n for n, step in found.items() if step > found[name]),
                key=lambda n: (found[n], n),
                reverse=True,
            )
        for other in newer:  # newest first: a crash leaves a prefix of the run visible
            async with aopened(_join(directory, other), options) as store:
                await set_aside_step(store, 0)
        return newer

    aside = background.run(run())
    if aside:
        _log.warning(
            "rolled %s back to %s: %s set aside", redact_url(directory), name, ", ".join(aside)
        )
    return aside


def last_checkpoint(dirpath: str | os.PathLike[str], **options: Any) -> str | None:
    """The checkpoint to resume from under a ``ModelCheckpoint`` ``dirpath``, on any backend:
    the committed checkpoint with the highest ``global_step`` (among equals a ``last*.ckpt``,
    then the one committed last); ``None`` when there is none (a first run).

    Pass it as ``trainer.fit(model, ckpt_path=last_checkpoint(dirpath))``. Lightning's own
    ``"last"`` lookup works on a local ``dirpath`` but not on ``s3://`` or ``gs://``: it lists
    the directory with fsspec, drops the scheme from what it lists, and then looks for
    ``bucket/...`` on the local disk, so the run silently starts from step 0. It also only
    knows ``last*.ckpt``, which lags a step checkpoint when a job is killed between the two
    saves, and does not exist without ``save_last=True``.

    Args:
        dirpath: the ``ModelCheckpoint``'s ``dirpath``.
        **options: store options, as for :class:`StoreCheckpointIO`.
    """

    async def newest() -> str | None:
        async with aopened(os.fspath(dirpath), options) as store:
            return _newest(await _acheckpoints(store))

    name = background.run(newest())
    return None if name is None else _join(dirpath, name)


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
