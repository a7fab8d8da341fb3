"""Walking a state: nested dicts, lists and tuples whose leaves are arrays or plain values.

The stager needs to find every array leaf of a state, replace it by its staged copy and rebuild
the same structure, without knowing how the checkpoint format names leaves. A leaf's *path* here
is the tuple of keys and indices that reaches it (``("optimizer", "state", 0, "exp_avg")``);
the format layer turns paths into its own names.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeAlias

__all__ = ["Path", "iter_leaves", "map_leaves"]

#: Keys and indices from the root of a state to one leaf.
Path: TypeAlias = tuple[Any, ...]


def _is_namedtuple(node: object) -> bool:
    return isinstance(node, tuple) and hasattr(type(node), "_fields")


def iter_leaves(tree: Any, prefix: Path = ()) -> Iterator[tuple[Path, Any]]:
    """Every leaf of ``tree`` with its path, depth first, dict entries in insertion order."""
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from iter_leaves(value, (*prefix, key))
    elif isinstance(tree, list | tuple):
        for index, value in enumerate(tree):
            yield from iter_leaves(value, (*prefix, index))
    else:
        yield prefix, tree


def map_leaves(fn: Callable[[Path, Any], Any], tree: Any, prefix: Path = ()) -> Any:
    """``tree`` rebuilt with every leaf replaced by ``fn(path, leaf)``.

    Dicts keep their keys and order (an ``OrderedDict`` stays one; other mappings become
    ``dict``), lists stay lists, tuples and named tuples keep their type.
    """
    if isinstance(tree, Mapping):
        items = {key: map_leaves(fn, value, (*prefix, key)) for key, value in tree.items()}
        return OrderedDict(items) if type(tree) is OrderedDict else items
    if isinstance(tree, list):
        return [map_leaves(fn, value, (*prefix, i)) for i, value in enumerate(tree)]
    if isinstance(tree, tuple):
        values = [map_leaves(fn, value, (*prefix, i)) for i, value in enumerate(tree)]
        return type(tree)(*values) if _is_namedtuple(tree) else type(tree)(values)
    return fn(prefix, tree)
