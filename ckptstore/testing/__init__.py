"""Test support shipped with ckptstore: the backend conformance suite.

Importing this package needs pytest; nothing else in ckptstore imports it.
"""

from ckptstore.testing.store_tests import BAD_KEYS, StoreTests

__all__ = ["BAD_KEYS", "StoreTests"]
