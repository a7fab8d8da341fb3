"""The ``async-breakdown`` suite's ``writer process`` probe: ckptstore's save run from a
second process over shared memory.

Item 1 of the background-writer work asks what the loop would lose if ckptstore's hashing,
packing, writes, commit and retention ran in a process of their own, with the training
process only copying into shared host buffers and signalling. This is that measurement, not
that feature: the training side (:class:`ProbeSaver`, in the benchmark's child) copies every
tensor into a file under ``/dev/shm`` (each slot page aligned, as the stager lays out its
arena) and writes one byte to this script's stdin; this script (``writer_probe.py DIR SHM
LAYOUT``) holds numpy views of the same file and, for every byte it reads, saves them with
``ckptstore.save(DIR, views, step=n)`` (incremental, verified, committed as any save), then
deletes step ``n - 2`` (a manager's ``max_to_keep=2``), and answers with one byte. The views
are saved as one flat dict by path, which holds the same bytes as the nested state.
"""

from __future__ import annotations

import json
import mmap
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

PAGE = 4096
HERE = Path(__file__).resolve().parent


def _layout(tensors: list[Any]) -> tuple[list[dict[str, Any]], int]:
    """Each tensor's slot (offset, dtype, shape) in the shared file, and the file's size."""
    slots, total = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        total = (total + PAGE - 1) // PAGE * PAGE
        slots.append(
            {"offset": total, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
        )
        total += nbytes
    return slots, max(total, PAGE)


class ProbeSaver:
    """The training side: a copy into shared memory, then one byte to the writer."""

    def __init__(self, tensors: list[Any], workdir: Path) -> None:
        import subprocess

        import torch

        slots, size = _layout(tensors)
        self.path = Path("/dev/shm") / f"ckptstore-probe-{os.getpid()}"
        with open(self.path, "wb") as f:
            f.truncate(size)
        with open(self.path, "r+b") as f:
            self.map = mmap.mmap(f.fileno(), size)
        page = b"\x5a" * (1 << 20)
        for start in range(0, size, len(page)):  # touched once, as the bare writer's arena is
            end = min(size, start + len(page))
            self.map[start:end] = page[: end - start]
        self.pairs = []
        for t, slot in zip(tensors, slots, strict=True):
            n = t.numel()
            dst = torch.frombuffer(self.map, dtype=t.dtype, count=n, offset=slot["offset"])
            self.pairs.append((dst.view(t.shape), t))
        layout = workdir / "probe-layout.json"
        layout.write_text(json.dumps(slots))
        self.writer = subprocess.Popen(
            [
                sys.executable,
                str(HERE / "writer_probe.py"),
                str(workdir / "ckpt"),
                str(self.path),
                str(layout),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self.pending = False

    def ack(self) -> None:
        if self.pending:
            assert self.writer.stdout is not None
            if self.writer.stdout.read(1) != b"k":
                raise RuntimeError(f"writer probe exited with {self.writer.wait()}")
            self.pending = False

    def done(self) -> bool:
        """Whether the writer has answered for the last save (without waiting)."""
        import select

        stdout = self.writer.stdout
        if self.pending and select.select([stdout], [], [], 0)[0]:  # type: ignore[type-var]
            self.ack()
        return not self.pending

    def save(self) -> None:
        self.ack()  # one save in flight, as for the others
        for dst, src in self.pairs:
            dst.copy_(src)
        assert self.writer.stdin is not None
        self.writer.stdin.write(b"s")
        self.writer.stdin.flush()
        self.pending = True

    def close(self) -> None:
        self.ack()
        assert self.writer.stdin is not None
        self.writer.stdin.close()
        self.writer.wait()
        self.pairs.clear()
        self.map.close()
        self.path.unlink(missing_ok=True)


def main(argv: list[str]) -> None:
    import ckptstore

    root, shm, layout = argv
    slots = json.loads(Path(layout).read_text())
    with open(shm, "r+b") as f:
        arena = mmap.mmap(f.fileno(), 0)
    views = {
        f"t{i:04d}": np.frombuffer(
            arena,
            dtype=np.dtype(s["dtype"]),
            count=int(np.prod(s["shape"], dtype=np.int64)),
            offset=s["offset"],
        ).reshape(s["shape"])
        for i, s in enumerate(slots)
    }
    n = 0
    while sys.stdin.buffer.read(1):
        n += 1
        ckptstore.save(root, views, step=n)
        if n > 2:
            ckptstore.delete_step(root, n - 2)
        sys.stdout.buffer.write(b"k")
        sys.stdout.buffer.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
