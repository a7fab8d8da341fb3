"""Shards of global arrays, as the frameworks describe them: what a rank saves and what it asks for.

A multi-rank save (:mod:`ckptstore.manager.distributed`) stores a tensor sharded across ranks
as one leaf of its global shape made of chunks (:mod:`ckptstore.layout.chunks`); a load on
any world size and sharding asks for the boxes a rank's new shard covers. This module turns
the frameworks' own descriptions into boxes and back:

* :class:`Shard`, ckptstore's own small wrapper: any array (torch, numpy, JAX) with its
  offsets in the global shape. It is how a rank hands over a shard that no framework type
  describes (an FSDP flat parameter's slice, a hand-split embedding table), and how it asks
  for one on load.
* torch ``DTensor``: its local tensor, at the offsets its mesh and placements give it.
  A fully replicated DTensor is an ordinary leaf (its local tensor is the whole array); a
  ``Partial`` one holds no array yet and is refused.
* ``jax.Array`` with a sharding that is not fully replicated: each addressable shard at its
  index, replicas saved once. As a load target, a ``jax.Array`` or ``jax.ShapeDtypeStruct``
  with such a sharding asks for the boxes of its addressable devices and comes back as an
  array of that sharding.

torch and JAX are imported only when a leaf of theirs is seen.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptstore.layout.chunks import Box
from ckptstore.layout.restore import Pieces

__all__ = ["LocalChunks", "Shard", "local_chunks", "rebuild_pieces", "wanted_boxes"]


class Shard:
    """One rank's shard of a global array, at ``offsets`` in ``global_shape``.

    Saved through :func:`ckptstore.distributed.save`, the shards of all ranks under one path
    become one leaf of ``global_shape``; as a load target, a ``Shard`` asks for its box of
    the saved array (whatever sharding saved it) and comes back as a ``Shard`` holding the
    loaded tensor, of the target tensor's type, dtype and device.

    Args:
        tensor: the shard's data: a torch tensor, numpy array or JAX array (as a target, its
            type, dtype, device and shape say what to load).
        offsets: where the shard starts in every dimension of the global array.
        global_shape: the global array's shape.

    Raises:
        ValueError: the offsets or the global shape do not fit the tensor's shape.
    """

    __slots__ = ("global_shape", "offsets", "tensor")

    def __init__(self, tensor: Any, *, offsets: Sequence[int], global_shape: Sequence[int]) -> None:
        shape = tuple(int(d) for d in tensor.shape)
        self.tensor = tensor
        self.offsets = tuple(_ints(offsets, "offsets"))
        self.global_shape = tuple(_ints(global_shape, "global_shape"))
        if not len(shape) == len(self.offsets) == len(self.global_shape):
            raise ValueError(
                f"a shard of shape {list(shape)} needs offsets and a global shape of "
                f"{len(shape)} dimensions, got {list(self.offsets)} and {list(self.global_shape)}"
            )
        for d, (at, n, total) in enumerate(
            zip(self.offsets, shape, self.global_shape, strict=True)
        ):
            if at < 0 or at + n > total:
                raise ValueError(
                    f"a shard of shape {list(shape)} at offsets {list(self.offsets)} reaches out "
                    f"of the global shape {list(self.global_shape)} (dimension {d})"
                )

    @property
    def box(self) -> Box:
        """The shard's box: its offsets and its shape."""
        return self.offsets, tuple(int(d) for d in self.tensor.shape)

    def __repr__(self) -> str:
        return (
            f"Shard({type(self.tensor).__name__}{list(self.tensor.shape)}, "
            f"offsets={list(self.offsets)}, global_shape={list(self.global_shape)})"
        )


def _ints(values: Sequence[int], name: str) -> list[int]:
    out = []
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise TypeError(f"Shard {name} are ints, got {value!r}")
        out.append(int(value))
    return out


@dataclass(frozen=True, slots=True)
class LocalChunks:
    """What one rank holds of a sharded leaf.

    Attributes:
        global_shape: the leaf's global shape.
        chunks: this rank's distinct boxes and their data (a framework array each).
        placeholder: an empty array of the leaf's framework and dtype: it stands for the
            leaf in the rank's state, so the leaf's dtype and attributes are staged as usual.
    """

    global_shape: tuple[int, ...]
    chunks: list[tuple[Box, Any]]
    placeholder: Any


def _torch_dtensor(leaf: Any) -> Any:
    """The DTensor class if ``leaf`` is a DTensor, else ``None``. Nothing can be a DTensor
    before its module is imported, so a state without any costs no import."""
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    return dtensor if dtensor is not None and isinstance(leaf, dtensor) else None


def _dtensor_box(tensor: Any) -> Box | None:
    """A DTensor's box on this rank, or ``None`` if it is fully replicated."""
    from torch.distributed.tensor import Partial, Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = tuple(tensor.placements)
    if any(isinstance(p, Partial) for p in placements):
        raise ValueError(
            "a DTensor with a Partial placement holds partial sums, not an array; "
            "redistribute it to Shard or Replicate placements before saving"
        )
    if all(isinstance(p, Replicate) for p in placements):
        return None
    shape, offset = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, placements
    )
    return tuple(int(o) for o in offset), tuple(int(d) for d in shape)


def _jax_sharded(leaf: Any) -> bool:
    """Whether ``leaf`` is a JAX array or shape struct with a sharding that splits it."""
    if "jax" not in sys.modules:
        return False
    import jax

    if not isinstance(leaf, jax.Array | jax.ShapeDtypeStruct):
        return False
    sharding = getattr(leaf, "sharding", None)
    return sharding is not None and not sharding.is_fully_replicated


def _box_of_index(index: tuple[slice, ...], shape: Sequence[int]) -> Box:
    starts, sizes = [], []
    for part, n in zip(index, shape, strict=True):
        start, stop, _ = part.indices(n)
        starts.append(start)
        sizes.append(stop - start)
    return tuple(starts), tuple(sizes)


def _empty_like(local: Any) -> Any:
    if "torch" in sys.modules and isinstance(local, sys.modules["torch"].Tensor):
        return local.detach().new_empty((0,))
    if _is_jax_array(local):
        import jax.numpy as jnp

        return jnp.zeros((0,), local.dtype)
    return np.empty(0, np.asarray(local).dtype)


def _is_jax_array(leaf: Any) -> bool:
    return "jax" in sys.modules and isinstance(leaf, sys.modules["jax"].Array)


def local_chunks(leaf: Any) -> LocalChunks | None:
    """What this rank holds of ``leaf`` if it is a shard of a global array, else ``None``.

    Raises:
        ValueError: a DTensor with a ``Partial`` placement.
    """
    if isinstance(leaf, Shard):
        return LocalChunks(leaf.global_shape, [(leaf.box, leaf.tensor)], _empty_like(leaf.tensor))
    if _torch_dtensor(leaf) is not None:
        box = _dtensor_box(leaf)
        if box is None:
            return None
        local = leaf.to_local()
        return LocalChunks(tuple(leaf.shape), [(box, local)], _empty_like(local))
    if _is_jax_array(leaf) and _jax_sharded(leaf):
        shape = tuple(leaf.shape)
        chunks: dict[Box, Any] = {}
        for shard in leaf.addressable_shards:
            chunks.setdefault(_box_of_index(shard.index, shape), shard.data)
        return LocalChunks(shape, list(chunks.items()), _empty_like(leaf))
    return None


def wanted_boxes(like: Any) -> list[Box] | None:
    """The boxes a restore-target leaf asks for, or ``None`` if it asks for the whole leaf.

    Raises:
        ValueError: a DTensor with a ``Partial`` placement.
    """
    if isinstance(like, Shard):
        return [like.box]
    if _torch_dtensor(like) is not None:
        box = _dtensor_box(like)
        return None if box is None else [box]
    if _jax_sharded(like):
        shape = tuple(like.shape)
        found = like.sharding.addressable_devices_indices_map(shape)
        return list(dict.fromkeys(_box_of_index(index, shape) for index in found.values()))
    return None


def rebuild_pieces(pieces: Pieces, attrs: dict[str, Any], like: Any) -> Any:
    """The value a target leaf asked for, from the boxes read for it.

    Raises:
        ValueError: the target's global shape differs from the checkpoint's.
    """
    from ckptstore.stage.stager import rebuild_leaf

    wanted = tuple(like.global_shape if isinstance(like, Shard) else like.shape)
    if wanted != pieces.shape:
        raise ValueError(
            f"the restore target has global shape {list(wanted)}, the checkpoint "
            f"{list(pieces.shape)}"
        )
    if isinstance(like, Shard):
        (array,) = pieces.arrays
        tensor = rebuild_leaf(array, attrs, None, like.tensor)
        return Shard(tensor, offsets=like.offsets, global_shape=like.global_shape)
    dtensor = _torch_dtensor(like)
    if dtensor is not None:
        (array,) = pieces.arrays
        local = rebuild_leaf(array, attrs, None, like.to_local())
        return dtensor.from_local(
            local,
            like.device_mesh,
            like.placements,
            run_check=False,
            shape=like.shape,
            stride=like.stride(),
        )
    import jax

    by_box = dict(zip(pieces.boxes, pieces.arrays, strict=True))
    dtype = np.dtype(like.dtype)
    shape = tuple(like.shape)

    def piece(index: tuple[slice, ...] | None) -> np.ndarray[Any, Any]:
        array = by_box[_box_of_index(index or (), shape)]
        return array if array.dtype == dtype else array.astype(dtype)

    return jax.make_array_from_callback(shape, like.sharding, piece)
