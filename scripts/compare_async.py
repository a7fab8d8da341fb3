"""The async suite's training loop with this tree's ckptstore against an earlier commit's,
side by side in one run.

What the loop loses to a background save moves by tens of milliseconds from one run to the
next on this shared machine (docs/benchmarks.md, the async sections), more than most changes
to the writer are worth. So this script runs the loop of :mod:`benchlib.async_save` (the same
children, workloads and ``lost per save`` figure as ``scripts/bench.py async``) in rounds:
each round runs the loop without saves, the ``bare`` writer, and ckptstore from each tree,
in fresh child processes, the two trees' order flipped every round, so a burst of load from
elsewhere lands on both sides alike. It prints every round and the medians: lost time per
save, and the CPU time a save costs the child process (less the loop without saves).

The other commit is checked out into a temporary git worktree (removed afterwards); both
sides run this tree's benchmark children, so they save the same bytes the same way and only
the library differs.

Usage: ``python scripts/compare_async.py 92252c9 -r 5 --workload transformer``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from benchlib import async_save  # noqa: E402

EVERY, SAVES = 60, 6


def _child(system: str, workload: str, workdir: Path, library: Path) -> dict[str, Any]:
    # the library's tree first on the children's path; the benchmark children are this tree's
    path = os.pathsep.join((str(library), str(HERE)))
    return async_save._run_child(
        system, workload, workdir, EVERY, SAVES, False, env={"PYTHONPATH": path}
    )


def _per_save(runs: list[dict[str, Any]], none: list[dict[str, Any]], key: str) -> list[float]:
    return [(r[key] - n[key]) / SAVES * 1e3 for r, n in zip(runs, none, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("commit", help="the earlier commit to compare with")
    parser.add_argument("-r", "--rounds", type=int, default=5)
    parser.add_argument("--workload", choices=("transformer", "1GiB"), default="transformer")
    parser.add_argument("--system", choices=("ckptstore", "ckptstore-lazy"), default="ckptstore")
    args = parser.parse_args()
    root = HERE.parent
    with tempfile.TemporaryDirectory(prefix="ckptstore-compare-") as scratch:
        other = Path(scratch) / "tree"
        subprocess.run(
            ["git", "-C", str(root), "worktree", "add", "--detach", "-q", str(other), args.commit],
            check=True,
        )
        try:
            sides = {"this": root, args.commit: other}
            runs: dict[str, list[dict[str, Any]]] = {k: [] for k in ("none", "bare", *sides)}
            work = Path(scratch) / "work"
            for r in range(args.rounds):
                runs["none"].append(_child("none", args.workload, work, root))
                runs["bare"].append(_child("bare", args.workload, work, root))
                order = list(sides) if r % 2 == 0 else list(sides)[::-1]
                for side in order:
                    runs[side].append(_child(args.system, args.workload, work, sides[side]))
                line = []
                for name in ("bare", *sides):
                    lost = _per_save(runs[name][-1:], runs["none"][-1:], "excess")[0]
                    cpu = _per_save(runs[name][-1:], runs["none"][-1:], "cpu")[0]
                    blocked = statistics.median(runs[name][-1]["blocked"]) * 1e3
                    line.append(f"{name} lost {lost:.0f} cpu {cpu:.0f} blocked {blocked:.1f}")
                print(f"round {r + 1}: " + " | ".join(line), flush=True)
            print(f"{args.system} on {args.workload}, ms per save, {args.rounds} rounds:")
            for name in ("bare", *sides):
                lost = _per_save(runs[name], runs["none"], "excess")
                cpu = _per_save(runs[name], runs["none"], "cpu")
                print(
                    f"  {name}: lost median {statistics.median(lost):.0f} "
                    f"(rounds {', '.join(f'{x:.0f}' for x in lost)}); "
                    f"CPU median {statistics.median(cpu):.0f}"
                )
        finally:
            subprocess.run(
                ["git", "-C", str(root), "worktree", "remove", "--force", str(other)], check=False
            )


if __name__ == "__main__":
    main()
