"""s3: the S3 backend against the raw transport ceiling and s3fs, on a local SeaweedFS.

One 1 GiB blob (random bytes, already in memory) is written and read back through:

* **ckptstore S3Store**: ``put`` (parallel multipart, 32 MiB parts, 16 in flight, each part's
  crc32c computed once and verified by the server, body sent from a view of the buffer) and
  ``read_into`` (parallel 32 MiB ranged GETs streamed into a preallocated buffer).
* **ceiling (plain aiobotocore, tuned)**: the same blob pre-split into ``bytes`` parts (untimed)
  through CreateMultipartUpload / 16 concurrent UploadPart / Complete with payload signing and
  botocore's own checksums off: the transport with nothing on top. Reads: 16 concurrent 32 MiB
  ranged GETs streamed into a preallocated buffer.
* **plain aiobotocore, defaults**: the same upload with botocore's default configuration, which
  checksums every part itself (``request_checksum_calculation="when_supported"``) and, over
  ``http://``, SHA-256 signs every byte: the cost of those defaults.
* **s3fs** ``pipe`` / ``cat`` with its defaults (both split large objects into concurrent
  parts or ranges in this s3fs version).

SeaweedFS (``weed mini``, started by this suite on loopback ports, signed requests with an
access key) serves S3 over ``http://`` and over ``https://`` with a self-signed certificate;
each row says which. The server shares the 2 cores with the client, so client CPU seconds per
GiB (this process, all threads) stand beside each figure. Runs alternate between systems
(``interleave``) after one untimed warm-up each; objects are deleted between runs, untimed.

The "ceiling" is the plain transport, not a bound ckptstore cannot pass: its parts are
``bytes`` objects that aiohttp joins with the request headers and asyncio copies again into
its write buffer whenever the socket does not take a part at once; ckptstore's body writer
sends 1 MiB slices of the caller's buffer and waits for the socket between them, so its
writes can cost less client CPU than the ceiling's. On this 2-core machine SeaweedFS itself
spends 8-14 CPU-seconds per GiB written (whichever client sends the bytes), so write speed
is bounded by the server and write ratios move with its share of the cores.
"""

from __future__ import annotations

import asyncio
import os
import statistics
from typing import Any

import numpy as np

from benchlib import Context, Result, Suite, Timing, interleave
from ckptstore.config import Settings
from ckptstore.store.s3 import S3Store
from ckptstore.testing.servers import SeaweedFS

STORE = "ckptstore S3Store"
CEILING = "ceiling: plain aiobotocore, tuned"
DEFAULTS = "plain aiobotocore, botocore defaults"
S3FS = "s3fs pipe/cat (defaults)"
BUCKET = "bench"
PART = 32 << 20
CONCURRENCY = 16
ACCESS_KEY = "bench-access-key"
SECRET_KEY = "bench-secret-key"


def raw_client(session: Any, endpoint: str, verify: str | None, *, tuned: bool) -> Any:
    """A plain aiobotocore client for the ceiling (``tuned``) or with botocore's defaults."""
    from aiobotocore.config import AioConfig

    options: dict[str, Any] = {
        "max_pool_connections": CONCURRENCY + 4,
        "s3": {"addressing_style": "path"},
        "retries": {"mode": "standard", "max_attempts": 3},
    }
    if tuned:
        options["s3"]["payload_signing_enabled"] = False
        options["request_checksum_calculation"] = "when_required"
        options["response_checksum_validation"] = "when_required"
    return session.create_client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        verify=verify,
        config=AioConfig(**options),
    )


async def raw_put(client: Any, key: str, parts: list[bytes], *, bucket: str = BUCKET) -> None:
    """The ceiling's write: ``parts`` as one multipart upload, ``CONCURRENCY`` parts in flight."""
    created = await client.create_multipart_upload(Bucket=bucket, Key=key)
    upload_id = created["UploadId"]
    slots = asyncio.Semaphore(CONCURRENCY)

    async def send(i: int) -> dict[str, Any]:
        async with slots:
            r = await client.upload_part(
                Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=i + 1, Body=parts[i]
            )
            return {"PartNumber": i + 1, "ETag": r["ETag"]}

    done = await asyncio.gather(*(send(i) for i in range(len(parts))))
    await client.complete_multipart_upload(
        Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": list(done)}
    )


async def raw_get(client: Any, key: str, out: memoryview, *, bucket: str = BUCKET) -> None:
    """The ceiling's read: ``CONCURRENCY`` concurrent ``PART``-sized ranged GETs into ``out``."""
    slots = asyncio.Semaphore(CONCURRENCY)

    async def fetch(start: int) -> None:
        end = min(start + PART, len(out))
        async with slots:
            r = await client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}")
            stream = r["Body"].raw_stream.content
            pos = start
            while pos < end:
                chunk = await stream.read(min(1 << 20, end - pos))
                if not chunk:
                    raise OSError("short body")
                out[pos : pos + len(chunk)] = chunk
                pos += len(chunk)
            r["Body"].close()

    await asyncio.gather(*(fetch(s) for s in range(0, len(out), PART)))


def _measure(
    ctx: Context, server: SeaweedFS, scheme: str, data: np.ndarray, blob: bytes
) -> tuple[dict[str, Timing], dict[str, Timing]]:
    import s3fs
    from aiobotocore.session import AioSession

    https = scheme == "https"
    endpoint = server.s3_https_endpoint if https else server.s3_endpoint
    verify = str(server.ca_file) if https else None
    size = data.nbytes
    parts = [blob[i : i + PART] for i in range(0, size, PART)]
    out = np.empty(size, dtype=np.uint8)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    settings = Settings(part_size=PART, multipart_threshold=PART, max_concurrency=CONCURRENCY)
    store = S3Store(
        BUCKET,
        f"{scheme}/store",
        endpoint_url=endpoint,
        access_key_id=ACCESS_KEY,
        secret_access_key=SECRET_KEY,
        verify=verify,
        settings=settings,
    )
    session = AioSession()
    tuned_cm = raw_client(session, endpoint, verify, tuned=True)
    default_cm = raw_client(session, endpoint, verify, tuned=False)
    tuned = loop.run_until_complete(tuned_cm.__aenter__())
    default = loop.run_until_complete(default_cm.__aenter__())
    fs = s3fs.S3FileSystem(
        key=ACCESS_KEY,
        secret=SECRET_KEY,
        endpoint_url=endpoint,
        client_kwargs={"verify": verify} if verify else {},
        config_kwargs={"s3": {"addressing_style": "path"}},
        use_listings_cache=False,
    )
    keys = {
        STORE: f"{scheme}/store/blob",
        CEILING: f"{scheme}/ceiling/blob",
        DEFAULTS: f"{scheme}/defaults/blob",
        S3FS: f"{scheme}/s3fs/blob",
    }

    def delete(name: str) -> None:
        loop.run_until_complete(tuned.delete_object(Bucket=BUCKET, Key=keys[name]))

    try:
        writes_cases = {
            STORE: lambda: loop.run_until_complete(store.put("blob", data)),
            CEILING: lambda: loop.run_until_complete(raw_put(tuned, keys[CEILING], parts)),
            DEFAULTS: lambda: loop.run_until_complete(raw_put(default, keys[DEFAULTS], parts)),
            S3FS: lambda: fs.pipe(f"{BUCKET}/{keys[S3FS]}", blob),
        }
        for name, case in writes_cases.items():  # warm-up: connections, server volumes
            delete(name)
            case()
        writes = interleave(writes_cases, ctx.repeat, setup=delete)
        for name, case in writes_cases.items():  # leave each object for the reads
            if name != DEFAULTS:
                delete(name)
                case()

        results: dict[str, bytes] = {}

        def s3fs_cat() -> None:
            results[S3FS] = fs.cat(f"{BUCKET}/{keys[S3FS]}")

        view = memoryview(out)
        read_cases = {
            STORE: lambda: loop.run_until_complete(store.read_into("blob", 0, out)),
            CEILING: lambda: loop.run_until_complete(raw_get(tuned, keys[CEILING], view)),
            S3FS: s3fs_cat,
        }

        def clear(name: str) -> None:
            out.fill(0)
            results.clear()

        for case in read_cases.values():
            case()
        reads = interleave(read_cases, ctx.repeat, setup=clear)
        # check what each system read back
        loop.run_until_complete(store.read_into("blob", 0, out))
        if not np.array_equal(out, data):
            raise AssertionError("ckptstore read back different bytes")
        loop.run_until_complete(raw_get(tuned, keys[CEILING], view))
        if not np.array_equal(out, data):
            raise AssertionError("the ceiling read back different bytes")
        s3fs_cat()
        if results[S3FS] != blob:
            raise AssertionError("s3fs read back different bytes")
        for name in writes_cases:
            delete(name)
    finally:
        loop.run_until_complete(store.close())
        loop.run_until_complete(tuned_cm.__aexit__(None, None, None))
        loop.run_until_complete(default_cm.__aexit__(None, None, None))
        loop.close()
        asyncio.set_event_loop(None)
    return writes, reads


def run(ctx: Context) -> list[Result]:
    # CKPTSTORE_BENCH_S3_MIB shrinks the blob on a machine short of memory (the suite holds
    # the blob, its parts and a read buffer: about 4x the size)
    size = (64 << 20) if ctx.quick else int(os.environ.get("CKPTSTORE_BENCH_S3_MIB", 1024)) << 20
    # the pre-serialized blob the ceiling and s3fs send; ckptstore puts a view of it
    blob = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes()
    data = np.frombuffer(blob, dtype=np.uint8)
    rows: list[Result] = []
    summary: list[str] = []
    workload = f"{size >> 20} MiB blob"
    with SeaweedFS(
        ctx.workdir / "seaweedfs", access_key=ACCESS_KEY, secret_key=SECRET_KEY, tls=True
    ) as server:
        server.create_bucket(BUCKET)
        for scheme in ("http", "https"):
            target = f"SeaweedFS {scheme}" + (" (self-signed)" if scheme == "https" else "")
            writes, reads = _measure(ctx, server, scheme, data, blob)
            for op, timings in (("write", writes), ("read", reads)):
                for system, t in timings.items():
                    rows.append(
                        Result(
                            "s3",
                            workload,
                            target,
                            system,
                            op,
                            size,
                            t.median,
                            t.runs,
                            t.cpu_median,
                            objects=1,
                        )
                    )
                ours = timings[STORE].median
                ratios = ", ".join(
                    f"{name}: {t.median / ours:.2f}x"
                    for name, t in timings.items()
                    if name != STORE
                )
                summary.append(
                    f"- {scheme} {op}: ckptstore {size / ours / (1 << 30):.2f} GiB/s, "
                    f"{statistics.median(timings[STORE].cpu) / (size / (1 << 30)):.2f} CPU s/GiB; "
                    f"others' time / ckptstore's time: {ratios}"
                )
    ctx.options["summary"] = (
        "Time of each system relative to ckptstore's (above 1.00x: ckptstore is faster), "
        "medians of this run:\n\n" + "\n".join(summary)
    )
    return rows


SUITE = Suite(
    name="s3",
    title="S3 backend vs raw aiobotocore ceiling and s3fs on SeaweedFS",
    run=run,
    description=__doc__.split("\n\n", 1)[1].strip(),
)
