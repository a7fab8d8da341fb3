"""hedged: restores from SeaweedFS while 2% of the reads straggle 5 s, with hedged reads.

The 1 GiB workload (16 arrays of 64 MiB) and the transformer workload (a model and its Adam
state, 496 arrays) are saved once to a local SeaweedFS; each is then restored with
``ckptstore.aload`` through the fault proxy (``ckptstore.testing.proxy``), which forwards
every request and answers a seeded 2% of the ranged GETs 5 s late. Three systems, each with
a fresh store per restore (a restore after a restart has no history of reads to compare
with), interleaved:

* **undelayed**: the proxy delays nothing (the yardstick; hedging on, nothing to hedge);
* **2% delayed 5 s, hedged**: ``Settings.hedged_reads = 0.05``, the default
  (``ckptstore.store.transport.Hedger``: a read twice as slow per MiB as the median
  of the reads timed so far is sent again, the first answer wins);
* **2% delayed 5 s, not hedged**: ``hedged_reads = 0``: what a straggler costs.

The goal (issue 30): the hedged restore takes at most 1.3x the undelayed one and reads at
most 1.05x its bytes (counted by the proxy: response bodies sent to the client). The proxy
is a Python process-local server on the same 2 cores, so absolute times are the proxy's;
the ratios are measured side by side. Every restore is checked bit-exact.
"""

from __future__ import annotations

import asyncio
import functools
import statistics
from typing import Any

from benchlib import Context, Result, Suite, interleave, workloads
from benchlib.s3 import ACCESS_KEY, SECRET_KEY
from ckptstore.layout.tree import flatten
from ckptstore.manager.functions import aload, asave
from ckptstore.store.s3 import S3Store
from ckptstore.testing.proxy import FaultProxy, ProxyFault
from ckptstore.testing.servers import SeaweedFS

BUCKET = "bench-hedged"
UNDELAYED = "undelayed"
HEDGED = "2% delayed 5 s, hedged"
UNHEDGED = "2% delayed 5 s, not hedged"
DELAY = ProxyFault("delay", ops=frozenset({"get"}), rate=0.02, seconds=5.0)


def run(ctx: Context) -> list[Result]:
    states = {
        "1 GiB (16 x 64 MiB)": workloads.big(ctx.quick),
        "transformer + Adam": workloads.transformer(ctx.quick),
    }
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    rows: list[Result] = []
    summary: list[str] = []
    with (
        SeaweedFS(
            ctx.workdir / "seaweedfs-hedged", access_key=ACCESS_KEY, secret_key=SECRET_KEY
        ) as server,
        FaultProxy(server.s3_endpoint, seed=30) as proxy,
    ):
        server.create_bucket(BUCKET)

        def store(endpoint: str, prefix: str, hedged: float = 0.05) -> S3Store:
            made = S3Store(
                BUCKET,
                prefix,
                endpoint_url=endpoint,
                access_key_id=ACCESS_KEY,
                secret_access_key=SECRET_KEY,
            )
            made.settings = made.settings.replace(hedged_reads=hedged)
            return made

        try:
            for workload, state in states.items():
                prefix = f"w{len(rows)}"
                direct = store(server.s3_endpoint, prefix)
                loop.run_until_complete(asave(direct, state, step=0))  # untimed
                loop.run_until_complete(direct.close())
                flat = flatten(state)
                nbytes = sum(a.nbytes for a in flat.arrays)
                got: dict[str, Any] = {}
                read_bytes: dict[str, list[int]] = {UNDELAYED: [], HEDGED: [], UNHEDGED: []}
                hedges: dict[str, list[tuple[int, int, int]]] = {HEDGED: [], UNHEDGED: []}

                def restore(
                    system: str,
                    prefix: str = prefix,
                    got: dict[str, Any] = got,
                    read_bytes: dict[str, list[int]] = read_bytes,
                    hedges: dict[str, list[tuple[int, int, int]]] = hedges,
                ) -> None:
                    proxy.set_faults([] if system == UNDELAYED else [DELAY])
                    before = proxy.body_bytes
                    fresh = store(proxy.endpoint, prefix, 0.0 if system == UNHEDGED else 0.05)
                    try:
                        got[system] = loop.run_until_complete(aload(fresh, step=0))
                    finally:
                        hedger = fresh._transport.hedger
                        if system in hedges:
                            hedges[system].append((hedger.reads, hedger.hedged, hedger.won))
                        loop.run_until_complete(fresh.close())
                    read_bytes[system].append(proxy.body_bytes - before)

                cases = {s: functools.partial(restore, s) for s in (UNDELAYED, HEDGED, UNHEDGED)}
                restore(UNDELAYED)  # warm-up: connections, the server's caches
                for key in read_bytes:
                    read_bytes[key].clear()
                timings = interleave(cases, ctx.repeat)
                for system, out in got.items():
                    back = flatten(out)
                    if back.paths != flat.paths or any(
                        a.tobytes() != b.tobytes()
                        for a, b in zip(back.arrays, flat.arrays, strict=True)
                    ):
                        raise AssertionError(f"{system}: a restore read back different bytes")
                for system, t in timings.items():
                    extra = ""
                    if system in hedges:
                        reads, hedged, won = (
                            statistics.median(x) for x in zip(*hedges[system], strict=True)
                        )
                        extra = f"reads {reads:.0f}, hedged {hedged:.0f}, hedge won {won:.0f}"
                    rows.append(
                        Result(
                            "hedged",
                            workload,
                            "SeaweedFS http via fault proxy",
                            system,
                            "restore",
                            nbytes,
                            t.median,
                            t.runs,
                            t.cpu_median,
                            notes=(
                                f"proxy body bytes median {statistics.median(read_bytes[system])}"
                                + (f"; {extra}" if extra else "")
                            ),
                        )
                    )
                base = timings[UNDELAYED].median
                byte_base = statistics.median(read_bytes[UNDELAYED])
                hedged_runs = ", ".join(f"{r:.2f}" for r in timings[HEDGED].runs)
                base_runs = ", ".join(f"{r:.2f}" for r in timings[UNDELAYED].runs)
                summary.append(
                    f"- {workload}: hedged {timings[HEDGED].median / base:.2f}x the undelayed "
                    f"restore (goal <= 1.3x; runs {hedged_runs} s against {base_runs} s), "
                    f"{statistics.median(read_bytes[HEDGED]) / byte_base:.3f}x its bytes "
                    f"(goal <= 1.05x); not hedged {timings[UNHEDGED].median / base:.2f}x"
                )
        finally:
            loop.close()
            asyncio.set_event_loop(None)
    ctx.options["summary"] = "Medians of this run:\n\n" + "\n".join(summary)
    return rows


SUITE = Suite(
    name="hedged",
    title="Hedged reads: restores while 2% of the reads straggle 5 s (SeaweedFS, fault proxy)",
    run=run,
    description=__doc__.split("\n\n", 1)[1].strip(),
)
