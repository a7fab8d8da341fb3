"""Test support shipped with ckptstore: the backend conformance suite and the checkpoint suite,
and what they run against: real servers (:mod:`~ckptstore.testing.servers`,
:mod:`~ckptstore.testing.fakegcs`) and an HTTP fault proxy for S3 and GCS
(:mod:`~ckptstore.testing.proxy`).

Importing this package needs pytest and hypothesis; nothing else in ckptstore imports it.
"""

from ckptstore.testing.checkpoint_tests import CheckpointTests, assert_same_state
from ckptstore.testing.store_tests import BAD_KEYS, StoreTests

__all__ = ["BAD_KEYS", "CheckpointTests", "StoreTests", "assert_same_state"]
