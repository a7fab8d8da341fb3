"""dcp: torch.distributed.checkpoint on one SeaweedFS bucket, three storage layers.

The same ``dcp.save``/``dcp.load`` calls (one process, ``no_dist=True``) with
``ckptstore.dcp.Writer``/``Reader``, with DCP's own ``FsspecWriter``/``FsspecReader`` over s3fs,
and with s3torchconnector's ``S3StorageWriter``/``S3StorageReader`` (its native CRT client),
all against one ``weed mini`` S3 gateway on 127.0.0.1 over plain HTTP with signed requests
(access key configured). Workloads: 1 GiB as 16 float32 tensors of 64 MiB, and a
transformer-like state (12 layers of d=1024 with Adam moments, about 0.6 GiB in 150 tensors
plus small ones). Every save goes to a fresh checkpoint prefix; loads read the checkpoint the
last save of that system wrote, into preallocated tensors. Runs alternate between systems
(``interleave``); figures are medians. The server shares the machine's 2 cores with the
client, so client CPU seconds are reported beside throughput.
"""

from __future__ import annotations

import itertools
import os
import uuid
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from benchlib import Context, Result, Suite, interleave

BUCKET = "dcp-bench"
ACCESS_KEY, SECRET_KEY = "benchaccess", "benchsecret0123456789"


def _big(quick: bool) -> dict[str, Any]:
    import torch

    count = 4 if quick else 16
    return {f"t{i}": torch.randn(16 << 20) for i in range(count)}  # 64 MiB each


def _transformer(quick: bool) -> dict[str, Any]:
    import torch

    d, layers = 1024, 3 if quick else 12
    model: dict[str, Any] = {"embed": torch.randn(8192, d)}
    for i in range(layers):
        for name, shape in (
            ("qkv", (3 * d, d)),
            ("proj", (d, d)),
            ("fc1", (4 * d, d)),
            ("fc2", (d, 4 * d)),
            ("ln1", (d,)),
            ("ln2", (d,)),
            ("qkv_bias", (3 * d,)),
            ("fc1_bias", (4 * d,)),
        ):
            model[f"layer{i}.{name}"] = torch.randn(*shape)
    optim = {
        name: {"exp_avg": torch.randn_like(t), "exp_avg_sq": torch.rand_like(t), "step": 10}
        for name, t in model.items()
    }
    return {"model": model, "optim": optim}


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


def run(ctx: Context) -> list[Result]:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    import ckptstore.dcp
    from ckptstore.testing.servers import SeaweedFS

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    os.environ.update(
        AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_REGION="us-east-1"
    )
    results: list[Result] = []
    with SeaweedFS(
        ctx.workdir / "seaweed-dcp", access_key=ACCESS_KEY, secret_key=SECRET_KEY
    ) as server:
        server.create_bucket(BUCKET)
        endpoint = server.s3_endpoint
        ck_options = {"endpoint_url": endpoint, "region": "us-east-1"}
        fs_options = {"endpoint_url": endpoint, "key": ACCESS_KEY, "secret": SECRET_KEY}

        writers: dict[str, Callable[[str], Any]] = {
            "ckptstore.dcp": lambda url: ckptstore.dcp.Writer(url, **ck_options),
            "DCP FsspecWriter (s3fs)": lambda url: FsspecWriter(url, **fs_options),
        }
        readers: dict[str, Callable[[str], Any]] = {
            "ckptstore.dcp": lambda url: ckptstore.dcp.Reader(url, **ck_options),
            "DCP FsspecWriter (s3fs)": lambda url: FsspecReader(url, **fs_options),
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

            writers["s3torchconnector"] = lambda url: at_endpoint(
                S3StorageWriter("us-east-1", url, s3client_config=config)
            )
            readers["s3torchconnector"] = lambda url: at_endpoint(
                S3StorageReader("us-east-1", url, s3client_config=config)
            )
        except ImportError as exc:
            notes = f"s3torchconnector not measured: {exc}"

        counter = itertools.count()
        for workload, state in (
            ("1 GiB, 64 MiB tensors", _big(ctx.quick)),
            ("transformer + Adam", _transformer(ctx.quick)),
        ):
            results += _measure(ctx, workload, state, writers, readers, counter, notes)
    ctx.options["summary"] = _summary(results)
    return results


#: Goals per peer and op: the peer's time / ckptstore.dcp's time should be at least this.
GOALS = {
    ("DCP FsspecWriter (s3fs)", "save"): 1.4,
    ("DCP FsspecWriter (s3fs)", "load"): 4.0,
    ("s3torchconnector", "save"): 1.0,
    ("s3torchconnector", "load"): 1.0,
}


def _summary(results: list[Result]) -> str:
    """Each peer's median time over ckptstore.dcp's, per workload and op, against the goal."""
    lines = []
    for workload in dict.fromkeys(r.workload for r in results):
        for op in ("save", "load"):
            rows = {r.system: r for r in results if r.workload == workload and r.op == op}
            ours = rows.get("ckptstore.dcp")
            if ours is None:
                continue
            ratios = []
            for (peer, goal_op), goal in GOALS.items():
                if goal_op == op and peer in rows:
                    ratio = rows[peer].seconds / ours.seconds
                    verdict = "met" if ratio >= goal else "NOT met"
                    ratios.append(f"{peer} {ratio:.2f}x (goal >= {goal}x: {verdict})")
            lines.append(
                f"- {workload}, {op}: ckptstore.dcp {ours.seconds:.2f} s; " + "; ".join(ratios)
            )
    return (
        "Each peer's median time / ckptstore.dcp's median time in this run (above 1.00x: "
        "ckptstore.dcp is faster):\n\n" + "\n".join(lines)
    )


def _measure(
    ctx: Context,
    workload: str,
    state: dict[str, Any],
    writers: dict[str, Callable[[str], Any]],
    readers: dict[str, Callable[[str], Any]],
    counter: Iterator[int],
    notes: str,
) -> list[Result]:
    import torch.distributed.checkpoint as dcp

    nbytes = _nbytes(state)
    last_url: dict[str, str] = {}

    def save(name: str) -> Callable[[], None]:
        def go() -> None:
            url = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}/{next(counter)}"
            dcp.save(state, storage_writer=writers[name](url), no_dist=True)
            last_url[name] = url

        return go

    def load(name: str) -> Callable[[], None]:
        def go() -> None:
            target = _zeros_like(state)
            dcp.load(target, storage_reader=readers[name](last_url[name]), no_dist=True)

        return go

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

    for op, make in (("save", save), ("load", load)):
        cases = {name: guarded(name, make(name)) for name in writers if name not in failed}
        for fn in cases.values():
            fn()  # untimed warm-up (and, for load, a checkpoint to read)
        timings = interleave(cases, ctx.repeat)
        for name, timing in timings.items():
            if name in failed:
                print(f"dcp: {name} {op} on {workload} failed: {failed[name]}")
                continue
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
    title="DCP storage layers on SeaweedFS (ckptstore.dcp vs FsspecWriter vs s3torchconnector)",
    run=run,
    description=__doc__ or "",
)
