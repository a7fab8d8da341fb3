"""One rank of a multi-process ckptstore.distributed scenario; started N times by
tests/test_distributed_ranks.py.

Usage: ``python tests/native_ranks.py SCENARIO ROOT [ARG...]`` with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set, and store options as JSON in CKPTSTORE_TEST_STORE_OPTIONS.
Each rank prints ``RESULT <json>`` lines; the test reads the last one.

Rank r's part of the state: a 1 MiB float32 shard of its own (``model/shard<r>``), small
tensors of its own, and entries every rank holds (a replicated bf16 weight, the step).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist

import ckptstore.manager.distributed as cd
from ckptstore import background
from ckptstore.store.base import Store
from ckptstore.store.registry import open_store
from ckptstore.store.wrappers import CountingStore, Fault, FaultStore, StoreWrapper, transient_error
from tests.multirank import KILL_ME, rank_main

OPTIONS: dict[str, Any] = json.loads(os.environ.get("CKPTSTORE_TEST_STORE_OPTIONS", "{}"))
SHARD = 256 * 1024  # float32 elements: 1 MiB


def shard(rank: int, seed: int) -> torch.Tensor:
    return torch.randn(SHARD, generator=torch.Generator().manual_seed(seed * 100 + rank))


def replicated(seed: int) -> torch.Tensor:
    return torch.arange(4096, dtype=torch.bfloat16) + seed


def part(rank: int, seed: int) -> dict[str, Any]:
    return {
        "model": {f"shard{rank}": shard(rank, seed), "replicated": replicated(seed)},
        "small": {f"r{rank}-{i}": torch.full((16,), float(seed * 1000 + i)) for i in range(30)},
        "step": seed,
    }


def opened(root: str, **settings: Any) -> Store:
    return open_store(root, **OPTIONS, **settings)


def scenario_save(root: str, step: str) -> dict[str, Any]:
    store = opened(root)
    info = cd.save(store, part(dist.get_rank(), int(step)), step=int(step))
    background.run(store.close())
    return {"attempt": info.attempt, "objects": info.objects}


def scenario_frozen(root: str, step: str) -> dict[str, Any]:
    """``ckptstore.distributed.save`` of tests/manager_ranks.py's fine-tuning part."""
    from tests.manager_ranks import frozen_part

    store = opened(root)
    info = cd.save(store, frozen_part(dist.get_rank(), int(step)), step=int(step))
    background.run(store.close())
    return {"attempt": info.attempt, "objects": info.objects}


def scenario_load(root: str, step: str, saved_world: str) -> dict[str, Any]:
    """Load on this (smaller) world: rank r takes the shards r, r + world, ... of the saved
    world, the replicated weight and the step, and reads nothing else."""
    rank, world, seed = dist.get_rank(), dist.get_world_size(), int(step)
    mine = range(rank, int(saved_world), world)
    counting = CountingStore(opened(root))
    like = {
        "model": {f"shard{r}": torch.empty(SHARD) for r in mine}
        | {"replicated": torch.empty(4096, dtype=torch.bfloat16)},
        "step": 0,
    }
    got = cd.load(counting, target=like)  # the latest step, as the coordinator sees it
    background.run(counting.close())
    exact = (
        got["step"] == seed
        and torch.equal(got["model"]["replicated"], replicated(seed))
        and sorted(got["model"]) == sorted(like["model"])
        and all(torch.equal(got["model"][f"shard{r}"], shard(r, seed)) for r in mine)
    )
    return {"exact": exact, "bytes_read": counting.bytes["read"], "shards": len(mine)}


class AfterFirstObject(StoreWrapper):
    """Rank 1's store in a save it does not survive: once one of its objects is durable,
    :meth:`stop` runs on its next write."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.puts = 0

    async def _hook(self, op: str, key: str, nbytes: int) -> None:
        if op != "put":
            return
        self.puts += 1
        if self.puts < 2:
            return
        attempt = key.rsplit("/", 1)[0] + "/"  # this save's objects, not earlier saves'
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if any("/r1-" in k for k in await self.inner.list_keys(attempt)):
                await self.stop()
        raise TimeoutError("no object of rank 1 appeared within 30 s")

    async def stop(self) -> None:
        raise NotImplementedError


class DiesAfterFirstObject(AfterFirstObject):
    """The process exits, as a preempted or OOM-killed rank would: no exception, no
    cleanup."""

    async def stop(self) -> None:
        os._exit(17)


class WaitsForSigkill(AfterFirstObject):
    """The rank says so on its output (``KILL ME``) and waits, mid-save, for the test to
    SIGKILL it from outside; unkilled, it fails after two minutes."""

    async def stop(self) -> None:
        print(KILL_ME, flush=True)
        await asyncio.wait_for(asyncio.Event().wait(), timeout=120)


def scenario_failures(root: str) -> dict[str, Any]:
    """Save step 1; then step 2, where rank 1's writes fail; then step 3, where rank 1 dies
    after storing an object."""
    rank = dist.get_rank()
    store = opened(root, pack_size=64 << 10)  # several objects per rank
    cd.save(store, part(rank, 1), step=1)
    outcome: dict[str, Any] = {}
    failing = FaultStore(store, [Fault(frozenset({"put"}), transient_error, after=1)])
    try:
        cd.save(failing if rank == 1 else store, part(rank, 2), step=2)
        outcome["raise"] = "succeeded"
    except Exception as exc:
        outcome["raise"] = f"{type(exc).__name__}: {exc}"
    print("RESULT " + json.dumps(outcome), flush=True)  # rank 1 does not live past the next
    try:
        cd.save(DiesAfterFirstObject(store) if rank == 1 else store, part(rank, 3), step=3)
        outcome["die"] = "succeeded"
    except Exception as exc:
        outcome["die"] = type(exc).__name__
    return outcome


def scenario_sigkill(root: str) -> dict[str, Any]:
    """Save step 1; then step 2, during which the test SIGKILLs rank 1 after it stored an
    object (see tests/test_distributed_ranks.py)."""
    rank = dist.get_rank()
    store = opened(root, pack_size=64 << 10)  # several objects per rank
    cd.save(store, part(rank, 1), step=1)
    outcome: dict[str, Any] = {}
    try:
        cd.save(WaitsForSigkill(store) if rank == 1 else store, part(rank, 2), step=2)
        outcome["killed"] = "succeeded"
    except Exception as exc:
        outcome["killed"] = f"{type(exc).__name__}: {exc}"
    return outcome


#: the collectives' deadline of the stalled-rank scenario, seconds
STALL_TIMEOUT = 5.0


def scenario_stall(root: str, what: str) -> dict[str, Any]:
    """Save step 1 over a gloo group whose collectives time out after STALL_TIMEOUT; then
    rank 1 stalls (alive and silent: it never calls the next save or load) while the other
    ranks ``what`` (``save`` step 2 or ``load`` step 1): they fail within the timeout, and
    say how long after the call that was."""
    from datetime import timedelta

    rank = dist.get_rank()
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=STALL_TIMEOUT))
    store = opened(root)
    cd.save(store, part(rank, 1), step=1, group=group)
    if rank == 1:
        print("RESULT " + json.dumps({"stalled": True}), flush=True)
        time.sleep(3 * STALL_TIMEOUT)  # silent past every survivor's deadline
        os._exit(0)  # never takes part again
    began = time.monotonic()
    try:
        if what == "save":
            cd.save(store, part(rank, 2), step=2, group=group)
        else:
            cd.load(store, 1, group=group)
        outcome = "succeeded"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    result = {"error": outcome, "seconds": time.monotonic() - began}
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # the group is broken: skip destroy_process_group's collectives


SCENARIOS = {
    "save": scenario_save,
    "frozen": scenario_frozen,
    "load": scenario_load,
    "failures": scenario_failures,
    "sigkill": scenario_sigkill,
    "stall": scenario_stall,
}


if __name__ == "__main__":
    rank_main(SCENARIOS)
