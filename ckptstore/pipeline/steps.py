"""The steps of a root: which are committed, their manifests, and what a face may do to a step.

Part of the engine's interface (docs/design.md, "The engine's interface"). A face lists, reads,
deletes, sets aside and recovers steps through these names, never through ``layout/``: the
rules behind them (a step is visible only through its manifest; deleting the newest step or
one another step references is refused; a set-aside step keeps its data until recovered or
collected) are the layout's, stated there once.
"""

from __future__ import annotations

from ckptstore.layout.commit import (
    CommitInfo,
    committed_steps,
    delete_step,
    is_own_key,
    latest_step,
    read_manifest,
)
from ckptstore.layout.gc import GCReport, collect_garbage
from ckptstore.layout.keys import attempt_prefix, check_step, manifest_key, parse_step, step_prefix
from ckptstore.layout.manifest import Manifest
from ckptstore.layout.references import delete_steps
from ckptstore.layout.rollback import recover, set_aside, set_aside_step

__all__ = [
    "CommitInfo",
    "GCReport",
    "Manifest",
    "attempt_prefix",
    "check_step",
    "collect_garbage",
    "committed_steps",
    "delete_step",
    "delete_steps",
    "is_own_key",
    "latest_step",
    "manifest_key",
    "parse_step",
    "read_manifest",
    "recover",
    "set_aside",
    "set_aside_step",
    "step_prefix",
]
