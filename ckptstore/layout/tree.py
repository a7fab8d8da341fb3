"""Nested states to named leaves and back.

A state is a nest of dicts, lists and tuples whose leaves are numpy arrays (or numpy scalars)
and plain JSON values (``None``, bools, ints, floats, strings). :func:`flatten` turns it into
a :class:`FlatState`: the arrays in a flat list, each with a path, and a *tree*, a JSON
description of the nesting in which every array is replaced by its index in that list and
every plain value is stored inline. :func:`unflatten` inverts it. Nothing is pickled: a leaf
of any other type is refused with an error naming its path.

Paths join the keys from the root with ``/``; a ``/`` or ``~`` inside a dict key is escaped
as ``~1`` or ``~0`` (JSON Pointer's escaping), so every path names exactly one leaf. Dict keys
may be strings or ints (torch optimizer states use int keys); a dict holding both ``1`` and
``"1"`` is refused, since the two would share a path.

Tree encoding (JSON), one node per container or leaf::

    int i                       array leaf i (the i-th entry of FlatState.arrays)
    {"s": i}                    numpy scalar leaf i (restored as a numpy scalar)
    {"v": value}                a plain JSON value
    {"d": [keys], "c": [nodes]} a dict (keys are str or int, in insertion order)
    {"l": [nodes]}              a list
    {"t": [nodes]}              a tuple

A stager (torch, JAX) builds the same structure with :func:`flatten`'s ``convert`` hook,
handing over host arrays it has already staged and per-leaf ``attrs`` (JSON) that the
manifest stores and :func:`unflatten`'s ``restore`` hook gets back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ckptstore.layout.dtypes import dtype_name

__all__ = [
    "MAX_DEPTH",
    "FlatState",
    "UnsupportedLeafError",
    "escape_key",
    "flatten",
    "join_path",
    "select_paths",
    "tree_paths",
    "unflatten",
]

#: Deepest nesting a state (and a manifest's tree) may have.
MAX_DEPTH = 200

#: What ``convert`` returns for a leaf it handles: the host array and its attrs.
Converted = tuple[np.ndarray[Any, Any], dict[str, Any] | None]


class UnsupportedLeafError(TypeError):
    """A state holds a leaf that a checkpoint cannot store; the message names its path."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        super().__init__(f"state leaf {path or '<root>'!r}: {reason}")


@dataclass(slots=True)
class FlatState:
    """A state as flat arrays plus the JSON tree that puts them back together.

    Attributes:
        tree: the nesting, in the encoding described in this module's docstring.
        paths: path of each array leaf, unique.
        arrays: host numpy arrays, one per path, of allowed dtypes (any strides).
        attrs: per array leaf, a JSON dict stored in the manifest (``None``: nothing).
    """

    tree: Any
    paths: list[str] = field(default_factory=list)
    arrays: list[np.ndarray[Any, Any]] = field(default_factory=list)
    attrs: list[dict[str, Any] | None] = field(default_factory=list)

    @property
    def nbytes(self) -> list[int]:
        """Bytes of each array leaf."""
        return [a.nbytes for a in self.arrays]


def escape_key(key: str | int) -> str:
    """One path segment for a dict key."""
    if isinstance(key, int):
        return str(key)
    if "~" in key or "/" in key:
        return key.replace("~", "~0").replace("/", "~1")
    return key


def join_path(prefix: str, segment: str, depth: int) -> str:
    """The path of a child at ``segment`` of the node at ``prefix`` (at ``depth``; the root's
    children are at depth 0 and their paths are just their segments)."""
    return segment if depth == 0 else f"{prefix}/{segment}"


def flatten(
    state: Any,
    *,
    convert: Callable[[Any, str], Converted | None] | None = None,
) -> FlatState:
    """Split ``state`` into array leaves and a JSON tree.

    Args:
        state: nested dicts (any ``Mapping``), lists and tuples of numpy arrays, numpy
            scalars and plain JSON values.
        convert: called with ``(leaf, path)`` for each leaf that is not a container, numpy
            value or plain value; returns ``(host_array, attrs)`` to store it, or ``None``
            to refuse it. Stagers pass their tensor conversion here.

    Raises:
        UnsupportedLeafError: a leaf of another type, an object/string dtype, a dict key
            that is neither str nor int, colliding keys, or nesting deeper than MAX_DEPTH.
    """
    flat = FlatState(tree=None)
    paths = flat.paths
    arrays = flat.arrays
    attrs = flat.attrs

    def add_array(array: np.ndarray[Any, Any], path: str, leaf_attrs: dict[str, Any] | None) -> int:
        if dtype_name(array.dtype) is None:
            raise UnsupportedLeafError(
                path,
                f"arrays of dtype {array.dtype} cannot be stored (numeric, bool, complex and "
                "ml_dtypes types only; nothing is pickled)",
            )
        arrays.append(array)
        paths.append(path)
        attrs.append(leaf_attrs)
        return len(arrays) - 1

    def visit(node: Any, path: str, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise UnsupportedLeafError(path, f"nested deeper than {MAX_DEPTH} levels")
        kind = type(node)
        if kind is np.ndarray:
            return add_array(node, path, None)
        if node is None or kind is bool or kind is str or kind is int or kind is float:
            return {"v": node}
        if isinstance(node, Mapping):
            keys: list[str | int] = []
            children: list[Any] = []
            seen: set[str] = set()
            for key, value in node.items():
                if type(key) is not str and type(key) is not int:
                    raise UnsupportedLeafError(
                        path, f"dict key {key!r} is a {type(key).__name__}; keys are str or int"
                    )
                segment = escape_key(key)
                if segment in seen:
                    raise UnsupportedLeafError(
                        path, f"dict keys {key!r} and {segment!r} would share one path"
                    )
                seen.add(segment)
                keys.append(key)
                children.append(visit(value, join_path(path, segment, depth), depth + 1))
            return {"d": keys, "c": children}
        if isinstance(node, list | tuple):
            items = [
                visit(v, join_path(path, str(i), depth), depth + 1) for i, v in enumerate(node)
            ]
            return {"t": items} if isinstance(node, tuple) else {"l": items}
        if isinstance(node, np.ndarray):  # subclasses (memmap, matrix) are stored as arrays
            return add_array(np.asarray(node), path, None)
        if isinstance(node, np.generic):
            return {"s": add_array(np.asarray(node), path, None)}
        if isinstance(node, bool | int | float | str):  # subclasses (IntEnum...) as plain values
            return {"v": _plain(node)}
        if convert is not None:
            converted = convert(node, path)
            if converted is not None:
                array, leaf_attrs = converted
                return add_array(array, path, leaf_attrs)
        raise UnsupportedLeafError(
            path,
            f"{type(node).__module__}.{type(node).__qualname__} is not storable; "
            "use numpy arrays, nested dicts/lists/tuples and plain JSON values "
            "(nothing is pickled)",
        )

    flat.tree = visit(state, "", 0)
    return flat


def _plain(value: bool | int | float | str) -> bool | int | float | str:
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    return str(value)


def tree_paths(tree: Any, count: int) -> tuple[list[str | None], list[str]]:
    """Walk an untrusted ``tree`` and return ``(path of each array leaf, value paths)``.

    Raises ``ValueError`` with a reason if the tree is malformed: unknown node shapes, leaf
    indices outside ``[0, count)`` or used twice, bad dict keys, or excessive depth. Callers
    that built the tree themselves may skip this.
    """
    leaf_paths: list[str | None] = [None] * count
    value_paths: list[str] = []
    stack: list[tuple[Any, str, int]] = [(tree, "", 0)]
    while stack:
        node, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ValueError(f"tree nested deeper than {MAX_DEPTH} levels at {path!r}")
        kind = type(node)
        if kind is int or (kind is dict and len(node) == 1 and "s" in node):
            index = node if kind is int else node["s"]
            if type(index) is not int or not 0 <= index < count:
                raise ValueError(f"tree leaf {path!r} names array {index!r} of {count}")
            if leaf_paths[index] is not None:
                raise ValueError(f"tree names array {index} twice ({path!r})")
            leaf_paths[index] = path
            continue
        if kind is not dict:
            raise ValueError(f"tree node at {path!r} is a {kind.__name__}, not an object")
        if len(node) == 1 and "v" in node:
            value = node["v"]
            if value is not None and type(value) not in (bool, int, float, str):
                raise ValueError(f"tree value at {path!r} is a {type(value).__name__}")
            value_paths.append(path)
            continue
        if len(node) == 2 and "d" in node and "c" in node:
            keys, children = node["d"], node["c"]
            if type(keys) is not list or type(children) is not list or len(keys) != len(children):
                raise ValueError(f"tree dict at {path!r} has mismatched keys and children")
            seen: set[str] = set()
            for key, child in zip(keys, children, strict=True):
                if type(key) is not str and type(key) is not int:
                    raise ValueError(f"tree dict at {path!r} has a {type(key).__name__} key")
                segment = escape_key(key)
                if segment in seen:
                    raise ValueError(f"tree dict at {path!r} repeats key {segment!r}")
                seen.add(segment)
                stack.append((child, join_path(path, segment, depth), depth + 1))
            continue
        if len(node) == 1 and ("l" in node or "t" in node):
            items = node.get("l", node.get("t"))
            if type(items) is not list:
                raise ValueError(f"tree sequence at {path!r} is not a list")
            stack.extend(
                (child, join_path(path, str(i), depth), depth + 1) for i, child in enumerate(items)
            )
            continue
        raise ValueError(f"tree node at {path!r} has unknown fields {sorted(node)[:5]}")
    missing = [i for i, p in enumerate(leaf_paths) if p is None]
    if missing:
        raise ValueError(f"tree does not place arrays {missing[:5]} (of {len(missing)})")
    return leaf_paths, value_paths


def unflatten(
    tree: Any,
    leaves: Sequence[Any] | Mapping[int, Any],
    *,
    selected: Callable[[str], bool] | None = None,
    restore: Callable[[Any, int], Any] | None = None,
) -> Any:
    """Rebuild the nested state from ``tree`` and the array ``leaves`` (by index).

    Args:
        tree: a tree from :func:`flatten` (or a validated manifest).
        leaves: the value of each array leaf, by index; a mapping may omit unselected ones.
        selected: if given, keep only leaves whose path it accepts: dicts drop unselected
            entries, lists and tuples keep their length with ``None`` in unselected places,
            and containers left with nothing selected are dropped.
        restore: called as ``restore(array, index)`` for each array leaf (not numpy
            scalars); its result takes the array's place. Stagers turn arrays back into
            tensors here, using the leaf's attrs from the manifest.
    """
    missing = object()

    def build(node: Any, path: str, depth: int) -> Any:
        if type(node) is int:
            if selected is not None and not selected(path):
                return missing
            return leaves[node] if restore is None else restore(leaves[node], node)
        if "v" in node:
            if selected is not None and not selected(path):
                return missing
            return node["v"]
        if "s" in node:
            if selected is not None and not selected(path):
                return missing
            value = leaves[node["s"]]
            return value[()] if isinstance(value, np.ndarray) else value
        if "d" in node:
            out: dict[str | int, Any] = {}
            for key, child in zip(node["d"], node["c"], strict=True):
                value = build(child, join_path(path, escape_key(key), depth), depth + 1)
                if value is not missing:
                    out[key] = value
            if selected is not None and not out and node["d"]:
                return missing
            return out
        items = node["l"] if "l" in node else node["t"]
        values = [build(c, join_path(path, str(i), depth), depth + 1) for i, c in enumerate(items)]
        if selected is not None and items and all(v is missing for v in values):
            return missing
        values = [None if v is missing else v for v in values]
        return tuple(values) if "t" in node else values

    result = build(tree, "", 0)
    return {} if result is missing else result


def select_paths(patterns: Iterable[str]) -> Callable[[str], bool]:
    """A predicate accepting a path equal to a pattern or under it (``"model"`` accepts
    ``"model/w"``)."""
    exact = set(patterns)
    prefixes = tuple(p + "/" for p in exact if p)

    def accept(path: str) -> bool:
        return path in exact or "" in exact or (bool(prefixes) and path.startswith(prefixes))

    return accept
