"""Any checkpoint directory, as one committed ckptstore step.

Hugging Face Trainer, Accelerate, DeepSpeed and Orbax each write a checkpoint as a directory
of files. :func:`upload` carries such a tree to any ckptstore URL as one step, and
:func:`download` brings a step back into a local directory, with the guarantees every
ckptstore checkpoint has: the step is visible only once every byte of it is durable (one
put-if-absent manifest), and every byte read back is crc32c-verified before anything is
visible in the target.

The tree is saved as an ordinary checkpoint, through the one save path
(:mod:`ckptstore.pipeline.save`): every regular file is a ``uint8`` leaf whose path is its
path in the tree, every directory is a dict (so empty directories are kept), and the one
packer (:class:`~ckptstore.layout.plan.PackPlan`) packs small files into few objects while
large files become objects of their own, uploaded in parallel multipart. A file's permission
bits are kept in its leaf's ``attrs`` (``{"mode": 0o644}``); a symlink that stays inside the
tree is kept as an empty leaf whose ``attrs`` hold its target. The manifest's metadata says
the step is a tree (``{"format": "ckptstore.files/1", ...}``), so ``ckptstore ls``, ``show``,
``verify`` and ``cp`` work on it as on any step, and ``ckptstore.load`` of it returns the
tree as nested dicts of ``uint8`` arrays.

Memory: files are never read whole into memory. A small file is read when the pack holding
it is built (the pipeline builds a bounded number of packs at once); a large file is mapped
read-only (``mmap``) and its pages are read as its parts upload, so a multi-GiB file costs
page cache, not process memory. At most ``Settings.max_concurrency`` objects are in flight.
Downloads mirror this: a large file is read straight into a mapping of its destination file,
packs a few at a time.

What the tree must satisfy (else :class:`~ckptstore.errors.UnsupportedTreeError`, naming the
path): only regular files, directories and symlinks whose target resolves inside the tree; no
FIFOs, sockets or devices. The tree must not change while it uploads: every file is checked
again (size, mtime, inode) before the commit, and a change refuses the commit. (Truncating a
file while it is mapped makes the kernel kill the process with SIGBUS; the adapters upload a
checkpoint directory only after its library finished writing it.)

Downloads: the step is written into a fresh temporary directory beside the target
(``.<name>.ckptstore-tmp-*``), every file fsynced, every byte verified, and only then renamed
to the target, so the target either does not exist or holds the whole verified tree. A target
that exists must be an empty directory (it is replaced); anything else is refused with
:class:`~ckptstore.errors.AlreadyExistsError`, so a download never merges into or overwrites
a user's files. A download killed half-way leaves only that hidden scratch directory (and a
background upload its hidden snapshot, see :class:`TreeMirror`). Names in the manifest are
checked before anything is created: a name that is empty, ``.``, ``..``, contains ``/`` or
NUL, or a symlink leading out of the tree, is refused
with :class:`~ckptstore.errors.CorruptCheckpointError`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import mmap
import os
import secrets
import shutil
import stat
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import numpy as np

from ckptstore import background, threads
from ckptstore.errors import (
    AlreadyExistsError,
    CheckpointFormatError,
    CommitConflictError,
    CorruptCheckpointError,
    UnsupportedTreeError,
)
from ckptstore.pipeline import save as save_path
from ckptstore.pipeline.codec import MAX_DEPTH, dtype_name, escape_key, join_path
from ckptstore.pipeline.restore import find_manifest, read_leaves
from ckptstore.pipeline.root import Root, aopened, check_options, opened
from ckptstore.pipeline.steps import Manifest, latest_step, set_aside
from ckptstore.store.base import Store
from ckptstore.store.checksum import crc32c
from ckptstore.store.fanout import gather_all
from ckptstore.store.transport import redact_url, store_logger

__all__ = [
    "FORMAT",
    "REPLACED_DIR",
    "TreeInfo",
    "TreeMirror",
    "adownload",
    "alocal_copy",
    "aroll_back",
    "aupload",
    "download",
    "is_tree_step",
    "local_copy",
    "move_aside",
    "numbered_after",
    "roll_back",
    "upload",
]

#: The ``format`` in the metadata of a step that holds a directory tree.
FORMAT = "ckptstore.files/1"

_UINT8 = np.dtype(np.uint8)
_UINT8_NAME = dtype_name(_UINT8) or "|u1"
_TEMP_MARK = ".ckptstore-tmp-"
_log = store_logger("ckptstore.restore")


@dataclass(frozen=True, slots=True)
class TreeInfo:
    """What an upload committed.

    Attributes:
        step: the committed step.
        attempt: its attempt id.
        files: regular files uploaded.
        links: symlinks kept.
        directories: directories (the root not counted).
        nbytes: bytes of file content.
        objects: data objects written.
    """

    step: int
    attempt: str
    files: int
    links: int
    directories: int
    nbytes: int
    objects: int


@dataclass(frozen=True, slots=True)
class _Entry:
    """One regular file or symlink of a scanned tree."""

    name: str  # relative path, "/"-joined, as on disk
    path: str  # its leaf path in the manifest (names escaped)
    size: int
    mode: int
    link: str | None
    identity: tuple[int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _scan(root: Path) -> tuple[Any, list[_Entry], int]:
    """Walk ``root``: its tree (the manifest's encoding: dicts, leaf indices), its files and
    links in leaf order, and the number of directories below it.

    Raises:
        UnsupportedTreeError: a special file, a symlink out of the tree, nesting too deep.
        NotADirectoryError: ``root`` is not a directory.
    """
    entries: list[_Entry] = []
    real_root = os.path.realpath(root)
    directories = 0

    def walk(directory: Path, name: str, path: str, depth: int) -> Any:
        nonlocal directories
        if depth > MAX_DEPTH:
            raise UnsupportedTreeError(f"{directory}: nested deeper than {MAX_DEPTH} levels")
        with os.scandir(directory) as it:
            found = sorted(it, key=lambda e: e.name)
        keys: list[str] = []
        children: list[Any] = []
        for item in found:
            rel = f"{name}/{item.name}" if name else item.name
            leaf_path = join_path(path, escape_key(item.name), depth)
            st = item.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                directories += 1
                child = walk(Path(item.path), rel, leaf_path, depth + 1)
            elif stat.S_ISREG(st.st_mode):
                child = len(entries)
                entries.append(
                    _Entry(rel, leaf_path, st.st_size, st.st_mode & 0o777, None, _identity(st))
                )
            elif stat.S_ISLNK(st.st_mode):
                target = os.readlink(item.path)
                _check_link(real_root, item.path, target, where=f"{root}/{rel}")
                child = len(entries)
                entries.append(_Entry(rel, leaf_path, 0, 0, target, _identity(st)))
            else:
                raise UnsupportedTreeError(
                    f"{root}/{rel}: a {_kind(st.st_mode)}, not a regular file, directory or "
                    "symlink; a checkpoint step carries only those"
                )
            keys.append(item.name)
            children.append(child)
        return {"d": keys, "c": children}

    if not root.is_dir():
        raise NotADirectoryError(f"{root}: not a directory (upload takes a directory tree)")
    return walk(root, "", "", 0), entries, directories


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
    ):
        if test(mode):
            return name
    return "special file"


def _check_link(real_root: str, link: str, target: str, *, where: str) -> None:
    """Refuse a symlink whose target is absolute or resolves outside ``real_root``
    (resolved through every link on the way, so a chain of links cannot leave it either)."""
    if not target or os.path.isabs(target) or "\0" in target:
        raise UnsupportedTreeError(
            f"{where}: symlink to {target!r} is absolute; only links that stay inside the "
            "tree (relative targets) can be carried"
        )
    resolved = os.path.realpath(link)
    if resolved != real_root and not resolved.startswith(real_root + os.sep):
        raise UnsupportedTreeError(
            f"{where}: symlink to {target!r} leads out of the tree ({resolved}); only links "
            "that stay inside it can be carried"
        )


class _FileLeaves(Sequence[np.ndarray[Any, Any]]):
    """The files of a tree as the leaves the pipeline's writer reads, opened only when the
    writer reaches them: a packed (small) file is read whole then, a large one mapped."""

    def __init__(self, root: Path, entries: list[_Entry], mapped: set[int]) -> None:
        self.root = root
        self.entries = entries
        self.mapped = mapped

    def __len__(self) -> int:
        return len(self.entries)

    @overload
    def __getitem__(self, index: int) -> np.ndarray[Any, Any]: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[np.ndarray[Any, Any]]: ...
    def __getitem__(
        self, index: int | slice
    ) -> np.ndarray[Any, Any] | Sequence[np.ndarray[Any, Any]]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        entry = self.entries[index]
        if entry.link is not None or entry.size == 0:
            return np.empty(0, _UINT8)
        where = self.root / entry.name
        try:
            fd = os.open(where, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise _changed(where, "it was removed") from None
        except OSError as exc:  # ELOOP: replaced by a symlink
            raise _changed(where, exc.strerror or "it cannot be opened") from None
        try:
            size = os.fstat(fd).st_size
            if size != entry.size:
                raise _changed(where, f"its size went from {entry.size} to {size} bytes")
            if index in self.mapped:
                # Mapped, not read: its pages are read as its parts upload.
                view = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
                view.madvise(mmap.MADV_SEQUENTIAL)
                return np.frombuffer(view, _UINT8)
            data = os.read(fd, size + 1)
            while len(data) < size + 1:
                more = os.read(fd, size + 1 - len(data))
                if not more:
                    break
                data += more
        finally:
            os.close(fd)
        if len(data) != size:
            raise _changed(where, f"{len(data)} bytes were read where {size} were expected")
        return np.frombuffer(data, _UINT8)


def _changed(where: Path, what: str) -> UnsupportedTreeError:
    return UnsupportedTreeError(
        f"{where} changed while it was uploaded ({what}); nothing was committed. Upload a "
        "checkpoint directory once its library has finished writing it"
    )


def _check_unchanged(root: Path, entries: list[_Entry]) -> None:
    for entry in entries:
        where = root / entry.name
        try:
            now = _identity(os.lstat(where))
        except FileNotFoundError:
            raise _changed(where, "it was removed") from None
        if now != entry.identity:
            raise _changed(where, "its size, mtime or inode differ from when it was listed")


# --------------------------------------------------------------------------- upload


async def aupload(
    source: str | os.PathLike[str],
    root: Root,
    *,
    step: int,
    metadata: Any = None,
    **store_options: Any,
) -> TreeInfo:
    """Upload the directory ``source`` as step ``step`` of ``root`` and commit it.

    Args:
        source: the directory tree (as another library wrote it).
        root: where the run's steps live: a URL, a path or an open Store.
        step: the step number to commit it as.
        metadata: JSON stored with it (``ckptstore show`` prints it).
        store_options: store options, as on every face.

    Returns:
        What was committed.

    Raises:
        UnsupportedTreeError: a special file, a symlink leaving the tree, or a file that
            changed during the upload (nothing is committed).
        CommitConflictError: ``step`` is already committed.
        NotADirectoryError: ``source`` is not a directory.
    """
    tree_root = Path(source)
    tree, entries, directories = await asyncio.to_thread(_scan, tree_root)
    form = {
        "format": FORMAT,
        "files": sum(1 for e in entries if e.link is None),
        "bytes": sum(e.size for e in entries),
        "user": metadata,
    }
    async with aopened(root, store_options) as store:
        return await _upload(store, tree_root, tree, entries, directories, step, form)


async def _upload(
    store: Store,
    tree_root: Path,
    tree: Any,
    entries: list[_Entry],
    directories: int,
    step: int,
    form: dict[str, Any],
) -> TreeInfo:
    paths = [e.path for e in entries]
    plan = save_path.plan(store, [e.size for e in entries], paths)
    mapped = {leaf for obj in plan.objects if not obj.packed for leaf in obj.leaves}
    async with await save_path.SaveSession.begin(store, step, form) as session:
        writer = save_path.object_writer(
            store, plan, session.prefix, _FileLeaves(tree_root, entries, mapped)
        )
        # One object per slot: bounds the files mapped (one descriptor each) and read at once.
        slots = asyncio.Semaphore(store.settings.transport.max_concurrency)

        async def write(index: int) -> None:
            async with slots:
                await writer.write(index)

        await gather_all((write(i) for i in range(len(plan.objects))), cancel=False)
        await asyncio.to_thread(_check_unchanged, tree_root, entries)
        draft = session.draft(
            paths,
            [_UINT8_NAME] * len(entries),
            [[e.size] for e in entries],
            [e.size for e in entries],
            [{"mode": e.mode} if e.link is None else {"symlink": e.link} for e in entries],
        )
        draft.add_plan(plan, writer.written.object_crc, writer.written.leaf_crc)
        info = await session.commit(draft.build(tree=tree, metadata=form))
    return TreeInfo(
        step=info.step,
        attempt=info.attempt,
        files=form["files"],
        links=sum(1 for e in entries if e.link is not None),
        directories=directories,
        nbytes=form["bytes"],
        objects=info.objects,
    )


def upload(
    source: str | os.PathLike[str],
    root: Root,
    *,
    step: int,
    metadata: Any = None,
    **store_options: Any,
) -> TreeInfo:
    """:func:`aupload` for synchronous callers (runs on ckptstore's background loop)."""
    return background.run(aupload(source, root, step=step, metadata=metadata, **store_options))


# --------------------------------------------------------------------------- download


def is_tree_step(manifest: Manifest) -> bool:
    """Whether ``manifest`` commits a directory tree (written by :func:`upload`)."""
    meta = manifest.metadata
    return isinstance(meta, dict) and meta.get("format") == FORMAT


@dataclass(frozen=True, slots=True)
class _Placed:
    """One leaf of a downloaded tree: where it goes and what it is."""

    leaf: int
    name: str  # relative path on disk
    mode: int
    link: str | None


def _layout(manifest: Manifest, where: str) -> tuple[list[str], list[_Placed]]:
    """The directories and files a tree step's manifest describes, every name checked.

    Raises:
        CorruptCheckpointError: a name that could leave the target or alias another, a
            node that is not a directory or a file, or bad attributes.
    """

    def reject(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{where}: step {manifest.step} is not a valid directory tree: {what}"
        )

    directories: list[str] = []
    placed: list[_Placed] = []
    stack: list[tuple[Any, str]] = [(manifest.tree, "")]
    while stack:
        node, name = stack.pop()
        if type(node) is int:
            attrs = manifest.attrs[node] or {}
            if manifest.dtypes[node] != _UINT8_NAME or len(manifest.shapes[node]) != 1:
                raise reject(f"{name!r} is not a byte string")
            link = attrs.get("symlink")
            if link is not None:
                if type(link) is not str or not link or "\0" in link or os.path.isabs(link):
                    raise reject(f"{name!r} is a symlink to {str(link)[:80]!r}")
                if manifest.leaf_length[node]:
                    raise reject(f"symlink {name!r} has content")
                placed.append(_Placed(node, name, 0, link))
                continue
            mode = attrs.get("mode", 0o644)
            if type(mode) is not int or not 0 <= mode <= 0o777:
                raise reject(f"{name!r} has mode {str(mode)[:20]!r}")
            placed.append(_Placed(node, name, mode, None))
            continue
        if type(node) is not dict or set(node) != {"d", "c"}:
            raise reject(f"{name or '<root>'!r} is neither a directory nor a file")
        if name:
            directories.append(name)
        for key, child in zip(node["d"], node["c"], strict=True):
            if (
                type(key) is not str
                or key in ("", ".", "..")
                or "/" in key
                or "\0" in key
                or key.startswith(_TEMP_MARK)
            ):
                raise reject(f"the name {str(key)[:80]!r} in {name or '<root>'!r}")
            stack.append((child, f"{name}/{key}" if name else key))
    return directories, placed


async def adownload(
    root: Root,
    target: str | os.PathLike[str],
    *,
    step: int | None = None,
    **store_options: Any,
) -> Path:
    """Download tree step ``step`` of ``root`` (default: the newest step) into ``target``.

    The tree is written into a temporary directory beside ``target``, verified and fsynced,
    then renamed to ``target``: nothing is visible under ``target`` until every byte of
    every file has matched its crc32c.

    Args:
        root: where the run's steps live: a URL, a path or an open Store.
        target: the directory to create; it must not exist or be an empty directory.
        step: the step (``None``: the newest committed step).
        store_options: store options, as on every face.

    Returns:
        ``target`` as a :class:`~pathlib.Path`.

    Raises:
        AlreadyExistsError: ``target`` exists and is not an empty directory.
        CheckpointFormatError: the step is not a directory tree (load it with
            ``ckptstore.load``).
        CorruptCheckpointError: a byte fails its crc32c, or the manifest names paths
            that would leave the target.
        NotFoundError: no such step.
    """
    dest = await asyncio.to_thread(_check_target, target)
    async with aopened(root, store_options) as store:
        manifest = await _tree_manifest(store, step)
        directories, placed = _layout(manifest, store.url)
        scratch = await asyncio.to_thread(_scratch_beside, dest)
        try:
            await _fill(store, manifest, scratch, directories, placed)
            await asyncio.to_thread(_publish, scratch, dest)
        except BaseException:
            await asyncio.to_thread(shutil.rmtree, scratch, True)
            raise
    return dest


def download(
    root: Root,
    target: str | os.PathLike[str],
    *,
    step: int | None = None,
    **store_options: Any,
) -> Path:
    """:func:`adownload` for synchronous callers (runs on ckptstore's background loop)."""
    return background.run(adownload(root, target, step=step, **store_options))


#: Where :func:`local_copy` moves what it replaces, beside the target: a name no checkpoint
#: library takes for one of its checkpoints (they match ``checkpoint-*`` and the like).
REPLACED_DIR = ".ckptstore-replaced"


async def alocal_copy(
    root: Root,
    target: str | os.PathLike[str],
    *,
    step: int | None = None,
    aside_dir: str | os.PathLike[str] | None = None,
    **store_options: Any,
) -> Path:
    """A verified local copy of tree step ``step`` at ``target``: reused when it is there
    already, downloaded otherwise. What a restart needs on the same node (the copy an earlier
    run downloaded or wrote is still there) and on a new one (nothing is).

    ``target`` is reused when it holds exactly the step: the same directories, files and
    symlinks and nothing else, every file of the step's size and crc32c (each file is read
    once to check it). Anything else there (a copy cut short, a file changed, another run's
    step of the same number after a rollback) is moved aside to
    ``<aside_dir>/<name>-<time>`` (logged at WARNING on the ``ckptstore.restore`` logger),
    never merged into or deleted, and the step is downloaded as :func:`adownload` does.

    Args:
        aside_dir: where to move what is replaced (default: :data:`REPLACED_DIR` beside
            ``target``; out of the directory a library lists its checkpoints in, so it never
            takes the old copy for a checkpoint or rotates it away).
        root, target, step, store_options: as for :func:`adownload`.

    Returns and Raises: as for :func:`adownload`, without its ``AlreadyExistsError``.
    """
    async with aopened(root, store_options) as store:
        manifest = await _tree_manifest(store, step)
        directories, placed = _layout(manifest, store.url)
        dest, aside = await asyncio.to_thread(
            _reuse_or_move, target, aside_dir, manifest, directories, placed
        )
        if aside is None and dest is not None:
            _log.info("step %d: reusing the verified local copy %s", manifest.step, dest)
            return dest
        if aside is not None:
            _log.warning(
                "step %d: %s did not hold step %d of %s exactly; moved it aside to %s and "
                "downloading",
                manifest.step,
                dest,
                manifest.step,
                store.url,
                aside,
            )
        return await adownload(store, target, step=manifest.step)


def local_copy(
    root: Root,
    target: str | os.PathLike[str],
    *,
    step: int | None = None,
    aside_dir: str | os.PathLike[str] | None = None,
    **store_options: Any,
) -> Path:
    """:func:`alocal_copy` for synchronous callers (runs on ckptstore's background loop)."""
    return background.run(
        alocal_copy(root, target, step=step, aside_dir=aside_dir, **store_options)
    )


async def _tree_manifest(store: Store, step: int | None) -> Manifest:
    """The manifest of tree step ``step`` (``None``: the newest).

    Raises:
        CheckpointFormatError: the step is not a directory tree.
    """
    manifest = await find_manifest(store, step)
    if not is_tree_step(manifest):
        raise CheckpointFormatError(
            f"{store.url}: step {manifest.step} is not a directory tree (no "
            f"{FORMAT!r} format in its metadata); read it with ckptstore.load"
        )
    return manifest


def _reuse_or_move(
    target: str | os.PathLike[str],
    aside_dir: str | os.PathLike[str] | None,
    manifest: Manifest,
    directories: list[str],
    placed: list[_Placed],
) -> tuple[Path | None, Path | None]:
    """``(target, None)`` when ``target`` holds the step exactly; ``(target, aside)`` when
    something else was there and is now at ``aside``; ``(None, None)`` when nothing was."""
    dest = Path(os.path.abspath(target))
    if not os.path.lexists(dest):
        return None, None
    if not dest.is_symlink() and dest.is_dir() and not any(dest.iterdir()):
        return None, None  # an empty directory: the download takes its place
    if _holds_exactly(dest, manifest, directories, placed):
        return dest, None
    return dest, move_aside(dest, aside_dir)


def move_aside(
    path: str | os.PathLike[str], aside_dir: str | os.PathLike[str] | None = None
) -> Path:
    """Rename ``path`` to ``<aside_dir>/<name>-<time>-<random>`` and return where it went:
    a local copy that must no longer be taken for a checkpoint, kept rather than deleted.

    Args:
        aside_dir: where to (default: :data:`REPLACED_DIR` beside ``path``); on the same
            filesystem, since it is one rename.
    """
    source = Path(os.path.abspath(path))
    where = Path(os.path.abspath(aside_dir)) if aside_dir else source.parent / REPLACED_DIR
    where.mkdir(parents=True, exist_ok=True)
    aside = where / f"{source.name}-{time.strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(3)}"
    os.rename(source, aside)
    return aside


def numbered_after(directory: str | os.PathLike[str], prefix: str) -> Callable[[int], list[Path]]:
    """For :func:`roll_back`'s ``newer_copies``: the directories ``<prefix><N>`` in
    ``directory`` with ``N`` above the step rolled back to (``checkpoint-N`` of the Hugging
    Face Trainer, ``checkpoint_N`` of Accelerate's automatic naming)."""

    def after(step: int) -> list[Path]:
        found = []
        for entry in Path(directory).glob(f"{prefix}*"):
            number = entry.name.removeprefix(prefix)
            if number.isdigit() and int(number) > step and entry.is_dir():
                found.append(entry)
        return sorted(found)

    return after


async def aroll_back(
    root: Root,
    step: int,
    *,
    newer_copies: Callable[[int], Iterable[Path]] = lambda step: (),
    aside_dir: str | os.PathLike[str] | None = None,
    **store_options: Any,
) -> list[int]:
    """Make tree step ``step`` the newest: what the adapters' ``rollback=True`` does.

    The newer committed steps are set aside in the store, as by :func:`ckptstore.rollback`
    (invisible, recoverable with :func:`ckptstore.recover_step` until gc removes them), and
    then the local copies of newer steps (``newer_copies(step)``: the library's own
    checkpoint directories) are moved aside (:func:`move_aside`), so neither the library's
    "resume from the newest" nor its rotation ever takes them for the run's checkpoints.

    Returns:
        The steps set aside in the store, descending.

    Raises:
        NotFoundError: ``step`` is not committed; nothing is set aside or moved.
        CheckpointFormatError: ``step`` is not a directory tree.
    """
    async with aopened(root, store_options) as store:
        await _tree_manifest(store, step)
        aside = await set_aside(store, step)
        moved = [
            await asyncio.to_thread(move_aside, copy, aside_dir) for copy in newer_copies(step)
        ]
    _log.warning(
        "rolled %s back to step %d: steps %s set aside in the store, local copies %s moved aside",
        store.url,
        step,
        sorted(aside) or "none",
        [str(p) for p in moved] or "none",
    )
    return aside


def roll_back(
    root: Root,
    step: int,
    *,
    newer_copies: Callable[[int], Iterable[Path]] = lambda step: (),
    aside_dir: str | os.PathLike[str] | None = None,
    **store_options: Any,
) -> list[int]:
    """:func:`aroll_back` for synchronous callers (runs on ckptstore's background loop)."""
    return background.run(
        aroll_back(root, step, newer_copies=newer_copies, aside_dir=aside_dir, **store_options)
    )


def _holds_exactly(
    dest: Path, manifest: Manifest, directories: list[str], placed: list[_Placed]
) -> bool:
    """Whether ``dest`` is a directory holding the step's tree and nothing else, every file
    with the step's size and crc32c."""
    if dest.is_symlink() or not dest.is_dir():
        return False
    found: set[str] = set()
    for where, dirs, files in os.walk(dest):
        relative = os.path.relpath(where, dest)
        for name in [*dirs, *files]:
            found.add(name if relative == "." else f"{relative}/{name}")
    if found != set(directories) | {entry.name for entry in placed}:
        return False
    for name in directories:
        if (dest / name).is_symlink() or not (dest / name).is_dir():
            return False
    for entry in placed:
        path = dest / entry.name
        if entry.link is not None:
            if not path.is_symlink() or os.readlink(path) != entry.link:
                return False
            continue
        info = path.lstat()
        if not stat.S_ISREG(info.st_mode) or info.st_size != manifest.leaf_length[entry.leaf]:
            return False
        if _file_crc(path) != manifest.leaf_crc[entry.leaf]:
            return False
    return True


def _file_crc(path: Path) -> int:
    value = 0
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            value = crc32c(block, value)
    return value


def _scratch_beside(dest: Path) -> Path:
    """A fresh directory beside ``dest``, so the final rename stays on one filesystem; made
    with the umask's mode, which the tree's root keeps once renamed."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    scratch = dest.parent / f".{dest.name}{_TEMP_MARK}{secrets.token_hex(6)}"
    scratch.mkdir()
    return scratch


def _check_target(target: str | os.PathLike[str]) -> Path:
    """``target`` as an absolute path, unless it exists and is not an empty directory.

    Raises:
        AlreadyExistsError: it exists and is not an empty directory.
    """
    dest = Path(os.path.abspath(target))
    if dest.is_symlink() or (dest.exists() and (not dest.is_dir() or any(dest.iterdir()))):
        raise AlreadyExistsError(
            f"{dest}: exists and is not an empty directory; a download never merges into or "
            "overwrites existing files (remove it or choose another target)"
        )
    return dest


async def _fill(
    store: Store, manifest: Manifest, scratch: Path, directories: list[str], placed: list[_Placed]
) -> None:
    """Write every directory, file and link of the step under ``scratch``, verified."""
    for name in sorted(directories):
        (scratch / name).mkdir()
    by_object: dict[int, list[_Placed]] = defaultdict(list)
    for entry in placed:
        if entry.link is None:
            by_object[manifest.leaf_object[entry.leaf]].append(entry)
    slots = asyncio.Semaphore(store.settings.transport.max_concurrency)

    async def fetch(obj: int, members: list[_Placed]) -> None:
        async with slots:
            if obj < 0:  # empty files
                await asyncio.to_thread(_write_files, scratch, members, {})
            elif (
                len(members) == 1
                and manifest.leaf_length[members[0].leaf] == (manifest.object_lengths[obj])
            ):
                await _fetch_mapped(store, manifest, scratch, members[0])
            else:
                arrays = await read_leaves(store, manifest, [m.leaf for m in members])
                await asyncio.to_thread(_write_files, scratch, members, arrays)

    # Every fetch ends before this returns, even on a failure: a file-writing thread must not
    # outlive the caller's removal of the scratch directory.
    await gather_all((fetch(obj, m) for obj, m in by_object.items()), cancel=False)
    links = [entry for entry in placed if entry.link is not None]
    if links:
        await asyncio.to_thread(_make_links, scratch, links, store.url, manifest.step)
    await asyncio.to_thread(_sync_directories, scratch, directories)


async def _fetch_mapped(store: Store, manifest: Manifest, scratch: Path, entry: _Placed) -> None:
    """A file that is an object of its own: read straight into a mapping of its file."""
    where = scratch / entry.name
    size = manifest.leaf_length[entry.leaf]
    fd = os.open(where, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)
        # Unmapped when the last array over it goes (an error's traceback may hold one).
        view = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE)
        await read_leaves(store, manifest, [entry.leaf], {entry.leaf: np.frombuffer(view, _UINT8)})
        await asyncio.to_thread(view.flush)
        os.fchmod(fd, entry.mode)
        await asyncio.to_thread(os.fsync, fd)
    finally:
        os.close(fd)


def _write_files(
    scratch: Path, members: list[_Placed], arrays: dict[int, np.ndarray[Any, Any]]
) -> None:
    for entry in members:
        fd = os.open(
            scratch / entry.name,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
        )
        try:
            data = arrays.get(entry.leaf)
            if data is not None and data.nbytes:
                view = memoryview(data).cast("B")  # type: ignore[arg-type]  # ndarray exports it
                while view:
                    view = view[os.write(fd, view) :]
            os.fchmod(fd, entry.mode)
            os.fsync(fd)
        finally:
            os.close(fd)


def _make_links(scratch: Path, links: list[_Placed], url: str, step: int) -> None:
    for entry in links:
        assert entry.link is not None
        os.symlink(entry.link, scratch / entry.name)
    real = os.path.realpath(scratch)
    for entry in links:
        try:
            _check_link(real, str(scratch / entry.name), entry.link or "", where=entry.name)
        except UnsupportedTreeError as exc:
            raise CorruptCheckpointError(
                f"{url}: step {step} is not a valid directory tree: {exc}"
            ) from None


def _sync_directories(scratch: Path, directories: list[str]) -> None:
    for name in [*sorted(directories, reverse=True), ""]:
        fd = os.open(scratch / name, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _publish(scratch: Path, dest: Path) -> None:
    """Rename the verified tree to ``dest``: an empty directory there is replaced."""
    _check_target(dest)  # again: something may have appeared there meanwhile
    try:
        os.rename(scratch, dest)  # POSIX: replaces an empty directory, refuses a full one
    except OSError as exc:
        raise AlreadyExistsError(
            f"{dest}: could not be replaced ({exc.strerror}); it must not exist or be empty"
        ) from None
    fd = os.open(dest.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- mirroring


class TreeMirror:
    """Uploads checkpoint directories as they are written, in the background, in order.

    The adapters (:mod:`ckptstore.integrations.transformers`, ``.accelerate``, ``.orbax``)
    hand it each directory their library finished writing. :meth:`submit` takes a snapshot
    of the directory in the caller's thread (hard links, so it costs one metadata operation
    per file, not a copy; files are copied where the filesystem has no hard links) and
    returns; one worker thread uploads the snapshots one after another with :func:`upload`
    and removes each once its step is committed. The snapshot is what makes the background
    upload safe against the library's own retention: a library that deletes an old
    checkpoint directory while it is still queued deletes its names, not the snapshot's.
    It does not protect against a file rewritten in place, which no checkpoint library does
    to a directory it has finished.

    A failed upload is raised by the next :meth:`submit`, by :meth:`wait` and by
    :meth:`close`, never dropped. A step that is not after the newest one committed or
    queued is refused by :meth:`submit` itself, as by the managers' ``save``: its commit
    would fail in the background, or a script run again in the same root would upload old
    step numbers between the previous run's.

    Args:
        root: where the steps go: a URL, a path or an open Store.
        snapshot: take a hard-link snapshot before returning from :meth:`submit`
            (``False``: upload the directory in place; it must then stay as it is until its
            upload finishes).
        snapshot_dir: where the snapshots go (default: beside each directory). Give one
            outside a directory whose every entry a library takes for a checkpoint
            (Accelerate's ``checkpoints/``), on the same filesystem so hard links work.
        resume_advice: how a user of the adapter resumes or rolls back, for the error that
            refuses an old step.
        store_options: store options, as on every face (checked here, before any upload).
    """

    def __init__(
        self,
        root: Root,
        *,
        snapshot: bool = True,
        snapshot_dir: str | os.PathLike[str] | None = None,
        resume_advice: str = (
            "To resume that run, download its newest step (ckptstore.files.local_copy) and "
            "upload the steps after it; to go back to an older step and upload the steps "
            "after it again, ckptstore.files.roll_back(root, step) sets the newer ones aside"
        ),
        **store_options: Any,
    ) -> None:
        check_options(root, store_options)
        self.root = root
        self.snapshot = snapshot
        self.snapshot_dir = None if snapshot_dir is None else Path(snapshot_dir)
        self.resume_advice = resume_advice
        self._options = store_options
        self._newest: int | None = None  # the store's newest step, once looked up
        self._newest_known = False
        self._queued: dict[concurrent.futures.Future[TreeInfo], int] = {}
        self._worker = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="ckptstore-mirror"
        )
        self._lock = threading.Lock()
        self._pending: list[concurrent.futures.Future[TreeInfo]] = []
        self._done: list[TreeInfo] = []
        background.close_at_exit(self, "an upload failed, its step is not in the store")

    def submit(
        self, directory: str | os.PathLike[str], step: int, *, metadata: Any = None
    ) -> concurrent.futures.Future[TreeInfo]:
        """Queue ``directory`` for upload as step ``step``; returns once it is snapshotted.

        Raises:
            CkptStoreError, OSError: an earlier upload failed (raised once, here or by
                :meth:`wait`), or the snapshot could not be taken.
        """
        self._raise_failed()
        source = Path(directory)
        if not source.is_dir():
            raise NotADirectoryError(f"{source}: not a directory; nothing to upload")
        self.check_step(step)
        copy = _link_snapshot(source, self.snapshot_dir) if self.snapshot else None
        try:
            future = self._worker.submit(self._upload, copy or source, copy, step, metadata)
        except BaseException:
            if copy is not None:
                shutil.rmtree(copy, ignore_errors=True)
            raise
        with self._lock:
            self._pending.append(future)
            self._queued[future] = step
        return future

    def check_step(self, step: int) -> None:
        """Refuse a step that is not after the newest committed or queued one (what
        :meth:`submit` does first; an adapter calls it before its library writes the step).
        The store's newest step is looked up once, at the first call.

        Raises:
            CommitConflictError: naming the newest step and :attr:`resume_advice`.
        """
        self.newest_step()
        with self._lock:  # an upload that failed does not count; one queued or done does
            queued = [s for f, s in self._queued.items() if not f.done() or not f.exception()]
        newest = max((s for s in (self._newest, *queued) if s is not None), default=None)
        if newest is not None and step <= newest:
            raise CommitConflictError(
                f"{self.where}: cannot upload step {step}: the newest step of this root is "
                f"{newest}, and a step is saved once, in increasing order. "
                f"{self.resume_advice}; or upload to a new root"
            )

    def newest_step(self) -> int | None:
        """The store's newest step: read once, with this mirror's uploads committed since."""
        if not self._newest_known:
            with opened(self.root, self._options) as store:
                self._newest = background.run(latest_step(store))
            self._newest_known = True
        with self._lock:
            done = [s for f, s in self._queued.items() if f.done() and not f.exception()]
        return max((s for s in (self._newest, *done) if s is not None), default=None)

    def adopt(self, directory: str | os.PathLike[str], step: int, *, metadata: Any = None) -> bool:
        """Queue the upload of a step the library has just resumed from, if the store lacks
        it and everything newer: its upload died with the process that saved it (a kill
        right after the save), so only this node holds it. Call it once the library loaded
        the directory (so it is whole enough to train from).

        Returns:
            Whether it was queued (``False``: the store holds this step or a newer one).
        """
        newest = self.newest_step()
        if newest is not None and step <= newest:
            return False
        _log.warning(
            "step %d: resumed from %s, which never reached %s; uploading it now",
            step,
            directory,
            self.where,
        )
        self.submit(directory, step, metadata=metadata)
        return True

    def rolled_back(self, step: int) -> None:
        """Take ``step`` as the root's newest from now on: after a roll-back to it, which
        set the newer steps aside (:func:`roll_back`).

        Raises:
            RuntimeError: an upload is still queued (roll back before uploading again, or
                :meth:`wait` first).
        """
        with self._lock:
            if self._pending:
                raise RuntimeError(
                    f"{self!r}: {len(self._pending)} uploads are still queued; wait() for them "
                    "before rolling back"
                )
            self._queued.clear()
        self._newest, self._newest_known = step, True

    def _upload(self, source: Path, copy: Path | None, step: int, metadata: Any) -> TreeInfo:
        try:
            return upload(source, self.root, step=step, metadata=metadata, **self._options)
        finally:
            if copy is not None:
                shutil.rmtree(copy, ignore_errors=True)

    def _raise_failed(self, *, wait: bool = False) -> None:
        with self._lock:
            pending = list(self._pending)
        if wait:
            threads.wait(pending)
        finished = [f for f in pending if f.done()]
        with self._lock:
            self._pending = [f for f in self._pending if f not in finished]
        error: BaseException | None = None
        for future in finished:
            with self._lock:
                step = self._queued.pop(future, None)
            exc = future.exception()
            if exc is None:
                self._done.append(future.result())
                if step is not None and self._newest_known:
                    self._newest = max(step, self._newest if self._newest is not None else step)
            elif error is None:
                error = exc
        if error is not None:
            raise error

    @property
    def uploaded(self) -> list[TreeInfo]:
        """The steps committed so far (as far as :meth:`submit` and :meth:`wait` have seen)."""
        return list(self._done)

    def wait(self) -> None:
        """Block until every queued directory is uploaded and committed.

        Raises:
            CkptStoreError, OSError: the first upload that failed.
        """
        self._raise_failed(wait=True)

    def close(self) -> None:
        """:meth:`wait`, then stop the worker. A mirror left open is closed when the main
        thread ends, so a script that never closes it still gets every upload it queued
        (a failure is then printed on stderr, naming the step)."""
        background.forget_at_exit(self)
        try:
            self.wait()
        finally:
            self._worker.shutdown(wait=True)

    @property
    def where(self) -> str:
        """The root, as messages name it (credentials in a URL's query redacted)."""
        return self.root.url if isinstance(self.root, Store) else redact_url(os.fspath(self.root))

    def __repr__(self) -> str:
        return f"TreeMirror({self.where!r})"

    def __enter__(self) -> TreeMirror:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _link_snapshot(source: Path, where: Path | None) -> Path:
    """A hard-linked copy of ``source`` in ``where`` (default: beside it; copies where links
    are refused)."""
    if where is not None:
        where.mkdir(parents=True, exist_ok=True)
    parent = source.parent if where is None else where
    copy = parent / f".{source.name}{_TEMP_MARK}mirror-{secrets.token_hex(6)}"

    def link_or_copy(src: str, dst: str) -> None:
        try:
            os.link(src, dst, follow_symlinks=False)
        except OSError:
            shutil.copy2(src, dst, follow_symlinks=False)

    try:
        shutil.copytree(source, copy, symlinks=True, copy_function=link_or_copy)
    except BaseException:
        shutil.rmtree(copy, ignore_errors=True)
        raise
    return copy
