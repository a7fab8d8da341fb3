"""``nfs://<mount path>``: the POSIX backend tuned for shared network filesystems.

ckptstore does not mount anything: ``nfs:///mnt/shared/ckpts`` names a directory on a
filesystem the machine has already mounted (NFS, Lustre, a FUSE-mounted object store...).
What differs from a local disk, and what this backend does about it:

* Attribute and directory caches. Clients cache ``stat`` results and listings for seconds
  (``acregmin``/``acdirmin``), so another host's new file may be invisible to ``stat``. Under
  close-to-open consistency an ``open`` revalidates, so ``head`` opens the file and ``fstat``s
  the descriptor instead of calling ``stat`` on the path, and a listing opens each directory.
* Commit without rename. ``RENAME_NOREPLACE`` is unavailable over NFS and rename-over would
  let a second writer silently replace a commit, so ``mode="create"`` publishes with ``link``,
  which the server performs atomically. A retransmitted LINK whose first reply was lost returns
  ``EEXIST`` although it succeeded; the check tells the two apart: our temp file has a unique
  name nobody else links, so if the final name is now the same inode, the link was ours. (The
  older check, a link count of 2 on the temp file, can read a cached count; inode identity
  cannot be faked by another writer.)
* Create is exactly as atomic as the filesystem's LINK. NFS servers perform LINK atomically,
  so one of N creators on any number of hosts wins. Some FUSE filesystems check the target's
  existence in the client: on SeaweedFS ``weed mount``, 8 creators split over two mounts of
  one filer both won in 7 of 200 races (one mount: exactly one winner, every time), and an
  overwrite reached the other mount's ``stat`` only a few milliseconds later. Check a
  filesystem before trusting it with commits from several hosts.
* Close before commit. Data is flushed to the server by ``fsync`` and ``close`` before the file
  is linked under its final name; directory fsyncs that a filesystem rejects are skipped,
  since NFS servers commit namespace operations synchronously.
* Silly renames. A file deleted while open becomes ``.nfsXXXX``, and FUSE keeps
  ``.fuse_hidden*``: listings skip both, so writes refuse keys with such segments (they would
  be written but never listed).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from typing import Any

from ckptstore.errors import AlreadyExistsError, InvalidKeyError, InvalidURLError, NotFoundError
from ckptstore.store.base import TEMP_PREFIX, MultipartUpload, ObjectMeta, PutMode
from ckptstore.store.local import LocalStore, _meta
from ckptstore.store.options import split_settings

__all__ = ["NFSStore"]


class NFSStore(LocalStore):
    """A directory on a mounted network filesystem."""

    schemes = ("nfs",)
    _hidden_prefixes = (TEMP_PREFIX, ".nfs", ".fuse_hidden")
    # O_DIRECT on a network filesystem changes the client's caching and write ordering, and
    # FUSE mounts often refuse it: writes here keep the page cache and fsync before commit.
    _direct_io = False

    @classmethod
    def from_url(cls, url: str, **options: Any) -> NFSStore:
        settings, rest = split_settings(options)
        if rest:
            raise TypeError(f"NFSStore: unknown options {sorted(rest)}")
        if url.startswith("nfs://") and not url.startswith("nfs:///"):
            raise InvalidURLError(
                f"{url!r}: nfs:// takes the path where the filesystem is mounted, e.g. "
                "nfs:///mnt/shared/ckpts; ckptstore does not mount servers itself"
            )
        return cls(cls._path_from_url(url), settings=settings)

    @property
    def url(self) -> str:
        return "nfs://" + self._root

    def _check_visible(self, key: str) -> None:
        for segment in key.split("/"):
            if self._hidden(segment):
                raise InvalidKeyError(
                    key,
                    f"segment {segment!r} looks like a filesystem-internal name "
                    f"({', '.join(self._hidden_prefixes)}), which listings skip on nfs://",
                )

    async def _put(self, key: str, data: memoryview, mode: PutMode) -> None:
        self._check_visible(key)
        await super()._put(key, data, mode)

    async def _create_multipart(self, key: str, part_size: int, mode: PutMode) -> MultipartUpload:
        self._check_visible(key)
        return await super()._create_multipart(key, part_size, mode)

    def _publish(self, temp: str, final: str, mode: PutMode, key: str) -> None:
        if mode == "overwrite":
            os.replace(temp, final)
            return
        try:
            os.link(temp, final)
        except FileExistsError:
            if not self._link_was_ours(temp, final):
                raise AlreadyExistsError(f"{self.url}/{key} already exists") from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)

    @staticmethod
    def _link_was_ours(temp: str, final: str) -> bool:
        """After ``link(temp, final)`` failed with EEXIST: whether ``final`` is our temp file
        all the same (the server performed a retransmitted LINK whose first reply was lost)."""
        try:
            mine, theirs = os.stat(temp), os.stat(final)
        except FileNotFoundError:
            return False
        return (mine.st_ino, mine.st_dev) == (theirs.st_ino, theirs.st_dev)

    def _sync_dir(self, path: str) -> None:
        try:
            super()._sync_dir(path)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF):
                raise

    def _stat(self, key: str) -> os.stat_result:
        # open + fstat revalidates the client's attribute cache (close-to-open consistency).
        with self._translate(key, "reading"):
            fd = os.open(self._path(key), os.O_RDONLY | os.O_CLOEXEC)
            try:
                st = os.fstat(fd)
            finally:
                os.close(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotFoundError(f"{self.url}/{key} does not exist (it is a directory)")
        return st

    async def _head(self, key: str) -> ObjectMeta:
        st = await self._run(self._stat, key)
        return _meta(key, st)
