"""Save and load timings of this tree against an earlier commit, side by side in one run.

A refactor of the save or restore path must not cost speed, and the machine this project runs
on is shared and noisy: two benchmark runs an hour apart differ by more than most regressions.
So this script measures both trees in one run, alternating: every repetition runs each
measurement once per tree, in fresh child processes, in an order that flips each round, so a
burst of load from elsewhere lands on both sides alike. It reports the median of each side and
their ratio, for wall time and for the process's CPU time (all its threads): on a machine
busy with other work the wall time of one save varies several-fold, while the CPU time the
library spends on it barely moves.

Each child first runs its operation once untimed (imports, buffer pools and first-touch page
faults belong to a process's first save, not to every save), then once timed.

The other commit is checked out into a temporary git worktree (removed afterwards); the
workloads come from this tree's ``scripts/benchlib/workloads.py`` for both sides, so both save
the same bytes. Measured per workload (big, small, transformer):

* ``save``: ``ckptstore.save`` to a fresh local directory (durable: the library fsyncs before
  committing);
* ``load``: ``ckptstore.load`` of that step, cold (every file fsynced and dropped from the page
  cache first);
* ``save-mem``/``load-mem``: the same on ``memory://``, where the library's own CPU work shows;
* ``dcp-save``/``dcp-load``: ``torch.distributed.checkpoint`` through ckptstore's DCP writer
  and reader, on the transformer workload only (``--no-dcp`` skips them).

Usage: ``python scripts/compare_commits.py 5150fdb -r 5``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# One measurement, run in a child whose sys.path puts the tree under test first. Prints one
# JSON line: seconds per operation.
CHILD = r"""
import json, os, sys, tempfile, time
from pathlib import Path
workload, face = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.environ["BENCHLIB"])
from benchlib import evict
from benchlib import workloads
import ckptstore

state = getattr(workloads, workload)(os.environ["QUICK"] == "1")
out = {}
with tempfile.TemporaryDirectory(dir=os.environ["WORKDIR"]) as scratch:
    if face == "dcp":
        import torch.distributed.checkpoint as dcp
        import ckptstore.dcp
        tstate = workloads.as_torch(state)
        url = str(Path(scratch) / "ckpt" / "1")
        dcp.save(tstate, storage_writer=ckptstore.dcp.Writer(url[:-1] + "0"), no_dist=True)
        t, c = time.perf_counter(), time.process_time()
        dcp.save(tstate, storage_writer=ckptstore.dcp.Writer(url), no_dist=True)
        out["dcp-save"] = time.perf_counter() - t
        out["dcp-save cpu"] = time.process_time() - c
        evict(p for p in Path(scratch).rglob("*") if p.is_file())
        t, c = time.perf_counter(), time.process_time()
        dcp.load(tstate, storage_reader=ckptstore.dcp.Reader(url), no_dist=True)
        out["dcp-load"] = time.perf_counter() - t
        out["dcp-load cpu"] = time.process_time() - c
    else:
        mem = face == "mem"
        url = "memory://compare" if mem else str(Path(scratch) / "ckpt")
        suffix = "-mem" if mem else ""
        ckptstore.save(url, state, step=0)  # warm: pools, imports, first page faults
        ckptstore.load(url, step=0)
        t, c = time.perf_counter(), time.process_time()
        ckptstore.save(url, state, step=1)
        out["save" + suffix] = time.perf_counter() - t
        out["save" + suffix + " cpu"] = time.process_time() - c
        if not mem:
            evict(p for p in Path(scratch).rglob("*") if p.is_file())
        t, c = time.perf_counter(), time.process_time()
        ckptstore.load(url, step=1)
        out["load" + suffix] = time.perf_counter() - t
        out["load" + suffix + " cpu"] = time.process_time() - c
print(json.dumps(out))
"""


def measure(tree: Path, workload: str, face: str, workdir: Path, quick: bool) -> dict[str, float]:
    env = dict(
        os.environ,
        PYTHONPATH=str(tree),
        BENCHLIB=str(HERE),
        WORKDIR=str(workdir),
        QUICK="1" if quick else "0",
        # Both sides save full: with incremental saves (issue 21's default) the second save
        # of one unchanging state writes nothing, which is not what is compared here.
        CKPTSTORE_INCREMENTAL="0",
    )
    done = subprocess.run(
        [sys.executable, "-c", CHILD, workload, face],
        env=env,
        cwd=workdir,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"{tree} {workload} {face} failed:\n{done.stderr}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rev", help="the commit to compare this tree against")
    parser.add_argument("-r", "--repeat", type=int, default=5)
    parser.add_argument("--workloads", default="big,small,transformer")
    parser.add_argument("--no-dcp", action="store_true")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    parser.add_argument("--workdir", type=Path, default=None, help="scratch (a local disk)")
    args = parser.parse_args()

    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    scratch = Path(tempfile.mkdtemp(prefix="ckptstore-compare-", dir=args.workdir))
    other = scratch / "other"
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(other), args.rev],
        check=True,
    )
    trees = {f"HEAD {head}": REPO, f"{args.rev}": other}
    jobs = [(w, f) for w in args.workloads.split(",") for f in ("disk", "mem")]
    if not args.no_dcp:
        jobs.append(("transformer", "dcp"))
    times: dict[tuple[str, str, str], list[float]] = {}
    try:
        for r in range(args.repeat):
            order = list(trees.items()) if r % 2 == 0 else list(trees.items())[::-1]
            for workload, face in jobs:
                for name, tree in order:
                    for op, seconds in measure(tree, workload, face, scratch, args.quick).items():
                        times.setdefault((workload, op, name), []).append(seconds)
            print(f"round {r + 1}/{args.repeat} done", file=sys.stderr)
    finally:
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "remove", "--force", str(other)], check=False
        )
        shutil.rmtree(scratch, ignore_errors=True)

    names = list(trees)
    print(f"| workload | operation | {names[0]} (median s) | {names[1]} (median s) | ratio |")
    print("|---|---|---:|---:|---:|")
    rows = sorted({(w, op) for w, op, _ in times}, key=lambda k: (k[0], k[1]))
    for workload, op in rows:
        a = times[(workload, op, names[0])]
        b = times[(workload, op, names[1])]
        ma, mb = statistics.median(a), statistics.median(b)
        print(f"| {workload} | {op} | {ma:.3f} | {mb:.3f} | {ma / mb:.2f} |")
    print(f"\nall runs (s): {json.dumps({'/'.join(k): v for k, v in times.items()})}")


if __name__ == "__main__":
    main()
