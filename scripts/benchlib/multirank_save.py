"""multirank-async: how long an async multi-rank save blocks each rank, against its memcpy.

``world`` gloo processes on this machine (4; 2 with ``--quick``) each hold a part of the
transformer-like state with its Adam moments of :mod:`benchlib.workloads` (torch CPU tensors,
dealt out largest first, round robin, so the parts are about equal) and save it through
``ckptstore.distributed.CheckpointManager`` (``max_to_keep=2``): to local disk (fsync before
commit) and to a SeaweedFS this suite starts (``weed mini``, S3 over ``http://``, anonymous,
on loopback ports, sharing the 2 cores with the ranks).

Each rank, after one untimed warm-up save (the staging pool, the store's connections, the
manager's gloo group), alternates ``repeat`` times:

* **memcpy**: one single-threaded ``Tensor.copy_`` of every tensor of its part into buffers
  allocated and touched before timing, the floor of any copy on one core;
* **blocking call**: the time inside ``mgr.save(step, part)``: the copy into the pooled
  staging arena and the hand-off to the manager's thread. The previous save is waited for,
  untimed, before the call, as a loop whose saves are further apart than their writes never
  waits for one;
* **commit**: from the call until ``wait_until_finished()`` returns: the background
  collectives, the writes of every rank and the coordinator's commit and retention.

CPU seconds are the calling thread's (the training's), none for the commit.

Every process runs with ``torch.set_num_threads(1)``. Figures are per rank medians; a row is
the rank whose blocking call was the slowest. Goal (issue 22): blocking call <= 1.25x memcpy.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from benchlib import Context, Result, Suite, torch_tensors, workloads

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent.parent
#: JSON store options a rank opens its URL with.
OPTIONS_ENV = "CKPTSTORE_BENCH_STORE_OPTIONS"
BUCKET = "bench-multirank"
#: seconds a rank has for its saves before the suite gives up on it
RANK_TIMEOUT = 1800


# ------------------------------------------------------------------ one rank (a child)


def _part(world: int, rank: int, quick: bool) -> dict[str, Any]:
    """Rank ``rank``'s part: every ``world``-th tensor of the workload, largest first."""
    tensors = torch_tensors(workloads.as_torch(workloads.transformer(quick)))
    order = sorted(range(len(tensors)), key=lambda i: (-tensors[i].nbytes, i))
    return {f"t{i:04d}": tensors[i] for n, i in enumerate(order) if n % world == rank}


def _rank(url: str, saves: int, quick: bool) -> dict[str, Any]:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import ckptstore.distributed

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=RANK_TIMEOUT))
    try:
        part = _part(dist.get_world_size(), dist.get_rank(), quick)
        reused = {key: torch.empty_like(t) for key, t in part.items()}
        for buffer in reused.values():
            buffer.zero_()  # touched: no page faults in the timed copies
        options = json.loads(os.environ.get(OPTIONS_ENV, "{}"))
        runs: dict[str, list[float]] = {"memcpy": [], "blocking call": [], "commit": []}
        # CPU time of the calling thread (the training's); the commit's is other threads'
        cpu: dict[str, list[float]] = {"memcpy": [], "blocking call": [], "commit": [0.0]}
        with ckptstore.distributed.CheckpointManager(
            url, max_to_keep=2, timeout=RANK_TIMEOUT, **options
        ) as mgr:
            mgr.save(0, part)
            mgr.wait_until_finished()
            for step in range(1, saves + 1):
                c0, t0 = time.thread_time(), time.perf_counter()
                for key, tensor in part.items():
                    reused[key].copy_(tensor)
                runs["memcpy"].append(time.perf_counter() - t0)
                cpu["memcpy"].append(time.thread_time() - c0)
                c0, t0 = time.thread_time(), time.perf_counter()
                mgr.save(step, part)
                runs["blocking call"].append(time.perf_counter() - t0)
                cpu["blocking call"].append(time.thread_time() - c0)
                mgr.wait_until_finished()
                runs["commit"].append(time.perf_counter() - t0)
        nbytes = sum(t.numel() * t.element_size() for t in part.values())
        return {"rank": dist.get_rank(), "nbytes": nbytes, "runs": runs, "cpu": cpu}
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ the suite (the parent)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run_ranks(
    world: int, url: str, options: dict[str, Any], saves: int, quick: bool, logs: Path
) -> list[dict[str, Any]]:
    """Run the ranks of one target; each rank's result, by rank."""
    port = _free_port()
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": "lo",
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE.parent.parent)]),
            OPTIONS_ENV: json.dumps(options),
        }
        log = open(logs / f"rank{rank}.log", "w+")  # noqa: SIM115
        args = [sys.executable, str(HERE), url, str(saves), "quick" if quick else "full"]
        procs.append((subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    results = []
    try:
        for rank, (proc, log) in enumerate(procs):
            proc.wait(timeout=RANK_TIMEOUT)
            log.seek(0)
            text = log.read()
            lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
            if proc.returncode or not lines:
                raise RuntimeError(f"rank {rank} of {url} failed:\n{text[-4000:]}")
            results.append(json.loads(lines[-1].removeprefix("RESULT ")))
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    return results


def run(ctx: Context) -> list[Result]:
    from ckptstore.testing.servers import SeaweedFS

    world = 2 if ctx.quick else 4
    saves = max(ctx.repeat, 3)
    workload = f"transformer + Adam over {world} ranks"
    rows: list[Result] = []
    lines: list[str] = []

    def measure(target: str, url: str, options: dict[str, Any]) -> None:
        ranks = _run_ranks(world, url, options, saves, ctx.quick, ctx.workdir / "logs" / target)
        median = {
            r["rank"]: {name: statistics.median(runs) for name, runs in r["runs"].items()}
            for r in ranks
        }
        worst = max(ranks, key=lambda r: median[r["rank"]]["blocking call"])
        for name, system, op in (
            ("memcpy", "memcpy (reused)", "copy"),
            ("blocking call", "ckptstore.distributed.CheckpointManager", "save call"),
            ("commit", "ckptstore.distributed.CheckpointManager", "until committed"),
        ):
            runs = worst["runs"][name]
            rows.append(
                Result(
                    "multirank-async",
                    workload,
                    target,
                    system,
                    op,
                    worst["nbytes"],
                    statistics.median(runs),
                    runs,
                    statistics.median(worst["cpu"][name]),
                    notes=f"rank {worst['rank']} of {world}, the slowest save call",
                )
            )
        ratios = ", ".join(
            f"rank {rank} {m['blocking call'] / m['memcpy']:.2f}x" for rank, m in median.items()
        )
        lines.append(f"- {target}: blocking call / memcpy per rank: {ratios} (goal <= 1.25x)")

    measure("local disk", str(ctx.workdir / "local"), {})
    with SeaweedFS(ctx.workdir / "seaweedfs") as server:
        server.create_bucket(BUCKET)
        url = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"
        measure("SeaweedFS http", url, {"endpoint_url": server.s3_endpoint, "anonymous": True})
    ctx.options["summary"] = "\n".join(lines)
    return rows


SUITE = Suite(
    name="multirank-async",
    title="Async multi-rank saves: the blocking call against memcpy, per rank",
    run=run,
    description=(__doc__ or "").split("\n\n", 1)[1].strip(),
)


if __name__ == "__main__":  # one rank, started by _run_ranks
    url, saves, size = sys.argv[1:]
    print("RESULT " + json.dumps(_rank(url, int(saves), size == "quick")), flush=True)
