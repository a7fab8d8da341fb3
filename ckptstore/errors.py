"""Every error ckptstore raises, in one tree.

Each leaf also subclasses the builtin exception a caller already catches, so code written
against plain files keeps working (``except FileNotFoundError`` catches a missing S3 key)::

    CkptStoreError (Exception)
    ├── InvalidKeyError        (ValueError)         a key that could escape or alias the root
    ├── InvalidURLError        (ValueError)         a URL no backend can open
    ├── InvalidRangeError      (ValueError)         a byte range outside its object
    ├── NotFoundError          (FileNotFoundError)  a key, step or bucket that does not exist
    │   └── BucketNotFoundError                     the bucket a URL names does not exist
    ├── AlreadyExistsError     (FileExistsError)    put-if-absent found the key present
    │   └── CommitConflictError                     another attempt committed this step first
    ├── CorruptCheckpointError (ValueError)         bytes or a manifest fail verification
    │   └── BrokenReferenceError                    a reference to an earlier step's object
    │                                               that is not a committed object of it
    ├── CheckpointFormatError  (ValueError)         an intact checkpoint another face must read
    ├── UnsupportedTreeError   (ValueError)         a directory tree no step can carry
    ├── NotSupportedError      (NotImplementedError) an operation a backend cannot do safely
    ├── MissingDependencyError (ImportError)        an optional client library is not installed
    ├── TornSnapshotError      (RuntimeError)       a lazy snapshot's source changed before its copy
    └── StoreError             (OSError)            the backend failed after its retries
        └── DeadlineExceededError (TimeoutError)    a request got no complete answer in time

Backends translate their client's exceptions into this tree in one table each; messages name
the URL or key and say what to do next, and never carry credentials or signed query strings:
every message passes through :func:`ckptstore.store.transport.redact` when the error is
made, so a URL with ``?secret_access_key=...`` or a password in its userinfo cannot reach a
traceback, a log line or the CLI's output through an error, whichever layer raised it.
"""

from __future__ import annotations

__all__ = [
    "AlreadyExistsError",
    "BrokenReferenceError",
    "BucketNotFoundError",
    "CheckpointFormatError",
    "CkptStoreError",
    "CommitConflictError",
    "CorruptCheckpointError",
    "DeadlineExceededError",
    "InvalidKeyError",
    "InvalidRangeError",
    "InvalidURLError",
    "MissingDependencyError",
    "NotFoundError",
    "NotSupportedError",
    "StoreError",
    "TornSnapshotError",
    "UnsupportedTreeError",
]


class CkptStoreError(Exception):
    """Base of every error raised by ckptstore; its text arguments are redacted."""

    def __init__(self, *args: object) -> None:
        # Imported here: the store layer's transport module imports this one.
        from ckptstore.store.transport import redact

        super().__init__(*(redact(a) if isinstance(a, str) else a for a in args))


class InvalidKeyError(CkptStoreError, ValueError):
    """A key is empty, absolute, contains ``..``, a backslash, NUL or an empty segment."""

    def __init__(self, key: object, reason: str) -> None:
        self.key = key
        self.reason = reason
        super().__init__(f"invalid key {key!r}: {reason}")


class InvalidURLError(CkptStoreError, ValueError):
    """A URL names no known backend or is malformed."""


class InvalidRangeError(CkptStoreError, ValueError):
    """A byte range is negative, reversed, or reaches past the end of its object."""


class NotFoundError(CkptStoreError, FileNotFoundError):
    """A key, step or bucket does not exist."""


class BucketNotFoundError(NotFoundError):
    """The bucket a URL names does not exist: no key or step under it can be found, and
    the message says so instead of naming the key or step asked for."""


class AlreadyExistsError(CkptStoreError, FileExistsError):
    """``put(..., mode="create")`` found the key already present."""


class CommitConflictError(AlreadyExistsError):
    """Another save attempt committed the same step first; this attempt stays invisible."""


class CorruptCheckpointError(CkptStoreError, ValueError):
    """Bytes read back fail their crc32c or length, or a manifest fails validation."""


class BrokenReferenceError(CorruptCheckpointError):
    """A manifest references an object of another step that is not a committed object of
    it: outside the root, at an attempt that never committed, at a step with no record left,
    or with another length or crc32c than its own manifest gives it."""


class CheckpointFormatError(CkptStoreError, ValueError):
    """A committed, intact checkpoint in a format this face does not read (a DCP checkpoint
    given to ``ckptstore.load``, an ordinary one to the DCP reader); the message names the face
    that reads it. Unlike :class:`CorruptCheckpointError`, nothing is wrong with the bytes."""


class UnsupportedTreeError(CkptStoreError, ValueError):
    """A directory tree ckptstore cannot carry as one step: a special file (FIFO, socket,
    device), a symlink that leaves the tree, or a file that changed while it was uploaded;
    or a state an export format cannot hold (a dtype it has no name for, two leaves of one
    name). The message names the path."""


class NotSupportedError(CkptStoreError, NotImplementedError):
    """A backend cannot perform an operation, or cannot perform it safely."""

    def __init__(self, operation: str, backend: str, hint: str = "") -> None:
        self.operation = operation
        self.backend = backend
        message = f"{operation} is not supported by the {backend} backend"
        super().__init__(f"{message}: {hint}" if hint else message)


class MissingDependencyError(CkptStoreError, ImportError):
    """A backend's client library is not installed; the message carries the install command."""


class TornSnapshotError(CkptStoreError, RuntimeError):
    """A lazy snapshot's source array changed (or was deleted) after ``save()`` and before
    ckptstore copied it, so that save is refused rather than written torn.

    Attributes:
        path: the leaf's path in the state (``"optim/state/0/exp_avg"``).
    """

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        super().__init__(
            f"lazy snapshot refused: the leaf {path!r} {reason} after save() and before "
            "ckptstore copied it, so nothing of this save was written. Call fence() (or "
            "enter fenced()) before changing the state, or save with snapshot='eager'"
        )


class StoreError(CkptStoreError, OSError):
    """A backend request failed after retries (network, permissions, server errors)."""


class DeadlineExceededError(StoreError, TimeoutError):
    """A request to a store got no complete answer within its deadline
    (``Settings.request_deadline``), its retries and the pauses between them included: a
    server that accepts and never answers, answers a byte at a time, or stops mid-body. Or a
    whole save or restore did not end within ``Settings.save_deadline`` or
    ``Settings.restore_deadline`` (a write the kernel never finished). The message names the
    operation, the URL and the deadline."""
