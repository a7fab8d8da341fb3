"""Tunables, gathered in one place and split by the layer that reads them.

:class:`Settings` holds three groups: :class:`TransportSettings` (how a store moves bytes),
:class:`LayoutSettings` (what a checkpoint looks like, how long a save or restore may take)
and :class:`GcSettings` (garbage collection and the save lease). A layer reads its own group
and those below it, so a store never sees the packing policy; a user names a setting alone,
whatever its group.

Every field is a named, documented parameter whose default says its unit. Each can be
overridden by an environment variable ``CKPTSTORE_<FIELD NAME IN CAPITALS>``, read once when
:func:`default_settings` is first called, or per store by passing ``settings=`` or the field
name as a keyword to :func:`ckptstore.open_store`. Sizes accept a plain byte count or a suffix:
``64MiB``, ``8M``, ``1GiB``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "GcSettings",
    "LayoutSettings",
    "Settings",
    "TransportSettings",
    "default_settings",
    "parse_size",
]

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(value: str | int) -> int:
    """Parse ``"64MiB"``, ``"8M"``, ``"4096"`` or an int into a byte count (binary units)."""
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must be >= 0, got {value}")
        return value
    match = _SIZE_RE.match(value)
    if not match:
        raise ValueError(f"cannot parse size {value!r}; use bytes or a suffix such as 64MiB")
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


@dataclass(frozen=True, slots=True)
class TransportSettings:
    """How a store moves bytes (``ckptstore/store/``): parts, concurrency, retries, the
    POSIX writes and each request's deadline.

    Attributes:
        part_size: bytes per part of a multipart write; also the unit of parallel ranged
            reads of one large object.
        multipart_threshold: objects at least this many bytes are written as multipart uploads.
        max_concurrency: parallel requests one store keeps in flight.
        max_inflight_bytes: bytes of request and response bodies one store keeps in flight
            (puts, multipart parts, ranged reads), on every backend; a single body larger than
            this goes alone. Bounds the memory a store's transfers pin.
        retry_attempts: attempts per request of a network backend (S3, GCS, fsspec), the
            first included, for failures worth retrying: throttling, 5xx, dropped
            connections, bodies that arrive short or fail their checksum. A connection
            refused on a store's first request is not retried: it fails at once.
        retry_delay: seconds before the first retry; doubled per retry, with jitter.
        retry_max_delay: longest wait between two attempts, in seconds.
        io_threads: threads for blocking POSIX I/O (writes and reads release the GIL).
        coalesce_gap: ranged reads of one object closer than this many bytes are merged.
        coalesce_limit: a merged ranged read is never larger than this many bytes.
        durable: fsync written files and their directories before a put returns (local, nfs).
        direct_io: local directories write the page-aligned body of large writes with
            ``O_DIRECT``, past the page cache: no copy into kernel memory, no page-cache
            allocation competing with training for CPU and memory, and checkpoints do not
            evict the data loader's cached files. Writes fall back to the page cache where the
            filesystem refuses ``O_DIRECT`` (tmpfs, some FUSE mounts).
        request_deadline: seconds one request to an object store (S3, GCS, fsspec) may take
            in all, its retries and the pauses between them included, before it fails with
            :class:`~ckptstore.errors.DeadlineExceededError`. The backends' own timeouts
            (``connect_timeout``, ``read_timeout`` on S3) bound each try's connect and each
            wait for a byte; this bounds the whole, so a server that trickles one byte a
            second cannot hold a save or a restore for hours. A request moves at most one
            part (``part_size``) or range, so the default leaves 32 MiB more than 10 s at
            under 1 MiB/s; one that must move a larger body in one piece (an fsspec put is
            one ``pipe_file``; an S3 or GCS put under ``multipart_threshold`` is one request;
            S3 grows parts to its 5 MiB minimum, or to fit 10,000 parts) gets the deadline
            once per ``part_size`` of the body.
        hedged_reads: the largest share of an object store's ranged reads sent a second time
            when slow against their peers (twice the median time per MiB of the last
            64 reads, at least 50 ms); the first answer wins (``ckptstore.store.transport.
            Hedger``). Hedges add at most about this share of the bytes read; 0 turns them off.
    """

    part_size: int = 32 << 20
    multipart_threshold: int = 64 << 20
    max_concurrency: int = 16
    max_inflight_bytes: int = 1 << 30
    retry_attempts: int = 10
    retry_delay: float = 0.1
    retry_max_delay: float = 5.0
    io_threads: int = 8
    coalesce_gap: int = 1 << 20
    coalesce_limit: int = 64 << 20
    durable: bool = True
    direct_io: bool = True
    request_deadline: float = 300.0
    hedged_reads: float = 0.05

    def __post_init__(self) -> None:
        _check_types(self)
        if self.part_size <= 0:
            raise ValueError(f"Settings.part_size must be > 0, got {self.part_size}")
        if self.max_concurrency <= 0 or self.io_threads <= 0:
            raise ValueError("Settings.max_concurrency and Settings.io_threads must be > 0")
        if self.max_inflight_bytes < self.part_size:
            raise ValueError("Settings.max_inflight_bytes must be at least one part_size")
        if self.retry_attempts < 1:
            raise ValueError(f"Settings.retry_attempts must be >= 1, got {self.retry_attempts}")
        if not 0 <= self.retry_delay <= self.retry_max_delay:
            raise ValueError(
                "Settings.retry_delay and Settings.retry_max_delay must satisfy "
                f"0 <= retry_delay <= retry_max_delay, got {self.retry_delay} and "
                f"{self.retry_max_delay}"
            )
        if not 0 <= self.hedged_reads <= 1:
            raise ValueError(f"Settings.hedged_reads must be in [0, 1], got {self.hedged_reads}")
        _check_seconds(self, "request_deadline")


@dataclass(frozen=True, slots=True)
class LayoutSettings:
    """What a checkpoint looks like and how long one save or restore of it may take
    (``ckptstore/layout/``, ``ckptstore/pipeline/``): packing, alignment, the manifest's
    cap, sharded chunks, incremental saves.

    Attributes:
        pack_threshold: leaves (arrays) smaller than this many bytes are packed together into
            pack objects; larger ones are written as objects of their own.
        pack_size: target size in bytes of one pack object; a pack is closed before a leaf
            would take it past this size (so 20,000 leaves of 4 KiB make 10 objects, not
            20,000 requests).
        leaf_alignment: the one leaf alignment of ckptstore: byte offsets of leaves inside a
            pack object (of every face: save, manager, distributed, DCP, Lightning) and inside
            a staging arena are multiples of this, so every leaf can be viewed in place (mmap,
            ``numpy.frombuffer``) with its dtype aligned. A power of two. (Staging arenas and
            their large leaves also start on an OS page, ``ckptstore.store.buffers.PAGE``: that
            is what ``O_DIRECT`` needs of a buffer, a property of the machine, not a setting.)
        manifest_max_bytes: a manifest larger than this is refused before it is read.
        chunk_block_size: the largest checksummed block of a sharded leaf's chunks (a power of
            two from 4 KiB to 1 GiB; a save uses a quarter of its chunks' shortest row when
            that is smaller): a load of part of a chunk reads and checks the whole blocks
            around it, so a smaller block reads less beyond what it needs and costs more
            manifest (about 11 bytes per block; see :mod:`ckptstore.layout.chunks`).
        incremental: saves record an xxh3-128 hash of every leaf and write only the leaves
            that changed since the newest committed step, referencing that step's objects
            for the rest (docs/format.md, "Incremental saves"). Costs one hashing pass over
            the state (about 0.1 s per GiB, in the background) and one manifest read per
            save; deleting a step then reads every manifest.
        save_deadline: seconds one whole save may take in the background (its hashing, writes
            and commit; for a rank of a multi-rank save, its own writes) before
            it fails with :class:`~ckptstore.errors.DeadlineExceededError` and its attempt is
            abandoned. Object-store requests are bounded one by one by ``request_deadline``;
            this bounds what they cannot: a local or NFS write the kernel never finishes, and
            a save that makes slow progress through thousands of requests. The default leaves
            a 1 TiB save of one process 0.3 GiB/s.
        restore_deadline: the same for one whole restore (its reads, checks and rebuilding
            of the arrays), on every face that restores.
    """

    pack_threshold: int = 1 << 20
    pack_size: int = 8 << 20
    leaf_alignment: int = 64
    manifest_max_bytes: int = 256 << 20
    chunk_block_size: int = 1 << 20
    incremental: bool = True
    save_deadline: float = 3600.0
    restore_deadline: float = 3600.0

    def __post_init__(self) -> None:
        _check_types(self)
        if self.pack_size <= 0 or self.leaf_alignment <= 0:
            raise ValueError("Settings.pack_size and Settings.leaf_alignment must be > 0")
        if self.leaf_alignment & (self.leaf_alignment - 1):
            raise ValueError(
                f"Settings.leaf_alignment must be a power of two, got {self.leaf_alignment}"
            )
        block = self.chunk_block_size
        if block & (block - 1) or not 4 << 10 <= block <= 1 << 30:
            raise ValueError(
                f"Settings.chunk_block_size must be a power of two from 4 KiB to 1 GiB, got {block}"
            )
        _check_seconds(self, "save_deadline")
        _check_seconds(self, "restore_deadline")


@dataclass(frozen=True, slots=True)
class GcSettings:
    """When garbage collection may remove what a save left, and the lease a running save
    holds against it (``ckptstore/layout/gc.py``, ``ckptstore/layout/lease.py``).

    Attributes:
        gc_grace_seconds: garbage collection leaves an uncommitted save attempt alone until it
            has been idle this many seconds (a running save's lease counts as activity).
        save_lease_seconds: a running save renews a lease on its attempt every quarter of
            this many seconds, and garbage collection never removes an attempt whose lease
            has not expired, whatever its grace period; a save whose lease lapsed refuses to
            commit (see ``ckptstore.layout.lease``).
    """

    gc_grace_seconds: int = 6 * 3600
    save_lease_seconds: int = 120

    def __post_init__(self) -> None:
        _check_types(self)
        if self.save_lease_seconds < 4:
            raise ValueError(
                f"Settings.save_lease_seconds must be at least 4, got {self.save_lease_seconds}"
            )


_Group = TransportSettings | LayoutSettings | GcSettings
#: Each group's attribute on :class:`Settings`, and its class.
_GROUPS: dict[str, type[_Group]] = {
    "transport": TransportSettings,
    "layout": LayoutSettings,
    "gc": GcSettings,
}
#: Every setting's name, its group's attribute and its type (``"int"``, ``"float"``, ``"bool"``).
_FIELDS: dict[str, tuple[str, str]] = {
    f.name: (group, str(f.type)) for group, cls in _GROUPS.items() for f in dataclasses.fields(cls)
}


def _check_types(group: _Group) -> None:
    for field in dataclasses.fields(group):
        value = getattr(group, field.name)
        if field.type == "int" and (not isinstance(value, int) or isinstance(value, bool)):
            raise TypeError(f"Settings.{field.name} must be an int, got {value!r}")
        if field.type == "float" and (
            not isinstance(value, int | float) or isinstance(value, bool)
        ):
            raise TypeError(f"Settings.{field.name} must be a number, got {value!r}")


def _check_seconds(group: _Group, name: str) -> None:
    if not getattr(group, name) > 0:
        raise ValueError(f"Settings.{name} must be > 0 seconds, got {getattr(group, name)}")


@dataclass(frozen=True, slots=True, init=False)
class Settings:
    """Every tunable of ckptstore, in one object split by the layer that reads it.

    A user sets a tunable by its name alone: ``Settings(part_size=64 << 20)``,
    ``open_store(url, part_size="64MiB")``, ``?part_size=64MiB`` in an object-store URL, or
    ``CKPTSTORE_PART_SIZE=64MiB``. Each layer reads only its own group, and those of the
    layers below it (``tests/test_layers.py`` checks):

    * ``transport`` (:class:`TransportSettings`), read by ``ckptstore/store/``: parts,
      concurrency, retries, the POSIX writes, each request's deadline;
    * ``layout`` (:class:`LayoutSettings`), read by ``ckptstore/layout/`` and
      ``ckptstore/pipeline/``: packing, the manifest's cap, sharded chunks, incremental
      saves, each save's and restore's deadline;
    * ``gc`` (:class:`GcSettings`): garbage collection's grace and the lease a running save
      holds against it.

    Args:
        transport, layout, gc: whole groups (default: their defaults).
        **fields: single settings by name, applied over the groups.

    Raises:
        TypeError: an unknown name, or a value of the wrong type.
        ValueError: a value out of its range.
    """

    transport: TransportSettings
    layout: LayoutSettings
    gc: GcSettings

    def __init__(
        self,
        *,
        transport: TransportSettings | None = None,
        layout: LayoutSettings | None = None,
        gc: GcSettings | None = None,
        **fields: Any,
    ) -> None:
        given = {"transport": transport, "layout": layout, "gc": gc}
        groups: dict[str, Any] = {
            name: cls() if given[name] is None else given[name] for name, cls in _GROUPS.items()
        }
        changes: dict[str, dict[str, Any]] = {}
        for name, value in fields.items():
            changes.setdefault(_field(name)[0], {})[name] = value
        for group, values in changes.items():
            groups[group] = dataclasses.replace(groups[group], **values)
        for group, value in groups.items():
            object.__setattr__(self, group, value)

    def replace(self, **changes: Any) -> Settings:
        """Return a copy with ``changes`` (settings by name) applied; values may be strings
        (as from a URL)."""
        return Settings(
            transport=self.transport, layout=self.layout, gc=self.gc, **_coerce(changes)
        )

    def values(self) -> dict[str, Any]:
        """Every setting by name, with its value."""
        return {name: getattr(getattr(self, group), name) for name, (group, _) in _FIELDS.items()}

    @classmethod
    def field_names(cls) -> frozenset[str]:
        """The name of every setting, of every group."""
        return frozenset(_FIELDS)


def _field(name: str) -> tuple[str, str]:
    """The group attribute and the type of setting ``name``; ``TypeError`` if unknown."""
    try:
        return _FIELDS[name]
    except KeyError:
        raise TypeError(f"unknown setting {name!r}; known: {', '.join(sorted(_FIELDS))}") from None


def _coerce(values: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in values.items():
        kind = _field(name)[1]
        if isinstance(value, str):
            if kind == "bool":
                lowered = value.strip().lower()
                if lowered not in {"1", "0", "true", "false", "yes", "no"}:
                    raise ValueError(f"setting {name}={value!r} is not a boolean")
                value = lowered in {"1", "true", "yes"}
            elif kind == "float":
                value = _parse_seconds(name, value)
            elif kind == "int" and name.startswith("retry_"):
                value = _parse_count(name, value)
            else:
                value = parse_size(value)
        out[name] = value
    return out


def _parse_seconds(name: str, value: str) -> float:
    try:
        seconds = float(value.strip().removesuffix("s"))
    except ValueError:
        raise ValueError(f"setting {name}={value!r} is not a number of seconds") from None
    if seconds != seconds or seconds in (float("inf"), float("-inf")):
        raise ValueError(f"setting {name}={value!r} is not a finite number of seconds")
    return seconds


def _parse_count(name: str, value: str) -> int:
    try:
        return int(value.strip())
    except ValueError:
        raise ValueError(f"setting {name}={value!r} is not a whole number") from None


@functools.cache
def default_settings() -> Settings:
    """Settings with ``CKPTSTORE_*`` environment overrides applied (read once)."""
    values: dict[str, Any] = {}
    for name in sorted(Settings.field_names()):
        variable = f"CKPTSTORE_{name.upper()}"
        if variable in os.environ:
            try:
                values.update(_coerce({name: os.environ[variable]}))
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"environment variable {variable}: {exc}") from None
    try:
        return Settings().replace(**values)
    except (TypeError, ValueError) as exc:  # checks across fields: max_inflight >= part_size
        raise type(exc)(f"CKPTSTORE_* environment variables: {exc}") from None
