"""async-breakdown: where the time an async save costs the training loop goes.

The ``async`` suite's loop and its ``lost per save`` figure (see :mod:`benchlib.async_save`),
on the transformer workload (456 MiB in 496 tensors), for ckptstore's eager save as it ships
and with one part of its background work taken away at a time, each in a fresh child, one
run of every variant per round, rounds alternating the variants, beside the loop without
saves and the ``bare`` writer (a separate process that hashes and durably writes the same
bytes). A part's cost is what the loop loses with it less what it loses without it:

* ``no fsync``: ``CKPTSTORE_DURABLE=0`` (no fsync of files or directories);
* ``buffered``: ``CKPTSTORE_DIRECT_IO=0`` (page-cache writes, then fsync);
* ``no crc32c``: crc32c returns at once (the save's own hashing of every byte);
* ``not incremental``: ``CKPTSTORE_INCREMENTAL=0`` (no xxh3 pass over every leaf to find
  the unchanged ones, and every leaf written);
* ``no retention``: ``max_to_keep=None`` (no step deleted after a commit);
* ``one pack``: ``CKPTSTORE_PACK_THRESHOLD`` and ``CKPTSTORE_PACK_SIZE`` at 1 GiB, so every
  leaf goes into one pack object: the per-object work (a file, its fsync, its requests)
  done once instead of 128 times;
* ``memory``: the manager saves to ``memory://``: no file at all, so what is left is the
  staging copy, the hashing and ckptstore's Python;
* ``lazy``: ``snapshot="lazy"``, as shipped (the loop fences before ``opt.step()``);
* ``writer process``: not a part taken away but the work moved: the loop copies the state
  into shared memory and signals a second process, which runs ``ckptstore.save`` (the same
  hashing, packing, incremental check, writes, commit) and the retention over it
  (:mod:`benchlib.writer_probe`). What a writer process would save the loop, measured before
  it is built; its process's CPU is not in the CPU figure, and the shared memory, mapped by
  the training process, is in its peak.

Variants that break a checkpoint (no crc32c) exist only in this suite's children. Each line
also gives the CPU time a save costs the whole process (``process_time``, less the loop
without saves) and the training thread's own CPU time per save (``thread_time``): a loss the
training thread does not spend on its CPU is a wait (the GIL, or the other core busy).
"""

from __future__ import annotations

import statistics
from typing import Any

from benchlib import Context, Result, Suite
from benchlib.async_save import PATCH_ENV, _run_child, lost_per_save

WORKLOAD = "transformer"
#: (name, the async suite's system, the child's extra environment)
VARIANTS: list[tuple[str, str, dict[str, str]]] = [
    ("none", "none", {}),
    ("bare", "bare", {}),
    ("ckptstore", "ckptstore", {}),
    ("no fsync", "ckptstore", {"CKPTSTORE_DURABLE": "0"}),
    ("buffered", "ckptstore", {"CKPTSTORE_DIRECT_IO": "0"}),
    ("no crc32c", "ckptstore", {PATCH_ENV: "nocrc"}),
    ("not incremental", "ckptstore", {"CKPTSTORE_INCREMENTAL": "0"}),
    ("no retention", "ckptstore", {PATCH_ENV: "keepall"}),
    (
        "one pack",
        "ckptstore",
        {"CKPTSTORE_PACK_THRESHOLD": str(1 << 30), "CKPTSTORE_PACK_SIZE": str(1 << 30)},
    ),
    ("memory", "ckptstore", {PATCH_ENV: "memory"}),
    ("lazy", "ckptstore-lazy", {}),
    ("writer process", "writer-probe", {}),
]


def run(ctx: Context) -> list[Result]:
    every, saves = (4, 2) if ctx.quick else (60, 6)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in VARIANTS}
    for _ in range(ctx.repeat):
        for name, system, env in VARIANTS:
            out = _run_child(system, WORKLOAD, ctx.workdir, every, saves, ctx.quick, env=env)
            runs[name].append(out)
            print(f"  {name}: {out}", flush=True)
    nbytes = runs["none"][0]["state_bytes"]
    none = runs["none"]
    rows: list[Result] = []
    lost: dict[str, float] = {}
    lines = []
    for name, _, _ in VARIANTS[1:]:
        per_round = lost_per_save(runs[name], none, saves)
        lost[name] = statistics.median(per_round)
        cpu = statistics.median(
            (r["cpu"] - b["cpu"]) / saves for r, b in zip(runs[name], none, strict=True)
        )
        main = statistics.median(
            (r["main_cpu"] - b["main_cpu"]) / saves for r, b in zip(runs[name], none, strict=True)
        )
        blocked = statistics.median(statistics.median(r["blocked"]) for r in runs[name])
        rows.append(
            Result(
                "async-breakdown",
                WORKLOAD,
                "local",
                name,
                "lost per save",
                nbytes,
                lost[name],
                per_round,
                cpu,
            )
        )
        lines.append(
            f"- {name}: lost {lost[name] * 1e3:.0f} ms/save (rounds "
            + ", ".join(f"{x * 1e3:.0f}" for x in per_round)
            + f"), blocking {blocked * 1e3:.0f} ms, CPU {cpu * 1e3:.0f} ms/save, of it the "
            f"training thread's {main * 1e3:.0f} ms"
        )
    ours = lost["ckptstore"]
    parts = [
        f"{name}: {(ours - lost[name]) * 1e3:+.0f} ms"
        for name, _, _ in VARIANTS
        if name not in ("none", "bare", "ckptstore", "lazy", "writer process")
    ]
    against_bare = (
        f"ckptstore lost/bare lost {ours / lost['bare']:.2f}x"
        if lost["bare"] > 0
        else f"bare lost {lost['bare'] * 1e3:.0f} ms (within the loop's noise)"
    )
    lines.append(
        "- **Cost of each part** (ckptstore's lost time less the variant's): "
        + "; ".join(parts)
        + f". {against_bare}; lazy lost/eager lost {lost['lazy'] / ours:.2f}x; writer "
        f"process lost/eager lost {lost['writer process'] / ours:.2f}x"
    )
    ctx.options["summary"] = (
        f"Loop: {(saves + 1) * every} steps, a save every {every} steps ({saves} timed saves "
        "after one untimed warm-up save); median over rounds.\n\n" + "\n".join(lines)
    )
    return rows


SUITE = Suite(
    name="async-breakdown",
    title="Async save on the transformer: what each part of the background work costs",
    run=run,
    description=__doc__.split("\n\n", 1)[1].strip(),
)
