"""The async benchmark's ``bare`` system: a durable, checksummed write from another process.

Run by :mod:`benchlib.async_save` as a separate process. It holds its own copy of a state's
bytes (objects of the sizes given on the command line, touched once before timing) and, for
every byte it reads on stdin, writes them as one checkpoint: for each object in turn, its
crc32c, then the object written with ``O_DIRECT`` to a temporary file, ``fsync``, rename, and
``fsync`` of the directory; then it answers with one byte. No Python runs in the training
process while it writes and no GIL, allocator or event loop is shared with it: what the loop
still loses is what the machine itself charges for hashing and writing those bytes (memory
bandwidth, cache, the CPU the kernel and the hypervisor spend on the I/O) for a plain,
one-object-at-a-time writer. A lower bound it is not: it does nothing to be gentle.

Usage: ``bare_writer.py DIR SIZE [SIZE ...]``
"""

from __future__ import annotations

import mmap
import os
import shutil
import sys

import crc32c

ALIGN = 4096


def main(argv: list[str]) -> None:
    root, sizes = argv[0], [int(s) for s in argv[1:]]
    padded = [(s + ALIGN - 1) // ALIGN * ALIGN for s in sizes]
    arena = mmap.mmap(-1, max(sum(padded), ALIGN))  # page aligned, as O_DIRECT needs
    arena.write(b"\x5a" * len(arena))
    view = memoryview(arena)
    os.makedirs(root, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0)
    n = 0
    while sys.stdin.buffer.read(1):
        n += 1
        step = os.path.join(root, str(n))
        os.makedirs(step)
        offset = 0
        for i, (size, length) in enumerate(zip(sizes, padded, strict=True)):
            crc32c.crc32c(view[offset : offset + size])
            path = os.path.join(step, f"obj{i}")
            fd = os.open(path + ".tmp", flags, 0o644)
            try:
                done = 0
                while done < length:
                    done += os.pwrite(fd, view[offset + done : offset + length], done)
                os.ftruncate(fd, size)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(path + ".tmp", path)
            dir_fd = os.open(step, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
            offset += length
        # Keep two checkpoints, as the other systems do.
        shutil.rmtree(os.path.join(root, str(n - 2)), ignore_errors=True)
        sys.stdout.buffer.write(b"k")
        sys.stdout.buffer.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
