"""Copying the arrays of a state into host buffers that ckptstore owns.

This is the only part of an async save that blocks the training loop, so it is built to run at
memcpy speed: every array leaf gets a slot in one pooled arena (:mod:`ckptstore.store.buffers`), so
steady-state saves take no page faults; large leaves are split into chunks and copied by a few
threads (the copies release the GIL); small host arrays are copied many to a call
(:func:`_copy_tasks`), not one copy each; leaves on an accelerator start their device-to-host
transfers before any is waited for. When :meth:`Stager.stage` returns, mutating or freeing the
source arrays can no longer change what is written (for CUDA sources: once
:meth:`StagedState.wait_ready` returns, which the writer calls before it reads a byte; the copies
are ordered on the source's stream, so the training loop's later kernels on that stream cannot
overtake them).

A *lazy* stage (``Stager.stage(state, lazy=True)``) walks the state, takes each leaf's
mutation counter and lays the arena out in the call, like an eager one, but leaves the copies
to a background thread (:mod:`ckptstore.stage.lazy`), and with them the making of each leaf's
slot in the arena, which the flat view shows once the copy is done: the call returns at once
and the copy overlaps whatever the caller does next, until something fences it.

Each framework is an :class:`ArrayKind` in its own module (``numpy``, ``torch``, ``jax``),
imported only when that framework is already imported by the caller, so staging a numpy state
never imports torch or JAX.
"""

from __future__ import annotations

import functools
import math
import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from numpy.typing import NDArray

from ckptstore.config import default_settings
from ckptstore.errors import CorruptCheckpointError
from ckptstore.layout.tree import FlatState, flatten
from ckptstore.stage.tree import Path, expand, iter_leaves, map_leaves
from ckptstore.store.buffers import (
    NATIVE_COPY,
    PAGE,
    BufferPool,
    HostBuffer,
    align_up,
    copy_into,
)
from ckptstore.threads import Pool, collection_paused

if TYPE_CHECKING:
    from ckptstore.stage.lazy import LazyCopy

__all__ = [
    "ArrayKind",
    "CopyTask",
    "DeviceCopies",
    "LeafSpec",
    "StagedState",
    "Stager",
    "pinned_memory",
]

#: Leaves of at least this many bytes start on a page boundary of the arena (PAGE), so
#: a local store writes them with O_DIRECT straight from the arena, without a bounce copy;
#: smaller ones are only aligned to ``Settings.leaf_alignment``.
PAGE_ALIGN_MIN = 64 << 10

#: One copy of a staging plan: ``(bytes the host's CPU moves for it, the copy)``: 0 for a
#: copy that a device's copy engine makes, which the thread only queues. The copy may be an object
#: whose class defines ``run_many(copies)``: consecutive copies of that class are then run by
#: one ``run_many`` call (torch copies a batch with one ``torch._foreach_copy_``, which releases
#: the GIL once for the batch instead of once per tensor).
CopyTask = tuple[int, Callable[[], None]]


# Not frozen: a frozen dataclass's __init__ sets each field through object.__setattr__, which
# cost about 1 us per leaf of every save (measured on 20,000 leaves); nothing mutates a spec.
@dataclass(slots=True)
class LeafSpec:
    """What the stager needs to know of one array leaf before copying it.

    Attributes:
        dtype: the numpy dtype of its host copy (``ml_dtypes`` types for bfloat16, float8...).
        shape: its shape.
        attrs: JSON-able facts restore needs (framework, device, requires_grad...);
            ``None`` for a plain numpy array, which needs none.
        pinned: its host copy should be page-locked (the source is on a CUDA device).
    """

    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    attrs: dict[str, Any] | None
    pinned: bool = False

    @property
    def nbytes(self) -> int:
        # math.prod, not np.prod: this runs for every leaf of every save, and np.prod's
        # ~2 us a call was a tenth of the staging overhead of a 200-leaf state.
        return math.prod(self.shape) * self.dtype.itemsize


class DeviceCopies(ABC):
    """The accelerator half of one lazy snapshot: copies issued from a background thread on
    streams of their own, ordered after what the caller had queued when it saved.

    Made in the caller's thread by :meth:`ArrayKind.device_copies` (where it records what the
    copies must wait for); its copies are issued, and :meth:`issued` called, by the background
    thread; :meth:`order` and :meth:`wait` are the two ways to wait for them.
    """

    @abstractmethod
    def owns(self, leaf: Any) -> bool:
        """Whether ``leaf`` lives on one of this snapshot's devices (else it is a host leaf)."""

    @abstractmethod
    def copies(self, leaf: Any, dst: NDArray[Any]) -> list[CopyTask]:
        """Tasks that issue the copy of ``leaf`` (one it owns) into ``dst``."""

    @abstractmethod
    def issued(self) -> None:
        """Called once every copy was issued (in the background thread)."""

    @abstractmethod
    def order(self) -> None:
        """Make the caller's later device work run after the copies, without blocking the
        host (the fence of a training loop)."""

    @abstractmethod
    def wait(self) -> None:
        """Block until the copies have landed in host memory (the writer's wait)."""


class ArrayKind(ABC):
    """How one framework's arrays are staged to host memory and rebuilt on restore."""

    #: The name recorded as the ``framework`` attribute of each leaf and accepted as a target.
    name: ClassVar[str]

    @abstractmethod
    def owns(self, leaf: Any) -> bool:
        """Whether ``leaf`` is an array of this framework.

        The answer must follow from ``type(leaf)`` alone (an ``isinstance`` check): a stage asks
        once per leaf type and reuses the answer for every leaf of that type."""

    def start(self, leaves: list[Any]) -> None:
        """Begin asynchronous device-to-host transfers of ``leaves`` before any is copied."""
        return None

    @abstractmethod
    def spec(self, leaf: Any) -> LeafSpec:
        """Dtype, shape and attributes of ``leaf``; raises ``TypeError`` if it cannot be staged."""

    @abstractmethod
    def copies(self, leaf: Any, dst: NDArray[Any], chunk_bytes: int) -> list[CopyTask]:
        """Tasks that together copy ``leaf`` into ``dst`` (same dtype and shape as its spec).

        Tasks may run concurrently on several threads; each must release the GIL while it
        copies. Large contiguous leaves are split into tasks of about ``chunk_bytes``.
        """

    def fence(self, leaves: list[Any]) -> Callable[[], None] | None:
        """Called after every copy was issued; returns what waits for asynchronous ones."""
        return None

    def host_view(self, leaf: Any) -> NDArray[Any] | None:
        """``leaf`` itself as a host array, without a copy, if it lives in host memory."""
        return None

    def host_address(self, leaf: Any) -> int | None:
        """The address of ``leaf``'s bytes if they lie in host memory, C-contiguous, as the
        arena holds them (no conjugate or negative view): a small such leaf is copied with
        others in one call (:func:`_copy_tasks`) instead of by :meth:`copies`. ``None``
        (the default) for any other leaf. (A numpy array of one of numpy's own dtypes goes
        into that call through its buffer, without being asked.)"""
        return None

    def version(self, leaf: Any) -> int | None:
        """``leaf``'s mutation counter now, for a lazy snapshot to check after its copy, or
        ``None`` if this framework keeps none: such a leaf is copied in the ``save()`` call
        even in a lazy snapshot, since a change to it could not be detected."""
        return None

    def lost(self, leaf: Any, version: int) -> str | None:
        """Why ``leaf`` may no longer hold what it held when :meth:`version` returned
        ``version`` (modified in place, deleted), as the end of a sentence naming the leaf;
        ``None`` if it holds it still."""
        return None

    def device_copies(self, leaves: list[Any]) -> DeviceCopies | None:
        """For a lazy snapshot of ``leaves`` (called in the caller's thread at ``save()``):
        how those on an accelerator are copied, or ``None`` if all are in host memory."""
        return None

    @abstractmethod
    def rebuild(self, array: NDArray[Any], attrs: dict[str, Any], like: Any | None) -> Any:
        """An array of this framework holding ``array``'s values.

        Args:
            array: the restored values (owned by the caller; may be used without a copy).
            attrs: the attributes recorded when the leaf was saved (may come from another
                framework, when a state is restored into a different type).
            like: a leaf of this framework from the restore target whose placement (device,
                sharding) and dtype the result takes, or ``None`` to follow ``attrs``.
        """


def array_kinds() -> list[ArrayKind]:
    """The array kinds of the frameworks the program has imported (numpy always)."""
    from ckptstore.stage.numpy import NumpyKind

    kinds: list[ArrayKind] = [NumpyKind()]
    if "torch" in sys.modules:
        from ckptstore.stage.torch import TorchKind

        kinds.append(TorchKind())
    if "jax" in sys.modules:
        from ckptstore.stage.jax import JaxKind

        kinds.append(JaxKind())
    return kinds


def kind_named(name: str) -> ArrayKind:
    """The array kind of framework ``name`` (``"numpy"``, ``"torch"``, ``"jax"``), importing it."""
    if name == "numpy":
        from ckptstore.stage.numpy import NumpyKind

        return NumpyKind()
    if name == "torch":
        from ckptstore.stage.torch import TorchKind

        return TorchKind()
    if name == "jax":
        from ckptstore.stage.jax import JaxKind

        return JaxKind()
    raise ValueError(f"unknown array framework {name!r}; use 'numpy', 'torch' or 'jax'")


@dataclass(init=False, eq=False)
class StagedState:
    """A state whose arrays are host copies the writer owns.

    Attributes:
        tree: the state's structure with every array leaf replaced by a C-contiguous numpy
            array (a view into :attr:`buffer`, or the source itself for a save that opted out
            of copying); other leaves are unchanged.
        attrs: for each array leaf, by path, the JSON-able attributes restore needs.
        nbytes: bytes of array data staged.
        buffer: the pooled arena the arrays live in; released by :meth:`release`.
        fences: what :meth:`wait_ready` waits for (device copies, a lazy copy).
        snapshot: the background copy of a lazy stage, until it is waited for.
    """

    _tree: Any = field(repr=False)
    attrs: dict[Path, dict[str, Any]]
    nbytes: int
    buffer: HostBuffer | None
    fences: list[Callable[[], None]]
    snapshot: LazyCopy | None
    _flat: FlatState | None = field(repr=False, compare=False)
    _make_tree: Callable[[], Any] | None = field(repr=False, compare=False)

    def __init__(
        self,
        tree: Any = None,
        attrs: dict[Path, dict[str, Any]] | None = None,
        nbytes: int = 0,
        buffer: HostBuffer | None = None,
        fences: list[Callable[[], None]] | None = None,
        snapshot: LazyCopy | None = None,
        *,
        make_tree: Callable[[], Any] | None = None,
    ) -> None:
        """``make_tree``, if given, builds :attr:`tree` at its first use instead: a save
        needs only :meth:`flat`, and the tree costs a second walk of the state."""
        self._tree = tree
        self.attrs = {} if attrs is None else attrs
        self.nbytes = nbytes
        self.buffer = buffer
        self.fences = [] if fences is None else fences
        self.snapshot = snapshot
        self._flat = None
        self._make_tree = make_tree

    @property
    def tree(self) -> Any:
        """See the class docstring."""
        if self._make_tree is not None:
            self._tree, self._make_tree = self._make_tree(), None
        return self._tree

    def flat(self) -> FlatState:
        """The staged state as the format layer's :class:`~ckptstore.layout.tree.FlatState`:
        the staged arrays as leaves, each with its attrs (framework, device...) for restore.
        :meth:`Stager.stage` builds it while its copies run; later calls return that one.

        Raises:
            UnsupportedLeafError: a leaf that is neither an array nor a plain value.
        """
        if self._flat is None:
            # The walker's paths are the checkpoint's paths, so each array's attrs are found
            # by its path in the flat view.
            flat = flatten(self.tree, expand=expand)
            flat.attrs = [self.attrs.get(path) for path in flat.paths]
            self._flat = flat
        return self._flat

    def start(self) -> None:
        """Start a lazy stage's background copy if it was staged with ``start=False`` and
        has not started yet; nothing otherwise."""
        if self.snapshot is not None:
            self.snapshot.start()

    def wait_ready(self) -> None:
        """Block until asynchronous copies have landed (CUDA sources, a lazy stage).

        Raises:
            TornSnapshotError: a lazy stage's source changed before it was copied.
            Exception: whatever a lazy stage's copy raised.
        """
        fences, self.fences = self.fences, []
        for fence in fences:
            fence()

    def release(self) -> None:
        """Give the host buffer back to its pool once the bytes are durable (idempotent).

        Waits for copies still running first, so no copy writes into a buffer another save
        was lent; raises what :meth:`wait_ready` raises, after giving the buffer back.
        """
        try:
            self.wait_ready()
        finally:
            if self.buffer is not None:
                self.buffer.release()
                self.buffer = None


def pinned_memory(capacity: int) -> tuple[NDArray[np.uint8], Any]:
    """``capacity`` bytes of page-locked host memory, allocated by torch (only CUDA sources
    ask for it, so torch is imported already): the pool's allocator for pinned arenas."""
    import torch

    owner = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
    return owner.numpy(), owner


class Stager:
    """Copies the arrays of a state into pooled host buffers.

    Args:
        pool: where arenas come from and go back to; one per stager by default, so closing
            the stager frees its arenas.
        threads: threads that copy in parallel (the calling thread is one of them); copying
            is bound by memory bandwidth, so more than two rarely helps.
        chunk_bytes: large contiguous leaves are copied in pieces of about this many bytes,
            so the threads share the work evenly.
        leaf_alignment: small leaves start at multiples of this inside the arena (default
            ``Settings.leaf_alignment``); large ones start on a page.
    """

    def __init__(
        self,
        pool: BufferPool | None = None,
        *,
        threads: int = 2,
        chunk_bytes: int = 16 << 20,
        leaf_alignment: int | None = None,
    ) -> None:
        if threads < 1 or chunk_bytes < 1:
            raise ValueError("threads and chunk_bytes must be >= 1")
        alignment = (
            default_settings().layout.leaf_alignment if leaf_alignment is None else leaf_alignment
        )
        if alignment < 1 or alignment & (alignment - 1):
            raise ValueError(f"leaf_alignment must be a power of two, got {alignment}")
        self.pool = pool if pool is not None else BufferPool()
        self.threads = threads
        self.chunk_bytes = chunk_bytes
        self.leaf_alignment = alignment
        self._executor: ThreadPoolExecutor | None = None
        self._lazy_executor: ThreadPoolExecutor | None = None

    def stage(
        self, state: Any, *, copy: bool = True, lazy: bool = False, start: bool = True
    ) -> StagedState:
        """Copy every array leaf of ``state`` into one pooled host arena.

        Args:
            state: nested dicts, lists and tuples of numpy, torch or JAX arrays and plain values.
            copy: ``False`` lets leaves already in host memory (numpy arrays, CPU torch tensors)
                through without a copy; only for a save that finishes before the caller
                touches the state again.
            lazy: return once the arena is laid out and leave the copies of torch tensors
                and JAX arrays to a background thread (:mod:`ckptstore.stage.lazy`); the
                result's ``snapshot`` is that copy, and :meth:`StagedState.wait_ready`
                waits for it and raises :class:`~ckptstore.errors.TornSnapshotError` if a
                source changed before its copy. Leaves without a mutation counter (numpy)
                are still copied in the call.
            start: with ``lazy``, start the background copy before returning; ``False``
                leaves it to :meth:`StagedState.start` (or the first wait for it), for a
                caller that hands the save to another thread first.

        Raises:
            TypeError: a leaf is an array ckptstore cannot store (object dtype, sparse...),
                or (``UnsupportedLeafError``) a leaf that is neither an array nor a plain value.
        """
        if lazy and not copy:
            raise ValueError("a lazy stage copies; it cannot let leaves through (copy=False)")
        with collection_paused():
            return self._lazy(state, start=start) if lazy else self._copied(state, copy=copy)

    def _lazy(self, state: Any, *, start: bool) -> StagedState:
        """``stage(state, lazy=True)``: the state walked once (:meth:`_walked`) and the arena
        laid out as for a copy, the copies left to a background thread where the leaf's
        framework keeps a mutation counter to check them by, made now where it does not.

        Only what must happen in the call happens in it: the walk (which refuses what cannot
        be stored), each leaf's counter, the arena's offsets, the events CUDA copies wait
        for. The leaves' slots in the arena, their copy records and batches are made by
        whichever thread first needs them (:class:`~ckptstore.stage.lazy.LazyCopy`): on the
        async benchmark's transformer (496 tensors) they were half of the 6 ms call.
        """
        from ckptstore.stage.lazy import LazyCopy, LeafCopy

        flat, to_copy, sources, staged, views = self._walked(state, copy=True)
        if not to_copy:
            return staged
        for kind, mine in _kinds_of(sources):
            kind.start(mine)
        specs = [spec for _, _, spec in sources]
        buffer, offsets = self._layout(specs)
        staged.buffer = buffer
        flat.region = buffer.data  # written in place by a local save
        flat.region_at = _region_at(len(flat.arrays), to_copy, offsets)
        staged.nbytes = sum(spec.nbytes for spec in specs)
        paths = [flat.paths[i] for i in to_copy]
        arrays = flat.arrays
        try:
            versions = [kind.version(leaf) for leaf, kind, _ in sources]
            now_slots: list[NDArray[Any] | None] = []  # None: copied later
            for j, version in enumerate(versions):
                if version is None:  # no counter to check a later copy by: copied now
                    spec = sources[j][2]
                    dst = arrays[to_copy[j]] = views[paths[j]] = _slot(buffer, spec, offsets[j])
                    now_slots.append(dst)
                else:
                    now_slots.append(None)
            now = (
                _copy_tasks(buffer, sources, now_slots, offsets, self.chunk_bytes)
                if None in versions
                else []
            )
            if now:
                copying = _Copying(now, self.threads, self.chunk_bytes)
                copying.start(self._helpers)
                copying.finish()
            counted = (
                [s for s, v in zip(sources, versions, strict=True) if v is not None]
                if None in versions
                else sources
            )
            device_of = {id(kind): kind.device_copies(mine) for kind, mine in _kinds_of(counted)}
            chunk_bytes = self.chunk_bytes

            def leaf_copies() -> list[LeafCopy]:
                # in the copying thread (or a fence's): the slots, shown in the flat view
                # the writer reads once the copy is done
                later = []
                for j, version in enumerate(versions):
                    if version is None:
                        continue
                    leaf, kind, spec = sources[j]
                    dst = arrays[to_copy[j]] = views[paths[j]] = _slot(buffer, spec, offsets[j])
                    device = device_of[id(kind)]
                    if device is not None and not device.owns(leaf):
                        device = None
                    later.append(LeafCopy(paths[j], leaf, kind, version, dst, device, chunk_bytes))
                return later

            devices = [device for device in device_of.values() if device is not None]
            snapshot = LazyCopy(leaf_copies, devices, chunk_bytes, self._lazy_thread())
            staged.snapshot = snapshot
            staged.fences.append(snapshot.result)
            if start:
                snapshot.start()
        except BaseException:
            staged.buffer.release()
            raise
        return staged

    def _lazy_thread(self) -> ThreadPoolExecutor:
        # One thread: a lazy copy overlaps a training loop that computes on the other cores,
        # and successive saves' copies never run at once (one save in flight). A Pool, which
        # takes work while the interpreter exits: an async save starts its copy from the
        # background loop, and a script's last save may get there after its main thread
        # ended (a ThreadPoolExecutor then refuses it, and the save would be lost).
        if self._lazy_executor is None:
            self._lazy_executor = Pool(1, "ckpt-lazy")
        return self._lazy_executor

    def _layout(self, specs: list[LeafSpec]) -> tuple[HostBuffer, list[int]]:
        """A pooled arena for leaves of these specs, and each leaf's offset in it: small
        leaves at ``leaf_alignment``, large ones on a page."""
        offsets, total = [], 0
        small = self.leaf_alignment
        large = max(PAGE, small)
        for spec in specs:
            nbytes = spec.nbytes
            start = align_up(total, large if nbytes >= PAGE_ALIGN_MIN else small)
            offsets.append(start)
            total = start + nbytes
        pinned = any(spec.pinned for spec in specs)
        buffer = self.pool.acquire(align_up(total, small), pin=pinned_memory if pinned else None)
        return buffer, offsets

    def _copied(self, state: Any, *, copy: bool) -> StagedState:
        """``stage(state)`` (not lazy): the state walked once (:meth:`_walked`), the arena
        laid out, each stand-in replaced by its slot, and the copies run. With nothing to
        copy there is no arena at all."""
        staged, offsets, sources, slots = self._laid_out(state, copy=copy)
        if staged.buffer is None:
            return staged
        try:
            tasks = _copy_tasks(staged.buffer, sources, slots, offsets, self.chunk_bytes)
            copying = _Copying(tasks, self.threads, self.chunk_bytes)
            copying.start(self._helpers)
            copying.finish()
            for kind, mine in _kinds_of(sources):
                fence = kind.fence(mine)
                if fence is not None:
                    staged.fences.append(fence)
        except BaseException:
            staged.buffer.release()
            raise
        return staged

    def _laid_out(
        self, state: Any, *, copy: bool
    ) -> tuple[StagedState, list[int], list[tuple[Any, ArrayKind, LeafSpec]], list[NDArray[Any]]]:
        """A stage's state walked once (:meth:`_walked`) and its arena laid out:
        ``(staged state, the offset in the arena of each leaf to copy, its (leaf, kind,
        spec), its slot there)``. Each leaf's framework has been told of the copies to come
        (``ArrayKind.start``) and the flat view shows the slots. With nothing to copy the
        staged state has no buffer."""
        flat, to_copy, sources, staged, views = self._walked(state, copy=copy)
        if not to_copy:
            return staged, [], [], []
        for kind, mine in _kinds_of(sources):
            kind.start(mine)
        specs = [spec for _, _, spec in sources]
        buffer, offsets = self._layout(specs)
        slots = [_slot(buffer, spec, offset) for spec, offset in zip(specs, offsets, strict=True)]
        paths = [flat.paths[i] for i in to_copy]
        for i, path, dst in zip(to_copy, paths, slots, strict=True):
            flat.arrays[i] = views[path] = dst
        staged.buffer = buffer
        flat.region = buffer.data  # written in place by a local save
        flat.region_at = _region_at(len(flat.arrays), to_copy, offsets)
        staged.nbytes = sum(flat.nbytes)
        return staged, offsets, sources, slots

    @staticmethod
    def _walked(
        state: Any, *, copy: bool
    ) -> tuple[
        FlatState,
        list[int],
        list[tuple[Any, ArrayKind, LeafSpec]],
        StagedState,
        dict[Path, NDArray[Any]],
    ]:
        """One walk of ``state`` for a stage, lazy or not: ``(flat view, the flat indices of
        the leaves to copy, each one's (leaf, kind, spec), the staged state, its host views by
        path)``.

        The one walker builds the format layer's flat view straight from ``state``, taking
        each framework's leaf apart (its spec) on the way and giving each leaf to copy a
        zero-length stand-in of its dtype, which the caller replaces by the leaf's slot in
        the arena (and in the views). With ``copy=False`` a leaf in host memory goes into
        the flat view as itself (numpy) or as its host view (a CPU tensor), and only the rest
        is to be copied. (The general path walked the state three times: find the leaves,
        rebuild the staged tree, flatten it.) The staged tree is built only if someone asks
        for it; a save never does.
        """
        kinds = array_kinds()
        numpy_kind = next(kind for kind in kinds if kind.name == "numpy")
        others = [kind for kind in kinds if kind is not numpy_kind]
        converted: dict[Path, tuple[Any, ArrayKind, LeafSpec]] = {}
        attrs: dict[Path, dict[str, Any]] = {}
        views: dict[Path, NDArray[Any]] = {}

        # The kind that owns each leaf type met, by type (ownership is an isinstance check,
        # so the type decides it): the kinds' checks run once per type, not once per leaf.
        owner_of: dict[type, ArrayKind | None] = {}

        def owner(leaf: Any) -> ArrayKind | None:
            # a copy stages numpy scalars as 0-d arrays marked as scalars; a copy=False stage
            # leaves them to the walker, which stores them as scalars
            scalar = isinstance(leaf, np.generic)
            for kind in (numpy_kind,) if scalar and copy else () if scalar else others:
                if kind.owns(leaf):
                    return kind
            return None

        def convert(leaf: Any, path: str) -> tuple[NDArray[Any], dict[str, Any] | None] | None:
            # runs for every leaf of every save: its calls are inlined (a lazy save's call is
            # mostly this walk)
            kind = owner_of.get(type(leaf), _UNSEEN)
            if kind is _UNSEEN:
                kind = owner_of[type(leaf)] = owner(leaf)
            if kind is None:
                return None
            try:
                spec = kind.spec(leaf)
            except TypeError as exc:
                raise TypeError(f"cannot stage the leaf at {_show(path)}: {exc}") from None
            leaf_attrs = spec.attrs
            if leaf_attrs is not None:
                attrs[path] = leaf_attrs
            if not copy:
                view = kind.host_view(leaf)
                if view is not None:
                    views[path] = view
                    return view, leaf_attrs
            converted[path] = (leaf, kind, spec)
            stand_in = _STAND_INS.get(spec.dtype)
            return (_stand_in(spec.dtype) if stand_in is None else stand_in), leaf_attrs

        flat = flatten(state, convert=convert, expand=expand)
        to_copy: list[int] = []
        sources: list[tuple[Any, ArrayKind, LeafSpec]] = []
        if copy:
            for i, (path, array) in enumerate(zip(flat.paths, flat.arrays, strict=True)):
                found = converted.get(path)
                if found is None:
                    if path in views:
                        continue  # let through: a host view
                    found = (array, numpy_kind, _spec(numpy_kind, array, path))
                to_copy.append(i)
                sources.append(found)
        elif converted:  # copy=False lets every host leaf through: only the others are copied
            to_copy = [i for i, path in enumerate(flat.paths) if path in converted]
            sources = [converted[flat.paths[i]] for i in to_copy]
        # the staged tree shows host views and arena slots in place of the leaves
        staged = StagedState(
            state,
            attrs,
            sum(flat.nbytes),
            make_tree=(lambda: map_leaves(lambda p, leaf: views.get(p, leaf), state))
            if views or to_copy
            else None,
        )
        staged._flat = flat
        return flat, to_copy, sources, staged, views

    def _helpers(self, count: int) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(count, thread_name_prefix="ckpt-stage")
        return self._executor

    def close(self) -> None:
        """Stop the copy threads and free the idle buffers."""
        for executor in (self._executor, self._lazy_executor):
            if executor is not None:
                executor.shutdown()
        self._executor = self._lazy_executor = None
        self.pool.clear()


class _Copying:
    """The copies of one save, shared by the calling thread and the stager's helpers.

    Helpers start copying at once; the calling thread joins in once its bookkeeping is done
    (:meth:`finish`). Each thread takes the largest copies first, in batches of about
    ``1 / (2 x threads)`` of the bytes left, so early batches are large (few hand-offs, each
    a moment a thread needs the GIL) and the last ones small (the threads finish together).
    """

    def __init__(self, tasks: list[CopyTask], threads: int, chunk_bytes: int) -> None:
        self._tasks = sorted(tasks, key=lambda task: -task[0])
        self._left = sum(n for n, _ in tasks)
        self._next = 0
        self._threads = threads
        # Too little work to be worth a hand-off: the calling thread copies it all.
        self._solo = threads == 1 or len(tasks) < 2 or self._left < 2 * chunk_bytes
        self._lock = threading.Lock()
        self._futures: list[Future[None]] = []
        self._error: BaseException | None = None

    def start(self, helpers: Callable[[int], ThreadPoolExecutor]) -> None:
        if self._solo:
            return
        pool = helpers(self._threads - 1)
        self._futures = [pool.submit(self._drain) for _ in range(self._threads - 1)]

    def _take(self) -> list[Callable[[], None]]:
        with self._lock:
            goal = max(1, self._left // (2 * self._threads))
            batch: list[Callable[[], None]] = []
            taken = 0
            while self._next < len(self._tasks) and taken < goal:
                n, copy = self._tasks[self._next]
                self._next += 1
                batch.append(copy)
                taken += n
            self._left -= taken
            return batch

    def _drain(self) -> None:
        try:
            while batch := self._take():
                _run_batch(batch)
        except BaseException as exc:
            self.cancel()
            self._error = self._error or exc

    def cancel(self) -> None:
        """Hand out no more copies (those running finish)."""
        with self._lock:
            self._next = len(self._tasks)

    def finish(self) -> None:
        """Copy what is left on this thread, wait for the helpers, raise the first error."""
        self._drain()
        for future in self._futures:
            future.result()
        if self._error is not None:
            raise self._error


def _region_at(count: int, placed: list[int], offsets: list[int]) -> list[int]:
    """Per flat leaf of ``count``, its offset in the arena: ``offsets[j]`` for leaf
    ``placed[j]``, ``-1`` for the others."""
    at = [-1] * count
    for i, offset in zip(placed, offsets, strict=True):
        at[i] = offset
    return at


def _run_batch(copies: list[Callable[[], None]]) -> None:
    """Run copies in order; consecutive ones of a class with ``run_many`` go in one call."""
    i = 0
    while i < len(copies):
        kind = type(copies[i])
        run_many = getattr(kind, "run_many", None)
        j = i + 1
        if run_many is not None:
            while j < len(copies) and type(copies[j]) is kind:
                j += 1
            run_many(copies[i:j])
        else:
            copies[i]()
        i = j


#: Zero-length arrays by dtype: what a leaf stands for in the flat view of
#: :meth:`Stager._copied` until its arena slot exists.
_STAND_INS: dict[np.dtype[Any], NDArray[Any]] = {}

#: A leaf type :meth:`Stager._walked` has not asked the kinds about yet.
_UNSEEN: Any = object()


def _slot(buffer: HostBuffer, spec: LeafSpec, offset: int) -> NDArray[Any]:
    """A leaf's slot in an arena: an array of its dtype and shape at ``offset``.

    One constructor call (which refuses a slot past the arena's end), not a slice, a dtype
    view and a reshape: 0.7 us against 1.2 us a leaf, on every leaf of every save."""
    return np.ndarray(spec.shape, spec.dtype, buffer.data, offset)


#: Host arrays under this many bytes are copied into the arena by :func:`_copy_tasks` in bulk
#: (one call for many), larger ones by their kind's copies, in pieces the threads share.
BULK_MAX = 1 << 20


def _copy_tasks(
    buffer: HostBuffer,
    sources: list[tuple[Any, ArrayKind, LeafSpec]],
    slots: Sequence[NDArray[Any] | None],
    offsets: list[int],
    chunk_bytes: int,
) -> list[CopyTask]:
    """The copies of ``sources`` into their ``slots`` of ``buffer`` (at ``offsets``); a
    leaf whose slot is ``None`` is copied by someone else (a lazy snapshot's thread).

    A small host array (under :data:`BULK_MAX`) is not given copies of its own: consecutive
    ones go in one task of about ``chunk_bytes``, which copies them all with one compiled
    call without the GIL (:func:`~ckptstore.store.buffers.copy_into`): numpy arrays through
    their buffers, torch tensors and numpy arrays of extension dtypes (bfloat16) by their
    addresses (:meth:`ArrayKind.host_address`), where the compiled module is built. Given
    copies of its own by its kind, such a leaf cost about 9 us of Python (numpy; 4.6 us for
    a torch tensor, copied in batches by torch); in bulk, about 1 us (20,000 leaves of
    4 KiB: 270 ms of staging before, 72 ms after, of which 24 ms copies). The call writes
    only its leaves' bytes, so leaves copied otherwise, or later, may lie between them.
    """
    tasks: list[CopyTask] = []
    run = _Run()
    by_address = NATIVE_COPY

    def flush() -> None:
        nonlocal run
        if run.leaves:
            tasks.append((run.nbytes, functools.partial(_bulk_copy, buffer.data, run)))
            run = _Run()

    for (leaf, kind, spec), dst, offset in zip(sources, slots, offsets, strict=True):
        if dst is None:
            continue
        nbytes = spec.nbytes
        if nbytes < BULK_MAX:
            if type(leaf) is np.ndarray and leaf.flags.c_contiguous and leaf.dtype.isbuiltin == 1:
                source: Any = leaf  # exports its buffer
            else:
                source = kind.host_address(leaf) if by_address else None
            if source is not None:
                if run.nbytes >= chunk_bytes:
                    flush()
                run.leaves.append(leaf)
                run.sources.append(source)
                run.offsets.append(offset)
                run.lengths.append(nbytes)
                run.nbytes += nbytes
                continue
        tasks += kind.copies(leaf, dst, chunk_bytes)
    flush()
    return tasks


@dataclass(slots=True)
class _Run:
    """Small host leaves one bulk copy moves: each leaf (held so its memory lives until the
    copy ran), what :func:`~ckptstore.store.buffers.copy_into` copies it from (the array, or
    its address), and where in the arena it goes."""

    leaves: list[Any] = field(default_factory=list)
    sources: list[Any] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    nbytes: int = 0


def _bulk_copy(arena: NDArray[np.uint8], run: _Run) -> None:
    """Copy a run's leaves into ``arena`` at their offsets, in one call."""
    copy_into(arena, run.sources, run.offsets, run.lengths)


def _stand_in(dtype: np.dtype[Any]) -> NDArray[Any]:
    array = _STAND_INS.get(dtype)
    if array is None:
        array = _STAND_INS[dtype] = np.empty(0, dtype)
    return array


def _spec(kind: ArrayKind, leaf: Any, path: Path) -> LeafSpec:
    """``kind.spec(leaf)``, its refusal naming the leaf's path."""
    try:
        return kind.spec(leaf)
    except TypeError as exc:
        raise TypeError(f"cannot stage the leaf at {_show(path)}: {exc}") from None


def _show(path: Path) -> str:
    return path or "<root>"


def contiguous_chunks(nbytes: int, itemsize: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """Element ranges ``[start, stop)`` of about ``chunk_bytes`` each covering a flat array."""
    count = nbytes // itemsize if itemsize else 0
    step = max(1, chunk_bytes // max(itemsize, 1))
    return [(start, min(start + step, count)) for start in range(0, count, step)] or [(0, 0)]


def target_kind(like: Any) -> ArrayKind | None:
    """The array kind a restore-target leaf asks for, or ``None`` for a non-array leaf."""
    if isinstance(like, np.ndarray | np.generic):
        return kind_named("numpy")
    if "torch" in sys.modules and isinstance(like, sys.modules["torch"].Tensor):
        return kind_named("torch")
    if "jax" in sys.modules:
        from ckptstore.stage.jax import is_jax_target

        if is_jax_target(like):
            return kind_named("jax")
    return None


def rebuild_state(tree: Any, attrs: dict[Path, dict[str, Any]], target: Any = None) -> Any:
    """Turn the host arrays of a restored state back into the arrays a caller wants.

    Args:
        tree: the state as the format layer read it; array leaves are numpy arrays.
        attrs: per array leaf, by path, the attributes recorded when it was staged.
        target: ``None`` rebuilds each leaf as it was saved (framework, device,
            ``requires_grad``); ``"numpy"``, ``"torch"`` or ``"jax"`` makes every array leaf
            one of those; a state (nested like ``tree``) gives per leaf the type, dtype and
            placement wanted: a torch tensor (its device, dtype, ``requires_grad``), a JAX
            array or ``jax.ShapeDtypeStruct`` (its sharding, dtype), a numpy array (its dtype).
            Leaves the target does not name, or names with a non-array, are rebuilt as saved.

    Raises:
        ValueError: a target leaf's shape differs from the saved one.
    """
    fixed = kind_named(target) if isinstance(target, str) else None
    likes = dict(iter_leaves(target)) if target is not None and fixed is None else {}

    def rebuild(path: Path, leaf: Any) -> Any:
        if not isinstance(leaf, np.ndarray):
            return leaf
        like = likes.get(path)
        try:
            return rebuild_leaf(leaf, attrs.get(path, {}), fixed, like)
        except ValueError as exc:
            raise leaf_error(exc, _show(path)) from None

    return map_leaves(rebuild, tree)


def saved_kind(attrs: dict[str, Any]) -> ArrayKind:
    """The array kind a leaf was saved from, by its manifest attributes.

    Raises:
        CorruptCheckpointError: the attributes name no array framework (they come from the
            manifest, not from the caller).
    """
    framework = attrs.get("framework", "numpy")
    if framework not in ("numpy", "torch", "jax"):
        raise CorruptCheckpointError(
            f"leaf attribute framework={str(framework)[:80]!r} names no array framework"
        )
    return kind_named(framework)


def leaf_error(exc: ValueError | TypeError, where: str) -> ValueError | TypeError:
    """``exc`` with the leaf ``where`` named in front of its message; a damaged
    checkpoint's :class:`~ckptstore.errors.CorruptCheckpointError` stays one, and a
    ``TypeError`` (a dtype the asked framework lacks) stays a ``TypeError``."""
    error: type[ValueError | TypeError]
    if isinstance(exc, CorruptCheckpointError):
        error = CorruptCheckpointError
    else:
        error = TypeError if isinstance(exc, TypeError) else ValueError
    return error(f"{where}: {exc}")


def rebuild_leaf(
    array: NDArray[Any], attrs: dict[str, Any], kind: ArrayKind | None, like: Any | None
) -> Any:
    """One restored host array as the array a caller wants.

    ``kind`` (a framework asked for every leaf) wins; else ``like``, a target leaf, gives the
    type, dtype and placement; else the leaf is rebuilt as ``attrs`` say it was saved.

    Raises:
        ValueError: ``like``'s shape differs from ``array``'s.
    """
    if kind is not None:
        return kind.rebuild(array, attrs, None)
    like_kind = target_kind(like) if like is not None else None
    if like_kind is None:
        return saved_kind(attrs).rebuild(array, attrs, None)
    like_shape = getattr(like, "shape", None)
    shape = array.shape if like_shape is None else tuple(like_shape)
    if shape != array.shape:
        raise ValueError(f"the restore target has shape {shape}, the checkpoint {array.shape}")
    return like_kind.rebuild(array, attrs, like)


def _kinds_of(sources: list[tuple[Any, ArrayKind, LeafSpec]]) -> list[tuple[ArrayKind, list[Any]]]:
    """The kinds among ``sources``, each with its leaves, in order of first appearance."""
    if not sources:
        return []
    kinds = [kind for _, kind, _ in sources]
    if kinds.count(kinds[0]) == len(kinds):  # one framework, as most states: no loop per leaf
        return [(kinds[0], [leaf for leaf, _, _ in sources])]
    by_kind: dict[int, tuple[ArrayKind, list[Any]]] = {}
    for leaf, kind, _ in sources:
        entry = by_kind.get(id(kind))
        if entry is None:
            entry = by_kind[id(kind)] = (kind, [])
        entry[1].append(leaf)
    return list(by_kind.values())
