"""save-floor: how close to the write+fsync ceiling a save of 20,000 small leaves can come here.

The format suite holds ``ckptstore.save`` of 20,000 float32 leaves of 4 KiB (80 MiB) against one
pre-serialized blob written with ``write`` and ``fsync`` (issue 31's goal: within 1.05x). This
suite splits that gap into what the disk costs and what the commit rules cost, by timing
these alternately in one process, each into a fresh directory after ``os.sync()``:

* **ceiling**: the format suite's, the same bytes as one blob, written and fsynced;
* **pack writes**: the very pack objects ``ckptstore.save`` writes for this state (its own
  :class:`~ckptstore.layout.plan.PackPlan`), already built, written in parallel with
  ``O_DIRECT`` from page-aligned buffers, each fsynced, then their directory: the disk's time for
  the save's bytes and nothing else;
* **minimal save**: a hand-written save that keeps ckptstore's rules and does nothing more:
  walk the dict; put the lease (written, fsynced, its directories fsynced) before any data
  (:mod:`ckptstore.layout.lease`); build each pack with ckptstore's own compiled pass (copy,
  each leaf's crc32c and xxh3-128: :meth:`PackPlan.fill_digests`) on one thread and write it as
  soon as it is built; encode the manifest's columns (JSON) while the writes run; once every
  pack is durable, put the manifest (temp file, fsync, ``link``, directory fsync) and remove
  the lease. No tree codec, no validation, no error handling, no bounds on buffers in flight;
* **lease** and **commit**: the minimal save's lease put and manifest put alone (the manifest
  of the last minimal save, about 1.7 MB against ckptstore's 1.9 MB), each into a fresh
  directory;
* **ckptstore.save**, as the format suite calls it.

No save can overlap its lease with its data (the lease lands first, so that garbage collection
in another process leaves the attempt alone) nor its manifest with its data (invariant 2 of
the commit protocol), so pack writes + lease + commit bound from below every save that writes
these packs, however fast its own work.

Each figure is the median of the rounds (one untimed warm-up of each first); the summary
gives each one's ratio to the ceiling, and the minimal save's phases (median ms from its
start): the walk, the lease landed and the first pack handed to the disk, the last pack
durable, the commit done. Linux only (``O_DIRECT``).
"""

from __future__ import annotations

import mmap
import os
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import orjson

import ckptstore
from benchlib import Context, Result, Suite, interleave
from benchlib.format import CEILING, _fsync_path, _write_fsync
from benchlib.workloads import small
from ckptstore.layout.plan import PackPlan
from ckptstore.store.checksum import as_uint8, crc32c
from ckptstore.store.local import LocalStore

IO_THREADS = 8


def _put(path: str, data: Any, direct: bool) -> None:
    """A durable put-if-absent of a local store: temp file, fsync, link, unlink."""
    temp = f"{path}.tmp"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        if direct:
            dfd = os.open(temp, os.O_WRONLY | os.O_DIRECT)
            try:
                os.pwrite(dfd, data, 0)
            finally:
                os.close(dfd)
        else:
            os.pwrite(fd, data, 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.link(temp, path)
    os.unlink(temp)


def _aligned(size: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    return np.frombuffer(mmap.mmap(-1, size), np.uint8)  # page aligned, as O_DIRECT needs


class Floor:
    """The pack writes and the minimal save of one state (see the module docstring)."""

    def __init__(self, state: dict[str, np.ndarray[Any, Any]]) -> None:
        self.state = state
        arrays = list(state.values())
        store = LocalStore(tempfile.gettempdir())
        self.settings, self.capabilities = store.settings, store.capabilities
        self.plan = PackPlan.for_store(
            [a.nbytes for a in arrays], self.settings, self.capabilities, list(state)
        )
        if not all(obj.packed for obj in self.plan.objects):
            raise ValueError("the minimal save handles packed leaves only")
        self.buffers = [_aligned(obj.size) for obj in self.plan.objects]
        self.io = ThreadPoolExecutor(IO_THREADS)
        self.hashing = ThreadPoolExecutor(1)
        self.phases: dict[str, list[float]] = {}
        self.manifest = b""
        for index in range(len(self.plan.objects)):  # built once for the pack writes
            self.plan.fill(index, arrays, self.buffers[index])

    def close(self) -> None:
        self.io.shutdown()
        self.hashing.shutdown()

    def pack_writes(self, root: str) -> None:
        writes = [
            self.io.submit(_put, f"{root}/{obj.name}", buf, True)
            for obj, buf in zip(self.plan.objects, self.buffers, strict=True)
        ]
        for write in writes:
            write.result()
        _fsync_path(root)

    @staticmethod
    def lease(root: str, attempt: str) -> None:
        """Put a save's lease: its directories made, the file written and fsynced, then every
        directory it created."""
        os.makedirs(attempt)
        _put(f"{attempt}/lease.json", b'{"expires": 0}', False)
        for directory in (attempt, os.path.dirname(attempt), root):
            _fsync_path(directory)

    def commit(self, step_dir: str) -> None:
        """Put the last minimal save's manifest bytes, as its commit does."""
        _put(f"{step_dir}/manifest.json", self.manifest, False)
        _fsync_path(step_dir)

    def save(self, root: str) -> None:
        t0 = time.perf_counter()
        marks: dict[str, float] = {}

        def mark(name: str) -> None:
            marks[name] = (time.perf_counter() - t0) * 1e3

        paths, arrays = [], []
        for path, array in self.state.items():
            paths.append(path)
            arrays.append(array)
        dtypes = [a.dtype for a in arrays]
        names = {dtype: dtype.name for dtype in set(dtypes)}
        mark("walk")
        attempt = f"{root}/1/attempt-{uuid.uuid4().hex}"
        lease = self.io.submit(self.lease, root, attempt)
        plan = PackPlan.for_store(
            [a.nbytes for a in arrays], self.settings, self.capabilities, paths
        )
        first: list[float] = []

        def build_and_write(index: int) -> tuple[list[int], list[str], int, Future[None]]:
            buf = self.buffers[index][: plan.objects[index].size]
            crcs, hashes = plan.fill_digests(index, arrays, buf)
            whole = crc32c(buf)
            lease.result()
            if not first:
                first.append((time.perf_counter() - t0) * 1e3)
            return (
                crcs,
                hashes,
                whole,
                self.io.submit(_put, f"{attempt}/{plan.objects[index].name}", buf, True),
            )

        builds = [self.hashing.submit(build_and_write, i) for i in range(len(plan.objects))]
        leaf_crc = [0] * len(arrays)
        leaf_hash = [""] * len(arrays)
        object_crc, writes = [], []
        for obj, build in zip(plan.objects, builds, strict=True):
            crcs, hashes, whole, write = build.result()
            for leaf, crc, digest in zip(obj.leaves, crcs, hashes, strict=True):
                leaf_crc[leaf] = crc
                leaf_hash[leaf] = digest
            object_crc.append(whole)
            writes.append(write)
        marks["lease+first write"] = first[0]
        encoded = orjson.dumps(
            {
                "paths": paths,
                "dtypes": [names[d] for d in dtypes],
                "shapes": [[*a.shape] for a in arrays],
                "objects": [obj.name for obj in plan.objects],
                "offsets": plan.leaf_offset,
                "lengths": plan.leaf_length,
                "crc32c": leaf_crc,
                "xxh3": leaf_hash,
                "object_crc32c": object_crc,
            }
        )
        for write in writes:
            write.result()
        _fsync_path(attempt)
        mark("last pack durable")
        self.manifest = encoded
        self.commit(f"{root}/1")
        os.unlink(f"{attempt}/lease.json")
        mark("committed")
        for name, ms in marks.items():
            self.phases.setdefault(name, []).append(ms)


CASES = {
    "ceiling": CEILING,
    "packs": "pack writes alone (built, O_DIRECT, parallel)",
    "lease": "lease put alone",
    "minimal": "minimal save (hand-written, same rules)",
    "commit": "manifest put alone",
    "ckptstore": "ckptstore.save",
}


def run(ctx: Context) -> list[Result]:
    state = small(ctx.quick)
    blob = np.concatenate([as_uint8(a) for a in state.values()])
    floor = Floor(state)
    dirs = {name: ctx.workdir / name for name in CASES}
    cases: dict[str, Callable[[], Any]] = {
        "ceiling": lambda: _write_fsync(dirs["ceiling"] / "blob", blob),
        "packs": lambda: floor.pack_writes(str(dirs["packs"])),
        "lease": lambda: floor.lease(str(dirs["lease"]), str(dirs["lease"] / "1" / "attempt")),
        "minimal": lambda: floor.save(str(dirs["minimal"])),  # makes the manifest "commit" puts
        "commit": lambda: floor.commit(str(dirs["commit"])),
        "ckptstore": lambda: ckptstore.save(dirs["ckptstore"], state, step=1),
    }

    def clear(name: str) -> None:
        shutil.rmtree(dirs[name], ignore_errors=True)
        dirs[name].mkdir(parents=True)
        os.sync()  # earlier runs' writeback stays out of the timed run

    try:
        for name, case in cases.items():  # untimed: imports, pools, first-touch faults
            clear(name)
            case()
        floor.phases.clear()
        timings = interleave(cases, ctx.repeat, setup=clear)
    finally:
        floor.close()
        for directory in dirs.values():
            shutil.rmtree(directory, ignore_errors=True)
    nbytes = int(blob.nbytes)
    rows = [
        Result(
            "save-floor",
            f"{len(state):,} x 4 KiB",
            "local dir",
            CASES[name],
            "save",
            nbytes,
            t.median,
            t.runs,
            t.cpu_median,
        )
        for name, t in timings.items()
    ]
    ceiling = timings["ceiling"].median
    lines = [
        f"- {CASES[name]}: {t.median * 1e3:.1f} ms, {t.median / ceiling:.2f}x the ceiling "
        "(rounds " + ", ".join(f"{x * 1e3:.1f}" for x in t.runs) + ")"
        for name, t in timings.items()
    ]
    bound = sum(timings[name].median for name in ("packs", "lease", "commit"))
    lines.append(
        f"- pack writes + lease + manifest put, which no save of these packs can overlap: "
        f"{bound * 1e3:.1f} ms, **{bound / ceiling:.2f}x the ceiling**"
    )
    lines.append(
        "- minimal save, median ms from its start: "
        + ", ".join(f"{name} {statistics.median(ms):.1f}" for name, ms in floor.phases.items())
    )
    ctx.options["summary"] = "\n".join(lines)
    return rows


SUITE = Suite(
    name="save-floor",
    title="Many small leaves: what the disk and the commit rules leave a local save",
    run=run,
    description=__doc__.split("\n\n", 1)[1].strip(),
)
