"""gcs: the GCS backend against raw gcsfs on fake-gcs-server, side by side.

Both sides talk to one fake-gcs-server (filesystem backend, plain HTTP on loopback) started
for the run with its data on tmpfs (a fresh directory under ``/dev/shm`` where the machine has
one, else under the work directory): with its data on this machine's disk one 4 KiB PUT took
about 15 ms, on tmpfs about 1.4 ms (its memory backend grew past 10 GB over the 1 GiB
workload and was OOM-killed). The emulator shares the 2 cores
with the client, so absolute figures are the emulator's; the ratios and the client CPU are
what to read. Workloads (the bytes of :mod:`benchlib.workloads`' big and small states): 1 GiB
as 16 objects of 64 MiB, all written (then read) concurrently; and 20,000 objects of 4 KiB,
written (then read) concurrently. Systems: ``GCSStore.put`` (64 MiB objects go as two 32 MiB
parts uploaded in parallel as temporary objects and joined by one ``compose``) and ``GCSStore``
with multipart off (one multipart/related upload request per object), against gcsfs's own
``_pipe`` (objects of 50 MiB and more as a resumable upload of sequential 50 MiB chunks,
smaller ones as one request) and ``_cat``. Reads: ``GCSStore.read_into`` into preallocated
buffers (32 MiB ranged GETs in parallel) or ``get`` for the small objects, against gcsfs
``_cat`` of the same keys.
Checkpoint level: ``asave`` of the same bytes as a state (16 leaves of 64 MiB; 20,000
float32 leaves of 4 KiB, which the format packs into a few objects) and ``aload`` of it
(``into=`` preallocated arrays for the large state), each run a new step. Every byte read
back is compared with what was written, untimed. Runs alternate
(``interleave``) after an untimed warm-up.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import warnings
from pathlib import Path

import numpy as np

from benchlib import Context, Result, Suite, Timing, interleave, workloads

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

BUCKET = "bench"
PARTS = "ckptstore GCSStore (parallel parts + compose)"
SINGLE = "ckptstore GCSStore (one request per object)"
RAW = "raw gcsfs _pipe / _cat"
CKPT = "ckptstore asave / aload (checkpoint on GCSStore)"


def run(ctx: Context) -> list[Result]:
    import gcsfs.core

    from ckptstore.config import Settings
    from ckptstore.manager.functions import adelete_step, aload, asave
    from ckptstore.store.gcs import GCSStore
    from ckptstore.testing.fakegcs import FakeGCS

    # The big and small workloads of benchlib.workloads, as the bytes of their leaves.
    big_count, big_size = workloads.big_shape(ctx.quick)
    small_count, small_size = workloads.small_count(ctx.quick), workloads.SMALL_LEAF_BYTES
    big = [a.view(np.uint8) for a in workloads.big(ctx.quick).values()]
    big_bytes = [b.tobytes() for b in big]  # gcsfs's pipe wants bytes; made untimed
    outs = {
        name: [np.empty(big_size, dtype=np.uint8) for _ in range(big_count)]
        for name in (PARTS, SINGLE)
    }
    small_leaves = list(workloads.small(ctx.quick).values())
    small = np.concatenate(small_leaves).view(np.uint8)
    small_bytes = [a.tobytes() for a in small_leaves]
    del small_leaves
    rows: list[Result] = []
    loop = asyncio.new_event_loop()
    warnings.filterwarnings("ignore", "Sending a large body", ResourceWarning)
    shm = Path("/dev/shm")
    with (
        tempfile.TemporaryDirectory(
            dir=shm if shm.is_dir() else ctx.workdir, prefix="ckptstore-bench-gcs-"
        ) as data,
        FakeGCS.start(Path(data)) as server,
    ):
        server.create_bucket(BUCKET)
        settings = Settings()
        parts = GCSStore(
            BUCKET, "parts", endpoint_url=server.endpoint, token="anon", settings=settings
        )
        single = GCSStore(
            BUCKET,
            "single",
            endpoint_url=server.endpoint,
            token="anon",
            settings=settings.replace(multipart_threshold=1 << 40),
        )
        fs = gcsfs.core.GCSFileSystem(
            endpoint_url=server.endpoint,
            token="anon",
            asynchronous=True,
            skip_instance_cache=True,
            loop=loop,
        )
        loop.run_until_complete(fs._set_session())
        ckpt = GCSStore(BUCKET, "ckpt", endpoint_url=server.endpoint, token="anon")
        big_state = {f"t{i:02d}": b for i, b in enumerate(big)}
        big_into = {f"t{i:02d}": np.empty(big_size, dtype=np.uint8) for i in range(big_count)}
        leaf = small_size // 4
        small_state = {
            f"t{i:05d}": small[i * small_size : (i + 1) * small_size].view(np.float32)
            for i in range(small_count)
        }
        steps = {"next": 1}
        saved: list[int] = []
        ckpt_objects: dict[int, int] = {}  # leaves saved -> data objects the save wrote

        def ckpt_save(state: dict[str, np.ndarray]):
            def go() -> None:
                step = steps["next"]
                steps["next"] += 1
                info = loop.run_until_complete(asave(ckpt, state, step=step))
                ckpt_objects[len(state)] = info.objects
                saved.append(step)

            return go

        def drop_old_steps(name: str) -> None:
            """Before a save: delete all but the newest step (untimed), so tmpfs stays small."""
            if name == CKPT:
                while len(saved) > 1:
                    loop.run_until_complete(adelete_step(ckpt, saved.pop(0)))

        def ckpt_load_big() -> None:
            loop.run_until_complete(aload(ckpt, step=saved[-1], into=big_into))
            got[CKPT] = []

        def ckpt_load_small() -> None:
            got[CKPT] = loop.run_until_complete(aload(ckpt, step=saved[-1]))

        big_keys = [f"big/obj-{i:02d}" for i in range(big_count)]
        small_keys = [f"small/t-{i:05d}" for i in range(small_count)]

        def store_put(store: GCSStore, keys: list[str], data: list[np.ndarray] | list[bytes]):
            async def go() -> None:
                await asyncio.gather(*(store.put(k, d) for k, d in zip(keys, data, strict=True)))

            return lambda: loop.run_until_complete(go())

        def raw_pipe(keys: list[str], data: list[bytes]):
            paths = {f"{BUCKET}/raw/{k}": d for k, d in zip(keys, data, strict=True)}
            return lambda: loop.run_until_complete(fs._pipe(paths))

        def store_read_big(store: GCSStore, name: str):
            async def go() -> None:
                await asyncio.gather(
                    *(store.read_into(k, 0, o) for k, o in zip(big_keys, outs[name], strict=True))
                )
                got[name] = []

            return lambda: loop.run_until_complete(go())

        got: dict[str, list[bytes]] = {}

        def store_get_small(store: GCSStore, name: str):
            async def go() -> None:
                got[name] = list(await asyncio.gather(*(store.get(k) for k in small_keys)))

            return lambda: loop.run_until_complete(go())

        def raw_cat(keys: list[str], name: str, marker: bool):
            paths = [f"{BUCKET}/raw/{k}" for k in keys]

            async def go() -> None:
                found = await fs._cat(paths)
                data = [found[p] for p in paths]
                if marker:  # the big workload: check_big looks for name + "/data"
                    got[name], got[name + "/data"] = [], data
                else:
                    got[name] = data

            return lambda: loop.run_until_complete(go())

        def check_big(name: str) -> None:
            """Verify the previous run of ``name`` (untimed, as interleave's setup)."""
            if got.pop(name, None) is None:
                return
            if name == CKPT:
                for i in range(big_count):
                    if not np.array_equal(big_into[f"t{i:02d}"], big[i]):
                        raise AssertionError("checkpoint load read back different bytes")
                    big_into[f"t{i:02d}"].fill(0)
                return
            if name == RAW:
                if got.pop(name + "/data", None) != big_bytes:
                    raise AssertionError("gcsfs read back different bytes")
                return
            if not all(np.array_equal(a, b) for a, b in zip(big, outs[name], strict=True)):
                raise AssertionError(f"{name} read back different bytes")
            for out in outs[name]:
                out.fill(0)

        def check_small(name: str) -> None:
            if name not in got:
                return
            value = got.pop(name)
            if name == CKPT:
                if sorted(value) != sorted(small_state) or not all(
                    value[k].tobytes() == v.tobytes() for k, v in small_state.items()
                ):
                    raise AssertionError("checkpoint load read back different leaves")
            elif value != small_bytes:
                raise AssertionError(f"{name} read back different bytes")

        try:
            big_writes = {
                PARTS: store_put(parts, big_keys, big),
                SINGLE: store_put(single, big_keys, big),
                RAW: raw_pipe(big_keys, big_bytes),
                CKPT: ckpt_save(big_state),
            }
            for case in big_writes.values():
                case()  # warm-up, and the objects the reads below fetch
            big_write_t = interleave(big_writes, ctx.repeat, setup=drop_old_steps)
            big_reads = {
                CKPT: ckpt_load_big,
                PARTS: store_read_big(parts, PARTS),
                SINGLE: store_read_big(single, SINGLE),
                RAW: raw_cat(big_keys, RAW, True),
            }
            for name, case in big_reads.items():
                case()
                check_big(name)
            big_read_t = interleave(big_reads, ctx.repeat, setup=check_big)
            for name in big_reads:
                check_big(name)

            small_writes = {
                SINGLE: store_put(single, small_keys, small_bytes),
                RAW: raw_pipe(small_keys, small_bytes),
                CKPT: ckpt_save(small_state),
            }
            # no warm-up here: the connections are warm, and 20,000 PUTs take minutes
            small_write_t = interleave(small_writes, ctx.repeat, setup=drop_old_steps)
            small_reads = {
                CKPT: ckpt_load_small,
                SINGLE: store_get_small(single, SINGLE),
                RAW: raw_cat(small_keys, RAW, False),
            }
            for name, case in small_reads.items():
                case()
                check_small(name)
            small_read_t = interleave(small_reads, ctx.repeat, setup=check_small)
            for name in small_reads:
                check_small(name)
        finally:
            loop.run_until_complete(ckpt.close())
            loop.run_until_complete(parts.close())
            loop.run_until_complete(single.close())
            if fs._session is not None:
                loop.run_until_complete(fs._session.close())
            loop.close()

    big_total = big_count * big_size
    small_total = small_count * small_size
    big_name = f"{big_total >> 20} MiB as {big_count} x {big_size >> 20} MiB"
    small_name = f"{small_count:,} x {small_size >> 10} KiB"
    for workload, nbytes, objects, op, timings in (
        (big_name, big_total, big_count, "write", big_write_t),
        (big_name, big_total, big_count, "read", big_read_t),
        (small_name, small_total, small_count, "write", small_write_t),
        (small_name, small_total, small_count, "read", small_read_t),
    ):
        for system, t in timings.items():
            count = big_count if objects == big_count else small_count
            written = ckpt_objects.get(count) if system == CKPT else objects
            rows.append(
                Result(
                    "gcs",
                    workload,
                    "fake-gcs-server (http, loopback)",
                    system,
                    op,
                    nbytes,
                    t.median,
                    t.runs,
                    t.cpu_median,
                    objects=written,
                )
            )

    def speedup(timings: dict[str, Timing], system: str) -> str:
        return f"{timings[RAW].median / timings[system].median:.2f}x"

    ctx.options["summary"] = (
        f"Against raw gcsfs in the same run (gcsfs time / ckptstore time, >1 is faster): "
        f"1 GiB write {speedup(big_write_t, PARTS)} with parallel parts + compose, "
        f"{speedup(big_write_t, SINGLE)} with one request per object; 1 GiB read "
        f"{speedup(big_read_t, PARTS)}; {small_name} write {speedup(small_write_t, SINGLE)}, "
        f"read {speedup(small_read_t, SINGLE)}. Parallel parts + compose vs one request per "
        f"64 MiB object on this emulator: "
        f"{big_write_t[SINGLE].median / big_write_t[PARTS].median:.2f}x. Checkpoint level "
        f"(asave/aload of the same bytes as a state of {big_count} leaves, and of "
        f"{small_count:,} float32 leaves of {leaf} values): save {speedup(big_write_t, CKPT)} "
        f"and load {speedup(big_read_t, CKPT)} against the raw gcsfs pipe/cat of the 1 GiB; "
        f"save {speedup(small_write_t, CKPT)} and load {speedup(small_read_t, CKPT)} against "
        f"{small_count:,} raw gcsfs PUTs/GETs."
    )
    return rows


SUITE = Suite(
    name="gcs",
    title="GCS backend vs raw gcsfs on fake-gcs-server",
    run=run,
    description=__doc__.split("\n\n", 1)[1].strip(),
)
