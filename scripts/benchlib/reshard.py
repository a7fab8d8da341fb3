"""reshard: a tensor saved by 4 ranks, loaded on 2, 3 and 8: store bytes read per byte needed.

One float32 table of 512 MiB (8,192 rows of 16,384 columns; ``--quick``: 32 MiB) is saved by
4 ranks, each passing its quarter of the rows as a ``ckptstore.distributed.Shard``, to a
local SeaweedFS (``weed mini`` on loopback ports, plain HTTP, signed requests) with the
default settings: the save checksums its chunks in blocks of a quarter row (16 KiB of a
64 KiB row; ``--quick``: 8 KiB), at most ``Settings.chunk_block_size`` (1 MiB). The ranks
are threads of this process in a ``LocalGroup``: the figure here is bytes, which threads
and processes request alike.

Then each world size loads it, every rank asking for its own box as a ``Shard`` target:

* rows split 2, 3 and 8 ways (as ``torch.chunk`` splits them): each rank's box cuts across
  the saved chunks' boundaries, the 3-way and 8-way splits inside blocks;
* a 2 x 2 grid (rows and columns), where each box takes half of every row of the chunks it
  overlaps.

For each load, the store bytes every rank requested (a counting store wrapper around the
rank's store) against the bytes of its box, summed over ranks; the worst rank's ratio too.
Time is the slowest rank's, median of ``repeat`` loads (the load of a resharded job waits for
its slowest rank). Every rank compares its box with the table's slice, untimed.
"""

from __future__ import annotations

import functools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from benchlib import Context, Result, Suite
from benchlib.s3 import ACCESS_KEY, SECRET_KEY
from ckptstore.testing.servers import SeaweedFS

BUCKET = "bench-reshard"
SAVERS = 4


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    """[low, high) of each of ``parts`` pieces of ``n``, as ``torch.chunk`` cuts them."""
    per = -(-n // parts)
    return [(min(n, i * per), min(n, (i + 1) * per)) for i in range(parts)]


def _boxes(shape: tuple[int, int], layout: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(offsets, shape) of each rank's box."""
    rows, cols = shape
    if layout.startswith("rows/"):
        return [((lo, 0), (hi - lo, cols)) for lo, hi in _split(rows, int(layout[5:]))]
    return [
        ((r0, c0), (r1 - r0, c1 - c0)) for r0, r1 in _split(rows, 2) for c0, c1 in _split(cols, 2)
    ]


def _run_ranks(world: int, fn: Any) -> list[Any]:
    import ckptstore.distributed

    group = ckptstore.distributed.LocalGroup(world)
    with ThreadPoolExecutor(world) as pool:
        return list(pool.map(lambda rank: fn(rank, group.member(rank)), range(world)))


def _load_box(
    url: str,
    options: dict[str, str],
    table: np.ndarray[Any, Any],
    layout: str,
    boxes: list[tuple[tuple[int, int], tuple[int, int]]],
    rank: int,
    comm: Any,
) -> tuple[float, int]:
    """One rank's load of its box: seconds, and store bytes it requested."""
    import ckptstore.distributed
    from ckptstore import background
    from ckptstore.distributed import Shard
    from ckptstore.store.registry import open_store
    from ckptstore.store.wrappers import CountingStore

    (r0, c0), (nr, nc) = boxes[rank]
    counting = CountingStore(open_store(url, **options))
    like = {
        "table": Shard(np.empty((nr, nc), np.float32), offsets=(r0, c0), global_shape=table.shape)
    }
    try:
        started = time.perf_counter()
        got = ckptstore.distributed.load(counting, 1, target=like, comm=comm)
        took = time.perf_counter() - started
    finally:
        background.run(counting.close())
    if not np.array_equal(got["table"].tensor, table[r0 : r0 + nr, c0 : c0 + nc]):
        raise AssertionError(f"{layout}: rank {rank} loaded other bytes")
    return took, int(counting.bytes["read"])


def run(ctx: Context) -> list[Result]:
    import ckptstore.distributed
    from ckptstore.distributed import Shard

    shape = (1024, 8192) if ctx.quick else (8192, 16384)
    table = np.random.default_rng(3).standard_normal(shape, dtype=np.float32)
    rows: list[Result] = []
    lines: list[str] = []
    with SeaweedFS(
        ctx.workdir / "seaweedfs", access_key=ACCESS_KEY, secret_key=SECRET_KEY
    ) as server:
        server.create_bucket(BUCKET)
        url = f"s3://{BUCKET}/reshard"
        options = {
            "endpoint_url": server.s3_endpoint,
            "access_key_id": ACCESS_KEY,
            "secret_access_key": SECRET_KEY,
        }

        def save(rank: int, comm: Any) -> None:
            (low, _), (n, _) = _boxes(shape, f"rows/{SAVERS}")[rank]
            part = {"table": Shard(table[low : low + n], offsets=(low, 0), global_shape=shape)}
            ckptstore.distributed.save(url, part, step=1, comm=comm, **options)

        _run_ranks(SAVERS, save)
        for layout in ("rows/2", "rows/3", "rows/8", "grid 2x2"):
            boxes = _boxes(shape, layout)
            world = len(boxes)
            runs: list[float] = []
            read: list[int] = []
            for _ in range(ctx.repeat):
                load = functools.partial(_load_box, url, options, table, layout, boxes)
                done = _run_ranks(world, load)
                runs.append(max(t for t, _ in done))
                read = [n for _, n in done]
            needed = [nr * nc * 4 for _, (nr, nc) in boxes]
            total = sum(read) / sum(needed)
            worst = max(r / n for r, n in zip(read, needed, strict=True))
            rows.append(
                Result(
                    "reshard",
                    f"{table.nbytes >> 20} MiB table saved by {SAVERS} ranks (rows)",
                    "SeaweedFS http",
                    f"load on {world} ranks, {layout}",
                    "load (slowest rank)",
                    table.nbytes,
                    float(np.median(runs)),
                    runs,
                    0.0,
                )
            )
            lines.append(
                f"- {layout} on {world} ranks: store bytes read / bytes needed {total:.3f}x "
                f"(worst rank {worst:.3f}x; goal <= 1.1x)"
            )
    ctx.options["summary"] = "This run:\n\n" + "\n".join(lines)
    return rows


SUITE = Suite(
    name="reshard",
    title="Resharding: a tensor saved on 4 ranks, loaded on 2, 3 and 8 (SeaweedFS)",
    run=run,
    description=__doc__.split("\n\n", 1)[1].strip(),
)
