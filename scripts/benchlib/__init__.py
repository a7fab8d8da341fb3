"""Benchmark suites for scripts/bench.py.

Every module in this package that defines ``SUITE = Suite(...)`` is a suite. A suite's ``run``
takes the shared :class:`Context` and returns :class:`Result` rows; ``bench.py`` runs the
suites asked for, writes the rows as JSON, and rewrites that suite's section of
``docs/benchmarks.md`` (between ``<!-- suite:NAME -->`` and ``<!-- /suite:NAME -->``) so
suites measured in different runs do not overwrite each other.

Rules every suite keeps: each figure is the median of ``ctx.repeat`` runs; ckptstore and the
ceiling or peer it is compared with are measured in the same run, interleaved, so a noisy
neighbour hits both; client CPU seconds are recorded beside wall time.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import resource
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Context:
    repeat: int
    workdir: Path
    quick: bool = False
    options: dict[str, Any] = field(default_factory=dict)
    #: the workloads to run, for a suite that runs several (``--workloads``); empty: all
    workloads: tuple[str, ...] = ()

    def chosen(self, names: Iterable[str]) -> list[str]:
        """Those of a suite's workloads ``names`` that this run asked for, in their order;
        a name the suite does not have fails the run before anything is measured."""
        names = list(names)
        unknown = sorted(set(self.workloads) - set(names))
        if unknown:
            raise SystemExit(f"--workloads {unknown}: this suite runs {names}")
        return [n for n in names if not self.workloads or n in self.workloads]


@dataclass
class Result:
    """One measured figure: the median over repeated runs of one system doing one operation."""

    suite: str
    workload: str
    target: str
    system: str
    op: str
    nbytes: int
    seconds: float
    runs: list[float]
    cpu_seconds: float
    objects: int | None = None
    notes: str = ""

    @property
    def gib_per_s(self) -> float:
        return self.nbytes / self.seconds / (1 << 30) if self.seconds else float("inf")

    @property
    def cpu_s_per_gib(self) -> float:
        return self.cpu_seconds / (self.nbytes / (1 << 30)) if self.nbytes else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["gib_per_s"] = self.gib_per_s
        out["cpu_s_per_gib"] = self.cpu_s_per_gib
        return out


@dataclass
class Suite:
    name: str
    title: str
    run: Callable[[Context], list[Result]]
    #: Markdown written under the table: what was compared, against what, how.
    description: str = ""


def evict(paths: Iterable[Path]) -> None:
    """Drop the files ``paths`` from the page cache so the next read of them comes from disk
    (cold-cache reads). Each is fsynced first: dirty pages cannot be dropped."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def leaves_of(tree: Any, kind: type) -> list[Any]:
    """The leaves of a state that are instances of ``kind``, depth first in dict and list
    order (the order in which suites lay a state's bytes end to end)."""
    if isinstance(tree, kind):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in leaves_of(v, kind)]
    if isinstance(tree, list | tuple):
        return [t for v in tree for t in leaves_of(v, kind)]
    return []


def torch_tensors(tree: Any) -> list[Any]:
    """The torch tensors of a state (:func:`leaves_of`)."""
    import torch

    return leaves_of(tree, torch.Tensor)


def cpu_time() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass
class Timing:
    runs: list[float]
    cpu: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    @property
    def cpu_median(self) -> float:
        return statistics.median(self.cpu)


def interleave(
    cases: dict[str, Callable[[], Any]],
    repeat: int,
    *,
    setup: Callable[[str], Any] | None = None,
) -> dict[str, Timing]:
    """Time each case ``repeat`` times, alternating between cases in every round so that
    machine noise lands on all of them alike. ``setup(name)`` runs untimed before each run,
    then a full garbage collection, so no run pays for collecting what an earlier run (often
    another system's) left behind."""
    timings = {name: Timing([], []) for name in cases}
    for _ in range(repeat):
        for name, fn in cases.items():
            if setup is not None:
                setup(name)
            gc.collect()
            c0, t0 = cpu_time(), time.perf_counter()
            fn()
            t1, c1 = time.perf_counter(), cpu_time()
            timings[name].runs.append(t1 - t0)
            timings[name].cpu.append(c1 - c0)
    return timings
