"""The stage call alone, on the async benchmark's transformer state (496 tensors), beside a
plain loop of ``copy_(non_blocking=True)`` calls into pinned buffers: how long ckptstore's
eager and lazy ``Stager.stage`` hold the caller, and when their copies have landed.

    python3 scripts/stage_call.py                  # on a CUDA device (cpu: --device cpu)

Prints one JSON line of medians (15 calls after 3 warm-ups each): ``*_call_ms`` is the call,
``*_done_ms`` the call plus the wait for its copies (``wait_ready``; for ``memcpy``, a
stream synchronization), and ``*_gc_ms`` the mean time per call that the cyclic collector's
passes took inside the stage call (on the CPU at 4215dd4, 0.3 to 0.6 ms of a 4 ms lazy
call: the pass that a save's paused collection runs as the call ends, and now and then one
over the whole heap). ``--profile N`` then profiles N more calls of each ckptstore stage
(cProfile, the functions with the most time of their own) and prints the tables to stderr.

To compare two commits side by side, run it once per commit in fresh processes, the older
one with ``PYTHONPATH`` set to an export of its tree (``git archive OLD ckptstore | tar -x -C
/tmp/old``): the script imports whichever ``ckptstore`` comes first on the path and says
which.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from benchlib.async_save import _state, _to_device

import ckptstore
from ckptstore.stage import Stager


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        tree = list(tree.values())
    if isinstance(tree, list | tuple):
        return [t for item in tree for t in _tensors(item)]
    return []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--calls", type=int, default=15)
    parser.add_argument("--profile", type=int, default=0, metavar="N")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)
    state = _to_device(_state("transformer", False), args.device)
    leaves = _tensors(state)
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in leaves]
    sync()
    stager = Stager()

    def memcpy() -> tuple[float, float]:
        t0 = time.perf_counter()
        for dst, src in zip(pinned, leaves, strict=True):
            dst.copy_(src, non_blocking=True)
        t1 = time.perf_counter()
        sync()
        return t1 - t0, time.perf_counter() - t0

    collecting = _Collections()

    def staged(lazy: bool) -> tuple[float, float]:
        t0 = time.perf_counter()
        collecting.inside = True
        copy = stager.stage(state, lazy=lazy)
        collecting.inside = False
        t1 = time.perf_counter()
        copy.wait_ready()
        t2 = time.perf_counter()
        copy.release()
        return t1 - t0, t2 - t0

    out: dict[str, Any] = {"ckptstore": ckptstore.__file__, "leaves": len(leaves)}
    systems: dict[str, Callable[[], tuple[float, float]]] = {
        "memcpy": memcpy,
        "eager": lambda: staged(False),
        "lazy": lambda: staged(True),
    }
    gc.callbacks.append(collecting.seen)
    for name, run in systems.items():
        for _ in range(3):
            run()
        collecting.total = 0.0
        runs = [run() for _ in range(args.calls)]
        out[f"{name}_call_ms"] = round(statistics.median(r[0] for r in runs) * 1e3, 2)
        out[f"{name}_done_ms"] = round(statistics.median(r[1] for r in runs) * 1e3, 2)
        out[f"{name}_gc_ms"] = round(collecting.total / args.calls * 1e3, 3)
    gc.callbacks.remove(collecting.seen)
    print(json.dumps(out), flush=True)
    for name in ("eager", "lazy") if args.profile else ():
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.profile):
            systems[name]()
        profile.disable()
        table = io.StringIO()
        pstats.Stats(profile, stream=table).sort_stats("tottime").print_stats(20)
        print(f"--- {name} stage, {args.profile} calls\n{table.getvalue()}", file=sys.stderr)
    stager.close()


class _Collections:
    """The time the cyclic collector's passes take inside stage calls (``inside``)."""

    def __init__(self) -> None:
        self.inside = False
        self.total = 0.0
        self._began: float | None = None

    def seen(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter() if self.inside else None
        elif self._began is not None:
            self.total += time.perf_counter() - self._began
            self._began = None


if __name__ == "__main__":
    main()
