"""One rank of a resharding scenario; started N times by tests/test_sharding_ranks.py.

Usage: ``python tests/shard_ranks.py SCENARIO ROOT STEP`` with RANK, WORLD_SIZE, MASTER_ADDR
and MASTER_PORT set, and store options as JSON in CKPTSTORE_TEST_STORE_OPTIONS. Each rank
prints ``RESULT <json>``.

The global state, the same whatever the world size:

* ``model/w``: 1024 x 1024 float32 (4 MiB), split by rows (``ckptstore.distributed.Shard``
  of a plain torch tensor);
* ``model/grid``: 512 x 768 bfloat16 as a DTensor on a 2 x 2 mesh, split along both
  dimensions (saved on 4 ranks only);
* ``model/half``: 256 x 512 float32 as a DTensor on a 2 x 2 mesh, split by rows along the
  first mesh dimension and replicated along the second (each box is held by two ranks and
  written once);
* ``step``: a plain value every rank holds.

The save runs on 4 ranks. A load on N ranks asks for rank r's rows of ``w`` (an uneven split
when N does not divide 1024) through a ``Shard`` target, and for the DTensors on a 1-D mesh
of N ranks (``grid`` by columns, ``half`` by rows).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import ckptstore.distributed as cdist
from ckptstore import background
from ckptstore.store.registry import open_store
from ckptstore.store.wrappers import CountingStore
from tests.multirank import rank_main

OPTIONS: dict[str, Any] = json.loads(os.environ.get("CKPTSTORE_TEST_STORE_OPTIONS", "{}"))
#: small enough that a rank's share of ``w`` spans many blocks
BLOCK = 64 << 10


def full_w() -> torch.Tensor:
    return torch.randn(1024, 1024, generator=torch.Generator().manual_seed(22))


def full_grid() -> torch.Tensor:
    return torch.arange(512 * 768, dtype=torch.float32).reshape(512, 768).to(torch.bfloat16)


def full_half() -> torch.Tensor:
    return torch.randn(256, 512, generator=torch.Generator().manual_seed(7))


def rows(n: int, world: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s rows of ``n`` split over ``world`` ranks, as torch.chunk splits."""
    per = -(-n // world)
    low = min(n, rank * per)
    return low, min(n, low + per)


def as_dtensor(full: torch.Tensor, mesh: Any, placements: Any) -> DTensor:
    shape, offset = compute_local_shape_and_global_offset(full.shape, mesh, placements)
    local = full[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
    return DTensor.from_local(
        local.contiguous(),
        mesh,
        placements,
        run_check=False,
        shape=full.shape,
        stride=full.stride(),
    )


def empty_dtensor(full: torch.Tensor, mesh: Any, placements: Any) -> DTensor:
    shape, _ = compute_local_shape_and_global_offset(full.shape, mesh, placements)
    return DTensor.from_local(
        torch.empty(shape, dtype=full.dtype),
        mesh,
        placements,
        run_check=False,
        shape=full.shape,
        stride=full.stride(),
    )


def scenario_save(root: str, step: str) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4
    mesh = init_device_mesh("cpu", (2, 2))
    low, high = rows(1024, world, rank)
    w = full_w()
    part = {
        "model": {
            "w": cdist.Shard(w[low:high], offsets=(low, 0), global_shape=w.shape),
            "grid": as_dtensor(full_grid(), mesh, (Shard(0), Shard(1))),
            "half": as_dtensor(full_half(), mesh, (Shard(0), Replicate())),
        },
        "step": int(step),
    }
    store = open_store(root, **OPTIONS, chunk_block_size=BLOCK)
    info = cdist.save(store, part, step=int(step))
    background.run(store.close())
    return {"attempt": info.attempt}


def scenario_load(root: str, step: str) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    low, high = rows(1024, world, rank)
    w = full_w()
    counting = CountingStore(open_store(root, **OPTIONS))
    like_w = {
        "model": {
            "w": cdist.Shard(torch.empty(high - low, 1024), offsets=(low, 0), global_shape=w.shape)
        }
    }
    got_w = cdist.load(counting, int(step), target=like_w)["model"]["w"]
    w_read = counting.bytes["read"]
    like = {
        "model": {
            "grid": empty_dtensor(full_grid(), mesh, (Shard(1),)),
            "half": empty_dtensor(full_half(), mesh, (Shard(0),)),
        },
        "step": 0,
    }
    got = cdist.load(counting, target=like)  # the latest step, a collective
    background.run(counting.close())
    exact = {
        "w": isinstance(got_w, cdist.Shard)
        and got_w.offsets == (low, 0)
        and torch.equal(got_w.tensor, w[low:high]),
        "grid": isinstance(got["model"]["grid"], DTensor)
        and torch.equal(
            got["model"]["grid"].to_local(), as_dtensor(full_grid(), mesh, (Shard(1),)).to_local()
        ),
        "half": torch.equal(
            got["model"]["half"].to_local(), as_dtensor(full_half(), mesh, (Shard(0),)).to_local()
        ),
        "step": got["step"] == int(step),
    }
    return {
        "exact": exact,
        "w_read": w_read,
        "w_needed": (high - low) * 1024 * 4,
        "all_read": counting.bytes["read"],
        "all_needed": (high - low) * 4096
        + math.prod(like["model"]["grid"].to_local().shape) * 2
        + math.prod(like["model"]["half"].to_local().shape) * 4,
    }


SCENARIOS = {"save": scenario_save, "load": scenario_load}


if __name__ == "__main__":
    rank_main(SCENARIOS)
