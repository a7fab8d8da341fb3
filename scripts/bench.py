"""Side-by-side benchmarks of ckptstore, its peers and the raw ceilings, in one run.

    python scripts/bench.py                      # every suite
    python scripts/bench.py store-local -r 5     # one suite, 5 runs each
    python scripts/bench.py --list

Writes ``<out>/results.json`` and rewrites each measured suite's section of
``docs/benchmarks.md``. Figures are medians of ``--repeat`` interleaved runs; ratios compare
systems measured in the same run, never across runs.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import pkgutil
import platform
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchlib import Context, Result, Suite

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
HEADER = """# Benchmarks

Produced by `python scripts/bench.py` (each section names the exact command that produced it).
Every figure is the median of repeated runs; ratios compare systems measured side by side in the
same run on the same machine. CPU is the benchmark process's user+system seconds (all threads).
"""


def discover() -> dict[str, Suite]:
    import benchlib

    suites: dict[str, Suite] = {}
    for info in pkgutil.iter_modules(benchlib.__path__):
        module = importlib.import_module(f"benchlib.{info.name}")
        suite = getattr(module, "SUITE", None)
        if isinstance(suite, Suite):
            suites[suite.name] = suite
    return suites


def machine() -> str:
    import numpy

    return (
        f"{platform.node() or 'host'}: {os.cpu_count()} cores, "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / (1 << 30):.0f} GiB, "
        f"{platform.platform()}, Python {platform.python_version()}, numpy {numpy.__version__}"
    )


def table(rows: list[Result]) -> str:
    lines = [
        "| workload | target | system | op | median s | GiB/s | CPU s/GiB | objects | runs (s) |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        runs = ", ".join(f"{x:.3f}" for x in r.runs)
        objects = "" if r.objects is None else str(r.objects)
        lines.append(
            f"| {r.workload} | {r.target} | {r.system} | {r.op} | {r.seconds:.3f} | "
            f"{r.gib_per_s:.2f} | {r.cpu_s_per_gib:.2f} | {objects} "
            f"| {runs} |"
        )
    return "\n".join(lines)


def write_section(suite: Suite, rows: list[Result], command: str, extra: str) -> None:
    text = DOC.read_text() if DOC.exists() else HEADER
    start, end = f"<!-- suite:{suite.name} -->", f"<!-- /suite:{suite.name} -->"
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    body = (
        f"{start}\n## {suite.title}\n\n`{command}` on {when}; {machine()}.\n\n"
        f"{suite.description}\n\n{table(rows)}\n\n{extra}\n{end}"
    )
    if start in text and end in text:
        before, rest = text.split(start, 1)
        text = before + body + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + body + "\n"
    DOC.parent.mkdir(exist_ok=True)
    DOC.write_text(text)


def main(argv: list[str] | None = None) -> int:
    suites = discover()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("suites", nargs="*", help="suites to run (default: all)")
    parser.add_argument("-r", "--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results")
    parser.add_argument("--workdir", type=Path, default=None, help="scratch directory")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    parser.add_argument("--no-doc", action="store_true", help="do not touch docs/benchmarks.md")
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args(argv)
    if args.list:
        for name, suite in sorted(suites.items()):
            print(f"{name:20s} {suite.title}")
        return 0
    unknown = set(args.suites) - set(suites)
    if unknown:
        parser.error(f"unknown suites {sorted(unknown)}; --list shows them")
    chosen = args.suites or sorted(suites)
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python scripts/bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    all_rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="ckptstore-bench-") as scratch:
        for name in chosen:
            suite = suites[name]
            workdir = Path(scratch) / name
            workdir.mkdir()
            ctx = Context(repeat=args.repeat, workdir=workdir, quick=args.quick)
            print(f"== {name}: {suite.title}", flush=True)
            rows = suite.run(ctx)
            print(table(rows), flush=True)
            extra = str(ctx.options.get("summary", ""))
            if extra:
                print(extra, flush=True)
            if not args.no_doc and not args.quick:
                write_section(suite, rows, command.strip(), extra)
            all_rows += [r.as_dict() for r in rows]
    (args.out / "results.json").write_text(json.dumps(all_rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
