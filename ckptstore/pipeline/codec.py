"""The tree codec and the dtype registry, as the faces use them.

Part of the engine's interface (docs/design.md, "The engine's interface"). A face that maps
its library's own tree onto ckptstore's (Lightning's checkpoint dict, the file adapters'
directory trees, the multi-rank runtime's merged parts) walks and names leaves with these,
so a key is escaped, a path joined and a dtype named the same way on every face.
"""

from __future__ import annotations

from ckptstore.layout.dtypes import dtype_name
from ckptstore.layout.restore import empty_array
from ckptstore.layout.tree import (
    MAX_DEPTH,
    FlatState,
    UnsupportedLeafError,
    escape_key,
    join_path,
    map_leaves,
)
from ckptstore.stage.stager import rebuild_leaf
from ckptstore.stage.tree import expand

__all__ = [
    "MAX_DEPTH",
    "FlatState",
    "UnsupportedLeafError",
    "dtype_name",
    "empty_array",
    "escape_key",
    "expand",
    "join_path",
    "map_leaves",
    "rebuild_leaf",
]
