"""Nested states to named leaves and back: the one walker and codec of a state's structure.

A state is a nest of containers whose leaves are arrays, plain JSON values (``None``, bools,
ints, floats, strings) and the few other values training states hold, stored by name (the
*typed values*: a ``torch.dtype``, a ``torch.device``; :data:`VALUE_KINDS`). The containers
are the ones users' training states are made of:

* dicts and other mappings (an ``OrderedDict`` comes back as one; any other mapping as a
  dict),
* lists, tuples and named tuples (an optax ``ScaleByAdamState``),
* dataclasses (walked by field),
* nodes a framework registers, through the ``expand`` hook every walker here takes: the stage
  layer passes JAX's pytree registry (:func:`ckptstore.stage.tree.expand`), so a flax
  ``struct.dataclass`` or an equinox module is walked by the children JAX gives it, and
  fields JAX keeps out of the tree (an optimizer's functions) are not part of the state.

:func:`iter_leaves` and :func:`map_leaves` walk a live state (the stager finds and replaces
its arrays with them; restore rebuilds a target's structure with them); :func:`flatten` turns
a state into a :class:`FlatState`: the arrays in a flat list, each with a path, and a *tree*,
a JSON description of the nesting in which every array is replaced by its index in that list
and every plain value is stored inline. :func:`unflatten` inverts it. Nothing is pickled, and
no class is named in the tree: a named tuple is stored as a tuple, a dataclass or registered
node as a dict of its children. Without a target they come back as those plain containers;
given a target (``like``) of the same structure, :func:`unflatten` rebuilds the target's own
containers (the named tuple, the ``TrainState``) around the restored leaves. A leaf of any
other type is refused with an error naming its path.

Paths join the keys from the root with ``/``; a ``/`` or ``~`` inside a dict key is escaped
as ``~1`` or ``~0`` (JSON Pointer's escaping), so every path names exactly one leaf. Dict keys
may be strings or ints (torch optimizer states use int keys); a dict holding both ``1`` and
``"1"`` is refused, since the two would share a path.

Tree encoding (JSON), one node per container or leaf::

    int i                       array leaf i (the i-th entry of FlatState.arrays)
    {"s": i}                    numpy scalar leaf i (restored as a numpy scalar)
    {"v": value}                a plain JSON value
    {"x": [kind, text]}         a typed value: its kind (a key of VALUE_KINDS) and its name
    {"d": [keys], "c": [nodes]} a dict, dataclass or registered node (keys str or int, in order)
    {"d": [keys], "c": [nodes], "o": 1}
                                an OrderedDict
    {"l": [nodes]}              a list
    {"t": [nodes]}              a tuple or named tuple

The ``"x"`` node and the ``"o"`` field came with manifest format version 4; a tree holding
neither is what versions 1 to 3 hold (:func:`uses_version_4` tells which).

A stager (torch, JAX) builds the same structure with :func:`flatten`'s ``convert`` hook,
handing over host arrays it has already staged and per-leaf ``attrs`` (JSON) that the
manifest stores and :func:`unflatten`'s ``restore`` hook gets back.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter, itemgetter
from typing import Any

import numpy as np

from ckptstore.errors import CheckpointFormatError, MissingDependencyError
from ckptstore.layout.dtypes import dtype_name

__all__ = [
    "MAX_DEPTH",
    "Branch",
    "Expand",
    "FlatState",
    "VALUE_KINDS",
    "UnsupportedLeafError",
    "branch",
    "escape_key",
    "flatten",
    "is_optimizer_path",
    "iter_leaves",
    "join_path",
    "map_leaves",
    "select_paths",
    "tree_paths",
    "unflatten",
    "uses_version_4",
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


@dataclass(frozen=True, slots=True)
class ValueKind:
    """A kind of typed value: how one is named in a tree and made again from its name.

    Attributes:
        name: the kind as the tree's ``"x"`` node spells it (``"torch.dtype"``).
        module, type_name: the type of its values (module and qualified name), by which
            :func:`flatten` recognises one without importing the library.
        pattern: the names a manifest may give (checked when it is read).
        text: the name of a value.
        value: the value a name stands for; raises :class:`CheckpointFormatError` if this
            installation has none of that name.
    """

    name: str
    module: str
    type_name: str
    pattern: re.Pattern[str]
    text: Callable[[Any], str]
    value: Callable[[str], Any]


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise MissingDependencyError(
            "the checkpoint holds torch values (a torch.dtype or torch.device); loading it "
            "needs torch: pip install torch"
        ) from exc
    return torch


def _torch_dtype(text: str) -> Any:
    torch = _torch()
    found = getattr(torch, text, None)
    if not isinstance(found, torch.dtype):
        raise CheckpointFormatError(
            f"the checkpoint holds torch.{text}, a dtype torch {torch.__version__} does not have"
        )
    return found


def _torch_device(text: str) -> Any:
    torch = _torch()
    try:
        return torch.device(text)
    except (RuntimeError, ValueError) as exc:
        raise CheckpointFormatError(
            f"the checkpoint holds torch.device({text!r}), which torch {torch.__version__} "
            f"does not know ({exc})"
        ) from None


#: The kinds of typed value, by name; docs/format.md lists them. A new kind is a new format
#: version: a reader refuses a name it does not know.
VALUE_KINDS: dict[str, ValueKind] = {
    kind.name: kind
    for kind in (
        ValueKind(
            "torch.dtype",
            "torch",
            "dtype",
            re.compile(r"[a-z][a-z0-9_]{0,39}"),
            lambda value: str(value).removeprefix("torch."),
            _torch_dtype,
        ),
        ValueKind(
            "torch.device",
            "torch",
            "device",
            re.compile(r"[a-z][a-z0-9_]{0,19}(:[0-9]{1,6})?"),
            str,
            _torch_device,
        ),
    )
}
_KIND_OF_TYPE = {(kind.module, kind.type_name): kind for kind in VALUE_KINDS.values()}


def uses_version_4(encoded_tree: bytes) -> bool:
    """Whether a tree, as compact JSON, holds a typed value or an ``OrderedDict`` (what
    needs manifest format version 4).

    A search of the bytes, not a walk: a ``"`` inside a JSON string is always written
    ``\\"``, so ``{"x":`` and ``"o":`` occur only as a node's own fields.
    """
    return b'{"x":' in encoded_tree or b'"o":' in encoded_tree


@dataclass(slots=True)
class Branch:
    """A container as the walkers see it.

    Attributes:
        tag: how the tree encodes it: ``"d"`` (by key), ``"l"`` (list) or ``"t"`` (tuple).
        keys: the key of each child (str or int; for sequences, the index).
        values: the children, in order.
        remake: builds the same kind of container around new children (in the same order);
            ``None`` for dicts, lists and tuples, which :meth:`rebuild` handles.
    """

    tag: str
    keys: Sequence[Any]
    values: Sequence[Any]
    remake: Callable[[list[Any]], Any] | None = None

    def rebuild(self, node: Any, values: list[Any]) -> Any:
        """A container like ``node`` (the one this branch was taken from) holding ``values``."""
        if self.remake is not None:
            return self.remake(values)
        if self.tag == "l":
            return values
        if self.tag == "t":
            kind = type(node)
            if kind is tuple:
                return tuple(values)
            return kind(*values) if hasattr(kind, "_fields") else kind(values)
        items = zip(self.keys, values, strict=True)
        return OrderedDict(items) if type(node) is OrderedDict else dict(items)


#: A framework's registry of container types: the :class:`Branch` of a node it knows, or
#: ``None`` for anything else. Called only for nodes that are not dicts, lists, tuples,
#: arrays or plain values, so it may be slower than the built-in cases (it should cache).
Expand = Callable[[Any], Branch | None]

#: Types that are never containers; checked first because most nodes of a state are leaves.
_LEAF_TYPES: frozenset[type] = frozenset(
    {np.ndarray, int, float, bool, str, bytes, type(None), complex}
)


def _dataclass_remake(node: Any, names: list[str]) -> Callable[[list[Any]], Any]:
    def remake(values: list[Any]) -> Any:
        # A shallow copy with the fields set directly works for frozen and slotted dataclasses
        # and for fields with init=False, where dataclasses.replace would not.
        out = copy.copy(node)
        for name, value in zip(names, values, strict=True):
            object.__setattr__(out, name, value)
        return out

    return remake


def branch(node: Any, expand: Expand | None = None) -> Branch | None:
    """How the walkers take ``node`` apart, or ``None`` if it is a leaf.

    Dicts and mappings, lists, tuples (named tuples included) and dataclass instances are
    containers, and so is every node ``expand`` knows; anything else (arrays, plain values,
    objects nobody knows) is a leaf.
    """
    kind = type(node)
    if kind in _LEAF_TYPES:
        return None
    if kind is dict:
        return Branch("d", list(node), list(node.values()))
    if kind is list:
        return Branch("l", range(len(node)), node)
    if isinstance(node, tuple):
        return Branch("t", range(len(node)), node)
    if isinstance(node, np.ndarray | np.generic):
        return None
    if expand is not None:
        found = expand(node)
        if found is not None:
            return found
    if isinstance(node, Mapping):
        return Branch("d", list(node), list(node.values()))
    if isinstance(node, list):
        return Branch("l", range(len(node)), node)
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        names = [f.name for f in dataclasses.fields(node)]
        values = [getattr(node, name) for name in names]
        return Branch("d", names, values, _dataclass_remake(node, names))
    return None


def walker_branch(expand: Expand | None) -> Callable[[Any], Branch | None]:
    """:func:`branch` for one walk of a state, remembering the types it found to be leaves.

    Whether a node is a leaf depends on its type alone: each container kind is recognised by
    type, and JAX's registry is keyed by type too (``expand`` must keep to that). A state of
    20,000 tensors has a handful of leaf types, so the chain of checks in :func:`branch`
    (costliest for leaves, which fail every one of them, an ``isinstance`` against the
    ``Mapping`` ABC among them) runs once per type instead of once per leaf.
    """
    leaf_types: set[type] = set()

    def of(node: Any) -> Branch | None:
        kind = type(node)
        if kind in leaf_types:
            return None
        found = branch(node, expand)
        if found is None:
            leaf_types.add(kind)
        return found

    return of


@dataclass(slots=True)
class FlatState:
    """A state as flat arrays plus the JSON tree that puts them back together.

    Attributes:
        tree: the nesting, in the encoding described in this module's docstring.
        paths: path of each array leaf, unique.
        arrays: host numpy arrays, one per path, of allowed dtypes (any strides).
        attrs: per array leaf, a JSON dict stored in the manifest (``None``: nothing).
        region: a host buffer the writer owns that holds some of the arrays (a staging
            arena), or ``None``. A local save writes runs of consecutive leaves in it as one
            object each, straight from it (:meth:`~ckptstore.layout.plan.PackPlan.in_region`),
            and zeroes the padding between them.
    """

    tree: Any
    paths: list[str] = field(default_factory=list)
    arrays: list[np.ndarray[Any, Any]] = field(default_factory=list)
    attrs: list[dict[str, Any] | None] = field(default_factory=list)
    region: np.ndarray[Any, np.dtype[np.uint8]] | None = None
    #: Per array leaf, its offset in :attr:`region` (``-1``: outside it), as whoever laid
    #: the leaves out there recorded it; ``None``: found from the arrays' addresses.
    region_at: list[int] | None = None

    def region_offsets(self) -> list[int] | None:
        """Per array leaf, its byte offset in :attr:`region` (``-1`` for a leaf outside it,
        or not C-contiguous), or ``None`` without a region.

        The stager records them as it lays the arena out (:attr:`region_at`): reading each
        array's address (``__array_interface__``) costs about 4.7 us a leaf, 94 ms for
        20,000 leaves."""
        region = self.region
        if region is None:
            return None
        if self.region_at is not None:
            return self.region_at
        start = region.__array_interface__["data"][0]
        end = start + region.nbytes
        offsets = []
        for array in self.arrays:
            at = array.__array_interface__["data"][0]
            inside = start <= at and at + array.nbytes <= end and array.flags.c_contiguous
            offsets.append(at - start if inside else -1)
        return offsets

    @property
    def nbytes(self) -> list[int]:
        """Bytes of each array leaf."""
        return [a.nbytes for a in self.arrays]

    @property
    def shapes(self) -> list[list[int]]:
        """Shape of each array leaf, as the manifest records it."""
        return [[*a.shape] for a in self.arrays]  # 2x faster than list(a.shape) a leaf

    def dtype_names(self) -> list[str]:
        """The manifest's dtype name of each array leaf.

        Raises:
            UnsupportedLeafError: naming the first leaf whose dtype no checkpoint can hold.
        """
        # a state has few dtypes and many leaves: each dtype is named once, and the leaves'
        # names looked up in bulk (a loop per leaf was 1.8 ms of a 20,000-leaf save)
        dtypes = list(map(_DTYPE, self.arrays))
        known = {dtype: dtype_name(dtype) for dtype in set(dtypes)}
        if None in known.values():
            for path, dtype in zip(self.paths, dtypes, strict=True):
                if known[dtype] is None:
                    raise UnsupportedLeafError(path, f"dtype {dtype} cannot be stored")
        return list(map(known.__getitem__, dtypes))  # type: ignore[arg-type]  # no None


#: Path segments that mark a leaf as optimizer state (besides any starting with ``optim``).
_OPTIMIZER_SEGMENTS = frozenset({"opt", "opt_state", "opt_states"})


def is_optimizer_path(path: str) -> bool:
    """Whether the leaf at ``path`` is optimizer state by the default rule of ``stream=True``:
    a segment starting with ``optim`` or equal to ``opt``, ``opt_state`` or ``opt_states``
    (case-insensitive). A streaming restore reads these after the rest, and a save keeps
    them in objects apart from the rest (:meth:`~ckptstore.layout.plan.PackPlan.in_region`)."""
    for segment in path.split("/"):
        low = segment.lower()
        if low.startswith("optim") or low in _OPTIMIZER_SEGMENTS:
            return True
    return False


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


class _BadKey(Exception):
    """A dict key that is neither str nor int (the key is the argument)."""


def _key_segments(keys: Iterable[Any]) -> list[str]:
    """The path segment of each dict key (:func:`escape_key`), or :class:`_BadKey`.

    Inline rather than a call of escape_key per key: this runs for every dict of every save
    and every manifest read, and on 20,000 leaves in one dict the calls were ~1 us a key."""
    if type(keys) is list and keys and not set(map(type, keys)) - {str}:
        joined = "".join(keys)
        if "~" not in joined and "/" not in joined:  # nothing to escape: each key is itself
            return list(keys)
    segments: list[str] = []
    for key in keys:
        kind = type(key)
        if kind is str:
            segments.append(key if "~" not in key and "/" not in key else escape_key(key))
        elif kind is int:
            segments.append(str(key))
        else:
            raise _BadKey(key)
    return segments


def _child_paths(found: Branch, path: str, depth: int) -> list[str]:
    """The path of each child of ``found`` (at ``path``, ``depth``); refuses keys that are
    neither str nor int and keys that would share a path."""
    if depth > MAX_DEPTH:
        raise UnsupportedLeafError(path, f"nested deeper than {MAX_DEPTH} levels")
    if found.tag != "d":
        return [join_path(path, str(i), depth) for i in range(len(found.values))]
    try:
        segments = _key_segments(found.keys)
    except _BadKey as exc:
        key = exc.args[0]
        raise UnsupportedLeafError(
            path, f"dict key {key!r} is a {type(key).__name__}; keys are str or int"
        ) from None
    if len(segments) > 1 and len(set(segments)) != len(segments):
        # an int key and its digits as a str, or a key escaped into another's spelling
        seen: dict[str, Any] = {}
        for key, segment in zip(found.keys, segments, strict=True):
            if segment in seen:
                raise UnsupportedLeafError(
                    path, f"dict keys {seen[segment]!r} and {key!r} would share one path"
                )
            seen[segment] = key
    if depth == 0:
        return segments
    return [f"{path}/{segment}" for segment in segments]


def iter_leaves(
    state: Any,
    *,
    expand: Expand | None = None,
    is_leaf: Callable[[Any], bool] | None = None,
) -> Iterator[tuple[str, Any]]:
    """Every leaf of ``state`` with its path, depth first, in container order.

    Args:
        state: any nest of the containers :func:`branch` knows.
        expand: the framework registry (see :data:`Expand`).
        is_leaf: nodes it accepts are leaves even if they are containers.

    Raises:
        UnsupportedLeafError: a dict key that is neither str nor int, colliding keys, or
            nesting deeper than MAX_DEPTH.
    """
    branch_of = walker_branch(expand)
    stack: list[tuple[Any, str, int]] = [(state, "", 0)]
    while stack:
        node, path, depth = stack.pop()
        found = None if is_leaf is not None and is_leaf(node) else branch_of(node)
        if found is None:
            yield path, node
            continue
        children = zip(found.values, _child_paths(found, path, depth), strict=True)
        stack.extend((value, child, depth + 1) for value, child in reversed(list(children)))


def map_leaves(
    fn: Callable[[str, Any], Any],
    state: Any,
    *,
    expand: Expand | None = None,
    is_leaf: Callable[[Any], bool] | None = None,
    on_branch: Callable[[str, Any], Any] | None = None,
) -> Any:
    """``state`` rebuilt with every leaf replaced by ``fn(path, leaf)``.

    Containers keep their kind (see :meth:`Branch.rebuild`): an ``OrderedDict`` stays one and
    other mappings become ``dict``, lists stay lists, tuples, named tuples, dataclasses and
    registered nodes keep their type. ``on_branch(path, container)``, if given, sees each
    rebuilt container and returns what takes its place.
    """

    branch_of = walker_branch(expand)

    def visit(node: Any, path: str, depth: int) -> Any:
        found = None if is_leaf is not None and is_leaf(node) else branch_of(node)
        if found is None:
            return fn(path, node)
        paths = _child_paths(found, path, depth)
        values = [
            visit(value, child, depth + 1) for value, child in zip(found.values, paths, strict=True)
        ]
        rebuilt = found.rebuild(node, values)
        return rebuilt if on_branch is None else on_branch(path, rebuilt)

    return visit(state, "", 0)


def flatten(
    state: Any,
    *,
    convert: Callable[[Any, str], Converted | None] | None = None,
    expand: Expand | None = None,
) -> FlatState:
    """Split ``state`` into array leaves and a JSON tree.

    Args:
        state: a nest of the containers :func:`branch` knows, holding numpy arrays, numpy
            scalars and plain JSON values.
        convert: called with ``(leaf, path)`` for each leaf that is not a numpy array or
            plain value; returns ``(host_array, attrs)`` to store it, or ``None`` to refuse
            it (a numpy scalar it returns ``None`` for is stored as a scalar). Stagers pass
            their tensor conversion here.
        expand: the framework registry of containers (see :data:`Expand`).

    Raises:
        UnsupportedLeafError: a leaf of another type, an object/string dtype, a dict key
            that is neither str nor int, colliding keys, or nesting deeper than MAX_DEPTH.
    """
    flat = FlatState(tree=None)
    branch_of = walker_branch(expand)
    paths = flat.paths
    arrays = flat.arrays
    attrs = flat.attrs
    # Per walk, as walker_branch remembers leaf types: the dtypes already found storable, and
    # the leaf types ``convert`` took (a tensor type goes straight to it, past the checks
    # every other kind of node needs; on 20,000 tensors those were ~1.5 us a leaf).
    storable: set[np.dtype[Any]] = set()
    converted_types: set[type] = set()

    def add_array(array: np.ndarray[Any, Any], path: str, leaf_attrs: dict[str, Any] | None) -> int:
        dtype = array.dtype
        if dtype not in storable:
            if dtype_name(dtype) is None:
                raise UnsupportedLeafError(
                    path,
                    f"arrays of dtype {dtype} cannot be stored (numeric, bool, complex and "
                    "ml_dtypes types only; nothing is pickled)",
                )
            storable.add(dtype)
        arrays.append(array)
        paths.append(path)
        attrs.append(leaf_attrs)
        return len(arrays) - 1

    def visit(node: Any, path: str, depth: int) -> Any:
        kind = type(node)
        if kind is np.ndarray:
            return add_array(node, path, None)
        if kind in converted_types:
            converted = convert(node, path)  # type: ignore[misc]  # only with convert
            if converted is not None:
                return add_array(converted[0], path, converted[1])
        if node is None or kind is bool or kind is str or kind is int or kind is float:
            return {"v": node}
        if isinstance(node, np.ndarray):  # subclasses (memmap, matrix) are stored as arrays
            return add_array(np.asarray(node), path, None)
        if isinstance(node, np.generic):
            # ``convert`` may claim a numpy scalar too (the stager stages it as a 0-d array
            # with its own attrs, as it always has)
            converted = convert(node, path) if convert is not None else None
            if converted is not None:
                return add_array(converted[0], path, converted[1])
            return {"s": add_array(np.asarray(node), path, None)}
        if isinstance(node, bool | int | float | str):  # subclasses (IntEnum...) as plain values
            return {"v": _plain(node)}
        found = branch_of(node)
        if found is None:
            typed = _KIND_OF_TYPE.get((kind.__module__, kind.__qualname__))
            if typed is not None:
                return {"x": [typed.name, typed.text(node)]}
        if found is None and convert is not None:
            converted = convert(node, path)
            if converted is not None:
                converted_types.add(kind)
                array, leaf_attrs = converted
                return add_array(array, path, leaf_attrs)
        if found is None:
            raise UnsupportedLeafError(
                path,
                f"{type(node).__module__}.{type(node).__qualname__} is not storable; "
                "use arrays, nested dicts/lists/tuples/dataclasses and plain JSON values "
                "(nothing is pickled)",
            )
        values = found.values
        child_paths = _child_paths(found, path, depth)
        children: list[Any]
        if _all_plain_arrays(values, storable):
            # a container of plain numpy arrays alone, of dtypes found storable (a flat dict
            # of 20,000 weights): added in bulk, without a call per leaf (the staging walk
            # of such a dict took 12 ms leaf by leaf, 5 ms so)
            start = len(arrays)
            arrays.extend(values)
            paths.extend(child_paths)
            attrs.extend([None] * len(values))
            children = list(range(start, len(arrays)))
        else:
            children = [
                # a leaf of a type ``convert`` took goes to it here, without a visit of its
                # own (one call and its type checks fewer for each leaf of every save)
                add_array(converted[0], child, converted[1])
                if type(value) in converted_types
                and (converted := convert(value, child)) is not None  # type: ignore[misc]
                else visit(value, child, depth + 1)
                for value, child in zip(values, child_paths, strict=True)
            ]
        if found.tag == "d":
            if kind is OrderedDict:
                return {"d": list(found.keys), "c": children, "o": 1}
            return {"d": list(found.keys), "c": children}
        return {found.tag: children}

    flat.tree = visit(state, "", 0)
    return flat


def _all_plain_arrays(values: Sequence[Any], storable: set[np.dtype[Any]]) -> bool:
    """Whether ``values`` (more than one) are all numpy arrays of that exact type, of dtypes
    in ``storable`` or storable (which are added to it). False for a dtype that is not: the
    walk then visits leaf by leaf and names the first such leaf."""
    if len(values) < 2 or set(map(type, values)) != {np.ndarray}:
        return False
    for dtype in set(map(_DTYPE, values)) - storable:
        if dtype_name(dtype) is None:
            return False
        storable.add(dtype)
    return True


_DTYPE = attrgetter("dtype")


def _plain(value: bool | int | float | str) -> bool | int | float | str:
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    return str(value)


def tree_paths(
    tree: Any, count: int, *, version_4: bool = True
) -> tuple[list[str | None], list[str]]:
    """Walk an untrusted ``tree`` and return ``(path of each array leaf, value paths)``
    (typed values are values).

    Raises ``ValueError`` with a reason if the tree is malformed: unknown node shapes, leaf
    indices outside ``[0, count)`` or used twice, bad dict keys, a typed value of a kind or
    name :data:`VALUE_KINDS` does not allow, or excessive depth; or, unless ``version_4``,
    a typed value or an ``OrderedDict`` (a manifest of an earlier version has neither).
    Callers that built the tree themselves may skip this.
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
        if len(node) == 1 and "x" in node:
            _check_typed(node["x"], path, version_4)
            value_paths.append(path)
            continue
        ordered = len(node) == 3 and node.get("o") == 1 and type(node["o"]) is int
        if ordered and not version_4:
            raise ValueError(f"tree dict at {path!r} is ordered, which needs format version 4")
        if (len(node) == 2 or ordered) and "d" in node and "c" in node:
            keys, children = node["d"], node["c"]
            if type(keys) is not list or type(children) is not list or len(keys) != len(children):
                raise ValueError(f"tree dict at {path!r} has mismatched keys and children")
            try:
                segments = _key_segments(keys)
            except _BadKey as exc:
                kind_name = type(exc.args[0]).__name__
                raise ValueError(f"tree dict at {path!r} has a {kind_name} key") from None
            if len(set(segments)) != len(segments):
                seen: set[str] = set()
                for segment in segments:
                    if segment in seen:
                        raise ValueError(f"tree dict at {path!r} repeats key {segment!r}")
                    seen.add(segment)
            child_paths = segments if depth == 0 else [f"{path}/{s}" for s in segments]
            if _fresh_indices(children, count, leaf_paths) and depth < MAX_DEPTH:
                # every child an array leaf not placed yet: checked in bulk, then placed
                for child, child_path in zip(children, child_paths, strict=True):
                    leaf_paths[child] = child_path
                continue
            for child, child_path in zip(children, child_paths, strict=True):
                if (
                    type(child) is int
                    and 0 <= child < count
                    and leaf_paths[child] is None
                    and depth < MAX_DEPTH
                ):
                    # a plain array leaf, placed here rather than through the stack: a state
                    # of 20,000 leaves spent a third of this walk pushing and popping them
                    leaf_paths[child] = child_path
                else:  # anything else, a bad index included, is checked (and named) below
                    stack.append((child, child_path, depth + 1))
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
    if None in leaf_paths:
        missing = [i for i, p in enumerate(leaf_paths) if p is None]
        raise ValueError(f"tree does not place arrays {missing[:5]} (of {len(missing)})")
    return leaf_paths, value_paths


def _fresh_indices(children: list[Any], count: int, leaf_paths: list[str | None]) -> bool:
    """Whether ``children`` are distinct ints in ``[0, count)`` that name no placed leaf,
    checked in bulk (a dict of 20,000 array leaves spent 20 ms of a manifest's validation
    checking them one by one). False only means "check each"."""
    if not children or set(map(type, children)) - {int}:
        return False
    if min(children) < 0 or max(children) >= count or len(set(children)) != len(children):
        return False
    placed = itemgetter(*children)(leaf_paths) if len(children) > 1 else (leaf_paths[children[0]],)
    return placed.count(None) == len(placed)


def _check_typed(typed: Any, path: str, version_4: bool) -> None:
    if not version_4:
        raise ValueError(f"tree value at {path!r} is a typed value, which needs format version 4")
    if type(typed) is not list or len(typed) != 2 or not all(type(t) is str for t in typed):
        raise ValueError(f"typed value at {path!r} is not a [kind, name] pair of strings")
    kind = VALUE_KINDS.get(typed[0])
    if kind is None:
        raise ValueError(f"typed value at {path!r} is of unknown kind {typed[0][:40]!r}")
    if not kind.pattern.fullmatch(typed[1]):
        raise ValueError(f"typed value at {path!r} names no {kind.name}: {typed[1][:40]!r}")


#: ``like`` of :func:`unflatten` when there is no target.
_NO_TARGET: Any = object()


def unflatten(
    tree: Any,
    leaves: Sequence[Any] | Mapping[int, Any],
    *,
    selected: Callable[[str], bool] | None = None,
    restore: Callable[[Any, int, Any], Any] | None = None,
    like: Any = _NO_TARGET,
    expand: Expand | None = None,
    is_leaf: Callable[[Any], bool] | None = None,
) -> Any:
    """Rebuild the nested state from ``tree`` and the array ``leaves`` (by index).

    Args:
        tree: a tree from :func:`flatten` (or a validated manifest).
        leaves: the value of each array leaf, by index; a mapping may omit unselected ones.
        selected: if given, keep only leaves whose path it accepts: dicts drop unselected
            entries, lists and tuples keep their length with ``None`` in unselected places,
            and containers left with nothing selected are dropped, as is an empty container
            whose own path is not selected.
        restore: called as ``restore(array, index, like_leaf)`` for each array leaf (not
            numpy scalars), with the leaf of ``like`` at its place (``None`` if none); its
            result takes the array's place. Stagers turn arrays back into tensors here, using
            the leaf's attrs from the manifest.
        like: a target of the same structure: the result is built in *its* containers (named
            tuples, dataclasses, registered nodes), holding exactly its leaves; a target leaf
            stands for the whole subtree at its path. Every path of the target must be in
            ``tree`` (the caller checks; a missing one raises ``KeyError``).
        expand, is_leaf: how to walk ``like`` (see :func:`iter_leaves`).
    """
    missing = object()
    # paths only serve ``selected``: without it every child is built at "" (a whole restore
    # of 20,000 leaves spent a fifth of its rebuild joining paths nothing read)
    located = selected is not None

    def build(node: Any, path: str, depth: int, target: Any) -> Any:
        if type(node) is int:
            if selected is not None and not selected(path):
                return missing
            value = leaves[node]
            return value if restore is None else restore(value, node, target)
        if "v" in node:
            if selected is not None and not selected(path):
                return missing
            return node["v"]
        if "s" in node:
            if selected is not None and not selected(path):
                return missing
            value = leaves[node["s"]]
            return value[()] if isinstance(value, np.ndarray) else value
        if "x" in node:
            if selected is not None and not selected(path):
                return missing
            kind, text = node["x"]
            return VALUE_KINDS[kind].value(text)
        if "d" in node:
            out: dict[str | int, Any] = {}
            if not located:
                # everything is selected: an array leaf is placed here, not through a call
                # per leaf (a fifth of the rebuild of 20,000 leaves in one dict), and a dict
                # of array leaves alone that nothing rebuilds is made in one call
                keys, children = node["d"], node["c"]
                if restore is None and not set(map(type, children)) - {int}:
                    out = dict(zip(keys, map(leaves.__getitem__, children), strict=True))
                    return OrderedDict(out) if "o" in node else out
                for key, child in zip(keys, children, strict=True):
                    if type(child) is int:
                        value = leaves[child]
                        out[key] = value if restore is None else restore(value, child, None)
                    else:
                        out[key] = build(child, "", depth + 1, None)
                return OrderedDict(out) if "o" in node else out
            for key, child in zip(node["d"], node["c"], strict=True):
                where = join_path(path, escape_key(key), depth)
                value = build(child, where, depth + 1, None)
                if value is not missing:
                    out[key] = value
            # an empty container is selected by its own path only, like a plain value
            if selected is not None and not out and (node["d"] or not selected(path)):
                return missing
            return OrderedDict(out) if "o" in node else out
        items = node["l"] if "l" in node else node["t"]
        values = [
            build(c, join_path(path, str(i), depth) if located else "", depth + 1, None)
            for i, c in enumerate(items)
        ]
        unselected = selected is not None and (items or not selected(path))
        if unselected and all(v is missing for v in values):
            return missing
        values = [None if v is missing else v for v in values]
        return tuple(values) if "t" in node else values

    def build_like(node: Any, path: str, depth: int, target: Any) -> Any:
        found = None if is_leaf is not None and is_leaf(target) else branch(target, expand)
        if found is None:
            value = build(node, path, depth, target)
            return None if value is missing else value
        if type(node) is not dict or not ("d" in node or "l" in node or "t" in node):
            raise KeyError(path)
        if "d" in node:
            stored = {escape_key(k): c for k, c in zip(node["d"], node["c"], strict=True)}
        else:
            stored = {str(i): c for i, c in enumerate(node["l"] if "l" in node else node["t"])}
        values = []
        for value, child in zip(found.values, _child_paths(found, path, depth), strict=True):
            segment = child if depth == 0 else child.rpartition("/")[2]
            values.append(build_like(stored[segment], child, depth + 1, value))
        return found.rebuild(target, values)

    if like is not _NO_TARGET:
        return build_like(tree, "", 0, like)
    result = build(tree, "", 0, None)
    return {} if result is missing else result


def select_paths(patterns: Iterable[str]) -> Callable[[str], bool]:
    """A predicate accepting a path equal to a pattern or under it (``"model"`` accepts
    ``"model/w"``)."""
    exact = set(patterns)
    prefixes = tuple(p + "/" for p in exact if p)

    def accept(path: str) -> bool:
        return path in exact or "" in exact or (bool(prefixes) and path.startswith(prefixes))

    return accept
