"""Test support shipped with ckptstore: the backend conformance suite, the checkpoint suite,
the incremental-save suite and the faces conformance suite (every face that saves against
every face that restores, :mod:`~ckptstore.testing.faces`),
and what they run against: real servers (:mod:`~ckptstore.testing.servers`,
:mod:`~ckptstore.testing.fakegcs`) and an HTTP fault proxy for S3 and GCS
(:mod:`~ckptstore.testing.proxy`).

The suites need pytest and hypothesis, so they are imported only when first used
(``from ckptstore.testing import StoreTests``): the servers must not need them, because
``python -m ckptstore.testing.local_s3`` is a newcomer's first command and runs without the
test extra. Nothing else in ckptstore imports this package.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "BAD_KEYS",
    "CheckpointTests",
    "FaceTests",
    "IncrementalTests",
    "StoreTests",
    "assert_same_state",
]

#: Where each public name lives.
_SUITES = {
    "BAD_KEYS": "ckptstore.testing.store_tests",
    "StoreTests": "ckptstore.testing.store_tests",
    "CheckpointTests": "ckptstore.testing.checkpoint_tests",
    "assert_same_state": "ckptstore.testing.checkpoint_tests",
    "IncrementalTests": "ckptstore.testing.incremental_tests",
    "FaceTests": "ckptstore.testing.face_tests",
}


def __getattr__(name: str) -> Any:
    module = _SUITES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
