"""What the ranks of a multi-rank save or load tell each other, as JSON: never a pickle.

:class:`~ckptstore.manager.jax_collectives.JaxCollectives` carries the ranks' messages
through ``jax.distributed``'s coordination service, a key-value store that whoever can reach
process 0's port may write to. Unpickling what is read there would let such a writer run
code in every process of the job; decoding JSON can at worst produce a wrong value, which
the protocol's own checks (steps, attempt ids, crc32c of every byte) refuse.

The messages are plain values and ckptstore's own frozen dataclasses (a rank's part, its
written objects, a failure, the outcome of a commit, a read plan). The encoding, one JSON
document per message, tags every node that JSON cannot say itself::

    null, true, 1, 1.5, "s"      themselves (non-finite floats as JSON's NaN/Infinity)
    [a, b]                        a list
    {"t": [a, b]}                 a tuple
    {"d": [[k, v], ...]}          a dict (keys of any encodable type, in order)
    {"b": "<base64>"}             bytes
    {"c": "module:Name", "f": {"field": value, ...}}
                                  a dataclass defined in a ckptstore module already imported

Decoding builds a dataclass only if its module is a ``ckptstore`` module this process has
imported (never importing one on a message's word) and the class named there is a
dataclass, from exactly its declared fields. Anything else is refused with a
:class:`MessageError` naming what.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import sys
from typing import Any

import numpy as np

__all__ = ["MessageError", "decode", "encode"]

#: Deepest nesting of a message: a state's tree may be 200 deep, and a level of it takes up
#: to three levels of a message (the tree's dict, its list of children, the child).
_MAX_DEPTH = 640


class MessageError(ValueError):
    """A value that is not a message, or a document that does not decode to one."""


def encode(obj: Any) -> bytes:
    """``obj`` as one JSON document.

    Raises:
        MessageError: a value of a type messages do not carry (named, with its path).
    """
    try:
        return json.dumps(_encode(obj, "", 0), separators=(",", ":")).encode()
    except RecursionError:
        raise MessageError("a message is nested too deeply to encode") from None


def decode(data: bytes) -> Any:
    """The value :func:`encode` encoded.

    Raises:
        MessageError: not a document :func:`encode` writes, or it names a class that may
            not be built from a message.
    """
    try:
        document = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise MessageError(f"a message is not JSON: {exc}") from None
    except RecursionError:
        raise MessageError(f"a message is nested deeper than {_MAX_DEPTH}") from None
    try:
        return _decode(document, 0)
    except RecursionError:
        raise MessageError(f"a message is nested deeper than {_MAX_DEPTH}") from None


def _encode(obj: Any, where: str, depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise MessageError(f"message nested deeper than {_MAX_DEPTH} at {where or '/'}")
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    if isinstance(obj, np.generic) and obj.dtype.kind in "biuf":
        return obj.item()
    # loops, not comprehensions: one Python frame per level of nesting
    if isinstance(obj, list | tuple):
        items = []
        for i, v in enumerate(obj):
            items.append(_encode(v, f"{where}/{i}", depth + 1))
        return items if isinstance(obj, list) else {"t": items}
    if isinstance(obj, dict):
        pairs = []
        for k, v in obj.items():
            key = _encode(k, f"{where}/<key>", depth + 1)
            pairs.append([key, _encode(v, f"{where}/{k}", depth + 1)])
        return {"d": pairs}
    if isinstance(obj, bytes | bytearray):
        return {"b": base64.b64encode(obj).decode("ascii")}
    cls = type(obj)
    if dataclasses.is_dataclass(obj) and cls.__module__.startswith("ckptstore."):
        fields = {
            f.name: _encode(getattr(obj, f.name), f"{where}/{f.name}", depth + 1)
            for f in dataclasses.fields(obj)
            if f.init
        }
        return {"c": f"{cls.__module__}:{cls.__qualname__}", "f": fields}
    raise MessageError(
        f"{type(obj).__module__}.{type(obj).__qualname__} at {where or '/'} is not a value "
        "the ranks' messages carry (plain JSON values, tuples, dicts, bytes, numpy scalars "
        "and ckptstore's dataclasses)"
    )


def _decode(node: Any, depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise MessageError(f"a message is nested deeper than {_MAX_DEPTH}")
    if node is None or isinstance(node, bool | int | float | str):
        return node
    if isinstance(node, list):
        items = []
        for v in node:
            items.append(_decode(v, depth + 1))
        return items
    if not isinstance(node, dict) or len(node) not in (1, 2):
        raise MessageError(f"a message holds a node of no known kind: {str(node)[:80]}")
    if set(node) == {"t"} and isinstance(node["t"], list):
        return tuple(_decode(node["t"], depth))
    if set(node) == {"d"} and isinstance(node["d"], list):
        out: dict[Any, Any] = {}
        for pair in node["d"]:
            if not (isinstance(pair, list) and len(pair) == 2):
                raise MessageError("a message's dict holds an entry that is not a pair")
            key = _decode(pair[0], depth + 1)
            try:
                out[key] = _decode(pair[1], depth + 1)
            except TypeError:  # an unhashable key
                raise MessageError(f"a message's dict has a key of type {type(key)}") from None
        return out
    if set(node) == {"b"} and isinstance(node["b"], str):
        try:
            return base64.b64decode(node["b"], validate=True)
        except ValueError:
            raise MessageError("a message's bytes are not base64") from None
    if set(node) == {"c", "f"} and isinstance(node["c"], str) and isinstance(node["f"], dict):
        return _build(node["c"], node["f"], depth)
    raise MessageError(f"a message holds a node of no known kind: {str(node)[:80]}")


def _build(name: str, fields: dict[str, Any], depth: int) -> Any:
    module_name, _, qualname = name.partition(":")
    module = sys.modules.get(module_name) if module_name.startswith("ckptstore.") else None
    cls: Any = module
    for part in qualname.split(".") if module is not None else []:
        cls = getattr(cls, part, None)
    if module is None or not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise MessageError(f"a message names {name[:120]!r}, which is not a ckptstore dataclass")
    declared = {f.name for f in dataclasses.fields(cls) if f.init}
    if set(fields) != declared:
        raise MessageError(
            f"a message's {qualname} has the fields {sorted(fields)}, not {sorted(declared)}"
        )
    return cls(**{key: _decode(value, depth + 1) for key, value in fields.items()})
