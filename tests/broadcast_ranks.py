"""One rank of a multi-process read-once-broadcast load; started N times by
tests/test_broadcast_ranks.py.

Usage: ``python tests/broadcast_ranks.py SCENARIO ROOT STEP [on|off]`` with RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, and store options as JSON in
CKPTSTORE_TEST_STORE_OPTIONS. Each rank prints ``RESULT <json>`` lines; the test reads the
last one.

The test process saves :func:`state` once; every rank then loads the whole replicated
model and its own shard (``shards/r<rank>``), through a counting store.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist

import ckptstore.manager.distributed as cd
from ckptstore import background
from ckptstore.store.registry import open_store
from ckptstore.store.wrappers import CountingStore
from tests.multirank import rank_main

OPTIONS: dict[str, Any] = json.loads(os.environ.get("CKPTSTORE_TEST_STORE_OPTIONS", "{}"))
SHARD = 256 * 1024  # float32 elements: 1 MiB, an object of its own (never packed)


def model() -> dict[str, Any]:
    """The replicated part: large leaves (an object each) and small packed ones."""
    gen = torch.Generator().manual_seed(3)
    return {
        "embed": torch.randn(512 * 1024, generator=gen),  # 2 MiB
        "blocks": [torch.randn(1024 * 1024, generator=gen).to(torch.bfloat16) for _ in range(3)],
        "norms": {f"n{i}": torch.full((512,), float(i)) for i in range(24)},
    }


def shard(rank: int) -> torch.Tensor:
    return torch.randn(SHARD, generator=torch.Generator().manual_seed(100 + rank))


def state(world: int) -> dict[str, Any]:
    return {"model": model(), "shards": {f"r{r}": shard(r) for r in range(world)}, "step": 5}


def nbytes(tree: Any) -> int:
    if isinstance(tree, dict):
        return sum(nbytes(v) for v in tree.values())
    if isinstance(tree, list):
        return sum(nbytes(v) for v in tree)
    return tree.numel() * tree.element_size() if isinstance(tree, torch.Tensor) else 0


def equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(equal, a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return bool(a == b)


def load(root: str, step: str, broadcast: str) -> tuple[dict[str, Any], CountingStore]:
    """This rank's load: the model and its own shard, as its target says."""
    rank = dist.get_rank()
    like = {
        "model": {
            "embed": torch.empty(512 * 1024),
            "blocks": [torch.empty(1024 * 1024, dtype=torch.bfloat16) for _ in range(3)],
            "norms": {f"n{i}": torch.empty(512) for i in range(24)},
        },
        "shards": {f"r{rank}": torch.empty(SHARD)},
        "step": 0,
    }
    counting = CountingStore(open_store(root, **OPTIONS))
    try:
        got = cd.load(counting, int(step), target=like, broadcast=broadcast == "on")
    finally:
        background.run(counting.close())
    return got, counting


def scenario_load(root: str, step: str, broadcast: str) -> dict[str, Any]:
    rank = dist.get_rank()
    got, counting = load(root, step, broadcast)
    expected = {"model": model(), "shards": {f"r{rank}": shard(rank)}, "step": 5}
    return {"exact": equal(got, expected), "bytes_read": counting.bytes["read"]}


def scenario_corrupt(root: str, step: str) -> dict[str, Any]:
    """Load from a checkpoint the test damaged: report the error this rank got."""
    try:
        load(root, step, "on")
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None}


class DiesInExchange(cd.TorchCollectives):
    """A rank that dies (as a preempted or OOM-killed one would: no exception, no cleanup)
    when the shared leaves are to be sent, having read its share for the others."""

    def exchange(self, sends: list[cd.Message], receives: list[cd.Message]) -> None:
        os._exit(17)


def scenario_die(root: str, step: str) -> dict[str, Any]:
    """Rank 1 dies as the shared leaves are sent: report the error this rank got."""
    rank = dist.get_rank()
    comm = DiesInExchange() if rank == 1 else cd.TorchCollectives()
    store = open_store(root, **OPTIONS)
    try:
        cd.load(store, int(step), comm=comm)
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    finally:
        background.run(store.close())
    return {"error": None}


SCENARIOS = {"load": scenario_load, "corrupt": scenario_corrupt, "die": scenario_die}


if __name__ == "__main__":
    rank_main(SCENARIOS)
