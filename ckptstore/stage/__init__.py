"""Arrays to host buffers: the blocking part of a save, and the way back on restore.

``Stager.stage(state)`` copies every numpy, torch and JAX array of a state into one pooled host
arena and returns a :class:`StagedState` the format layer writes without another copy;
``rebuild_state`` turns restored host arrays back into the arrays a caller asks for. torch and
JAX are imported only by their own modules, and only when the caller has imported them.
"""

from ckptstore.stage.stager import (
    ArrayKind,
    LeafSpec,
    StagedState,
    Stager,
    kind_named,
    rebuild_state,
)
from ckptstore.stage.tree import Path, iter_leaves, map_leaves
from ckptstore.store.buffers import BufferPool, HostBuffer, PoolStats

__all__ = [
    "ArrayKind",
    "BufferPool",
    "HostBuffer",
    "LeafSpec",
    "Path",
    "PoolStats",
    "StagedState",
    "Stager",
    "iter_leaves",
    "kind_named",
    "map_leaves",
    "rebuild_state",
]
