"""The one restore path: select -> read -> verify -> rebuild.

Every face that reads a checkpoint (``ckptstore.load``, ``CheckpointManager.restore``,
``ckptstore.distributed.load``, the Lightning plug-in; the DCP reader for its byte ranges)
goes through these stages, so they agree on what a request means and on what goes wrong:

1. **select** (:func:`select`): which leaves of a committed step the caller wants. One rule on
   every face:

   * ``keys``: a leaf path (``"model/layer0/w"``) or a prefix (``"model"``), or a list of
     them; only their bytes are read. Each key must name something in the step: a key that
     matches nothing raises :class:`~ckptstore.errors.NotFoundError` naming every such key
     (a typo is never silently dropped). An empty list is a ``ValueError``.
   * ``target``: ``"numpy"``, ``"torch"`` or ``"jax"`` makes every array that; a state (a
     nest of arrays, ``jax.ShapeDtypeStruct`` s and placeholders such as ``None``) names what
     to read (its leaves' paths, when ``keys`` is not given, each of which must exist, as a
     key would), gives each array's type, dtype and placement, and the result is built in the
     target's own containers: named tuples, dataclasses, registered JAX pytree nodes (an
     optax state, a flax ``TrainState``) come back as themselves. A target leaf that is a
     shard of a global array (a :class:`~ckptstore.stage.shards.Shard`, a ``DTensor``, a
     JAX array or shape struct with a sharding that splits it) asks for the boxes its shard
     covers: only the bytes of those boxes are read (:mod:`ckptstore.layout.chunks`).

   A checkpoint another face wrote in its own format (DCP's) is refused here with
   :class:`~ckptstore.errors.CheckpointFormatError` naming the face that reads it.
2. **read** and **verify**: :func:`ckptstore.layout.restore.read_leaves` fetches exactly the
   selected byte ranges, in parallel, straight into the destination arrays, and checks every
   crc32c before anything is returned.
3. **rebuild** (:func:`rebuild`): each host array becomes the array the caller asked for
   (:func:`ckptstore.stage.stager.rebuild_leaf`: framework, device, dtype, sharding), and the
   structure is put back (:func:`ckptstore.layout.tree.unflatten`).

:func:`request` checks what was asked before any I/O (so a face can refuse bad arguments
before its collectives); :func:`read` runs stages 1-2 on the event loop; :func:`rebuild` runs
in the caller's thread,
since building tensors on a device is not the loop's work. :func:`arestore` and
:func:`restore` chain them for async and sync callers. A face that runs collectives between
the stages (``ckptstore.distributed.load``, whose ranks read shared leaves once and send
them to each other: :mod:`ckptstore.manager.broadcast`) calls :func:`select_step`, then
:func:`read_selected` for the leaves it reads itself, and :func:`rebuild` once the other
leaves' arrays are in the selection.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ckptstore import background
from ckptstore.errors import CheckpointFormatError, NotFoundError
from ckptstore.layout.chunks import Box
from ckptstore.layout.commit import latest_step, read_manifest
from ckptstore.layout.manifest import Manifest
from ckptstore.layout.restore import Pieces, empty_array, read_leaves
from ckptstore.layout.tree import flatten, iter_leaves, select_paths, unflatten
from ckptstore.pipeline.deadline import bounded
from ckptstore.pipeline.streaming import Reader, Streamed, is_optimizer_path
from ckptstore.stage.shards import rebuild_pieces, wanted_boxes
from ckptstore.stage.stager import (
    ArrayKind,
    kind_named,
    leaf_error,
    rebuild_leaf,
    saved_kind,
    target_kind,
)
from ckptstore.stage.tree import expand
from ckptstore.store.base import Store
from ckptstore.store.transport import store_logger

#: One INFO record per restore (docs/reference.md, "Logging"), redacted like every record.
_log = store_logger("ckptstore.restore")

__all__ = [
    "LeafRestore",
    "Request",
    "Selection",
    "arestore",
    "find_manifest",
    "later_reader",
    "missing_keys",
    "read",
    "read_leaves",
    "read_selected",
    "rebuild",
    "request",
    "restore",
    "select",
    "select_paths",
    "select_step",
]

#: A face's own way to turn one restored host array into its value:
#: ``leaf(array, path, attrs)``, with the attrs its saver stored.
LeafRestore = Callable[[np.ndarray[Any, Any], str, dict[str, Any] | None], Any]

#: Formats of manifests that only one face can read, by the prefix of their metadata
#: ``format``, with what reads them (DCP's writer flattens the state to DCP's names and
#: serialises non-tensor values with ``torch.save``; only DCP's planner puts them back).
_OWN_FACE = {
    "ckptstore.dcp/": "torch.distributed.checkpoint.load(..., storage_reader="
    "ckptstore.dcp.Reader(url))",
}


@dataclass(slots=True)
class Selection:
    """What a restore reads from one committed step, and how it rebuilds it.

    Attributes:
        manifest: the step's validated manifest.
        where: the store URL, for messages.
        asked: the request it answers.
        leaves: indices of the array leaves to read.
        accept: the path predicate of the selection (``None``: everything).
        arrays: the verified host arrays by leaf index, once :func:`read` has run (for a
            leaf a target asked for in parts, its :class:`~ckptstore.layout.restore.Pieces`).
        later: with a streaming request, the selected leaves read in the background after
            the state is returned (:mod:`ckptstore.pipeline.streaming`); the others are
            :meth:`first`.
        stream: the background part, once :func:`rebuild` has started it.
    """

    manifest: Manifest
    where: str
    asked: Request
    leaves: list[int]
    accept: Callable[[str], bool] | None = None
    arrays: dict[int, Any] = field(default_factory=dict)
    later: list[int] = field(default_factory=list)
    stream: Streamed | None = None

    def first(self) -> list[int]:
        """The selected leaves read before the restore returns (all, unless it streams)."""
        if not self.later:
            return self.leaves
        later = set(self.later)
        return [leaf for leaf in self.leaves if leaf not in later]

    def boxes(self) -> dict[int, list[Box]]:
        """By leaf index, the boxes a target asks for of the leaves it wants in parts (its
        shards of sharded leaves); a face reads those leaves on the rank that asked."""
        if not self.asked.boxes:
            return {}
        index = {path: i for i, path in enumerate(self.manifest.paths)}
        return {index[p]: boxes for p, boxes in self.asked.boxes.items() if p in index}


async def find_manifest(store: Store, step: int | None) -> Manifest:
    """The validated manifest of ``step`` (``None``: the newest committed step).

    Raises:
        NotFoundError: nothing committed, or no such step.
        CorruptCheckpointError: the manifest fails validation.
    """
    if step is None:
        step = await latest_step(store)
        if step is None:
            raise NotFoundError(f"{store.url}: no committed checkpoint")
    return await read_manifest(store, step)


def _is_target_leaf(node: Any) -> bool:
    return target_kind(node) is not None


def missing_keys(known: Sequence[str], keys: Iterable[str]) -> list[str]:
    """The keys that name none of the paths ``known`` (sorted), neither one of them nor a
    prefix of one: the one rule of what a key names (``""`` names every path, if any).
    :func:`select_paths` is its partner: which paths a key selects."""
    missing = []
    for key in keys:
        if key == "" and known:
            continue
        at = bisect.bisect_left(known, key)
        if at < len(known) and known[at] == key:
            continue
        at = bisect.bisect_left(known, key + "/")
        if at < len(known) and known[at].startswith(key + "/"):
            continue
        missing.append(key)
    return missing


def _missing(manifest: Manifest, keys: list[str]) -> list[str]:
    """The keys that name no leaf (nor any prefix of one) of ``manifest``."""
    return missing_keys(sorted(manifest.all_paths()), keys)


def _as_keys(keys: str | Iterable[str]) -> list[str]:
    wanted = [keys] if isinstance(keys, str) else list(keys)
    bad = [key for key in wanted if not isinstance(key, str)]
    if bad:
        raise TypeError(f"keys are leaf paths or prefixes (str), not {bad[0]!r}")
    if not wanted:
        raise ValueError("keys is empty: nothing to load (keys=None loads every leaf)")
    return wanted


@dataclass(slots=True)
class Request:
    """What a caller asked of a restore, checked before any I/O (see :func:`request`).

    Attributes:
        keys: the paths and prefixes to read (``None``: every leaf).
        kind: the array kind every array becomes (a ``target`` string), or ``None``.
        like: the target state the result is built in, or ``None``.
        likes: target leaves by path, when a state target gives types but ``keys`` select.
        boxes: by path, the boxes of the leaves a target asks for in parts (its shards).
        stream: a streaming restore (:mod:`ckptstore.pipeline.streaming`): the call returns
            once the first part is read, and the rest is read in the background.
        first: with ``stream``, the keys of the first part (``None``: every leaf but the
            optimizer's state).
    """

    keys: list[str] | None = None
    kind: ArrayKind | None = None
    like: Any = None
    likes: dict[str, Any] = field(default_factory=dict)
    boxes: dict[str, list[Box]] = field(default_factory=dict)
    stream: bool = False
    first: list[str] | None = None


def request(
    keys: str | Iterable[str] | None = None,
    target: Any = None,
    stream: bool | str | Iterable[str] = False,
) -> Request:
    """Check ``keys``, ``target`` and ``stream`` (see the module docstring for the rule, and
    :mod:`ckptstore.pipeline.streaming` for ``stream``), before any I/O.

    Raises:
        ValueError: ``keys`` or ``stream`` is empty, a target state holds no leaves, or an
            unknown framework name.
        TypeError: a key that is not a string, or a ``stream`` that is neither a bool nor keys.
    """
    asked = Request()
    if stream is True:
        asked.stream = True
    elif isinstance(stream, str) or (
        stream is not False and stream is not None and isinstance(stream, Iterable)
    ):
        asked.stream, asked.first = True, _as_keys(stream)
    elif stream is not False and stream is not None:
        raise TypeError(
            f"stream is True (every leaf but the optimizer's state first), False, or the keys "
            f"to read before returning, not {stream!r}"
        )
    if isinstance(target, str):
        asked.kind = kind_named(target)
    elif target is not None:
        leaves = list(iter_leaves(target, expand=expand, is_leaf=_is_target_leaf))
        for path, leaf in leaves:
            boxes = wanted_boxes(leaf)
            if boxes is not None:
                asked.boxes[path] = boxes
        if keys is None:
            if not leaves:
                raise ValueError("the restore target holds no leaves to load")
            asked.keys, asked.like = [path for path, _ in leaves], target
        else:
            asked.likes = dict(leaves)
    if keys is not None:
        asked.keys = _as_keys(keys)
    return asked


def select(manifest: Manifest, where: str, asked: Request) -> Selection:
    """Stage 1: which leaves of ``manifest`` the request reads.

    Raises:
        NotFoundError: a key, or a leaf of a target state, that names nothing in the step;
            the message names every such key.
        CheckpointFormatError: the checkpoint is in a format only another face reads.
    """
    meta = manifest.metadata
    form = meta.get("format") if isinstance(meta, dict) else None
    for prefix, reader in _OWN_FACE.items():
        if isinstance(form, str) and form.startswith(prefix):
            raise CheckpointFormatError(
                f"{where}: step {manifest.step} is a {form} checkpoint; read it with {reader}"
            )
    selection = Selection(manifest, where, asked, list(range(len(manifest.paths))))
    if asked.keys is not None:
        missing = _missing(manifest, asked.keys)
        if missing:
            named = ", ".join(repr(key) for key in missing[:5])
            if len(missing) > 5:
                named += f" and {len(missing) - 5} more"
            known = sorted(manifest.all_paths())
            raise NotFoundError(
                f"{where}: step {manifest.step} has no leaf {named} (its paths look like "
                f"{known[:3]})"
            )
        accept = select_paths(asked.keys)
        selection.accept = accept
        selection.leaves = [i for i, path in enumerate(manifest.paths) if accept(path)]
    if asked.stream:
        selection.later = _later(selection)
    return selection


def _later(selection: Selection) -> list[int]:
    """The leaves a streaming request reads in the background (see
    :mod:`ckptstore.pipeline.streaming` for the rule)."""
    manifest, asked = selection.manifest, selection.asked
    paths = manifest.paths
    if asked.first is not None:
        missing = _missing(manifest, asked.first)
        if missing:
            raise NotFoundError(
                f"{selection.where}: step {manifest.step} has no leaf "
                f"{', '.join(repr(key) for key in missing[:5])} to read first (stream=)"
            )
        first = select_paths(asked.first)
        later = [i for i in selection.leaves if not first(paths[i])]
    else:
        later = [i for i in selection.leaves if is_optimizer_path(paths[i])]
    boxed = selection.boxes()  # a target's shards: rebuilt from their pieces at once
    return [i for i in later if i not in boxed and len(manifest.shapes[i]) > 0]


async def read(
    store: Store,
    step: int | None,
    asked: Request,
    *,
    into: Any = None,
    manifest: Manifest | None = None,
) -> Selection:
    """Stages 1 and 2: select, then read and verify the selected leaves.

    Args:
        store: the store of the run's root.
        step: the step (``None``: the newest committed one).
        asked: what to read (:func:`request`).
        into: a state of numpy arrays to fill in place, matched by path (dtype and shape
            must equal the checkpoint's); they become the result's arrays.
        manifest: the step's manifest, if the caller has already read it from ``store``
            (as :func:`find_manifest` does: validated); it is not read again.

    Raises:
        NotFoundError: no such step, a key or target leaf naming nothing, or a leaf of
            ``into`` the step lacks.
        CorruptCheckpointError: the manifest or any byte read fails verification.
        DeadlineExceededError: the restore took longer than ``Settings.restore_deadline``.
    """
    return await bounded(
        _read(store, step, asked, into, manifest),
        seconds=store.settings.layout.restore_deadline,
        what=f"restore of {'the newest step' if step is None else f'step {step}'} from {store.url}",
        setting="restore_deadline",
    )


async def _read(
    store: Store, step: int | None, asked: Request, into: Any, manifest: Manifest | None
) -> Selection:
    began = time.monotonic()
    if manifest is not None and step is not None and manifest.step != step:
        raise ValueError(f"the manifest given is step {manifest.step}'s, not step {step}'s")
    selection = (
        select(manifest, store.url, asked)
        if manifest is not None
        else await select_step(store, step, asked)
    )
    manifest = selection.manifest
    fill: dict[int, np.ndarray[Any, Any]] = {}
    if into is not None:
        index = {path: i for i, path in enumerate(manifest.paths)}
        given = flatten(into, expand=expand)
        for path, array in zip(given.paths, given.arrays, strict=True):
            if path not in index:
                raise NotFoundError(
                    f"{store.url}: step {manifest.step} has no array leaf {path!r} to fill into"
                )
            fill[index[path]] = array
    for leaf in selection.later:  # the background part reads into the caller's arrays too
        if leaf in fill:
            have, shape = fill[leaf], tuple(manifest.shapes[leaf])
            if have.dtype != manifest.dtype(leaf) or have.shape != shape:
                raise ValueError(
                    f"into[{manifest.paths[leaf]!r}] is {have.dtype}{list(have.shape)}, but "
                    f"the checkpoint holds {manifest.dtype(leaf)}{list(shape)}"
                )
            selection.arrays[leaf] = have
    await read_selected(store, selection, into=fill)
    if _log.isEnabledFor(logging.INFO):
        seconds = time.monotonic() - began
        later = set(selection.later)
        nbytes = sum(
            int(a.nbytes)
            for i, a in selection.arrays.items()
            if i not in later and hasattr(a, "nbytes")
        )
        _log.info(
            "restored step %d from %s: %d of %d leaves, %.1f MiB read and verified in %.2f s, "
            "%.1f MiB/s%s",
            manifest.step,
            store.url,
            len(selection.leaves) - len(selection.later),
            len(manifest.paths),
            nbytes / 2**20,
            seconds,
            nbytes / 2**20 / max(seconds, 1e-6),
            f"; {len(selection.later)} more in the background" if selection.later else "",
        )
    return selection


async def select_step(store: Store, step: int | None, asked: Request) -> Selection:
    """Stage 1 on a store: the step's validated manifest and what ``asked`` selects of it.

    Raises:
        NotFoundError: no such step, or a key or target leaf naming nothing.
        CorruptCheckpointError: the manifest fails validation.
        CheckpointFormatError: the checkpoint is in a format only another face reads.
    """
    return select(await find_manifest(store, step), store.url, asked)


async def read_selected(
    store: Store,
    selection: Selection,
    *,
    leaves: Sequence[int] | None = None,
    into: Mapping[int, np.ndarray[Any, Any]] | None = None,
) -> None:
    """Stage 2: read and verify ``leaves`` (default: every selected leaf) into
    ``selection.arrays``. A face that gets some leaves another way (a multi-rank load, where
    one rank reads a shared leaf for all) reads the rest here and adds its own arrays.

    Args:
        store: the store the selection's manifest came from.
        selection: what :func:`select` chose.
        leaves: the leaf indices to read, a subset of ``selection.leaves`` (default: its
            :meth:`~Selection.first` part).
        into: arrays to read into, by leaf index (dtype and shape as the checkpoint's).

    Raises:
        CorruptCheckpointError: anything read fails verification.
    """
    wanted = selection.first() if leaves is None else leaves
    boxes = selection.boxes()
    selection.arrays.update(
        await read_leaves(
            store,
            selection.manifest,
            wanted,
            into,
            {leaf: boxes[leaf] for leaf in wanted if leaf in boxes},
        )
    )


def rebuild(
    selection: Selection,
    *,
    leaf: LeafRestore | None = None,
    store: Store | None = None,
    owned: bool = False,
    reader: Reader | None = None,
) -> Any:
    """Stage 3: the state :func:`read` read, its arrays as asked, in the asked structure.

    For a streaming request it also starts the background part
    (:mod:`ckptstore.pipeline.streaming`): its leaves are built around the host arrays they
    will be read into, and read from ``store`` once the state is built.

    Args:
        selection: what :func:`read` returned.
        leaf: the face's own rebuild of each array leaf (replaces the target's rule).
        store: where a streaming request's background part is read from.
        owned: the face opened ``store`` for this restore: the background part closes it
            when it ends (``selection.stream`` is set when it took the store over).
        reader: how the background part reads (default: :func:`later_reader` of ``store``);
            a tiered manager's falls back to its persistent tier.

    Raises:
        ValueError: a target leaf's shape differs from the checkpoint's (named by path).
    """
    manifest, asked = selection.manifest, selection.asked
    paths, attrs = manifest.paths, manifest.attrs
    later: Streamed | None = None
    if selection.later:
        if store is None:
            raise ValueError("a streaming restore's rebuild needs the store it reads from")
        later = Streamed(selection.where, manifest.step, paths)
        for index in selection.later:
            if index not in selection.arrays:
                shape = tuple(manifest.shapes[index])
                selection.arrays[index] = empty_array(shape, manifest.dtype(index))
    deferred = set(selection.later)

    kinds: dict[str, ArrayKind] = {}  # by saved framework; a restore runs this per leaf
    # A numpy array saved with no attributes and asked for as saved or as numpy is itself:
    # returned before the general rule, which cost 20,000-leaf restores 1 us a leaf.
    plain = (
        leaf is None
        and later is None
        and not asked.likes
        and (asked.kind is None or asked.kind.name == "numpy")
    )

    def restore_leaf(array: Any, index: int, like: Any) -> Any:
        if plain and like is None and attrs[index] is None and type(array) is np.ndarray:
            return array
        if leaf is not None:
            if later is not None and index in deferred:
                return later.hold(
                    index,
                    array,
                    lambda host: leaf(host, paths[index], attrs[index]),
                    immutable=False,
                )
            return leaf(array, paths[index], attrs[index])
        if like is None and asked.likes:
            like = asked.likes.get(paths[index])
        leaf_attrs = attrs[index] or {}
        try:
            if isinstance(array, Pieces):
                return rebuild_pieces(array, leaf_attrs, like)
            kind: ArrayKind | None = None
            if like is None or asked.kind is not None:
                kind = asked.kind
                if kind is None:  # as saved
                    name = leaf_attrs.get("framework", "numpy")
                    known = kinds.get(name) if isinstance(name, str) else None
                    kind = known or kinds.setdefault(str(name), saved_kind(leaf_attrs))
            if later is None or index not in deferred:
                if kind is None:
                    return rebuild_leaf(array, leaf_attrs, None, like)
                return kind.rebuild(array, leaf_attrs, None)

            def build(host: Any) -> Any:
                if kind is None:
                    return rebuild_leaf(host, leaf_attrs, None, like)
                return kind.rebuild(host, leaf_attrs, None)

            if like is not None:  # a placeholder is built later: check its shape now
                _check_shape(like, array)
            immutable = _is_jax(kind if kind is not None else target_kind(like))
            return later.hold(index, array, build, immutable=immutable)
        except (ValueError, TypeError) as exc:  # named by its leaf; a damaged checkpoint's
            # error stays a CorruptCheckpointError
            where = f"{selection.where}: step {manifest.step}, leaf {paths[index]!r}"
            raise leaf_error(exc, where) from None

    # Every leaf a plain numpy array given back as it is, no target to check it against: no
    # call per leaf at all.
    as_is = (
        plain
        and asked.like is None
        and not asked.boxes
        and attrs.count(None) == len(attrs)
        and not set(map(type, selection.arrays.values())) - {np.ndarray}
    )
    state = _unflatten(selection, None if as_is else restore_leaf)
    if later is not None and store is not None:
        read_later = reader if reader is not None else later_reader(store, selection)
        later.start(read_later, close=store.close if owned else None)
        selection.stream = later
    return state


def _is_jax(kind: ArrayKind | None) -> bool:
    return kind is not None and kind.name == "jax"


def _check_shape(like: Any, array: Any) -> None:
    like_shape = getattr(like, "shape", None)
    if like_shape is not None and tuple(like_shape) != tuple(array.shape):
        raise ValueError(
            f"the restore target has shape {tuple(like_shape)}, the checkpoint {array.shape}"
        )


def later_reader(store: Store, selection: Selection) -> Reader:
    """How a streaming restore's background part reads its leaves (bounded by the restore
    deadline, as the first part is)."""
    manifest = selection.manifest

    async def read_later(leaves: list[int], into: dict[int, np.ndarray[Any, Any]]) -> None:
        await bounded(
            read_leaves(store, manifest, leaves, into),
            seconds=store.settings.layout.restore_deadline,
            what=f"background part of the restore of step {manifest.step} from {store.url}",
            setting="restore_deadline",
        )

    return read_later


def _unflatten(selection: Selection, restore_leaf: Callable[[Any, int, Any], Any] | None) -> Any:
    manifest, asked = selection.manifest, selection.asked
    if asked.like is not None:
        return unflatten(
            manifest.tree,
            selection.arrays,
            selected=selection.accept,
            restore=restore_leaf,
            like=asked.like,
            expand=expand,
            is_leaf=_is_target_leaf,
        )
    return unflatten(
        manifest.tree, selection.arrays, selected=selection.accept, restore=restore_leaf
    )


async def arestore(
    store: Store,
    step: int | None,
    asked: Request,
    *,
    into: Any = None,
    leaf: LeafRestore | None = None,
) -> Any:
    """The whole restore path from a coroutine: :func:`read`, then :func:`rebuild`."""
    return rebuild(await read(store, step, asked, into=into), leaf=leaf)


def restore(store: Store, step: int | None, asked: Request) -> Any:
    """The whole restore path for a synchronous caller: the reads on the background loop,
    the rebuild in the calling thread (and, for a streaming request, the background part on
    a thread of its own, reading from ``store``)."""
    return rebuild(background.run(read(store, step, asked)), store=store)
