"""How a checkpoint maps onto the objects of a store.

``tree`` (nested state <-> named leaves), ``plan`` (which object and offset each leaf gets),
``manifest`` (the validated JSON index), ``commit`` (data, then one put-if-absent),
``restore`` (verified reads), ``gc`` (abandoned attempts). This layer knows numpy and the
Store contract, nothing of torch or JAX.
"""

from ckptstore.layout.commit import CommitInfo, write_checkpoint
from ckptstore.layout.gc import GCReport, collect_garbage
from ckptstore.layout.manifest import FORMAT_VERSION, Manifest
from ckptstore.layout.plan import PackPlan, PlannedObject
from ckptstore.layout.restore import read_leaves
from ckptstore.layout.tree import FlatState, UnsupportedLeafError, flatten, unflatten

__all__ = [
    "FORMAT_VERSION",
    "CommitInfo",
    "FlatState",
    "GCReport",
    "Manifest",
    "PackPlan",
    "PlannedObject",
    "UnsupportedLeafError",
    "collect_garbage",
    "flatten",
    "read_leaves",
    "unflatten",
    "write_checkpoint",
]
