"""One rank of a multi-process DCP scenario; tests/test_dcp_multirank.py starts N of these.

Usage: ``python tests/dcp_ranks.py SCENARIO URL [URL...]`` with RANK, WORLD_SIZE, MASTER_ADDR
and MASTER_PORT set, and store options as JSON in CKPTSTORE_TEST_STORE_OPTIONS. Each rank
prints one ``RESULT <json>`` line; the test reads it.

The state is the same on every run: a row-sharded DTensor (so saving on 4 ranks and loading
on 2 makes DCP reshard), a replicated tensor, a bytes value, and many small tensors.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import ckptstore.dcp
from ckptstore import background
from ckptstore.store.registry import open_store
from ckptstore.store.wrappers import CountingStore
from tests.multirank import KILL_ME, join_group

#: Store options (an S3 endpoint...) as JSON, from the test.
OPTIONS: dict[str, Any] = json.loads(os.environ.get("CKPTSTORE_TEST_STORE_OPTIONS", "{}"))
ROWS, COLS = 1024, 256  # 1 MiB of float32, sharded by rows


def full_weight(seed: int) -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(seed))


def make_state(mesh: Any, seed: int, *, empty: bool = False) -> dict[str, Any]:
    weight = torch.zeros(ROWS, COLS) if empty else full_weight(seed)
    small = {
        f"s{i}": torch.zeros(16) if empty else torch.full((16,), float(seed * 1000 + i))
        for i in range(50)
    }
    return {
        "weight": distribute_tensor(weight, mesh, [Shard(0)]),
        "bias": torch.zeros(COLS, dtype=torch.bfloat16)
        if empty
        else torch.arange(COLS, dtype=torch.bfloat16) + seed,
        "step": -1 if empty else seed,
        "small": small,
    }


def check_state(state: dict[str, Any], seed: int) -> bool:
    weight = state["weight"]
    assert isinstance(weight, DTensor)
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = ROWS // world
    expected = full_weight(seed)[rank * rows : (rank + 1) * rows]
    return (
        torch.equal(weight.to_local(), expected)
        and torch.equal(state["bias"], torch.arange(COLS, dtype=torch.bfloat16) + seed)
        and state["step"] == seed
        and all(
            torch.equal(t, torch.full((16,), float(seed * 1000 + int(k[1:]))))
            for k, t in state["small"].items()
        )
    )


class FailingPlanner(DefaultSavePlanner):
    """Rank 1 fails after resolving a few items: it raises (``"raise"``), dies outright
    (``"die"``), or says it is mid-save and waits for the test to SIGKILL it (``"wait"``)."""

    def __init__(self, how: str, url: str) -> None:
        super().__init__()
        self.how = how
        self.url = url
        self.resolved = 0

    def resolve_data(self, write_item: WriteItem) -> Any:
        self.resolved += 1
        if dist.get_rank() == 1 and self.resolved == 10:
            if self.how == "die":
                wait_for_own_object(self.url)
                os._exit(17)  # a preempted or OOM-killed rank: no cleanup, no exception
            if self.how == "wait":
                wait_for_own_object(self.url)
                print(KILL_ME, flush=True)
                threading.Event().wait(timeout=120)
                raise TimeoutError("rank 1 was not killed within 120 s")
            raise RuntimeError("rank 1 fails on purpose")
        return super().resolve_data(write_item)


def wait_for_own_object(url: str) -> None:
    """Poll until this rank has at least one object stored, so it dies mid-save."""
    store = open_store(url, **OPTIONS)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        keys = background.run(store.list_keys())
        if any(f"/r{dist.get_rank()}-" in key for key in keys):
            return
    raise TimeoutError("no object of this rank appeared within 30 s")


def scenario_save(mesh: Any, url: str, seed: str) -> dict[str, Any]:
    dcp.save(make_state(mesh, int(seed)), storage_writer=ckptstore.dcp.Writer(url, **OPTIONS))
    return {"saved": True}


def scenario_load(mesh: Any, url: str, seed: str) -> dict[str, Any]:
    root, step = url.rsplit("/", 1)  # count the requests to the whole root
    counting = CountingStore(open_store(root, **OPTIONS))
    state = make_state(mesh, 0, empty=True)
    dcp.load(state, storage_reader=ckptstore.dcp.Reader(counting, step=int(step)))
    background.run(counting.close())  # a Store the caller passes in stays the caller's
    return {"exact": check_state(state, int(seed)), "bytes_read": counting.bytes["read"]}


def attempt_save(
    state: dict[str, Any], url: str, planner: FailingPlanner, **options: Any
) -> BaseException | None:
    """``dcp.save`` through a ckptstore writer; what it raised, or None if it saved."""
    try:
        writer = ckptstore.dcp.Writer(url, **options, **OPTIONS)
        dcp.save(state, storage_writer=writer, planner=planner)
    except BaseException as exc:  # DCP raises CheckpointException, a BaseException
        return exc
    return None


def scenario_failures(mesh: Any, good: str, failed: str, died: str) -> dict[str, Any]:
    """Save ``good``; then a save where rank 1 raises; then one where rank 1 dies."""
    dcp.save(make_state(mesh, 1), storage_writer=ckptstore.dcp.Writer(good, **OPTIONS))
    error = attempt_save(make_state(mesh, 2), failed, FailingPlanner("raise", failed))
    outcome = {"raise": "succeeded" if error is None else type(error).__name__}
    print("RESULT " + json.dumps(outcome), flush=True)  # rank 1 may not live past the next save
    # small packs, so rank 1 has uploaded some objects when it dies; not incremental, since
    # a save that compares with a base resolves every item before it writes any
    error = attempt_save(
        make_state(mesh, 3), died, FailingPlanner("die", died), pack_size=512, incremental=False
    )
    outcome["die"] = "succeeded" if error is None else type(error).__name__
    return outcome


def scenario_sigkill(mesh: Any, good: str, killed: str) -> dict[str, Any]:
    """Save ``good``; then a save during which the test SIGKILLs rank 1 once it has uploaded
    objects of its own (see tests/test_dcp_ranks_sigkill.py)."""
    dcp.save(make_state(mesh, 1), storage_writer=ckptstore.dcp.Writer(good, **OPTIONS))
    planner = FailingPlanner("wait", killed)
    # not incremental: see scenario_failures
    error = attempt_save(make_state(mesh, 2), killed, planner, pack_size=512, incremental=False)
    return {"killed": "succeeded" if error is None else f"{type(error).__name__}: {error}"}


def scenario_async(mesh: Any, thread_url: str, process_url: str) -> dict[str, Any]:
    """async_save with the thread executor, then with the process executor, one writer.

    The process executor pickles the writer, which by then has a store open, into a daemon
    process; the writer must travel without it and reopen there.
    """
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    writer = ckptstore.dcp.Writer(thread_url, **OPTIONS)
    dcp.async_save(make_state(mesh, 5), checkpoint_id=thread_url, storage_writer=writer).result(
        timeout=120
    )
    dcp.async_save(
        make_state(mesh, 6),
        checkpoint_id=process_url,
        storage_writer=writer,
        async_checkpointer_type=AsyncCheckpointerType.PROCESS,
    ).result(timeout=120)
    exact = []
    for url, seed in ((thread_url, 5), (process_url, 6)):
        loaded = make_state(mesh, 0, empty=True)
        dcp.load(loaded, storage_reader=ckptstore.dcp.Reader(url, **OPTIONS))
        exact.append(check_state(loaded, seed))
    return {"exact": exact}


def scenario_incremental(mesh: Any, first: str, second: str) -> dict[str, Any]:
    """Save the same state twice: the second save references the first's unchanged objects
    (every rank compares its own items with the base the coordinator held); then load it."""
    for url in (first, second):
        dcp.save(make_state(mesh, 1), storage_writer=ckptstore.dcp.Writer(url, **OPTIONS))
    root, step = second.rsplit("/", 1)
    manifest = ckptstore.read_manifest(root, int(step), **OPTIONS)
    loaded = make_state(mesh, 0, empty=True)
    dcp.load(loaded, storage_reader=ckptstore.dcp.Reader(second, **OPTIONS))
    return {
        "own": manifest.own_bytes,
        "referenced": manifest.referenced_bytes,
        "exact": check_state(loaded, 1),
    }


SCENARIOS = {
    "save": scenario_save,
    "incremental": scenario_incremental,
    "load": scenario_load,
    "failures": scenario_failures,
    "sigkill": scenario_sigkill,
    "async": scenario_async,
}


def main() -> None:
    scenario, *args = sys.argv[1:]
    join_group(timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    try:
        result = SCENARIOS[scenario](mesh, *args)
        print("RESULT " + json.dumps(result), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
