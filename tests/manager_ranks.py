"""One rank of a multi-process ckptstore.distributed.CheckpointManager scenario; started N
times by tests/test_distributed_manager_ranks.py.

Usage: ``python tests/manager_ranks.py SCENARIO ROOT`` with RANK, WORLD_SIZE, MASTER_ADDR
and MASTER_PORT set, and store options as JSON in CKPTSTORE_TEST_STORE_OPTIONS. Each rank
prints ``RESULT <json>`` lines; the test reads the last one. Rank r's part of the state is
tests/native_ranks.py's (a 1 MiB shard of its own, small tensors of its own, a replicated
bf16 weight and the step), and its store is a :class:`~tests.gated_store.Gate` over the
shared root, so the scenario holds, fails or freezes this rank's background writes.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

import ckptstore.distributed
from tests.gated_store import HELD_FOR, Gate
from tests.multirank import outcome_of, rank_main
from tests.native_ranks import SHARD, opened, part, replicated, shard

FAILING_RANK = 1
#: seconds the manager's gloo group waits in a collective before failing (as the world's)
GROUP_TIMEOUT = 60.0


def exact(got: dict[str, Any], rank: int, seed: int) -> bool:
    """Whether ``got`` (read through :func:`like`) is rank ``rank``'s part at ``seed``,
    bit for bit."""
    return (
        got["step"] == seed
        and torch.equal(got["model"][f"shard{rank}"], shard(rank, seed))
        and torch.equal(got["model"]["replicated"], replicated(seed))
    )


def like(rank: int) -> dict[str, Any]:
    return {
        "model": {
            f"shard{rank}": torch.empty(SHARD),
            "replicated": torch.empty(4096, dtype=torch.bfloat16),
        },
        "step": 0,
    }


def scenario_manager(root: str) -> dict[str, Any]:
    """Step 1 with every rank's writes held until the rank has returned from ``save``, run
    a training all-reduce and changed its state; steps 2-4 under ``max_to_keep=2``; step 5
    and 6 with the failing rank's writes failing (reported at the wait, then at the next
    save, step 7, which saves nothing); step 8."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gate = Gate(opened(root))
    out: dict[str, Any] = {}
    with ckptstore.distributed.CheckpointManager(gate, max_to_keep=2, timeout=GROUP_TIMEOUT) as mgr:
        gate.hold()
        state = part(rank, 1)
        assert mgr.save(1, state) is True
        assert mgr.last_handle is not None
        # Returned, yet this rank's writes wait on the gate: nothing of step 1 is durable.
        out["in flight at return"] = not mgr.last_handle.done() and mgr.all_steps() == []
        # The training's collectives go on while the save's run on their own group (the
        # coordinator's background waits on its gate, the others' in the first collective).
        total = torch.tensor([float(rank)])
        dist.all_reduce(total)
        out["all_reduce"] = total.item() == world * (world - 1) / 2
        # Each rank's background reaches a write of its own only once the ranks before it
        # in the protocol let theirs through, so a rank waits for its own gate only.
        assert gate.held.wait(HELD_FOR), "the background never reached a write"
        for tensor in (*state["model"].values(), *state["small"].values()):
            tensor.fill_(-7.0)  # after the call returned: must not reach the checkpoint
        gate.release()
        mgr.wait_until_finished()
        out["exact"] = exact(mgr.restore(target=like(rank)), rank, 1)

        for step in (2, 3, 4):
            mgr.save(step, part(rank, step))
        mgr.wait_until_finished()
        out["kept"] = mgr.all_steps()

        if rank == FAILING_RANK:
            gate.mode = "fail"
        mgr.save(5, part(rank, 5))
        out["wait"] = outcome_of(mgr.wait_until_finished)
        mgr.save(6, part(rank, 6))
        out["next save"] = outcome_of(lambda: mgr.save(7, part(rank, 7)))
        gate.mode = "pass"
        mgr.save(8, part(rank, 8))
        mgr.wait_until_finished()
        out["steps"] = mgr.all_steps()
        out["exact 8"] = exact(mgr.restore(target=like(rank)), rank, 8)
    return out


def scenario_sigkill(root: str) -> dict[str, Any]:
    """Step 1; then step 2, during whose background write the test SIGKILLs the failing
    rank; the survivors' ``wait_until_finished`` reports it."""
    gate = Gate(opened(root, pack_size=64 << 10))
    mgr = ckptstore.distributed.CheckpointManager(gate, max_to_keep=2, timeout=GROUP_TIMEOUT)
    return killed_in_step_2(gate, mgr, part)


def killed_in_step_2(
    gate: Gate, mgr: ckptstore.distributed.CheckpointManager, make: Any
) -> dict[str, Any]:
    """Save ``make(rank, 1)``, then ``make(rank, 2)`` with the failing rank's writes
    killing it; what the survivors' wait and close say."""
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    mgr.save(1, make(rank, 1))
    mgr.wait_until_finished()
    if rank == FAILING_RANK:
        gate.mode = "kill"
    out["returned"] = mgr.save(2, make(rank, 2))
    print("RESULT " + json.dumps(out), flush=True)
    out["killed"] = outcome_of(mgr.wait_until_finished)
    out["close"] = outcome_of(mgr.close)
    return out


#: the manager's collective deadline in the stalled-rank scenario, seconds
STALL_TIMEOUT = 5.0


def scenario_stall(root: str) -> dict[str, Any]:
    """Step 1; then the failing rank stalls (alive, silent: it never calls ``save(2)``) while
    the others save step 2: their collectives fail at the manager's ``timeout``, and they say
    how long after the ``save`` call that was."""
    import os
    import time

    rank = dist.get_rank()
    mgr = ckptstore.distributed.CheckpointManager(opened(root), timeout=STALL_TIMEOUT)
    mgr.save(1, part(rank, 1))
    mgr.wait_until_finished()
    if rank == FAILING_RANK:
        print("RESULT " + json.dumps({"stalled": True}), flush=True)
        time.sleep(2 * STALL_TIMEOUT)  # silent past every survivor's deadline
        os._exit(0)  # never takes part again: no close(), no goodbye
    began = time.monotonic()
    mgr.save(2, part(rank, 2))
    out = {"error": outcome_of(mgr.wait_until_finished)}
    out["seconds"] = time.monotonic() - began  # type: ignore[assignment]
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)  # the group is broken: skip close()'s and destroy_process_group's collectives


def frozen_part(rank: int, seed: int) -> dict[str, Any]:
    """A fine-tuning state: a 1 MiB frozen shard per rank and a frozen replicated weight
    (the same at every step), small tensors and the step that change."""
    return {
        "model": {
            f"frozen{rank}": torch.arange(SHARD, dtype=torch.float32) + rank,
            "replicated": torch.arange(4096, dtype=torch.bfloat16),
        },
        "small": {f"r{rank}-{i}": torch.full((16,), float(seed * 1000 + i)) for i in range(30)},
        "step": seed,
    }


def frozen_exact(got: dict[str, Any], rank: int, seed: int) -> bool:
    """Whether ``got`` holds rank ``rank``'s :func:`frozen_part` at ``seed``, bit for bit."""
    want = frozen_part(rank, seed)
    return (
        got["step"] == seed
        and all(torch.equal(got["model"][k], v) for k, v in want["model"].items())
        and all(torch.equal(got["small"][k], v) for k, v in want["small"].items())
    )


def scenario_incremental(root: str) -> dict[str, Any]:
    """Steps 1-2 of a fine-tuning state with ``max_to_keep=1``: step 2 writes only what
    changed on every rank and references step 1's objects for the rest, and loads bit-exact
    after step 1 is retired; step 3 with ``full=True`` writes everything again."""
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    with ckptstore.distributed.CheckpointManager(
        opened(root), max_to_keep=1, timeout=GROUP_TIMEOUT
    ) as mgr:
        for step in (1, 2):
            mgr.save(step, frozen_part(rank, step))
            mgr.wait_until_finished()
        out["steps after 2"] = mgr.all_steps()
        out["exact 2"] = frozen_exact(mgr.restore(2), rank, 2)
        mgr.save(3, frozen_part(rank, 3), full=True)
        mgr.wait_until_finished()
        out["exact 3"] = frozen_exact(mgr.restore(3), rank, 3)
    return out


def scenario_incremental_sigkill(root: str) -> dict[str, Any]:
    """Step 1 of a fine-tuning state; then step 2, incremental and a lazy snapshot, during
    whose background write the test SIGKILLs the failing rank; the survivors'
    ``wait_until_finished`` reports it."""
    gate = Gate(opened(root))
    mgr = ckptstore.distributed.CheckpointManager(gate, timeout=GROUP_TIMEOUT, snapshot="lazy")
    return killed_in_step_2(gate, mgr, frozen_part)


def scenario_lazy(root: str) -> dict[str, Any]:
    """Three steps of a training loop with lazy snapshots: each ``save`` returns before the
    copy, the optimizer step right after it is fenced, the training's all-reduce runs, and
    every committed step holds the weights of its ``save`` call."""
    rank = dist.get_rank()
    weight = torch.nn.Parameter(torch.arange(SHARD, dtype=torch.float32) + rank)
    opt = torch.optim.SGD([weight], lr=1.0)
    with ckptstore.distributed.CheckpointManager(
        opened(root), snapshot="lazy", timeout=GROUP_TIMEOUT
    ) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"model": {f"w{rank}": weight}, "step": step})
            weight.grad = torch.ones_like(weight)
            opt.step()  # the pre-hook fences the lazy copy first
            dist.all_reduce(torch.ones(1))
        mgr.wait_until_finished()
        return {
            str(step): torch.equal(
                mgr.restore(step)["model"][f"w{rank}"],
                torch.arange(SHARD, dtype=torch.float32) + rank - (step - 1),
            )
            for step in (1, 2, 3)
        }


def scenario_incremental_again(root: str) -> dict[str, Any]:
    """After the SIGKILL: a new world saves step 2 again, incrementally over step 1, and
    loads it bit-exact."""
    rank = dist.get_rank()
    with ckptstore.distributed.CheckpointManager(opened(root), timeout=GROUP_TIMEOUT) as mgr:
        mgr.save(2, frozen_part(rank, 2))
        mgr.wait_until_finished()
        return {"exact 2": frozen_exact(mgr.restore(2), rank, 2)}


#: the step at whose start the preempted rank gets SIGTERM, and the save interval
PREEMPT_AT, INTERVAL = 13, 5


def scenario_preempt(root: str, how: str) -> dict[str, Any]:
    """A training loop that saves every INTERVAL steps under ``preemption=True`` (``how``:
    ``signal``) or ``save_before`` (``deadline``); at step PREEMPT_AT the failing rank alone
    gets SIGTERM (from itself, as from a scheduler) or passes its time limit. Every rank
    must save that step, wait for it to be durable and leave by ``Preempted``; each prints
    what it knew before that, and the exit status says the rest."""
    import logging
    import os
    import signal
    import time

    logging.basicConfig(level=logging.WARNING)  # Preempted's record says what was saved
    rank = dist.get_rank()
    options: dict[str, Any] = {"preemption": True}
    if how == "deadline":
        options = {"save_before": time.time() + 3600}
    mgr = ckptstore.distributed.CheckpointManager(
        opened(root), save_interval_steps=INTERVAL, timeout=GROUP_TIMEOUT, **options
    )
    print("RESULT " + json.dumps({"started": True}), flush=True)
    for step in range(100):
        if step == PREEMPT_AT and rank == FAILING_RANK:
            if how == "signal":
                os.kill(os.getpid(), signal.SIGTERM)
            else:
                assert mgr._watch is not None
                mgr._watch.save_before = time.time() + 0.5  # within the margin: stop now
        print("RESULT " + json.dumps({"step": step}), flush=True)
        mgr.save(step, part(rank, step))
        time.sleep(0.01)
    return {"finished": "never preempted"}


def scenario_left_open(root: str) -> dict[str, Any]:
    """A manager the script never closes: what the end of the main thread does for it
    (ckptstore's exit hook, called here as the interpreter would) commits step 1 and
    destroys the gloo groups the manager made, so none is left for the interpreter's
    teardown, where gloo's threads can abort the process."""
    from ckptstore import background

    rank = dist.get_rank()
    mgr = ckptstore.distributed.CheckpointManager(
        opened(root), timeout=GROUP_TIMEOUT, preemption=True
    )
    groups = [mgr._own_group, mgr._flags_group]
    mgr.save(1, part(rank, 1))
    background._close_all_at_exit()  # what threading's exit hooks run
    known = dist.distributed_c10d._world.pg_map
    return {
        "groups": len(groups),
        "left": sum(group in known for group in groups),
        "steps": ckptstore.list_steps(root),
    }


def frozen_like(rank: int) -> dict[str, Any]:
    """A target for rank ``rank``'s :func:`frozen_part`: the leaves it saved, no others."""
    return {
        "model": {
            f"frozen{rank}": torch.empty(SHARD),
            "replicated": torch.empty(4096, dtype=torch.bfloat16),
        },
        "small": {f"r{rank}-{i}": torch.empty(16) for i in range(30)},
        "step": 0,
    }


def tiered(root: Any, local: str, **options: Any) -> ckptstore.distributed.CheckpointManager:
    return ckptstore.distributed.CheckpointManager(
        root, local=local, timeout=GROUP_TIMEOUT, **options
    )


def scenario_tiers(root: str, local: str) -> dict[str, Any]:
    """Issue 28 item 6: steps 1-4 of a fine-tuning state on a local tier per rank under
    ``local``, every 2nd copied to the persistent tier ``root`` (incrementally: the copy of 4
    references the frozen leaves of 2); what each tier holds, and where restores read."""
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    with tiered(opened(root), local, persistent_every=2, local_max_to_keep=2) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(step, frozen_part(rank, step))
            dist.all_reduce(torch.ones(1))  # the training's collectives go on meanwhile
        mgr.wait_until_finished()
        listing = mgr.tiers()
        out["local"], out["persistent"] = listing.local, listing.persistent
        for step in (4, 3, 2):
            got = mgr.restore(step, target=frozen_like(rank))
            assert mgr.last_restore is not None
            out[f"exact {step}"] = frozen_exact(got, rank, step)
            out[f"tier {step}"] = mgr.last_restore.tier
    return out


def scenario_tiers_sigkill(root: str, local: str) -> dict[str, Any]:
    """Step 1 saved and copied; step 2 committed on every rank's local tier, during whose
    copy to the persistent tier the test SIGKILLs the failing rank."""
    gate = Gate(opened(root))
    return killed_in_step_2(gate, tiered(gate, local), frozen_part)


def scenario_tiers_again(root: str, local: str) -> dict[str, Any]:
    """After the SIGKILL, a new world on the same local directory: its start copies step 2,
    which every rank's local tier holds, and the restore reads it from there."""
    rank = dist.get_rank()
    with tiered(opened(root), local) as mgr:
        got = mgr.restore(target=frozen_like(rank))
        assert mgr.last_restore is not None
        out = {"exact 2": frozen_exact(got, rank, 2), "tier": mgr.last_restore.tier}
        mgr.wait_until_finished()
        out["persistent"] = mgr.tiers().persistent
        return out


SCENARIOS = {
    "tiers": scenario_tiers,
    "tiers_sigkill": scenario_tiers_sigkill,
    "tiers_again": scenario_tiers_again,
    "left_open": scenario_left_open,
    "manager": scenario_manager,
    "sigkill": scenario_sigkill,
    "stall": scenario_stall,
    "preempt": scenario_preempt,
    "incremental": scenario_incremental,
    "incremental_sigkill": scenario_incremental_sigkill,
    "incremental_again": scenario_incremental_again,
    "lazy": scenario_lazy,
}


if __name__ == "__main__":
    rank_main(SCENARIOS)
