"""Which object each leaf goes into, and at what offset.

Object stores charge per request and throttle many small ones, and every object is a file on
a filesystem, so a state of 20,000 small tensors must not become 20,000 objects. The plan:

* a leaf of at least ``Settings.pack_threshold`` bytes is an object of its own; the store's
  ``put`` splits it into parts that upload in parallel (``Settings.part_size``, grown so the
  upload stays within the backend's part-count limit);
* smaller leaves are packed, in state order (so one module's leaves share few objects), into
  pack objects of at most ``Settings.pack_size`` bytes, each leaf at an offset that is a
  multiple of ``Settings.leaf_alignment`` so it can be viewed in place with its dtype;
* empty leaves take no object at all;
* leaves of different ``groups`` never share a pack (an incremental save keeps the leaves
  that did not change apart from those that did, :mod:`ckptstore.layout.incremental`, so a
  pack of unchanged leaves can be reused whole next time).

The plan is plain data (``leaf_object``, ``leaf_offset``, ``objects[i].size``), so a stager
can allocate the pack buffers itself and copy device memory straight into each leaf's slot;
otherwise :meth:`PackPlan.fill` builds a pack with one copy per leaf into a buffer of the
process-wide pool (:data:`ckptstore.store.buffers.host_buffers`).

It is the one packer of ckptstore: ``ckptstore.save``, the manager, multi-rank saves, the DCP
writer (whose items are leaves of bytes) and the Lightning plug-in all plan with it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptstore.config import Settings
from ckptstore.store.base import Capabilities
from ckptstore.store.buffers import PAGE
from ckptstore.store.checksum import gather_crc32c, gather_digests

__all__ = ["PackPlan", "PlannedObject"]


@dataclass(frozen=True, slots=True)
class PlannedObject:
    """One data object of a checkpoint.

    Attributes:
        name: its key relative to the attempt prefix (``pack-000003``, ``leaf-000004``).
        size: length in bytes.
        leaves: indices of the leaves it holds, in offset order.
        packed: whether it is a pack of leaves (else it holds exactly one leaf, at offset
            0, spanning the whole object).
        start: for a pack cut straight from the save's region (:meth:`PackPlan.in_region`),
            its byte offset there: the object is those bytes, built by no copy.
    """

    name: str
    size: int
    leaves: tuple[int, ...]
    packed: bool
    start: int | None = None


@dataclass(frozen=True, slots=True)
class PackPlan:
    """Where every leaf of one save lives.

    Attributes:
        objects: the data objects, in name order.
        leaf_object: per leaf, the index into ``objects`` (``-1`` for an empty leaf).
        leaf_offset: per leaf, the byte offset inside its object.
        leaf_length: per leaf, its length in bytes.
    """

    objects: list[PlannedObject]
    leaf_object: list[int]
    leaf_offset: list[int]
    leaf_length: list[int]

    @classmethod
    def build(
        cls,
        lengths: Sequence[int],
        *,
        pack_threshold: int,
        pack_size: int,
        alignment: int,
        max_object_size: int = 1 << 62,
        paths: Sequence[str] | None = None,
        groups: Sequence[int] | None = None,
    ) -> PackPlan:
        """Plan leaves of the given byte ``lengths``.

        Args:
            lengths: bytes per leaf.
            pack_threshold: leaves smaller than this are packed.
            pack_size: a pack never exceeds this many bytes (a leaf is never split).
            alignment: offsets inside a pack are multiples of this (a power of two).
            max_object_size: the largest object the store can hold; a leaf over it fails.
            paths: leaf paths, to name a leaf in errors.
            groups: per leaf, a group number; packs hold leaves of one group, lower groups
                first (default: one group, state order).

        Raises:
            ValueError: a leaf larger than ``max_object_size``.
        """
        # With numpy, one search per pack rather than a step per leaf: the loop per leaf
        # took 3-4 ms of a 20,000-leaf save's path to its first write.
        count = len(lengths)
        threshold = min(pack_threshold, pack_size)
        mask = alignment - 1
        sizes = np.fromiter(lengths, dtype=np.int64, count=count)
        order = (
            np.arange(count)
            if groups is None  # stable: state order in a group
            else np.argsort(np.asarray(groups, dtype=np.int64).reshape(count), kind="stable")
        )
        ordered = sizes[order]
        alone = np.flatnonzero(ordered >= threshold)  # positions in ``order``
        too_large = np.flatnonzero(ordered[alone] > max_object_size)
        if too_large.size:
            index = int(order[alone[too_large[0]]])
            where = f"{paths[index]!r}" if paths is not None else f"#{index}"
            raise ValueError(
                f"leaf {where} is {lengths[index]} bytes, more than this store's largest "
                f"object ({max_object_size} bytes)"
            )
        small = np.flatnonzero((ordered > 0) & (ordered < threshold))
        small_sizes = ordered[small]
        # a member's offset in its pack is the aligned sizes of the members before it, so
        # a pack starting at small leaf ``s`` ends before the first leaf whose end passes
        # ``begins[s] + pack_size`` (``ends`` never decreases)
        begins = np.zeros(small.size, dtype=np.int64)
        np.cumsum((small_sizes[:-1] + mask) & ~mask, out=begins[1:])
        ends = begins + small_sizes
        # where a group's first leaf with bytes lies: a pack never spans one
        cuts = np.empty(0, dtype=np.int64)
        if groups is not None:
            filled = np.flatnonzero(ordered > 0)
            kinds = np.asarray(groups, dtype=np.int64)[order[filled]]
            cuts = filled[1:][kinds[1:] != kinds[:-1]]
        # the events that number the objects, in the order a walk of the leaves meets them:
        # (position, 0) a pack closed there, before the leaf at it; (position, 1) a leaf alone
        events: list[tuple[int, int, int, int]] = [(int(p), 1, 0, 0) for p in alone]
        first = 0
        while first < small.size:
            last = int(np.searchsorted(ends, begins[first] + pack_size, side="right"))
            last = max(last, first + 1)
            closed = int(small[last]) if last < small.size else count
            cut = int(np.searchsorted(cuts, small[first], side="right"))
            if cut < cuts.size and cuts[cut] < closed:  # the next group begins first
                closed = int(cuts[cut])
                last = int(np.searchsorted(small, closed, side="left"))
            events.append((closed, 0, first, last))
            first = last
        events.sort()
        objects: list[PlannedObject] = []
        leaf_object = np.full(count, -1, dtype=np.int64)
        leaf_offset = np.zeros(count, dtype=np.int64)
        for position, kind, first, last in events:
            number = len(objects)
            if kind:
                index = int(order[position])
                leaf_object[index] = number
                objects.append(
                    PlannedObject(f"leaf-{number:06d}", int(sizes[index]), (index,), False)
                )
                continue
            members = order[small[first:last]]
            leaf_object[members] = number
            leaf_offset[members] = begins[first:last] - begins[first]
            size = int(ends[last - 1] - begins[first])
            objects.append(PlannedObject(f"pack-{number:06d}", size, tuple(members.tolist()), True))
        return cls(objects, leaf_object.tolist(), leaf_offset.tolist(), list(lengths))

    @classmethod
    def for_store(
        cls,
        lengths: Sequence[int],
        settings: Settings,
        capabilities: Capabilities,
        paths: Sequence[str] | None = None,
        *,
        pack_threshold: int | None = None,
        pack_size: int | None = None,
        groups: Sequence[int] | None = None,
    ) -> PackPlan:
        """Plan with the thresholds in ``settings`` (or the ``pack_threshold`` and
        ``pack_size`` given, as the DCP writer's own) and the limits of a backend; ``groups``
        as in :meth:`build`."""
        caps = capabilities
        largest = caps.max_part_size * caps.max_parts if caps.multipart else caps.max_part_size
        pack_size = min(settings.layout.pack_size if pack_size is None else pack_size, largest)
        return cls.build(
            lengths,
            pack_threshold=settings.layout.pack_threshold
            if pack_threshold is None
            else pack_threshold,
            pack_size=pack_size,
            alignment=settings.layout.leaf_alignment,
            max_object_size=largest,
            paths=paths,
            groups=groups,
        )

    @classmethod
    def in_region(
        cls,
        lengths: Sequence[int],
        offsets: Sequence[int],
        *,
        object_size: int,
        gap: int,
        rest: Callable[[list[int]], PackPlan],
        groups: Sequence[int] | None = None,
    ) -> PackPlan:
        """Plan the leaves that lie in one host region (a staging arena) as slices of it.

        A local store pays per object (a file, its fsyncs, the event loop's turns for each
        write), and packing leaves into pooled buffers costs a copy and the buffers. Where
        the leaves already lie one after another in a region the writer owns, a run of them
        (in region order, at most ``gap`` bytes of padding between two) is one object,
        written straight from the region: each leaf's offset in the object is its offset in
        the region less the run's start. A run is cut where it would pass ``object_size``
        bytes, before a leaf that starts on a page (so that each object's bytes start on
        one, as a direct write wants them), or at twice ``object_size`` where it has no
        such leaf. A leaf of ``object_size`` or more is an object of its own.

        Args:
            lengths: bytes per leaf (0: no bytes to write, as for a reused leaf).
            offsets: per leaf, its offset in the region, or ``-1`` if it lies elsewhere.
            object_size: the largest run object.
            gap: the most padding between two leaves of one run.
            rest: plans leaves of the lengths it is given (those in the region at 0) as
                :meth:`build` does: the leaves outside the region keep their objects from it.
            groups: per leaf, a group number (as in :meth:`build`); a run holds leaves of
                one group.
        """
        objects: list[PlannedObject] = []
        leaf_object = [-1] * len(lengths)
        leaf_offset = [0] * len(lengths)
        inside = sorted((offsets[i], i) for i, n in enumerate(lengths) if n and offsets[i] >= 0)

        def close(run: list[int]) -> None:
            start = offsets[run[0]]
            size = offsets[run[-1]] + lengths[run[-1]] - start
            number = len(objects)
            for leaf in run:
                leaf_object[leaf] = number
                leaf_offset[leaf] = offsets[leaf] - start
            if len(run) == 1 and size >= object_size:
                objects.append(PlannedObject(f"leaf-{number:06d}", size, (run[0],), False))
            else:
                objects.append(PlannedObject(f"pack-{number:06d}", size, tuple(run), True, start))

        run: list[int] = []
        on_page = 0  # the last position in ``run`` after the first whose leaf starts on a page
        end = 0
        for offset, leaf in inside:
            if run and (
                not 0 <= offset - end <= gap
                or (groups is not None and groups[leaf] != groups[run[0]])
                or lengths[run[0]] >= object_size  # a large leaf goes alone
            ):
                close(run)
                run, on_page = [], 0
            if run and offset + lengths[leaf] - offsets[run[0]] > object_size:
                # full: cut before the last leaf that starts on a page (the next object's
                # bytes then start on one too, as a direct write from the region wants
                # them), else at twice object_size
                if offset % PAGE == 0:
                    close(run)
                    run, on_page = [], 0
                elif on_page:
                    close(run[:on_page])
                    run = run[on_page:]
                    on_page = 0  # the new run's first leaf is the one on a page
                elif offset + lengths[leaf] - offsets[run[0]] > 2 * object_size:
                    close(run)
                    run, on_page = [], 0
            if run and offset % PAGE == 0:
                on_page = len(run)
            run.append(leaf)
            end = offset + lengths[leaf]
        if run:
            close(run)
        # the leaves outside the region, in the objects ``rest`` gives them
        outside = rest([0 if offsets[i] >= 0 else n for i, n in enumerate(lengths)])
        renumber: dict[int, int] = {}
        for leaf, n in enumerate(lengths):
            if not n or offsets[leaf] >= 0:
                continue
            old = outside.leaf_object[leaf]
            if old not in renumber:
                renumber[old] = len(objects)
                obj = outside.objects[old]
                kind = "pack" if obj.packed else "leaf"
                objects.append(
                    PlannedObject(f"{kind}-{len(objects):06d}", obj.size, obj.leaves, obj.packed)
                )
            leaf_object[leaf] = renumber[old]
            leaf_offset[leaf] = outside.leaf_offset[leaf]
        return cls(objects, leaf_object, leaf_offset, list(lengths))

    @property
    def total_bytes(self) -> int:
        """Bytes over all objects (leaves plus alignment padding)."""
        return sum(obj.size for obj in self.objects)

    def fill(self, index: int, arrays: Sequence[np.ndarray[Any, Any]], out: Any) -> list[int]:
        """Copy the leaves of pack ``index`` into ``out`` (a writable uint8 array of at least
        the pack's size) and zero the alignment gaps; returns each member's crc32c.

        One copy per leaf; a non-contiguous leaf is gathered by that same copy
        (:func:`~ckptstore.store.checksum.gather_crc32c`: one compiled call per pack where
        the install has it).
        """
        obj = self.objects[index]
        return gather_crc32c(out, arrays, obj.leaves, self.leaf_offset, self.leaf_length)

    def fill_digests(
        self, index: int, arrays: Sequence[np.ndarray[Any, Any]], out: Any
    ) -> tuple[list[int], list[str]]:
        """:meth:`fill`, and each member's xxh3-128 too, found in the same pass
        (:func:`~ckptstore.store.checksum.gather_digests`)."""
        obj = self.objects[index]
        return gather_digests(out, arrays, obj.leaves, self.leaf_offset, self.leaf_length)
