"""Walking a state in the stage layer: the format layer's walker, plus the containers that
array frameworks register.

There is one walker (:mod:`ckptstore.layout.tree`): it knows dicts, lists, tuples, named tuples
and dataclasses, and takes every other container kind from an ``expand`` hook, since the format
layer knows nothing of torch or JAX. This module is that hook. JAX users keep their state in
pytrees: an optax optimizer state is named tuples, a flax ``TrainState`` is a registered
``struct.dataclass`` whose optimizer and apply function are static fields, an equinox model is
a registered module. :func:`expand` asks JAX's own registry how such a node comes apart (its
children, keyed by field name where JAX gives keys) and how it goes back together, so the stager
saves exactly the children JAX sees, and a restore target is rebuilt by JAX's own unflatten.
JAX is consulted only when the program has imported it.

The stager's walkers are :func:`iter_leaves` and :func:`map_leaves` of the format layer with this
hook bound in; a leaf's *path* is its checkpoint path (``"optimizer/state/0/exp_avg"``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeAlias

from ckptstore.layout import tree as layout_tree
from ckptstore.layout.tree import Branch

__all__ = ["Path", "expand", "iter_leaves", "map_leaves"]

#: A leaf's path from the root of a state: its name in the checkpoint.
Path: TypeAlias = str

#: Types JAX's registry called leaves; a type is registered (or not) once, at definition.
_JAX_LEAF_TYPES: set[type] = set()


def _key(entry: Any, node: Any) -> str | int:
    """The dict key of one JAX key-path entry (a field name, a dict key, an index)."""
    for name in ("name", "key", "idx"):  # GetAttrKey, DictKey/FlattenedIndexKey, SequenceKey
        value = getattr(entry, name, None)
        if type(value) is str or type(value) is int:
            return value
    raise layout_tree.UnsupportedLeafError(
        "", f"{type(node).__qualname__} has a pytree child keyed {entry!r}; keys are str or int"
    )


def expand(node: Any) -> Branch | None:
    """The children of a node JAX's pytree registry knows, or ``None`` (also without JAX)."""
    if "jax" not in sys.modules:
        return None
    kind = type(node)
    if kind in _JAX_LEAF_TYPES:
        return None
    tree_util = sys.modules["jax"].tree_util
    children, treedef = tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    if len(children) == 1 and children[0][0] == () and children[0][1] is node:
        _JAX_LEAF_TYPES.add(kind)
        return None
    keys = [_key(path[-1], node) for path, _ in children]
    values = [value for _, value in children]

    def remake(new: list[Any]) -> Any:
        return tree_util.tree_unflatten(treedef, new)

    return Branch("d", keys, values, remake)


def iter_leaves(state: Any) -> Iterator[tuple[Path, Any]]:
    """Every leaf of ``state`` with its path (:func:`ckptstore.layout.tree.iter_leaves`)."""
    return layout_tree.iter_leaves(state, expand=expand)


def map_leaves(fn: Callable[[Path, Any], Any], state: Any) -> Any:
    """``state`` with every leaf replaced by ``fn(path, leaf)``, containers kept
    (:func:`ckptstore.layout.tree.map_leaves`)."""
    return layout_tree.map_leaves(fn, state, expand=expand)
