"""Every face's error paths against a real server, in one child process that then exits
(tests/test_error_paths.py): each call below fails, and must close every client it opened.

Usage: ``python tests/error_paths_child.py DIALECT URL MISSING_BUCKET_URL SCRATCH`` with the
server's options as JSON in CKPTSTORE_TEST_STORE_OPTIONS. ``URL`` is an empty root. Prints
``RESULT <json>``: for each scenario, the error it raised and the stores it left open.

Open clients are found where they live: an S3 store's aiobotocore client, a GCS store's
aiohttp session. The parent also reads this process's stderr for aiohttp's "Unclosed ..."
warnings at exit (``-W always::ResourceWarning`` shows them all).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

import ckptstore
import ckptstore.dcp
import ckptstore.distributed
import ckptstore.files
from ckptstore import background
from ckptstore.cli.main import main as cli
from ckptstore.store.gcs import GCSStore
from ckptstore.store.s3 import S3Store

OPTIONS: dict[str, Any] = json.loads(os.environ.get("CKPTSTORE_TEST_STORE_OPTIONS", "{}"))

#: held strongly: a store dropped with its client open is the leak to report, not to
#: let the garbage collector hide
opened: list[Any] = []
kept: list[Any] = []  # the control scenario's store


def _track() -> None:
    """Note every store that opens a client."""
    s3_open = S3Store._open_client

    async def open_client(self: S3Store) -> Any:
        opened.append(self)
        return await s3_open(self)

    S3Store._open_client = open_client  # type: ignore[method-assign]
    gcs_client = GCSStore._client

    async def client(self: GCSStore) -> Any:
        opened.append(self)
        return await gcs_client(self)

    GCSStore._client = client  # type: ignore[method-assign]


def _still_open() -> list[str]:
    """The stores left with a client open; the list starts again for the next scenario."""
    left = []
    for store in opened:
        if isinstance(store, S3Store) and store._client_cm is not None:
            left.append(store.url)
        if isinstance(store, GCSStore) and store._session is not None:
            left.append(store.url)
    opened.clear()
    return left


def _query(url: str) -> str:
    return url + "?" + "&".join(f"{k}={v}" for k, v in OPTIONS.items())


def scenarios(url: str, nobucket: str, scratch: Path) -> Iterator[tuple[str, Callable[[], Any]]]:
    state = {"w": np.arange(1024, dtype=np.float32), "step": 1}
    o = OPTIONS

    def manager_restore() -> None:
        with ckptstore.CheckpointManager(url, **o) as mgr:
            mgr.restore(99)

    def manager_save() -> None:
        with ckptstore.CheckpointManager(nobucket, **o) as mgr:
            mgr.save(1, state)
            mgr.wait_until_finished()

    def dcp_load() -> None:
        import torch.distributed.checkpoint as dcp

        dcp.load({"w": np.zeros(4)}, storage_reader=ckptstore.dcp.Reader(f"{url}/5", **o))

    def dcp_save() -> None:
        import torch
        import torch.distributed.checkpoint as dcp

        dcp.save({"w": torch.zeros(4)}, storage_writer=ckptstore.dcp.Writer(f"{nobucket}/5", **o))

    def tier_copy() -> None:  # the local save commits; the copy to a missing bucket fails
        with ckptstore.CheckpointManager(nobucket, local=str(scratch / "tier"), **o) as mgr:
            mgr.save(1, state)
            mgr.wait_until_finished()

    def mirror() -> None:
        (scratch / "tree").mkdir(exist_ok=True)
        (scratch / "tree" / "weights.bin").write_bytes(b"x" * 4096)
        mirror = ckptstore.files.TreeMirror(nobucket, **o)
        try:
            mirror.submit(scratch / "tree", 1)
            mirror.wait()
        finally:
            mirror.close()

    def lightning_save() -> None:
        import torch

        from ckptstore.lightning import StoreCheckpointIO

        StoreCheckpointIO(**o).save_checkpoint({"w": torch.zeros(4)}, f"{nobucket}/3")

    def lightning_load() -> None:
        from ckptstore.lightning import StoreCheckpointIO

        StoreCheckpointIO(**o).load_checkpoint(f"{url}/77")

    def cli_fails(*argv: str) -> Callable[[], None]:
        def run() -> None:
            status = cli(list(argv))
            if status != 0:
                raise SystemExit(status)

        return run

    def left_open() -> None:  # the control: a store this child opens and never closes
        kept.append(ckptstore.open_store(url, **o))
        ckptstore.list_steps(kept[-1])  # a Store passed in is left open

    yield "control: a store left open", left_open
    yield "save", lambda: ckptstore.save(url, state, step=1, **o)  # the one that succeeds
    yield "load a missing step", lambda: ckptstore.load(url, step=99, **o)
    yield "load from a missing bucket", lambda: ckptstore.load(nobucket, **o)
    yield "save to a missing bucket", lambda: ckptstore.save(nobucket, state, step=1, **o)
    yield "save a step that exists", lambda: ckptstore.save(url, state, step=1, **o)
    yield "read_manifest of a missing step", lambda: ckptstore.read_manifest(url, 99, **o)
    yield "list_steps of a missing bucket", lambda: ckptstore.list_steps(nobucket, **o)
    yield "rollback to a missing step", lambda: ckptstore.rollback(url, 99, **o)
    yield "recover_step of a missing step", lambda: ckptstore.recover_step(url, 99, **o)
    yield "gc of a missing bucket", lambda: ckptstore.gc(nobucket, **o)
    yield (
        "manager refusing preemption=",
        lambda: ckptstore.CheckpointManager(url, preemption=[999], **o),
    )
    yield (
        "manager refusing local= the same root",
        lambda: ckptstore.CheckpointManager(url, local=url, **o),
    )
    yield "manager restore of a missing step", manager_restore
    yield "manager save to a missing bucket", manager_save
    yield (
        "files.download of a missing step",
        lambda: ckptstore.files.download(url, scratch / "dest", step=99, **o),
    )
    yield (
        "files.upload of a missing directory",
        lambda: ckptstore.files.upload(scratch / "nosuch", url, step=5, **o),
    )
    yield "tier copy to a missing bucket", tier_copy
    yield "files.TreeMirror to a missing bucket", mirror

    def one_rank() -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            init = f"file://{scratch / 'group'}"
            dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)

    def distributed_save() -> None:
        one_rank()
        ckptstore.distributed.save(nobucket, state, step=1, **o)

    def distributed_manager() -> None:
        one_rank()
        with ckptstore.distributed.CheckpointManager(nobucket, **o) as mgr:
            mgr.save(1, state)
            mgr.wait_until_finished()

    yield "distributed.save to a missing bucket", distributed_save
    yield "distributed manager save to a missing bucket", distributed_manager
    yield "lightning save to a missing bucket", lightning_save
    yield "distributed.load of a missing step", lambda: ckptstore.distributed.load(url, 99, **o)
    yield "dcp load of a step never committed", dcp_load
    yield "dcp save to a missing bucket", dcp_save
    yield "lightning load of a missing checkpoint", lightning_load
    yield "cli ls of a missing bucket", cli_fails("ls", _query(nobucket))
    yield "cli show of a missing step", cli_fails("show", _query(url), "99")
    yield "cli verify of a missing step", cli_fails("verify", _query(url), "99")
    yield "cli cp to a missing bucket", cli_fails("cp", _query(url), _query(nobucket))
    yield "cli rm of a missing step", cli_fails("rm", _query(url), "99")
    yield "cli gc of a missing bucket", cli_fails("gc", _query(nobucket))


def main() -> None:
    _dialect, url, nobucket, scratch = sys.argv[1:]
    _track()
    out: dict[str, Any] = {}
    for name, call in scenarios(url, nobucket, Path(scratch)):
        error = None
        try:
            with contextlib.redirect_stdout(sys.stderr):
                call()
        except BaseException as exc:  # SystemExit of the CLI included
            error = f"{type(exc).__name__}: {exc}"[:4000]
            del exc
        out[name] = {"error": error, "open": _still_open()}
        while kept:
            background.run(kept.pop().close())
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
