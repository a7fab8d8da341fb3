"""Measure one store and suggest the part size and concurrency to use with it.

``ckptstore tune URL`` runs :func:`tune_store`. It writes scratch objects under a fresh
``.ckptstore-tune-<id>/`` prefix of the store and deletes them afterwards, and measures:

* large objects: one object of ``size`` bytes written with ``put`` (a parallel multipart
  upload) and read back with ``read_into`` (parallel ranged reads into one reused buffer),
  first at each candidate part size with a fixed concurrency, then at each candidate
  concurrency with the best part size found (a two-stage search: a few trials, not a grid);
* small objects: ``small_count`` objects of ``small_size`` bytes put and then got, all issued at
  once under each candidate concurrency, which gives the request rate packing must live with.

The best configuration is the one that moves the bytes through a write and a read in the least
total time. Client CPU seconds (this process, every thread) are recorded beside each figure,
because on a small machine a local server and the client compete for the same cores.

On a local directory every written file is dropped from the page cache (``posix_fadvise``)
before it is read, so reads measure the disk rather than memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ckptstore.store.base import Capabilities, Store
from ckptstore.store.registry import open_store

__all__ = [
    "DEFAULT_CONCURRENCIES",
    "DEFAULT_PART_SIZES",
    "LargeTrial",
    "SmallTrial",
    "TuneReport",
    "size_name",
    "tune_store",
    "usable_part_sizes",
]

#: Part sizes tried by default, in bytes (S3 allows 5 MiB to 5 GiB per part).
DEFAULT_PART_SIZES: tuple[int, ...] = (8 << 20, 16 << 20, 32 << 20, 64 << 20)
#: Request concurrencies tried by default.
DEFAULT_CONCURRENCIES: tuple[int, ...] = (4, 8, 16, 32)
_MIB = float(1 << 20)


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass(frozen=True, slots=True)
class LargeTrial:
    """One large object written and read back with one configuration.

    Attributes:
        part_size: bytes per part (write) and per ranged read.
        concurrency: requests kept in flight (``Settings.max_concurrency``).
        nbytes: object size in bytes.
        write_seconds: wall time of the put, median over repeats.
        read_seconds: wall time of the read, median over repeats.
        write_cpu_seconds: client CPU seconds of the put, median over repeats.
        read_cpu_seconds: client CPU seconds of the read, median over repeats.
    """

    part_size: int
    concurrency: int
    nbytes: int
    write_seconds: float
    read_seconds: float
    write_cpu_seconds: float
    read_cpu_seconds: float

    @property
    def write_mib_s(self) -> float:
        return self.nbytes / _MIB / self.write_seconds if self.write_seconds else float("inf")

    @property
    def read_mib_s(self) -> float:
        return self.nbytes / _MIB / self.read_seconds if self.read_seconds else float("inf")

    @property
    def total_seconds(self) -> float:
        return self.write_seconds + self.read_seconds

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["write_mib_s"] = self.write_mib_s
        out["read_mib_s"] = self.read_mib_s
        return out


@dataclass(frozen=True, slots=True)
class SmallTrial:
    """Many small objects put and got at one concurrency.

    Attributes:
        concurrency: requests kept in flight.
        count: objects written and read.
        size: bytes per object.
        put_seconds: wall time to put all of them.
        get_seconds: wall time to get all of them.
    """

    concurrency: int
    count: int
    size: int
    put_seconds: float
    get_seconds: float

    @property
    def puts_per_s(self) -> float:
        return self.count / self.put_seconds if self.put_seconds else float("inf")

    @property
    def gets_per_s(self) -> float:
        return self.count / self.get_seconds if self.get_seconds else float("inf")

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["puts_per_s"] = self.puts_per_s
        out["gets_per_s"] = self.gets_per_s
        return out


@dataclass(frozen=True, slots=True)
class TuneReport:
    """What :func:`tune_store` measured and what it suggests.

    Attributes:
        url: the store measured.
        large: every large-object trial, in the order run.
        small: every small-object trial.
        best: the large-object trial with the least write + read time.
        repeat: runs per figure (figures are medians).
    """

    url: str
    large: list[LargeTrial]
    small: list[SmallTrial]
    best: LargeTrial
    repeat: int
    notes: list[str] = field(default_factory=list)

    @property
    def suggested_settings(self) -> dict[str, int]:
        """``Settings`` fields to use with this store."""
        return {"part_size": self.best.part_size, "max_concurrency": self.best.concurrency}

    def as_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "repeat": self.repeat,
            "large": [t.as_dict() for t in self.large],
            "small": [t.as_dict() for t in self.small],
            "best": self.best.as_dict(),
            "suggested_settings": self.suggested_settings,
            "notes": list(self.notes),
        }


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _drop_cached(store: Store, key: str) -> None:
    """Evict a local file from the page cache so the next read comes from the disk."""
    local_path: Callable[[str], str] | None = getattr(store, "local_path", None)
    if local_path is None or not hasattr(os, "posix_fadvise"):
        return
    fd = os.open(local_path(key), os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


async def _large_trial(
    url: str,
    options: dict[str, Any],
    prefix: str,
    data: memoryview,
    out: memoryview,
    part_size: int,
    concurrency: int,
    repeat: int,
) -> LargeTrial:
    settings = {
        "part_size": part_size,
        "max_concurrency": concurrency,
        "multipart_threshold": min(part_size, len(data)),
        "max_inflight_bytes": max(1 << 30, part_size * concurrency),
    }
    writes: list[float] = []
    reads: list[float] = []
    write_cpu: list[float] = []
    read_cpu: list[float] = []
    async with open_store(url, **{**options, **settings}) as store:
        for run in range(repeat):
            key = f"{prefix}large-{part_size}-{concurrency}-{run}"
            c0, t0 = _cpu_seconds(), time.perf_counter()
            await store.put(key, data)
            t1, c1 = time.perf_counter(), _cpu_seconds()
            await asyncio.to_thread(_drop_cached, store, key)
            c2, t2 = _cpu_seconds(), time.perf_counter()
            await store.read_into(key, 0, out)
            t3, c3 = time.perf_counter(), _cpu_seconds()
            if out[:64] != data[:64] or out[-64:] != data[-64:]:
                raise AssertionError(f"{store.url}: read back different bytes than written")
            await store.delete([key])
            writes.append(t1 - t0)
            write_cpu.append(c1 - c0)
            reads.append(t3 - t2)
            read_cpu.append(c3 - c2)
    return LargeTrial(
        part_size=part_size,
        concurrency=concurrency,
        nbytes=len(data),
        write_seconds=_median(writes),
        read_seconds=_median(reads),
        write_cpu_seconds=_median(write_cpu),
        read_cpu_seconds=_median(read_cpu),
    )


async def _small_trial(
    url: str, options: dict[str, Any], prefix: str, count: int, size: int, concurrency: int
) -> SmallTrial:
    payload = os.urandom(size)
    keys = [f"{prefix}small-{concurrency}/{i:06d}" for i in range(count)]
    async with open_store(url, **{**options, "max_concurrency": concurrency}) as store:
        t0 = time.perf_counter()
        await asyncio.gather(*(store.put(key, payload) for key in keys))
        t1 = time.perf_counter()
        got = await asyncio.gather(*(store.get(key) for key in keys))
        t2 = time.perf_counter()
        if any(g != payload for g in got):
            raise AssertionError(f"{store.url}: a small object read back differently")
        await store.delete(keys)
    return SmallTrial(concurrency, count, size, t1 - t0, t2 - t1)


def size_name(n: int) -> str:
    """A size as a ``Settings`` value: ``33554432`` -> ``"32MiB"``."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return f"{n}B"


def usable_part_sizes(caps: Capabilities, size: int, part_sizes: Sequence[int]) -> list[int]:
    """The candidate part sizes within the backend's limits and not above ``size``, sorted.

    Raises:
        ValueError: if none is left; the message names the bounds a part size must meet.
    """
    usable = sorted(
        {p for p in part_sizes if caps.min_part_size <= p <= min(caps.max_part_size, size)}
    )
    if not usable:
        # Only the bounds that apply are named: most backends have no real maximum (their
        # limit is a huge sentinel) and a minimum of one byte, which says nothing to a user.
        bounds = [f"at most {size_name(size)} (the object size, --size)"]
        if caps.max_part_size < size:
            bounds.append(f"at most {size_name(caps.max_part_size)} (the backend's maximum)")
        if caps.min_part_size > 1:
            bounds.append(f"at least {size_name(caps.min_part_size)} (the backend's minimum)")
        tried = ",".join(size_name(p) for p in sorted(set(part_sizes)))
        raise ValueError(
            f"no candidate part size fits (tried --part-sizes {tried}): a part must be "
            f"{' and '.join(bounds)}; give smaller --part-sizes or a larger --size"
        )
    return usable


async def tune_store(
    url: str,
    *,
    size: int = 256 << 20,
    part_sizes: Sequence[int] = DEFAULT_PART_SIZES,
    concurrencies: Sequence[int] = DEFAULT_CONCURRENCIES,
    small_count: int = 512,
    small_size: int = 4 << 10,
    repeat: int = 1,
    options: dict[str, Any] | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> TuneReport:
    """Measure the store at ``url`` and pick the fastest part size and concurrency.

    Args:
        url: the store to measure; scratch objects go under a fresh prefix and are deleted.
        size: bytes of the large object each trial writes and reads.
        part_sizes: candidate part sizes in bytes; those outside the backend's limits or
            larger than ``size`` are skipped.
        concurrencies: candidate request concurrencies.
        small_count: small objects per small-object trial.
        small_size: bytes per small object.
        repeat: runs per large-object figure (the median is kept).
        options: options for :func:`~ckptstore.open_store` (endpoint, credentials...).
        progress: called as ``progress(done, total, label)`` after each trial.

    Returns:
        every measured figure and the best configuration.
    """
    options = dict(options or {})
    if size <= 0 or small_count <= 0 or small_size <= 0 or repeat <= 0:
        raise ValueError("size, small_count, small_size and repeat must be positive")
    if not part_sizes or not concurrencies:
        raise ValueError("give at least one part size and one concurrency")
    concurrencies = sorted(set(concurrencies))
    if min(concurrencies) <= 0:
        raise ValueError(f"concurrencies must be positive, got {concurrencies}")
    notes: list[str] = []
    prefix = f".ckptstore-tune-{uuid.uuid4().hex[:12]}/"
    async with open_store(url, **options) as probe:
        caps = probe.capabilities
        default_concurrency = probe.settings.transport.max_concurrency
        store_url = probe.url
    usable = usable_part_sizes(caps, size, part_sizes)
    if not caps.multipart:
        notes.append(
            "this backend writes every object in one request; part size only changes reads"
        )
    data = memoryview(np.random.default_rng(0).bytes(size))
    out = memoryview(bytearray(size))  # zero-filled, so touched once: no trial pays page faults
    stage1 = min(concurrencies, key=lambda c: abs(c - default_concurrency))
    large: list[LargeTrial] = []
    small: list[SmallTrial] = []
    total = len(usable) + 2 * len(concurrencies) - 1  # stage1 is run once, not twice

    def report(label: str) -> None:
        if progress is not None:
            progress(len(large) + len(small), total, label)

    try:
        for part_size in usable:
            trial = await _large_trial(url, options, prefix, data, out, part_size, stage1, repeat)
            large.append(trial)
            report(f"part {_size_text(part_size)} x{stage1}")
        best_part = min(large, key=lambda t: t.total_seconds).part_size
        for concurrency in concurrencies:
            if concurrency == stage1:
                continue
            trial = await _large_trial(
                url, options, prefix, data, out, best_part, concurrency, repeat
            )
            large.append(trial)
            report(f"part {_size_text(best_part)} x{concurrency}")
        for concurrency in concurrencies:
            small.append(
                await _small_trial(url, options, prefix, small_count, small_size, concurrency)
            )
            report(f"{small_count} small objects x{concurrency}")
    finally:
        async with open_store(url, **options) as store:
            with contextlib.suppress(Exception):  # best effort: the trials delete as they go
                await store.delete_prefix(prefix)
    best = min(large, key=lambda t: t.total_seconds)
    return TuneReport(store_url, large, small, best, repeat, notes)


def _size_text(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return f"{n}B"
