"""One process of a JAX multi-process scenario; started N times by tests/test_jax_ranks.py.

Usage: ``python tests/jax_ranks.py SCENARIO ROOT STEP`` with RANK, WORLD_SIZE and MASTER_PORT
set (tests/multirank.py's ``run_ranks``), ``XLA_FLAGS=--xla_force_host_platform_device_count=K``
with ``K * WORLD_SIZE == 8``, and store options as JSON in CKPTSTORE_TEST_STORE_OPTIONS. The
process joins ``jax.distributed`` (its coordination service on 127.0.0.1:MASTER_PORT) and
prints ``RESULT <json>``.

The global state, on the 8 devices of the job whatever the number of processes:

* ``x``: 512 x 384 float32 over a 4 x 2 mesh ``("a", "b")``, split along both dimensions
  (8 boxes);
* ``y``: 256 x 64 bfloat16 split by rows along ``b`` and replicated along ``a``: 2 boxes,
  each on 4 devices of different processes (written once each);
* ``r``: 64 x 32 float32 replicated on every device (one whole leaf, written once);
* ``step``: a plain value.

The load asks for ``x``, ``y`` and ``r`` on a 2 x 4 mesh ``("p", "q")`` (``x`` transposed,
``y`` by columns, ``r`` by rows), and all replicated.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable
from typing import Any

import jax
import ml_dtypes
import numpy as np
from jax._src.distributed import global_state
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ckptstore
import ckptstore.distributed as cd
from ckptstore import background
from ckptstore.manager.jax_collectives import JaxCollectives
from ckptstore.store.base import Store
from ckptstore.store.registry import open_store
from ckptstore.store.wrappers import CountingStore
from tests.gated_store import HELD_FOR, Gate

OPTIONS: dict[str, Any] = json.loads(os.environ.get("CKPTSTORE_TEST_STORE_OPTIONS", "{}"))
BLOCK = 4096  # chunk_block_size: small, so a box spans many blocks
#: seconds the survivors of a killed process wait for it (JaxCollectives timeout)
KILL_TIMEOUT = 10.0


def full() -> dict[str, np.ndarray[Any, Any]]:
    """The global arrays, the same on every process and in the test."""
    rng = np.random.default_rng(4)
    return {
        "x": rng.standard_normal((512, 384), dtype=np.float32),
        "y": (np.arange(256 * 64, dtype=np.float32).reshape(256, 64) / 3).astype(
            ml_dtypes.bfloat16
        ),
        "r": rng.standard_normal((64, 32), dtype=np.float32),
    }


def meshes() -> tuple[Mesh, Mesh, Mesh]:
    devices = np.array(jax.devices())
    assert devices.size == 8, devices
    return (
        Mesh(devices.reshape(4, 2), ("a", "b")),
        Mesh(devices.reshape(2, 4), ("p", "q")),
        Mesh(devices, ("n",)),
    )


def state(seed: int = 0) -> dict[str, Any]:
    saved, _, _ = meshes()
    arrays = full()
    specs = {"x": P("a", "b"), "y": P("b", None), "r": P()}
    out: dict[str, Any] = {
        key: jax.make_array_from_callback(
            arrays[key].shape,
            NamedSharding(saved, spec),
            lambda index, key=key: arrays[key][index] + seed,
        )
        for key, spec in specs.items()
    }
    out["step"] = seed
    return out


def opened(root: str) -> Store:
    return open_store(root, **OPTIONS, chunk_block_size=BLOCK)


def scenario_save(root: str, step: str) -> dict[str, Any]:
    """Save on every process, with the collectives ckptstore picks for a JAX job."""
    counting = CountingStore(opened(root))
    mine = state()
    assert not mine["x"].is_fully_addressable  # the point: arrays spanning processes
    info = cd.save(counting, mine, step=int(step))
    background.run(counting.close())
    try:  # a single-process save cannot hold what other processes hold
        ckptstore.save(f"{root}-whole", {"x": mine["x"]}, step=1, **OPTIONS)
        refused = "succeeded"
    except TypeError as exc:
        refused = str(exc)
    # once every process is past the save, no key of its collectives is left in the
    # coordination service
    client = global_state.client
    client.wait_at_barrier("jax_ranks-saved", 60_000)
    return {
        "attempt": info.attempt,
        "written": counting.bytes["put"],
        "refused": refused,
        "left": len(client.key_value_dir_get_bytes("ckptstore/")),
    }


def _needed(array: jax.Array) -> int:
    """The bytes of the distinct boxes this process's devices hold of ``array``."""
    boxes = {
        tuple(part.indices(n)[:2] for part, n in zip(shard.index, array.shape, strict=True))
        for shard in array.addressable_shards
    }
    size = array.dtype.itemsize
    return sum(size * math.prod(stop - start for start, stop in box) for box in boxes)


def scenario_load(root: str, step: str) -> dict[str, Any]:
    """Load onto a 2 x 4 mesh and replicated, checking every addressable shard."""
    _, loaded, line = meshes()
    arrays = full()
    targets = {
        "2x4": {"x": P("q", "p"), "y": P(None, "q"), "r": P("p")},
        "replicated": {"x": P(), "y": P(), "r": P()},
    }
    result: dict[str, Any] = {}
    for name, specs in targets.items():
        mesh = loaded if name == "2x4" else line
        like = {
            key: jax.ShapeDtypeStruct(
                arrays[key].shape, arrays[key].dtype, sharding=NamedSharding(mesh, spec)
            )
            for key, spec in specs.items()
        }
        counting = CountingStore(opened(root))
        got = cd.load(counting, int(step), target=like)
        background.run(counting.close())
        result[name] = {
            "exact": all(
                np.asarray(shard.data).tobytes() == arrays[key][shard.index].tobytes()
                for key in like
                for shard in got[key].addressable_shards
            ),
            "sharding": all(got[key].sharding == like[key].sharding for key in like),
            "global": all(
                not got[key].is_fully_addressable and got[key].shape == arrays[key].shape
                for key in like
            ),
            "read": counting.bytes["read"],
            "needed": sum(_needed(got[key]) for key in like),
        }
    return result


def scenario_broadcast(root: str, step: str) -> dict[str, Any]:
    """A load of the replicated leaf of the latest step (which process 0 finds and
    broadcasts) on every process, asking for the read-once broadcast through the
    coordination service (exchange)."""
    arrays = full()
    counting = CountingStore(opened(root))
    # not through shared memory, which processes of one host would use
    got = cd.load(counting, keys=["r"], broadcast=True, shared_memory=False)
    background.run(counting.close())
    return {
        "exact": np.asarray(got["r"]).tobytes() == arrays["r"].tobytes(),
        "read": counting.bytes["read"],
    }


def scenario_sigkill(root: str, step: str) -> dict[str, Any]:
    """Save ``step``; then ``step + 1``, during which the test SIGKILLs process 1 in its
    first write."""
    comm = JaxCollectives("sigkill", timeout=KILL_TIMEOUT)
    store = opened(root)
    cd.save(store, state(), step=int(step), comm=comm)
    gate = Gate(store)
    if comm.rank == 1:
        gate.mode = "kill"
    try:
        cd.save(gate, state(1), step=int(step) + 1, comm=comm)
        outcome = "succeeded"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    return {"killed": outcome}


def own_part(rank: int, seed: int) -> dict[str, Any]:
    """Process ``rank``'s part of the manager scenario's state at ``seed``: a JAX array on
    one of its own devices, a numpy array (which can change in place) and the step."""
    return {
        f"jax{rank}": jax.device_put(
            np.full(4096, rank + 10 * seed, np.float32), jax.local_devices()[0]
        ),
        f"host{rank}": np.arange(1024, dtype=np.float32) * (rank + 1) + seed,
        "step": seed,
    }


def scenario_manager(root: str, step: str) -> dict[str, Any]:
    """The multi-rank ``CheckpointManager`` on ``JaxCollectives`` of its own: ``step`` saved
    with this process's writes held until its save has returned and its numpy leaf has
    changed in place; then two more saves under ``max_to_keep=2``."""
    comm = JaxCollectives("manager")
    rank, first = comm.rank, int(step)
    gate = Gate(opened(root))
    out: dict[str, Any] = {}
    with cd.CheckpointManager(gate, max_to_keep=2, comm=comm) as mgr:
        gate.hold()
        part = own_part(rank, first)
        assert mgr.save(first, part) is True
        assert mgr.last_handle is not None
        out["in flight at return"] = not mgr.last_handle.done() and mgr.all_steps() == []
        assert gate.held.wait(HELD_FOR), "the background never reached a write"
        part[f"host{rank}"] += 100  # after the call returned: must not reach the checkpoint
        gate.release()
        mgr.wait_until_finished()
        got = background.run(ckptstore.aload(gate, first, target="numpy"))
        out["exact"] = all(
            np.asarray(got[key]).tobytes() == np.asarray(value).tobytes()
            for other in range(comm.world)
            for key, value in own_part(other, first).items()
            if key != "step"
        )
        for later in (first + 1, first + 2):
            mgr.save(later, own_part(rank, later))
        mgr.wait_until_finished()
        out["steps"] = mgr.all_steps()
    return out


#: seconds the others wait for a stalled process (JaxCollectives timeout)
STALL_TIMEOUT = 5.0


def scenario_stall(root: str, step: str) -> dict[str, Any]:
    """Save ``step``; then process 1 stalls (alive and silent: it never calls the next
    save) while the others save ``step + 1``: they fail within the collectives' timeout,
    and say how long after the call that was."""
    import time

    comm = JaxCollectives("stall", timeout=STALL_TIMEOUT)
    store = opened(root)
    cd.save(store, state(), step=int(step), comm=comm)
    if comm.rank == 1:
        print("RESULT " + json.dumps({"stalled": True}), flush=True)
        time.sleep(3 * STALL_TIMEOUT)  # silent past every other process's deadline
        os._exit(0)  # never takes part again, nor in jax.distributed's shutdown barrier
    began = time.monotonic()
    try:
        cd.save(store, state(1), step=int(step) + 1, comm=comm)
        outcome = "succeeded"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    result = {"error": outcome, "seconds": time.monotonic() - began}
    print("RESULT " + json.dumps(result), flush=True)
    # process 0 hosts the coordination service, whose end aborts every other process:
    # outlive the stalled one
    time.sleep(max(0.0, 3 * STALL_TIMEOUT + 2 - (time.monotonic() - began)))
    os._exit(0)


SCENARIOS: dict[str, Callable[..., dict[str, Any]]] = {
    "stall": scenario_stall,
    "manager": scenario_manager,
    "save": scenario_save,
    "load": scenario_load,
    "broadcast": scenario_broadcast,
    "sigkill": scenario_sigkill,
}


def main() -> None:
    scenario, *args = sys.argv[1:]
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{os.environ['MASTER_PORT']}",
        num_processes=int(os.environ["WORLD_SIZE"]),
        process_id=int(os.environ["RANK"]),
        initialization_timeout=120,
        # longer than any scenario, so the service never declares a process dead and
        # aborts the others itself: the collectives' own timeout is what is tested
        heartbeat_timeout_seconds=300,
        shutdown_timeout_seconds=10,
    )
    result = SCENARIOS[scenario](*args)
    print("RESULT " + json.dumps(result), flush=True)
    if scenario in ("sigkill", "stall"):
        # jax.distributed's shutdown waits for every process at a barrier, the killed or
        # stalled one too: leave without it
        sys.stdout.flush()
        os._exit(0)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
