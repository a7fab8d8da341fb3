"""dcp: checkpoints of torch tensors on one SeaweedFS bucket: three DCP storage layers,
ckptstore's own checkpoint, and the raw transport ceiling, in one interleaved run.

* **ckptstore.dcp**, **DCP FsspecWriter (s3fs)**, **s3torchconnector**: the same
  ``dcp.save``/``dcp.load`` calls (one process, ``no_dist=True``) with ``ckptstore.dcp.Writer``/
  ``Reader``, with DCP's own ``FsspecWriter``/``FsspecReader`` over s3fs (defaults), and with
  s3torchconnector's ``S3StorageWriter``/``S3StorageReader`` (its native CRT client). Loads
  fill one set of target tensors allocated before the timed runs.
* **ckptstore asave / aload**: ckptstore's own format, no DCP: ``ckptstore.asave`` of the same
  tensors (numpy views of them, no copy) to an ``S3Store`` with default settings, each save a
  new step, and ``ckptstore.aload(..., into=...)`` into preallocated arrays (every leaf's
  crc32c checked).
* **ceiling: plain aiobotocore, tuned** (the s3 suite's ceiling): the same tensor bytes,
  serialized before the timed runs into one blob held as 32 MiB ``bytes`` parts, sent as one
  multipart upload with 16 parts in flight, payload signing and botocore's checksums off; read
  back with 16 concurrent 32 MiB ranged GETs into one preallocated buffer. It is the transport
  alone: no serialization, metadata, commit, checksums or tensor boundaries.

All of them write to and read from one bucket of one ``weed mini`` S3 gateway on 127.0.0.1
over plain HTTP with signed requests (access key configured), with the same credentials.
Workloads (:mod:`benchlib.workloads`, the same every suite uses): 1 GiB as 16 float32 tensors
of 64 MiB, and the transformer-like state with its Adam state (456 MiB in 496 tensors), as
torch tensors. Every save goes to a
fresh checkpoint prefix (a fresh step; a fresh key for the ceiling); loads read what the last
save of that system wrote. What ckptstore's own load and the ceiling read back is compared
with the saved tensors after the timed runs. Runs alternate between systems (``interleave``)
after one untimed warm-up each; figures are medians. The server shares the machine's 2 cores
with the client, so client CPU seconds (this process, all threads) are reported beside
throughput.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import numpy as np

from benchlib import Context, Result, Suite, interleave, torch_tensors, workloads
from benchlib.s3 import ACCESS_KEY, CEILING, PART, SECRET_KEY, raw_client, raw_get, raw_put
from benchlib.workloads import as_torch
from ckptstore.store.checksum import as_uint8

BUCKET = "dcp-bench"
NATIVE = "ckptstore asave / aload"
DCP_OURS = "ckptstore.dcp"
FSSPEC = "DCP FsspecWriter (s3fs)"
S3TC = "s3torchconnector"


def _nbytes(state: Any) -> int:
    import torch

    if isinstance(state, dict):
        return sum(_nbytes(v) for v in state.values())
    return state.numel() * state.element_size() if isinstance(state, torch.Tensor) else 0


def _zeros_like(state: Any) -> Any:
    import torch

    if isinstance(state, dict):
        return {k: _zeros_like(v) for k, v in state.items()}
    return torch.zeros_like(state) if isinstance(state, torch.Tensor) else state


def _numpy_views(state: Any) -> Any:
    """The state with every tensor replaced by a numpy array sharing its memory."""
    import torch

    if isinstance(state, dict):
        return {k: _numpy_views(v) for k, v in state.items()}
    return state.numpy() if isinstance(state, torch.Tensor) else state


def _blob_parts(state: Any) -> list[bytes]:
    """The state's tensor bytes, concatenated into one blob held as ``PART``-sized parts."""
    parts: list[bytes] = []
    part = bytearray()
    for tensor in torch_tensors(state):
        view = memoryview(tensor.numpy()).cast("B")
        while view:
            take = PART - len(part)
            part += view[:take]
            view = view[take:]
            if len(part) == PART:
                parts.append(bytes(part))
                part.clear()
    if part:
        parts.append(bytes(part))
    return parts


def _check(state: Any, got: Any, what: str) -> None:
    """Raise unless ``got`` holds the bytes of the tensors of ``state``: tensors of the same
    tree, or one flat uint8 buffer holding them end to end (the ceiling's blob)."""
    if isinstance(got, np.ndarray):
        pos = 0
        for tensor in torch_tensors(state):
            want = as_uint8(tensor.numpy())  # flat first: 0-d step counters included
            if not np.array_equal(got[pos : pos + want.size], want):
                raise AssertionError(f"{what} read back different bytes at offset {pos}")
            pos += want.size
        return
    for tensor, loaded in zip(torch_tensors(state), torch_tensors(got), strict=True):
        if not tensor.equal(loaded):
            raise AssertionError(f"{what} read back different bytes")


def _nothing() -> None:
    pass


@dataclass(frozen=True)
class _System:
    """One system's timed save and load of a workload, and its untimed bookkeeping."""

    save: Callable[[], None]
    load: Callable[[], None]
    #: after the load warm-up: empty the load's target, so ``check`` sees the timed loads' bytes
    clear: Callable[[], None] = _nothing
    #: after the timed loads: raise unless the last load read back what was saved
    check: Callable[[], None] = _nothing


def _dcp_system(
    state: Any,
    target: Any,
    writer: Callable[[str], Any],
    reader: Callable[[str], Any],
    counter: Iterator[int],
) -> _System:
    import torch.distributed.checkpoint as dcp

    last: dict[str, str] = {}

    def save() -> None:
        url = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}/{next(counter)}"
        dcp.save(state, storage_writer=writer(url), no_dist=True)
        last["url"] = url

    def load() -> None:
        dcp.load(target, storage_reader=reader(last["url"]), no_dist=True)

    return _System(save, load)


def _native_system(
    loop: asyncio.AbstractEventLoop, store: Any, state: Any, counter: Iterator[int]
) -> _System:
    from ckptstore.manager.functions import aload, asave

    arrays = _numpy_views(state)
    target = _zeros_like(state)
    into = _numpy_views(target)  # aload fills target's memory through these views
    last: dict[str, int] = {}

    def save() -> None:
        step = next(counter)
        loop.run_until_complete(asave(store, arrays, step=step))
        last["step"] = step

    def load() -> None:
        loop.run_until_complete(aload(store, step=last["step"], into=into))

    def clear() -> None:
        for tensor in torch_tensors(target):
            tensor.zero_()

    return _System(save, load, clear, lambda: _check(state, target, NATIVE))


def _ceiling_system(
    loop: asyncio.AbstractEventLoop, client: Any, state: Any, counter: Iterator[int]
) -> _System:
    parts = _blob_parts(state)  # the pre-serialized blob, made untimed
    out = np.empty(sum(len(p) for p in parts), dtype=np.uint8)
    last: dict[str, str] = {}

    def save() -> None:
        key = f"ceiling/{uuid.uuid4().hex[:8]}/{next(counter)}"
        loop.run_until_complete(raw_put(client, key, parts, bucket=BUCKET))
        last["key"] = key

    def load() -> None:
        loop.run_until_complete(raw_get(client, last["key"], memoryview(out), bucket=BUCKET))

    return _System(save, load, lambda: out.fill(0), lambda: _check(state, out, CEILING))


def run(ctx: Context) -> list[Result]:
    # DCP's fsspec and s3torchconnector layers find their credentials in the environment.
    # They are set for this suite's run alone: left behind, they reached the suites run after
    # it in the same process (multirank-async's ranks then signed their requests to an
    # anonymous SeaweedFS, which refused them).
    credentials = {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_REGION": "us-east-1",
    }
    with mock.patch.dict(os.environ, credentials):
        return _run(ctx)


def _run(ctx: Context) -> list[Result]:
    from aiobotocore.session import AioSession
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    import ckptstore.dcp
    from ckptstore.store.s3 import S3Store
    from ckptstore.testing.servers import SeaweedFS

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    results: list[Result] = []
    loop = asyncio.new_event_loop()  # ckptstore's own checkpoint and the ceiling run on it
    with SeaweedFS(
        ctx.workdir / "seaweed-dcp", access_key=ACCESS_KEY, secret_key=SECRET_KEY
    ) as server:
        server.create_bucket(BUCKET)
        endpoint = server.s3_endpoint
        ck_options = {"endpoint_url": endpoint, "region": "us-east-1"}
        fs_options = {"endpoint_url": endpoint, "key": ACCESS_KEY, "secret": SECRET_KEY}

        writers: dict[str, Callable[[str], Any]] = {
            DCP_OURS: lambda url: ckptstore.dcp.Writer(url, **ck_options),
            FSSPEC: lambda url: FsspecWriter(url, **fs_options),
        }
        readers: dict[str, Callable[[str], Any]] = {
            DCP_OURS: lambda url: ckptstore.dcp.Reader(url, **ck_options),
            FSSPEC: lambda url: FsspecReader(url, **fs_options),
        }
        notes = ""
        try:
            from s3torchconnector import S3ClientConfig
            from s3torchconnector._s3client import S3Client
            from s3torchconnector.dcp import S3StorageReader, S3StorageWriter

            config = S3ClientConfig(force_path_style=True)

            def at_endpoint(storage: Any) -> Any:
                # its DCP classes take no endpoint; give their filesystem a client that has one
                storage.fs._client = S3Client(
                    "us-east-1", endpoint=endpoint, s3client_config=config
                )
                return storage

            writers[S3TC] = lambda url: at_endpoint(
                S3StorageWriter("us-east-1", url, s3client_config=config)
            )
            readers[S3TC] = lambda url: at_endpoint(
                S3StorageReader("us-east-1", url, s3client_config=config)
            )
        except ImportError as exc:
            notes = f"s3torchconnector not measured: {exc}"

        store = S3Store(
            BUCKET,
            f"native-{uuid.uuid4().hex[:8]}",
            endpoint_url=endpoint,
            region="us-east-1",
            access_key_id=ACCESS_KEY,
            secret_access_key=SECRET_KEY,
        )
        client_cm = raw_client(AioSession(), endpoint, None, tuned=True)
        client = loop.run_until_complete(client_cm.__aenter__())
        counter = itertools.count()
        try:
            for workload, make in (
                ("1 GiB as 16 x 64 MiB", workloads.big),
                ("transformer + Adam (~400 MiB)", workloads.transformer),
            ):
                state = as_torch(make(ctx.quick))
                target = _zeros_like(state)  # the DCP loads' target, shared, allocated untimed
                systems = {
                    name: _dcp_system(state, target, writers[name], readers[name], counter)
                    for name in writers
                }
                systems[NATIVE] = _native_system(loop, store, state, counter)
                systems[CEILING] = _ceiling_system(loop, client, state, counter)
                results += _measure(ctx, workload, _nbytes(state), systems, notes)
                del state, target, systems
        finally:
            loop.run_until_complete(store.close())
            loop.run_until_complete(client_cm.__aexit__(None, None, None))
            loop.close()
    ctx.options["summary"] = _summary(results)
    return results


#: Goals per peer and op: the peer's time / ckptstore's time should be at least this.
GOALS = {
    (FSSPEC, "save"): 1.4,
    (FSSPEC, "load"): 4.0,
    (S3TC, "save"): 1.0,
    (S3TC, "load"): 1.0,
}
#: Goal against the ceiling: ckptstore's time / the ceiling's time should be at most this.
CEILING_GOAL = 1.10


def _summary(results: list[Result]) -> str:
    """ckptstore's own checkpoint and ckptstore.dcp against the ceiling and each peer, per
    workload and op, with the verdict against the goal."""
    lines = []
    for workload in dict.fromkeys(r.workload for r in results):
        for op in ("save", "load"):
            rows = {r.system: r for r in results if r.workload == workload and r.op == op}
            for ours_name in (NATIVE, DCP_OURS):
                ours = rows.get(ours_name)
                if ours is None:
                    continue
                parts = []
                ceiling = rows.get(CEILING)
                if ceiling is None:
                    parts.append("the ceiling not measured")
                else:
                    ratio = ours.seconds / ceiling.seconds
                    verdict = "met" if ratio <= CEILING_GOAL else "NOT met"
                    parts.append(
                        f"{ratio:.2f}x the ceiling's time ({ceiling.seconds:.2f} s, "
                        f"{ceiling.cpu_s_per_gib:.2f} CPU s/GiB; goal <= {CEILING_GOAL:.2f}x: "
                        f"{verdict})"
                    )
                for (peer, goal_op), goal in GOALS.items():
                    if goal_op != op:
                        continue
                    if peer not in rows:
                        parts.append(f"{peer} not measured")
                        continue
                    ratio = rows[peer].seconds / ours.seconds
                    verdict = "met" if ratio >= goal else "NOT met"
                    parts.append(
                        f"{peer} takes {ratio:.2f}x as long ({rows[peer].seconds:.2f} s, "
                        f"{rows[peer].cpu_s_per_gib:.2f} CPU s/GiB; goal >= {goal:.2f}x: "
                        f"{verdict})"
                    )
                lines.append(
                    f"- {workload}, {op}: {ours_name} {ours.seconds:.2f} s "
                    f"({ours.cpu_s_per_gib:.2f} CPU s/GiB): " + "; ".join(parts)
                )
    return (
        "From this run's medians: ckptstore's time against the ceiling's (at most 1.10x is the "
        "goal), and each peer's time against ckptstore's (above 1.00x: ckptstore is faster), "
        "with client CPU seconds per GiB:\n\n" + "\n".join(lines)
    )


def _measure(
    ctx: Context, workload: str, nbytes: int, systems: dict[str, _System], notes: str
) -> list[Result]:
    results = []
    failed: dict[str, str] = {}

    def guarded(name: str, fn: Callable[[], None]) -> Callable[[], None]:
        # A peer that fails (s3torchconnector's CRT client gave up on writes to the loaded
        # gateway once) is reported as failed instead of ending the whole run.
        def go() -> None:
            if name in failed:
                return
            try:
                fn()
            except BaseException as exc:
                failed[name] = f"{type(exc).__name__}: {str(exc).splitlines()[-1][:200]}"

        return go

    for op in ("save", "load"):
        cases = {
            name: guarded(name, getattr(system, op))
            for name, system in systems.items()
            if name not in failed
        }
        for fn in cases.values():
            fn()  # untimed warm-up (and, for load, a checkpoint to read)
        if op == "load":
            for system in systems.values():
                system.clear()
        timings = interleave(cases, ctx.repeat)
        for name, timing in timings.items():
            if name in failed:
                print(f"dcp: {name} {op} on {workload} failed: {failed[name]}")
                continue
            if op == "load":
                systems[name].check()
            results.append(
                Result(
                    suite="dcp",
                    workload=workload,
                    target="SeaweedFS S3 (http, signed)",
                    system=name,
                    op=op,
                    nbytes=nbytes,
                    seconds=timing.median,
                    runs=timing.runs,
                    cpu_seconds=timing.cpu_median,
                    notes=notes,
                )
            )
    return results


SUITE = Suite(
    name="dcp",
    title="Torch checkpoints on SeaweedFS: DCP storage layers, ckptstore, transport ceiling",
    run=run,
    description=__doc__ or "",
)
