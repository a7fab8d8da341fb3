"""Staging JAX arrays to host buffers, and rebuilding them on restore.

Device-to-host transfers are started on every leaf (``copy_to_host_async``) before the first
one is waited for, so they overlap each other instead of running one after another. A sharded
array is gathered shard by shard straight into its slot of the arena: each addressable shard
with ``replica_id == 0`` is copied to the index range it covers, so replicated shards are
copied once and no intermediate full-size array is built. An array that spans several
processes is staged here only if it is fully replicated (every process copies its own
replica; :func:`ckptstore.distributed.save` writes one of them); one sharded over processes
is saved as chunks by :mod:`ckptstore.pipeline.sharding`, and a save of it here names that.

A lazy snapshot (:mod:`ckptstore.stage.lazy`) needs no version counter for JAX: arrays are
immutable. But an array donated to a jitted function (``donate_argnums``) is deleted, and its
buffer reused for the function's outputs; a lazy snapshot checks ``is_deleted()`` before and
after each copy and refuses the save, naming the leaf, if the array is gone. The transfers
are still started (``copy_to_host_async``) in the ``save()`` call.

bfloat16, float8 and int4 arrays have ``ml_dtypes`` numpy dtypes already, so their host copies
are byte-exact. Restoring without a target puts each array on the default device; a target
(a ``jax.Array`` or ``jax.ShapeDtypeStruct``) gives its sharding and dtype.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from numpy.typing import NDArray

from ckptstore.errors import CorruptCheckpointError
from ckptstore.stage.numpy import check_dtype
from ckptstore.stage.stager import ArrayKind, CopyTask, LeafSpec

__all__ = ["JaxKind"]

_SAME_SIZE_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _copy_shard(dst: NDArray[Any], index: tuple[slice, ...], data: jax.Array) -> None:
    src = np.asarray(data)
    view_index: tuple[Any, ...] = (*index, ...)  # with the ellipsis, a view even when 0-d
    out = dst[view_index]
    # Copy custom (ml_dtypes) types as same-sized unsigned ints: a raw copy numpy runs without
    # the GIL, where a user-defined dtype might hold it.
    uint = _SAME_SIZE_UINT.get(src.dtype.itemsize)
    if src.dtype.kind not in "biufc" and uint is not None:
        src, out = src.view(uint), out.view(uint)
    np.copyto(out, src, casting="no")


class JaxKind(ArrayKind):
    """``jax.Array`` leaves, sharded or not, on the devices of this host."""

    name = "jax"

    def owns(self, leaf: Any) -> bool:
        return isinstance(leaf, jax.Array)

    def start(self, leaves: list[Any]) -> None:
        for leaf in leaves:
            leaf.copy_to_host_async()

    def spec(self, leaf: Any) -> LeafSpec:
        array: jax.Array = leaf
        if jnp.issubdtype(array.dtype, jax.dtypes.prng_key):
            raise TypeError("typed PRNG key arrays: save jax.random.key_data(key) instead")
        if not (array.is_fully_addressable or array.sharding.is_fully_replicated):
            raise TypeError(
                "the array is sharded over several processes, so this process holds only part "
                "of it; save it with ckptstore.distributed.save on every process, which saves "
                "each process's shards as chunks of one leaf"
            )
        dtype = np.dtype(array.dtype)
        check_dtype(dtype)
        devices = sorted(array.devices(), key=lambda d: d.id)
        attrs: dict[str, Any] = {
            "framework": self.name,
            "dtype": str(dtype),
            "device": str(devices[0]),
            "devices": len(devices),
        }
        return LeafSpec(dtype, tuple(array.shape), attrs)

    def copies(self, leaf: Any, dst: NDArray[Any], chunk_bytes: int) -> list[CopyTask]:
        array: jax.Array = leaf
        # One addressable replica per index range. It is replica 0 when the array is on
        # this host alone; an array replicated over several processes has replica 0 on one
        # of them only, and every process copies its own replica.
        first: dict[tuple[tuple[int, int], ...], Any] = {}
        for shard in sorted(array.addressable_shards, key=lambda s: s.replica_id):
            span = tuple(
                part.indices(n)[:2] for part, n in zip(shard.index, dst.shape, strict=True)
            )
            first.setdefault(span, shard)
        tasks: list[CopyTask] = []
        for shard in first.values():
            nbytes = int(np.prod(shard.data.shape, dtype=np.int64)) * dst.itemsize
            tasks.append((nbytes, functools.partial(_copy_shard, dst, shard.index, shard.data)))
        return tasks

    def version(self, leaf: Any) -> int | None:
        return 0  # immutable: only deletion (donation) can take its value away

    def lost(self, leaf: Any, version: int) -> str | None:
        if not leaf.is_deleted():
            return None
        return (
            "was deleted (donated to a jitted function, or deleted by hand); call fence() "
            "before the call that donates it"
        )

    def rebuild(self, array: NDArray[Any], attrs: dict[str, Any], like: Any | None) -> Any:
        if like is None:
            if attrs.get("framework") == self.name and not _jax_holds(array.dtype):
                # An array saved by JAX always has a dtype JAX has: the manifest lies.
                raise CorruptCheckpointError(f"a leaf saved as a JAX array has dtype {array.dtype}")
            return jax.device_put(array)
        if np.dtype(like.dtype) != array.dtype:
            array = array.astype(like.dtype)
        sharding = getattr(like, "sharding", None)
        if sharding is None:
            return jax.device_put(array)
        if not sharding.is_fully_addressable:
            # a sharding over several processes: each fills its own devices from the array
            return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])
        return jax.device_put(array, sharding)


@functools.cache
def _jax_holds(dtype: np.dtype[Any]) -> bool:
    """Whether JAX has arrays of ``dtype`` (asked once per dtype, with an empty array)."""
    try:
        jax.device_put(np.empty(0, dtype))
    except (TypeError, jax.errors.JaxRuntimeError):
        return False
    return True


def is_jax_target(like: Any) -> bool:
    """Whether ``like`` (a restore target leaf) asks for a JAX array."""
    return isinstance(like, jax.Array | jax.ShapeDtypeStruct)
