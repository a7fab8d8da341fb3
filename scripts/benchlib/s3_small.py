"""s3-small: 20,000 tensors of 4 KiB on a local SeaweedFS, packed checkpoint vs one object each.

The workload a model's biases, norms and optimizer scalars make, the small workload of
:mod:`benchlib.workloads`: 20,000 float32 arrays of 1,024 values (4 KiB each, 78 MiB in all),
already in memory. ``CKPTSTORE_BENCH_SMALL_COUNT`` runs on its first N arrays only: through
s3fs each tensor costs a request both ways (about 1.8 ms to write and 2.7 ms to read one on
this 2-core machine), so the full count takes 1.5 minutes a run.

* **ckptstore save / load**: ``ckptstore.asave`` of the state to an ``S3Store`` (the format
  packs the small arrays into a few objects of up to 8 MiB, written in parallel, then one
  conditional manifest PUT) and ``ckptstore.aload`` of it (parallel ranged GETs, every leaf's
  crc32c checked).
* **s3fs, one object per tensor**: what a writer that stores each tensor as its own object does
  (torchsnapshot, or DCP's ``FsspecWriter`` with one file per tensor): s3fs ``pipe`` of a
  ``{key: bytes}`` dict with every tensor as its own object (s3fs sends them concurrently, in
  batches) and ``cat`` of all the keys back.

SeaweedFS (``weed mini``, started by this suite on loopback ports, plain HTTP, signed requests)
is the server; it shares the 2 cores with the client, so client CPU seconds stand beside each
figure. Runs alternate between systems (``interleave``) after one untimed warm-up each; every
run writes to a fresh prefix and the previous one is deleted, untimed. Every byte read back is
compared with what was written, untimed.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from benchlib import Context, Result, Suite, interleave, workloads
from benchlib.s3 import ACCESS_KEY, SECRET_KEY
from ckptstore.manager.functions import adelete_step, aload, asave
from ckptstore.store.s3 import S3Store
from ckptstore.testing.servers import SeaweedFS

CKPT = "ckptstore asave / aload (packed checkpoint)"
S3FS = "s3fs pipe / cat, one object per tensor"
BUCKET = "bench-small"


def run(ctx: Context) -> list[Result]:
    import s3fs

    # The small workload of benchlib.workloads (CKPTSTORE_BENCH_SMALL_COUNT runs a shorter one).
    state = workloads.small(ctx.quick)
    if "CKPTSTORE_BENCH_SMALL_COUNT" in os.environ:
        state = dict(list(state.items())[: int(os.environ["CKPTSTORE_BENCH_SMALL_COUNT"])])
    count = len(state)
    payload = {name: array.tobytes() for name, array in state.items()}
    nbytes = sum(len(b) for b in payload.values())
    workload = f"{count:,} x 4 KiB"
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    rows: list[Result] = []
    written: dict[str, int] = {}
    with SeaweedFS(
        ctx.workdir / "seaweedfs-small", access_key=ACCESS_KEY, secret_key=SECRET_KEY
    ) as server:
        server.create_bucket(BUCKET)
        store = S3Store(
            BUCKET,
            "ckpt",
            endpoint_url=server.s3_endpoint,
            access_key_id=ACCESS_KEY,
            secret_access_key=SECRET_KEY,
        )
        fs = s3fs.S3FileSystem(
            key=ACCESS_KEY,
            secret=SECRET_KEY,
            endpoint_url=server.s3_endpoint,
            config_kwargs={"s3": {"addressing_style": "path"}},
            use_listings_cache=False,
        )
        step = {"next": 0, "s3fs": 0}

        def s3fs_prefix(n: int) -> str:
            return f"{BUCKET}/s3fs/run{n}"

        def setup(name: str) -> None:
            """Untimed: drop the previous run's data so every write goes to a fresh prefix."""
            if name == CKPT and step["next"] > 0:
                loop.run_until_complete(adelete_step(store, step["next"] - 1))
            if name == S3FS and step["s3fs"] > 0:
                fs.rm(s3fs_prefix(step["s3fs"] - 1), recursive=True)

        def ckpt_save() -> None:
            info = loop.run_until_complete(asave(store, state, step=step["next"]))
            written[CKPT] = info.objects + 1  # and the manifest
            step["next"] += 1

        def s3fs_pipe() -> None:
            prefix = s3fs_prefix(step["s3fs"])
            fs.pipe({f"{prefix}/{name}": data for name, data in payload.items()})
            written[S3FS] = len(payload)
            step["s3fs"] += 1

        got: dict[str, Any] = {}

        def ckpt_load() -> None:
            got[CKPT] = loop.run_until_complete(aload(store, step=step["next"] - 1))

        def s3fs_cat() -> None:
            prefix = s3fs_prefix(step["s3fs"] - 1)
            got[S3FS] = fs.cat([f"{prefix}/{name}" for name in payload])

        try:
            writes = {CKPT: ckpt_save, S3FS: s3fs_pipe}
            for name, case in writes.items():  # warm-up: connections, server volumes
                setup(name)
                case()
            write_t = interleave(writes, ctx.repeat, setup=setup)
            reads = {CKPT: ckpt_load, S3FS: s3fs_cat}
            for case in reads.values():
                case()
            read_t = interleave(reads, ctx.repeat)
            loaded = got[CKPT]
            prefix = s3fs_prefix(step["s3fs"] - 1)
            for name in state:
                if loaded[name].tobytes() != payload[name]:
                    raise AssertionError(f"ckptstore read back different bytes for {name}")
                if got[S3FS][f"{prefix}/{name}"] != payload[name]:
                    raise AssertionError(f"s3fs read back different bytes for {name}")
        finally:
            loop.run_until_complete(store.close())
            loop.close()
            asyncio.set_event_loop(None)
    summary = []
    for op, timings in (("write", write_t), ("read", read_t)):
        for system, t in timings.items():
            rows.append(
                Result(
                    "s3-small",
                    workload,
                    "SeaweedFS http",
                    system,
                    op,
                    nbytes,
                    t.median,
                    t.runs,
                    t.cpu_median,
                    objects=written[system],
                )
            )
        ratio = timings[S3FS].median / timings[CKPT].median
        summary.append(
            f"- {op}: ckptstore {timings[CKPT].median:.3f} s ({written[CKPT]} objects incl. the "
            f"manifest), s3fs one object per tensor {timings[S3FS].median:.3f} s "
            f"({written[S3FS]} objects): ckptstore {ratio:.1f}x faster (goal >= 50x)"
        )
    ctx.options["summary"] = "Medians of this run:\n\n" + "\n".join(summary)
    return rows


SUITE = Suite(
    name="s3-small",
    title="S3: 20,000 small tensors, packed checkpoint vs one object per tensor (SeaweedFS)",
    run=run,
    description=__doc__.split("\n\n", 1)[1].strip(),
)
