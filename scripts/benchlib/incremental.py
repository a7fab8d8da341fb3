"""incremental: what an incremental save costs against a full save of the same state.

The fine-tuning state of :mod:`benchlib.workloads` (a frozen 200 MiB base, a trainable
adapter and its Adam moments) is saved on local disk and on a local SeaweedFS (``weed mini``
on loopback ports, plain HTTP, signed requests; it shares the 2 cores with the client).
Each run first takes one training step (untimed), then saves: **full** with
``asave(..., full=True)`` into one root, **incremental** with ``asave`` into another, whose
newest step it references for every unchanged leaf. Restores load the newest step of each
root. The bytes each incremental save puts to data objects are counted at the store (a
counting wrapper) and compared with the bytes the training step changed. Runs alternate
(``interleave``) after one untimed warm-up each; each system's previous step is deleted,
untimed, so the roots stay at two steps. Every restored byte is compared with the state.
"""

from __future__ import annotations

import asyncio
import shutil
from typing import Any

import numpy as np

from benchlib import Context, Result, Suite, interleave, workloads
from benchlib.s3 import ACCESS_KEY, SECRET_KEY
from ckptstore.config import default_settings
from ckptstore.manager.functions import adelete_step, alist_steps, aload, asave
from ckptstore.store.base import Store
from ckptstore.store.local import LocalStore
from ckptstore.store.s3 import S3Store
from ckptstore.testing.incremental_tests import KeyCountingStore
from ckptstore.testing.servers import SeaweedFS

FULL = "ckptstore full save"
INCR = "ckptstore incremental save"
BUCKET = "bench-incremental"

#: scripts/bench.py turns incremental saves off for every suite (CKPTSTORE_INCREMENTAL=0);
#: this one measures them, so its stores turn them on (the full arm saves with full=True).
INCREMENTAL = default_settings().replace(incremental=True)


def _same(actual: Any, expected: Any) -> bool:
    if isinstance(expected, dict):
        return all(_same(actual[k], v) for k, v in expected.items())
    if isinstance(expected, np.ndarray):
        return bool(actual.tobytes() == expected.tobytes())
    return bool(actual == expected)


def _measure(
    ctx: Context, target: str, full_store: Store, incr_store: Store, loop: Any
) -> tuple[list[Result], str]:
    run = workloads.fine_tuning(ctx.quick)
    counting = KeyCountingStore(incr_store)
    roots = {FULL: full_store, INCR: counting}
    nbytes = sum(a.nbytes for a in _arrays(run.state))
    steps = {FULL: 0, INCR: 0}
    written: list[tuple[int, int]] = []  # (data bytes put, bytes changed) per incremental save

    def save(name: str) -> None:
        steps[name] += 1
        before = counting.data_bytes()
        loop.run_until_complete(asave(roots[name], run.state, step=steps[name], full=name == FULL))
        if name == INCR and steps[name] > 2:  # past the first incremental save's repack
            written.append((counting.data_bytes() - before, run.changed_bytes()))

    def setup(name: str) -> None:
        """Untimed: a training step, and keep each root at its newest step."""
        run.train_step()
        for step in loop.run_until_complete(alist_steps(roots[name]))[:-1]:
            loop.run_until_complete(adelete_step(roots[name], step))

    saves = {FULL: lambda: save(FULL), INCR: lambda: save(INCR)}
    # warm-up; the incremental root gets its base and its first incremental save (which
    # also repacks the frozen small leaves once), so the timed ones are the steady state
    for name in (FULL, INCR, INCR):
        setup(name)
        saves[name]()
    save_t = interleave(saves, ctx.repeat, setup=setup)
    got: dict[str, Any] = {}

    def load(name: str) -> None:
        got[name] = loop.run_until_complete(aload(roots[name]))

    loads = {FULL: lambda: load(FULL), INCR: lambda: load(INCR)}
    for case in loads.values():
        case()
    load_t = interleave(loads, ctx.repeat)
    # the newest of each root holds the state of its last save; both must equal their own
    # snapshot: the incremental root's newest step was saved after the full root's
    if not _same(got[INCR], run.state):
        raise AssertionError(f"{target}: the incremental restore differs from the state")

    rows = []
    for op, timings in (("save", save_t), ("restore", load_t)):
        for system, t in timings.items():
            rows.append(
                Result("incremental", "fine-tuning", target, system, op, nbytes,
                       t.median, t.runs, t.cpu_median)
            )  # fmt: skip
    put = sum(w for w, _ in written)
    changed = sum(c for _, c in written)
    ratio_bytes = put / changed if changed else float("nan")
    summary = (
        f"- {target}: bytes put per incremental save {put / max(len(written), 1):,.0f} for "
        f"{changed / max(len(written), 1):,.0f} changed ({ratio_bytes:.3f}x, goal <= 1.05x); "
        f"save {save_t[INCR].median:.3f} s vs full {save_t[FULL].median:.3f} s "
        f"({save_t[INCR].median / save_t[FULL].median:.2f}x, goal <= 0.15x on SeaweedFS); "
        f"restore {load_t[INCR].median:.3f} s vs full {load_t[FULL].median:.3f} s "
        f"({load_t[INCR].median / load_t[FULL].median:.2f}x, goal <= 1.1x)"
    )
    return rows, summary


def _arrays(state: Any) -> list[np.ndarray[Any, Any]]:
    if isinstance(state, dict):
        return [a for v in state.values() for a in _arrays(v)]
    return [state] if isinstance(state, np.ndarray) else []


def run(ctx: Context) -> list[Result]:
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    rows: list[Result] = []
    summary: list[str] = []
    try:
        local = ctx.workdir / "incremental"
        shutil.rmtree(local, ignore_errors=True)
        full_store = LocalStore(local / "full", settings=INCREMENTAL)
        incr_store = LocalStore(local / "incr", settings=INCREMENTAL)
        try:
            got, line = _measure(ctx, "local", full_store, incr_store, loop)
        finally:
            loop.run_until_complete(full_store.close())
            loop.run_until_complete(incr_store.close())
        rows += got
        summary.append(line)
        with SeaweedFS(
            ctx.workdir / "seaweedfs-incremental", access_key=ACCESS_KEY, secret_key=SECRET_KEY
        ) as server:
            server.create_bucket(BUCKET)
            stores = [
                S3Store(
                    BUCKET,
                    prefix,
                    endpoint_url=server.s3_endpoint,
                    access_key_id=ACCESS_KEY,
                    secret_access_key=SECRET_KEY,
                    settings=INCREMENTAL,
                )
                for prefix in ("full", "incr")
            ]
            try:
                got, line = _measure(ctx, "SeaweedFS http", *stores, loop)
            finally:
                for store in stores:
                    loop.run_until_complete(store.close())
            rows += got
            summary.append(line)
    finally:
        loop.close()
        asyncio.set_event_loop(None)
    ctx.options["summary"] = "Medians of this run:\n\n" + "\n".join(summary)
    return rows


SUITE = Suite(
    name="incremental",
    title="Incremental saves: a fine-tuning state, full save vs incremental save",
    run=run,
    description=__doc__.split("\n\n", 1)[1].strip(),
)
