"""broadcast: 8 ranks loading one replicated state from SeaweedFS, read once vs every rank.

The load of a data-parallel job: every rank loads the whole state (8 float32 tensors of
64 MiB, 512 MiB; ``--quick``: 8 of 1 MiB), which the suite saved once to a local SeaweedFS
(``weed mini``, started by this suite on loopback ports, plain HTTP, signed requests).
Eight gloo processes on 127.0.0.1 (started once; ``CKPTSTORE_BENCH_BROADCAST_RANKS`` changes
the count) run ``ckptstore.distributed.load`` in rounds, the two systems alternating:

* **read once, broadcast** (``broadcast=True``, the default): each tensor is read from the
  store by one rank, the reads spread over the ranks, straight into a shared-memory segment
  that the other ranks of the host (here: all) map copy-on-write;
* **read once, broadcast over gloo only** (``shared_memory=False``): the same reads, sent to
  the others over gloo, as ranks on other hosts get them;
* **every rank reads** (``broadcast=False``): each rank reads the whole state from the store.

A run starts after a barrier; its time is the slowest rank's (the job waits for it), its CPU
seconds the sum over ranks, and its bytes read the sum over ranks of what a counting store
wrapper saw requested from the store. Every rank compares what it loaded with the state,
untimed. One untimed load of each system comes first (connections to the server and
between the ranks). The server and all ranks share the machine's cores, so the gloo-only
system's transfer over loopback competes with the server for them; on hosts of their own
the ranks' network links are not the server's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchlib import Context, Result, Suite
from benchlib.s3 import ACCESS_KEY, SECRET_KEY
from ckptstore.testing.servers import SeaweedFS, free_ports

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent.parent
BUCKET = "bench-broadcast"
SYSTEMS = {
    "on": "ckptstore read once, broadcast",
    "gloo": "ckptstore read once, broadcast over gloo only",
    "off": "ckptstore, every rank reads",
}
#: ``ckptstore.distributed.load`` options of each system.
OPTIONS = {
    "on": {"broadcast": True},
    "gloo": {"broadcast": True, "shared_memory": False},
    "off": {"broadcast": False},
}
TENSORS = 8


def _state(quick: bool) -> dict[str, Any]:
    import torch

    numel = (1 << 18) if quick else (16 << 20)  # float32: 1 MiB or 64 MiB
    gen = torch.Generator().manual_seed(7)
    return {f"w{i}": torch.randn(numel, generator=gen) for i in range(TENSORS)}


# ------------------------------------------------------------------ one rank


def _rank_main() -> None:
    """One rank: ``repeat`` rounds of both systems, each round's figures to rank 0's output."""
    import resource
    import time
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import ckptstore.distributed
    from ckptstore import background
    from ckptstore.store.registry import open_store
    from ckptstore.store.wrappers import CountingStore

    config = json.loads(os.environ["CKPTSTORE_BENCH_BROADCAST"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    state = _state(config["quick"])
    like = {name: torch.empty_like(tensor) for name, tensor in state.items()}
    store = open_store(config["url"], **config["options"])
    for flag in SYSTEMS:  # untimed warm-up: connections to the server and between ranks
        ckptstore.distributed.load(store, 1, target=like, **OPTIONS[flag])
    rounds = []
    for _ in range(config["repeat"]):
        for flag in SYSTEMS:
            counting = CountingStore(store)
            dist.barrier()
            usage = resource.getrusage(resource.RUSAGE_SELF)
            c0, t0 = usage.ru_utime + usage.ru_stime, time.perf_counter()
            got = ckptstore.distributed.load(counting, 1, target=like, **OPTIONS[flag])
            t1 = time.perf_counter()
            usage = resource.getrusage(resource.RUSAGE_SELF)
            cpu = usage.ru_utime + usage.ru_stime - c0
            exact = all(torch.equal(got[name], state[name]) for name in state)
            figures: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(figures, (t1 - t0, cpu, counting.bytes["read"], exact))
            rounds.append({"system": flag, "ranks": figures})
            del got
    background.run(store.close())
    if dist.get_rank() == 0:
        print("ROUNDS " + json.dumps(rounds), flush=True)
    dist.destroy_process_group()


# ------------------------------------------------------------------ the suite


def run(ctx: Context) -> list[Result]:
    import statistics

    import ckptstore

    world = int(os.environ.get("CKPTSTORE_BENCH_BROADCAST_RANKS", "8"))
    state = _state(ctx.quick)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    with SeaweedFS(
        ctx.workdir / "seaweedfs-broadcast", access_key=ACCESS_KEY, secret_key=SECRET_KEY
    ) as server:
        server.create_bucket(BUCKET)
        options = {
            "endpoint_url": server.s3_endpoint,
            "access_key_id": ACCESS_KEY,
            "secret_access_key": SECRET_KEY,
        }
        url = f"s3://{BUCKET}/replicated"
        ckptstore.save(url, state, step=1, **options)
        del state
        config = {"url": url, "options": options, "repeat": ctx.repeat, "quick": ctx.quick}
        port = free_ports(1)[0]
        procs = [
            subprocess.Popen(
                [sys.executable, str(HERE)],
                env={
                    **os.environ,
                    "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE.parent.parent)]),
                    "CKPTSTORE_BENCH_BROADCAST": json.dumps(config),
                    "RANK": str(rank),
                    "WORLD_SIZE": str(world),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                    "GLOO_SOCKET_IFNAME": "lo",
                },
                stdout=subprocess.PIPE,
                text=True,
            )
            for rank in range(world)
        ]
        outputs = [proc.communicate(timeout=3600)[0] for proc in procs]
        for rank, proc in enumerate(procs):
            if proc.returncode != 0:
                raise RuntimeError(f"broadcast rank {rank} exited with {proc.returncode}")
    (line,) = [x for x in outputs[0].splitlines() if x.startswith("ROUNDS ")]
    rounds = json.loads(line.removeprefix("ROUNDS "))
    rows, medians = [], {}
    workload = f"{world} ranks x {nbytes >> 20} MiB replicated"
    for flag, system in SYSTEMS.items():
        mine = [r["ranks"] for r in rounds if r["system"] == flag]
        if not all(exact for ranks in mine for *_, exact in ranks):
            raise AssertionError(f"{system}: a rank loaded different bytes")
        runs = [max(seconds for seconds, *_ in ranks) for ranks in mine]
        read = statistics.median(sum(b for _, _, b, _ in ranks) for ranks in mine)
        medians[flag] = (statistics.median(runs), read)
        rows.append(
            Result(
                "broadcast",
                workload,
                "SeaweedFS http",
                system,
                "load",
                nbytes,
                statistics.median(runs),
                runs,
                statistics.median(sum(cpu for _, cpu, _, _ in ranks) for ranks in mine),
                notes=f"store bytes read {read / nbytes:.2f}x the state",
            )
        )
    (t_on, read_on), (t_gloo, _), (t_off, read_off) = (medians[f] for f in SYSTEMS)
    ctx.options["summary"] = (
        "Medians of this run:\n\n"
        f"- bytes read from the store: {read_on / nbytes:.2f}x the state with broadcast, "
        f"{read_off / nbytes:.2f}x with every rank reading (goal <= 1.05x)\n"
        f"- load time: {t_on:.2f} s with broadcast, {t_off:.2f} s with every rank reading: "
        f"{t_on / t_off:.2f}x (goal <= 0.5x); broadcast over gloo only (no shared memory) "
        f"{t_gloo:.2f} s, {t_gloo / t_off:.2f}x"
    )
    return rows


SUITE = Suite(
    name="broadcast",
    title="Multi-rank load of a replicated state: read once and broadcast vs every rank reads",
    run=run,
    description=__doc__.split("\n\n", 1)[1].strip(),
)


if __name__ == "__main__":
    _rank_main()
