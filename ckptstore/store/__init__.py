"""Bytes on a backend: the async Store contract, its backends, and wrappers over any store."""

from ckptstore.store.base import Capabilities, MultipartUpload, ObjectMeta, PutMode, Store
from ckptstore.store.registry import open_store, register_backend, registered_schemes

__all__ = [
    "Capabilities",
    "MultipartUpload",
    "ObjectMeta",
    "PutMode",
    "Store",
    "open_store",
    "register_backend",
    "registered_schemes",
]
