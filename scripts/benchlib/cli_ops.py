"""cli-ops: what ``ckptstore verify`` and ``ckptstore cp`` cost against plain file I/O.

A 1 GiB checkpoint (the big workload of :mod:`benchlib.workloads`: 16 arrays of 64 MiB, saved
durably with ``ckptstore.save``) on the local disk. Verify: ``verify_step`` (re-read every
byte, crc32c of every object and leaf) against a plain sequential read of the same files into
one reused buffer, which checks nothing; the ratio is the price of checking. Copy:
``copy_step`` to another local directory (stream every object with its crc32c, read the copy
back and verify it, commit its manifest) against a plain copy of the same files (read, write,
fsync each file, fsync the directory), which verifies nothing. ``copy_step`` reads every byte
twice by design (the source from the disk, then the copy it verifies, mostly from the page
cache) and hashes it twice. Before every run the source files are dropped from the page cache
(``posix_fadvise(POSIX_FADV_DONTNEED)``) and the copy destinations removed; runs alternate
(``interleave``) after an untimed warm-up.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import ckptstore
from benchlib import Context, Result, Suite, Timing, evict, interleave, workloads
from ckptstore.layout.maintenance import copy_step, verify_step

VERIFY = "ckptstore verify"
COPY = "ckptstore cp (copy + verify + commit)"
PLAIN_READ = "plain sequential read"
PLAIN_COPY = "plain copy (read, write, fsync)"


def _plain_read(paths: list[Path], buf: bytearray) -> None:
    view = memoryview(buf)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(view):
                pass


def _plain_copy(paths: list[Path], dst: Path, buf: bytearray) -> None:
    dst.mkdir(parents=True)
    view = memoryview(buf)
    for path in paths:
        fd = os.open(dst / path.name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            with open(path, "rb", buffering=0) as f:
                while n := f.readinto(view):
                    done = 0
                    while done < n:
                        done += os.write(fd, view[done:n])
            os.fsync(fd)
        finally:
            os.close(fd)
    dfd = os.open(dst, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def run(ctx: Context) -> list[Result]:
    count, size = workloads.big_shape(ctx.quick)
    state = workloads.big(ctx.quick)
    src = ctx.workdir / "src"
    ckptstore.save(src, state, step=1)
    del state
    paths = sorted(p for p in (src / "1").glob("attempt-*/*") if p.is_file())
    total = ckptstore.read_manifest(src, 1).nbytes
    buf = bytearray(8 << 20)
    copies = {COPY: ctx.workdir / "copy", PLAIN_COPY: ctx.workdir / "plain"}
    loop = asyncio.new_event_loop()

    async def verify() -> None:
        async with ckptstore.open_store(src) as store:
            report = await verify_step(store, 1)
        if not report.ok or report.nbytes != total:
            raise AssertionError(f"verify failed: {report}")

    async def copy() -> None:
        async with ckptstore.open_store(src) as a, ckptstore.open_store(copies[COPY]) as b:
            await copy_step(a, b, 1)

    def fresh(name: str) -> None:
        evict(paths)
        if name in copies:
            shutil.rmtree(copies[name], ignore_errors=True)
            os.sync()

    try:
        verify_cases = {
            VERIFY: lambda: loop.run_until_complete(verify()),
            PLAIN_READ: lambda: _plain_read(paths, buf),
        }
        copy_cases = {
            COPY: lambda: loop.run_until_complete(copy()),
            PLAIN_COPY: lambda: _plain_copy(paths, copies[PLAIN_COPY], buf),
        }
        for name, case in {**verify_cases, **copy_cases}.items():  # untimed warm-up
            fresh(name)
            case()
        verifies = interleave(verify_cases, ctx.repeat, setup=fresh)
        copied = interleave(copy_cases, ctx.repeat, setup=fresh)
    finally:
        loop.close()

    workload = f"{total >> 20} MiB checkpoint as {count} x {size >> 20} MiB arrays"
    rows = [
        Result(
            "cli-ops",
            workload,
            "local disk",
            system,
            op,
            total,
            t.median,
            t.runs,
            t.cpu_median,
            objects=len(paths),
        )
        for op, timings in (("verify (cold cache)", verifies), ("copy (durable)", copied))
        for system, t in timings.items()
    ]

    def share(timings: dict[str, Timing], ours: str, plain: str) -> str:
        return f"{timings[plain].median / timings[ours].median:.0%}"

    ctx.options["summary"] = (
        f"`verify` runs at **{share(verifies, VERIFY, PLAIN_READ)}** of a plain sequential "
        f"read's throughput; `cp` at **{share(copied, COPY, PLAIN_COPY)}** of a plain "
        "copy's (it reads and hashes every byte twice: the source, then the copy). Ratios "
        "of median throughputs measured in this run."
    )
    return rows


SUITE = Suite(
    name="cli-ops",
    title="ckptstore verify and cp vs plain reads and copies",
    run=run,
    description=__doc__.split("\n\n", 1)[1].strip(),
)
