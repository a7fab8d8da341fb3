"""stage: copying a state into host memory, reused buffers against fresh ones.

The blocking part of an async save is the copy of the state into host memory. This suite
copies the 1 GiB workload (16 float32 torch tensors of 64 MiB), the transformer-like state
with its Adam state (456 MiB in 496 tensors) and 20,000 tensors of 4 KiB (80 MiB; ``--quick``:
2,000), all from :mod:`benchlib.workloads`, four ways, interleaved, after one untimed warm-up
run each:

* ``memcpy (reused)``: one single-threaded ``Tensor.copy_`` per tensor into buffers allocated
  and touched before timing: the floor a copy can reach on one core;
* ``ckptstore Stager (pooled)``: ``Stager.stage`` as a save calls it, into the pooled arena
  the previous run gave back (two copy threads);
* ``ckptstore Stager (fresh arena)``: the same with a new pool every run, so every page of the
  arena is faulted in during the copy;
* ``Tensor.clone`` (fresh): what a stager that allocates per save does.

The process runs with ``torch.set_num_threads(1)``, as the training loop of the ``async``
suite does. For the small leaves the summary gives the stager's time beyond the memcpy per
leaf (issue 19's budget: 10 us): the walk of the state, each leaf's spec and slot, and the
copies' hand-off, everything a save does per leaf before it returns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benchlib import Context, Result, Suite, interleave, torch_tensors
from benchlib.workloads import WORKLOADS, as_torch


def _cases(state: Any, pooled: Any) -> dict[str, Callable[[], Any]]:
    import torch

    from ckptstore.stage import Stager

    tensors = torch_tensors(state)
    reused = [torch.empty_like(t) for t in tensors]

    def memcpy() -> None:
        for dst, src in zip(reused, tensors, strict=True):
            dst.copy_(src)

    def stage_pooled() -> None:
        pooled.stage(state).release()

    def stage_fresh() -> None:
        stager = Stager()
        stager.stage(state).release()
        stager.close()

    def clone() -> None:
        copies = [t.clone() for t in tensors]
        del copies

    return {
        "memcpy (reused)": memcpy,
        "ckptstore Stager (pooled)": stage_pooled,
        "ckptstore Stager (fresh arena)": stage_fresh,
        "Tensor.clone (fresh)": clone,
    }


def run(ctx: Context) -> list[Result]:
    import torch

    from ckptstore.stage import Stager

    torch.set_num_threads(1)
    rows: list[Result] = []
    lines: list[str] = []
    for workload in ("1 GiB as 16 x 64 MiB", "transformer + Adam (~400 MiB)", "20,000 x 4 KiB"):
        state = as_torch(WORKLOADS[workload](ctx.quick))
        nbytes = sum(t.numel() * t.element_size() for t in torch_tensors(state))
        pooled = Stager()
        cases = _cases(state, pooled)
        for fn in cases.values():
            fn()
        timings = interleave(cases, ctx.repeat)
        for name, timing in timings.items():
            rows.append(
                Result(
                    "stage",
                    workload,
                    "host memory",
                    name,
                    "copy",
                    nbytes,
                    timing.median,
                    timing.runs,
                    timing.cpu_median,
                )
            )
        floor = timings["memcpy (reused)"].median
        lines.append(
            f"- {workload}: pooled {timings['ckptstore Stager (pooled)'].median / floor:.2f}x "
            f"memcpy, fresh arena {timings['ckptstore Stager (fresh arena)'].median / floor:.2f}x, "
            f"clone {timings['Tensor.clone (fresh)'].median / floor:.2f}x"
        )
        if workload == "20,000 x 4 KiB":
            leaves = len(torch_tensors(state))
            beyond = (timings["ckptstore Stager (pooled)"].median - floor) / leaves * 1e6
            lines.append(
                f"- {workload}: the pooled stager's time beyond the memcpy, per leaf: "
                f"{beyond:.1f} us ({leaves:,} leaves; goal <= 10 us)"
            )
        pooled.close()
    ctx.options["summary"] = "Time relative to memcpy into reused buffers:\n\n" + "\n".join(lines)
    return rows


SUITE = Suite(
    name="stage",
    title="Staging: copy into reused vs fresh host buffers",
    run=run,
    description=__doc__.split("\n\n", 1)[1].strip(),
)
