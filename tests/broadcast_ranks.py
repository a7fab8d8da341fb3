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
from ckptstore.manager import segments
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


class CountingCollectives(cd.TorchCollectives):
    """The world's collectives, counting the bytes this rank receives through exchange()."""

    received = 0

    def exchange(self, sends: list[cd.Message], receives: list[cd.Message]) -> None:
        super().exchange(sends, receives)
        self.received += sum(buffer.nbytes for _, _, buffer in receives)


def split_hosts() -> None:
    """Make this rank believe it runs on one of two hosts, by rank parity, so the load
    shares memory with the ranks of its parity and goes over gloo to the others."""
    real = segments.host_identity
    half = dist.get_rank() % 2
    segments.host_identity = lambda: f"{real()} half {half}"  # type: ignore[assignment]


def load(
    root: str, step: str, broadcast: str, memory: str = "shm"
) -> tuple[dict[str, Any], CountingStore, CountingCollectives]:
    """This rank's load: the model and its own shard, as its target says. ``memory``:
    ``shm`` shares memory between the ranks of the host, ``split`` as if on two hosts
    (:func:`split_hosts`), ``net`` sends everything over gloo (``shared_memory=False``)."""
    rank = dist.get_rank()
    if memory == "split":
        split_hosts()
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
    comm = CountingCollectives()
    try:
        got = cd.load(
            counting,
            int(step),
            target=like,
            comm=comm,
            broadcast=broadcast == "on",
            shared_memory=memory != "net",
        )
    finally:
        background.run(counting.close())
    return got, counting, comm


def scenario_load(root: str, step: str, broadcast: str, memory: str = "shm") -> dict[str, Any]:
    rank = dist.get_rank()
    got, counting, comm = load(root, step, broadcast, memory)
    expected = {"model": model(), "shards": {f"r{rank}": shard(rank)}, "step": 5}
    exact = equal(got, expected)
    # a loaded tensor is this rank's own: writable, and a write stays here
    got["model"]["embed"].fill_(float(rank))
    dist.barrier()
    own = bool((got["model"]["embed"] == float(rank)).all())
    return {
        "exact": exact,
        "own": own,
        "bytes_read": counting.bytes["read"],
        "received_over_group": comm.received,
    }


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


class DiesAfterReading(cd.TorchCollectives):
    """A rank that dies having read its share for the others into shared memory, as it is
    about to tell them so (the second all_gather of a load)."""

    gathers = 0

    def all_gather(self, obj: Any) -> list[Any]:
        self.gathers += 1
        if self.gathers == 2:
            os._exit(17)
        return super().all_gather(obj)


def scenario_die(root: str, step: str, when: str = "sending") -> dict[str, Any]:
    """Rank 1 dies: as the shared leaves are sent over gloo (``sending``; the ranks do not
    share memory), or having read its share into shared memory (``announcing``). Report
    the error this rank got."""
    rank = dist.get_rank()
    dies = DiesInExchange if when == "sending" else DiesAfterReading
    comm = dies() if rank == 1 else cd.TorchCollectives()
    store = open_store(root, **OPTIONS)
    try:
        cd.load(store, int(step), comm=comm, shared_memory=when != "sending")
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    finally:
        background.run(store.close())
    return {"error": None}


def scenario_stream(root: str, step: str) -> dict[str, Any]:
    """A streaming load: the embedding first (shared between the ranks), the rest (the
    blocks, norms and this rank's shard) read by each rank itself in the background; the
    training loop's own collective runs while it reads."""
    import ckptstore
    from ckptstore.pipeline import streaming

    rank = dist.get_rank()
    like = {"model": model(), "shards": {f"r{rank}": torch.empty(SHARD)}, "step": 0}
    counting = CountingStore(open_store(root, **OPTIONS))
    comm = CountingCollectives()
    got = cd.load(counting, int(step), target=like, comm=comm, stream=["model/embed", "step"])
    background_part = len(streaming.pending())
    dist.barrier()  # a collective of the loop's own, beside the background reads
    ckptstore.fence()
    background.run(counting.close())
    expected = {"model": model(), "shards": {f"r{rank}": shard(rank)}, "step": 5}
    return {
        "exact": equal(got, expected),
        "background_part": background_part,
        "bytes_read": counting.bytes["read"],
    }


SCENARIOS = {
    "load": scenario_load,
    "corrupt": scenario_corrupt,
    "die": scenario_die,
    "stream": scenario_stream,
}


if __name__ == "__main__":
    rank_main(SCENARIOS)
