"""Shared-memory segments: how ranks on one host hand each other a broadcast's bytes.

A read-once load (:mod:`ckptstore.manager.broadcast`) reads each shared leaf on one rank.
Sending it to the other ranks over the process group costs, between processes of one host,
a trip through the kernel's socket path per receiver (gloo on loopback TCP): as much CPU as
reading it from the store again. Ranks that share a host need no network: the reader reads
the leaves straight into a segment, a file on a memory filesystem (``/dev/shm``), and the
others map that file.

Why a file under ``/dev/shm`` and not :mod:`multiprocessing.shared_memory`:

* **No copy on any side, private arrays.** The reader fills the file through a shared
  mapping (the store's reads land there, nothing is copied after); every rank, the reader
  included, then hands its caller arrays over a *private* (copy-on-write) mapping of it. The
  pages stay one copy in memory for all ranks of the host until a rank writes to its
  arrays, which copies only the pages written, for that rank alone: the arrays are writable
  like any loaded array and no rank sees another's writes. A mapping outlives the file's
  name, so the arrays stay valid once the segment is removed. ``SharedMemory`` maps only
  shared, so a receiver would have to copy its bytes out.
* **No bus error.** The reader reserves the segment's memory with ``posix_fallocate`` before
  writing: a memory filesystem that is full (Docker gives containers 64 MiB of ``/dev/shm``
  by default) refuses there, and the load sends those bytes over the group instead, where a
  sparse file would kill the process with ``SIGBUS`` on the first page that does not fit.
* **Removal a dead process cannot prevent.** The reader holds an exclusive ``flock`` on the
  segment from the moment it exists; the kernel drops it when the process dies, however it
  dies. See :func:`remove_orphans`. (Before Python 3.13 ``SharedMemory`` also registers every
  attached segment with the resource tracker, which unlinks it when any attaching process
  exits.)

The pages of a segment are memory of the memory filesystem: they count against its size
(and the cgroup of the reader) until the file is removed *and* the last array over them is
freed, exactly as long as a loaded array lives. Where that is unwanted, ``shared_memory=False``
on :func:`ckptstore.distributed.load <ckptstore.manager.distributed.load>` sends every
transfer over the group, and ``CKPTSTORE_SHM_DIR`` names another memory filesystem (a larger
tmpfs mounted for the purpose) for the segments.

**Which ranks share a host.** :func:`host_identity` is the host name, the kernel's boot id
and the device number of the segment directory's filesystem: equal on two ranks only if they
run on one booted kernel (two containers with one host name do not share a boot id unless
they share a kernel) and see the same filesystem there (a container with ``/dev/shm`` of its
own has a device of its own). Where any of it is missing (no ``/proc``, no segment
directory), the rank shares nothing. A receiver still checks that the file it opens is the
one the reader announced (inode and size) and falls back to the group otherwise.

**Names and removal.** A segment is ``<dir>/ckptstore-bcast-<random 96 bits>-<n>``, created
with ``O_EXCL``, so two loads or two jobs on one host never share one. The reader removes its
segments as soon as every receiver has mapped them (a collective the load runs anyway),
and on any error. A reader killed before that leaves its segment behind with its lock
released: the next load on the host that makes segments removes it, and so do the surviving
ranks of the failed load (:func:`remove_orphans`).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import secrets
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["Segment", "SegmentName", "attach", "host_identity", "remove_orphans", "segment_dir"]

#: Every segment's file name starts with this; :func:`remove_orphans` looks at nothing else.
PREFIX = "ckptstore-bcast-"

#: An empty orphan candidate (its creator may be between creating and locking it) is left
#: alone for this many seconds.
_EMPTY_GRACE = 60.0

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def segment_dir() -> Path:
    """Where segments go: ``CKPTSTORE_SHM_DIR``, by default ``/dev/shm``."""
    return Path(os.environ.get("CKPTSTORE_SHM_DIR") or "/dev/shm")


def host_identity() -> str | None:
    """What ranks that can share segments have in common (see the module docstring);
    ``None`` where this rank cannot share any."""
    try:
        boot = _BOOT_ID.read_text().strip()
        info = os.stat(segment_dir())
    except OSError:
        return None
    if not boot or not stat.S_ISDIR(info.st_mode):
        return None
    return f"{socket.gethostname()} {boot} {info.st_dev}"


@dataclass(frozen=True, slots=True)
class SegmentName:
    """What a reader tells the other ranks of a segment it filled."""

    path: str
    inode: int
    nbytes: int


class Segment:
    """A segment this rank creates and fills; :meth:`remove` (idempotent) removes its name.

    Attributes:
        buffer: the segment's bytes through a shared mapping, to read the leaves into.
        name: what receivers attach it by.
    """

    def __init__(self, fd: int, path: Path, nbytes: int) -> None:
        self._fd = fd
        self._path = path
        self._shared: mmap.mmap | None = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
        self.buffer: np.ndarray[Any, Any] | None = np.frombuffer(self._shared, np.uint8)
        self.name = SegmentName(str(path), os.fstat(fd).st_ino, nbytes)
        self._removed = False

    @classmethod
    def create(cls, nbytes: int, token: str, number: int) -> Segment | None:
        """A new segment of ``nbytes``, its memory reserved; ``None`` where the memory
        filesystem has no room or no segment can be made (the caller sends over the
        group)."""
        path = segment_dir() / f"{PREFIX}{token}-{number}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError:
            return None
        try:
            # locked at once: the lock says "my creator is alive" to remove_orphans, which
            # leaves an empty unlocked file alone for a while (this gap) and removes any
            # other unlocked one
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.posix_fallocate(fd, 0, nbytes)
            return cls(fd, path, nbytes)
        except (OSError, ValueError):
            with contextlib.suppress(OSError):
                os.unlink(path)
            os.close(fd)
            return None

    def private(self) -> np.ndarray[Any, Any]:
        """The filled segment as this rank's own arrays see it: a copy-on-write mapping.

        Drops the shared mapping: no write reaches the other ranks' mappings from here on.
        """
        view = np.frombuffer(mmap.mmap(self._fd, self.name.nbytes, mmap.MAP_PRIVATE), np.uint8)
        self._drop_shared()
        return view

    def remove(self) -> None:
        """Remove the segment's name and this rank's hold on it; mappings stay valid."""
        if self._removed:
            return
        self._removed = True
        with contextlib.suppress(OSError):
            os.unlink(self._path)
        self._drop_shared()
        os.close(self._fd)

    def _drop_shared(self) -> None:
        self.buffer = None
        shared, self._shared = self._shared, None
        if shared is not None:
            # a view still held elsewhere (a failed read's traceback) keeps the mapping
            # until it is freed; nothing writes through it after the read
            with contextlib.suppress(BufferError):
                shared.close()


def attach(name: SegmentName) -> np.ndarray[Any, Any] | None:
    """A copy-on-write mapping of another rank's segment; ``None`` if this rank cannot open
    it as announced (not the same filesystem after all, or gone): the caller then receives
    the bytes over the group."""
    try:
        fd = os.open(name.path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if info.st_ino != name.inode or info.st_size != name.nbytes:
            return None
        # ACCESS_COPY: private and writable, though the file is open read-only
        return np.frombuffer(mmap.mmap(fd, name.nbytes, access=mmap.ACCESS_COPY), np.uint8)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def remove(name: SegmentName) -> None:
    """Remove another rank's segment by name, if it is still the one announced."""
    with contextlib.suppress(OSError):
        if os.stat(name.path).st_ino == name.inode:
            os.unlink(name.path)


def new_token() -> str:
    """The random part of one load's segment names on this rank."""
    return secrets.token_hex(12)


def remove_orphans() -> list[str]:
    """Remove segments whose creator died before removing them; the names removed.

    A segment is an orphan when nobody holds its lock (its creator locks it for its whole
    life) and it has its size (the creator locks it before sizing it; an empty one is left
    alone for a minute, the gap between creating and locking). Segments of live loads, of
    this job or another, are locked and left alone.
    """
    removed: list[str] = []
    try:
        names = [n for n in os.listdir(segment_dir()) if n.startswith(PREFIX)]
    except OSError:
        return removed
    for name in names:
        path = segment_dir() / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            info = os.fstat(fd)
            orphan = info.st_size > 0 or time.time() - info.st_mtime > _EMPTY_GRACE
            if orphan and os.stat(path).st_ino == info.st_ino:
                os.unlink(path)
                removed.append(name)
        except OSError:
            pass  # locked (alive), or gone meanwhile
        finally:
            os.close(fd)
    return removed
