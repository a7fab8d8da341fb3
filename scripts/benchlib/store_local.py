"""store-local: the local backend against plain POSIX I/O of the same bytes.

Write: ckptstore's ``LocalStore`` puts 16 objects of 64 MiB (1 GiB, the bytes of the big
workload of :mod:`benchlib.workloads`; durable: each file and its
directory fsynced, published with a rename) concurrently, as a checkpoint writer does, against
the ceiling a careful program reaches with plain calls: for each file ``open``, ``write`` the
whole buffer, ``fsync``, ``close``, then one ``fsync`` of the directory. Read: ``read_into``
of every object into preallocated buffers against a plain sequential ``readinto`` of the same
files into the same buffers. Before every read run both sides' files are dropped from the page
cache (``posix_fadvise(POSIX_FADV_DONTNEED)`` after an fsync), so both read from the disk.
A third system, the same plain calls with one file per thread on 8 threads, shows
what parallel I/O alone buys on this disk. Runs alternate (``interleave``) after one untimed
warm-up run each, so noise lands on every system alike. The disk of the machine these figures
come from is shared: single runs of the same system differ by up to 5x (the runs column), so
read ratios to within about a third, not to the percent.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from benchlib import Context, Result, Suite, Timing, evict, interleave, workloads
from ckptstore.config import Settings
from ckptstore.store.local import LocalStore

STORE = "ckptstore LocalStore"
CEILING = "plain open+write+fsync / sequential read"
THREADED = "plain, one file per thread (8 threads)"
THREADS = 8


def _write_one(path: Path, buf: np.ndarray) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(buf).cast("B")
        done = 0
        while done < len(view):
            done += os.write(fd, view[done:])
        os.fsync(fd)
    finally:
        os.close(fd)


def _plain_write(
    directory: Path, buffers: list[np.ndarray], pool: ThreadPoolExecutor | None
) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / f"obj-{i:02d}" for i in range(len(buffers))]
    if pool is None:
        for path, buf in zip(paths, buffers, strict=True):
            _write_one(path, buf)
    else:
        list(pool.map(_write_one, paths, buffers))
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _read_one(path: Path, out: np.ndarray) -> None:
    with open(path, "rb", buffering=0) as f:
        view = memoryview(out).cast("B")
        done = 0
        while done < len(view):
            n = f.readinto(view[done:])
            if not n:
                raise OSError(f"{path} is short")
            done += n


def _plain_read(paths: list[Path], outs: list[np.ndarray], pool: ThreadPoolExecutor | None) -> None:
    if pool is None:
        for path, out in zip(paths, outs, strict=True):
            _read_one(path, out)
    else:
        list(pool.map(_read_one, paths, outs))


def run(ctx: Context) -> list[Result]:
    count, size = workloads.big_shape(ctx.quick)
    total = count * size
    buffers = [a.view(np.uint8) for a in workloads.big(ctx.quick).values()]
    outs = [np.empty(size, dtype=np.uint8) for _ in range(count)]
    dirs = {
        STORE: ctx.workdir / "store",
        CEILING: ctx.workdir / "plain",
        THREADED: ctx.workdir / "threaded",
    }
    store_dir = dirs[STORE]
    pool = ThreadPoolExecutor(THREADS)
    keys = [f"step/obj-{i:02d}" for i in range(count)]
    loop = asyncio.new_event_loop()
    store = LocalStore(store_dir, settings=Settings(durable=True))

    async def store_write() -> None:
        await asyncio.gather(*(store.put(k, b) for k, b in zip(keys, buffers, strict=True)))

    async def store_read() -> None:
        await asyncio.gather(
            *(store.read_into(k, 0, out) for k, out in zip(keys, outs, strict=True))
        )

    def clear(name: str) -> None:
        shutil.rmtree(dirs[name], ignore_errors=True)
        os.sync()  # the deletes' and the other side's writeback do not land in the timed run

    try:
        write_cases = {
            STORE: lambda: loop.run_until_complete(store_write()),
            CEILING: lambda: _plain_write(dirs[CEILING], buffers, None),
            THREADED: lambda: _plain_write(dirs[THREADED], buffers, pool),
        }
        for name, case in write_cases.items():  # warm-up: first runs here were 3-7x slower
            clear(name)
            case()
        writes = interleave(write_cases, ctx.repeat, setup=clear)
        if not ctx.quick:
            loop.run_until_complete(store_write())
        paths = [Path(store.local_path(k)) for k in keys]

        def uncache(name: str) -> None:
            evict(paths)
            for out in outs:
                out.fill(0)

        reads = interleave(
            {
                STORE: lambda: loop.run_until_complete(store_read()),
                CEILING: lambda: _plain_read(paths, outs, None),
                THREADED: lambda: _plain_read(paths, outs, pool),
            },
            ctx.repeat,
            setup=uncache,
        )
        loop.run_until_complete(store_read())
        for buf, out in zip(buffers, outs, strict=True):
            if not np.array_equal(buf, out):
                raise AssertionError("read-back differs from what was written")
    finally:
        loop.run_until_complete(store.close())
        loop.close()
        pool.shutdown()

    workload = f"{total >> 20} MiB as {count} x {size >> 20} MiB"
    rows = []
    for op, timings in (("write (durable)", writes), ("read (cold cache)", reads)):
        for system, t in timings.items():
            rows.append(
                Result(
                    "store-local",
                    workload,
                    "local disk",
                    system,
                    op,
                    total,
                    t.median,
                    t.runs,
                    t.cpu_median,
                    objects=count,
                )
            )

    def ratio(timings: dict[str, Timing], other: str) -> str:
        return f"{timings[other].median / timings[STORE].median:.0%}"

    ctx.options["summary"] = (
        f"LocalStore throughput as a share of plain sequential open+write+fsync: "
        f"**{ratio(writes, CEILING)}** (write), of a plain sequential read: "
        f"**{ratio(reads, CEILING)}** (read); target >= 90% for both. Against the same plain "
        f"calls spread over {THREADS} threads (one file per thread): "
        f"{ratio(writes, THREADED)} (write), {ratio(reads, THREADED)} (read). "
        "Ratios of median throughputs measured in this run."
    )
    return rows


SUITE = Suite(
    name="store-local",
    title="Local backend vs plain write+fsync and sequential read",
    run=run,
    description=__doc__.split("\n\n", 1)[1].strip(),
)
