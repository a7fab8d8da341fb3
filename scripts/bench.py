"""Side-by-side benchmarks of ckptstore, its peers and the raw ceilings, in one run.

    python scripts/bench.py                      # every suite
    python scripts/bench.py store-local -r 5     # one suite, 5 runs each
    python scripts/bench.py --list
    python scripts/bench.py --charts-only --out DIR   # redraw charts from DIR/results.json

Writes ``<out>/results.json`` and rewrites each measured suite's section of
``docs/benchmarks.md`` (table, text and a PNG chart under ``docs/img/``) and the page's header
(the command, the machine, the version of every library measured). Figures are medians of
``--repeat`` interleaved runs; ratios compare systems measured in the same run, never across
runs.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import pkgutil
import platform
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchlib import Context, Result, Suite, report

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
IMG = ROOT / "docs" / "img"


def discover() -> dict[str, Suite]:
    import benchlib

    suites: dict[str, Suite] = {}
    for info in pkgutil.iter_modules(benchlib.__path__):
        try:
            module = importlib.import_module(f"benchlib.{info.name}")
        except ModuleNotFoundError as exc:  # a machine without that suite's client library
            print(f"suite module {info.name} unavailable here: {exc}", file=sys.stderr)
            continue
        suite = getattr(module, "SUITE", None)
        if isinstance(suite, Suite):
            suites[suite.name] = suite
    return suites


def machine() -> str:
    import numpy

    cpu = report.machine_facts().get("cpu", "cpu unknown")
    gpu = ""
    torch = sys.modules.get("torch")  # only where a suite has already imported it
    if torch is not None and torch.cuda.is_available():
        gpu = f", {torch.cuda.get_device_name()} (torch {torch.__version__})"
    return (
        f"{platform.node() or 'host'}: {os.cpu_count()} cores ({cpu}), "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / (1 << 30):.0f} GiB"
        f"{gpu}, {platform.platform()}, Python {platform.python_version()}, "
        f"numpy {numpy.__version__}"
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


def chart_path(suite_name: str) -> Path:
    return IMG / f"bench-{suite_name}.png"


def chart_line(suite: Suite) -> str:
    """The markdown that embeds a suite's chart, or says when it will appear."""
    if chart_path(suite.name).exists():
        return f"![{suite.title}: GiB/s per system](img/{chart_path(suite.name).name})"
    return (
        f"*The chart of this section appears on the next run of `python scripts/bench.py "
        f"{suite.name}` (drawn with matplotlib: `pip install 'ckptstore[bench]'`).*"
    )


def draw_chart(suite: Suite, rows: list[dict[str, object]]) -> bool:
    """Draw ``rows`` into the suite's PNG; False (and a message) if matplotlib is missing."""
    try:
        report.chart(rows, chart_path(suite.name), title=suite.title)
    except ModuleNotFoundError as exc:
        print(f"no chart for {suite.name}: {exc}; pip install 'ckptstore[bench]'", flush=True)
        return False
    return True


def embed_chart(suite: Suite) -> None:
    """Put the suite's chart line into its existing section of docs/benchmarks.md."""
    if not DOC.exists():
        return
    text = DOC.read_text()
    start, end = f"<!-- suite:{suite.name} -->", f"<!-- /suite:{suite.name} -->"
    if start not in text or end not in text:
        return
    before, rest = text.split(start, 1)
    body, after = rest.split(end, 1)
    kept = [
        line
        for line in body.split("\n")
        if not line.startswith(f"![{suite.title}")
        and not line.startswith("*The chart of this section appears")
    ]
    body = "\n".join(kept).rstrip("\n") + "\n\n" + chart_line(suite) + "\n"
    DOC.write_text(before + start + body + end + after)


def write_header() -> None:
    text = DOC.read_text() if DOC.exists() else ""
    block = report.header_block(
        report.library_versions(), report.machine_facts(), sections=report.section_runs(text)
    )
    DOC.parent.mkdir(exist_ok=True)
    DOC.write_text(report.replace_header(text, block))


def merge_results(path: Path, suites_run: list[str], rows: list[dict[str, object]]) -> None:
    """Write ``rows`` to results.json, keeping the rows of suites not run this time."""
    kept: list[dict[str, object]] = []
    if path.exists():
        kept = [r for r in json.loads(path.read_text()) if r.get("suite") not in suites_run]
    path.write_text(json.dumps(kept + rows, indent=2))


def charts_only(suites: dict[str, Suite], results: Path, chosen: list[str]) -> int:
    if not results.exists():
        print(f"{results} does not exist: run the suites first", file=sys.stderr)
        return 2
    rows = json.loads(results.read_text())
    drawn = 0
    for name in chosen:
        mine = [r for r in rows if r.get("suite") == name]
        if not mine:
            embed_chart(suites[name])  # the line saying the chart comes with the next run
            continue
        if not draw_chart(suites[name], mine):
            return 1
        embed_chart(suites[name])
        print(f"{chart_path(name)}: {len(mine)} rows", flush=True)
        drawn += 1
    if not drawn:
        print(f"{results} holds no rows of {chosen}", file=sys.stderr)
        return 2
    write_header()
    return 0


def write_section(suite: Suite, rows: list[Result], command: str, commit: str, extra: str) -> None:
    text = DOC.read_text() if DOC.exists() else ""
    start, end = f"<!-- suite:{suite.name} -->", f"<!-- /suite:{suite.name} -->"
    when = datetime.datetime.now(datetime.UTC)
    body = (
        f"{start}\n## {suite.title}\n\n{report.section_line(command, commit, when, machine())}\n\n"
        f"{suite.description}\n\n{table(rows)}\n\n{extra}\n\n{chart_line(suite)}\n{end}"
    )
    if start in text and end in text:
        before, rest = text.split(start, 1)
        text = before + body + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + body + "\n"
    DOC.parent.mkdir(exist_ok=True)
    DOC.write_text(text)


def main(argv: list[str] | None = None) -> int:
    # Incremental saves (the default) write only what changed since the previous step, and
    # most suites save one unchanging state again and again: ckptstore would be timed writing
    # nothing. Every suite measures full saves, here and in the children it starts, except
    # the incremental suite, which turns them on for the stores it measures them on.
    os.environ.setdefault("CKPTSTORE_INCREMENTAL", "0")
    suites = discover()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("suites", nargs="*", help="suites to run (default: all)")
    parser.add_argument("-r", "--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results")
    parser.add_argument("--workdir", type=Path, default=None, help="scratch directory")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    parser.add_argument(
        "--workloads",
        default="",
        help="comma-separated workloads, for the suites that run several (async, async-gpu): "
        "the section then holds those alone; default all",
    )
    parser.add_argument("--no-doc", action="store_true", help="do not touch docs/benchmarks.md")
    parser.add_argument("--list", action="store_true")
    parser.add_argument(
        "--charts-only",
        action="store_true",
        help="redraw the charts from <out>/results.json and embed them; measure nothing",
    )
    args = parser.parse_args(argv)
    if args.list:
        for name, suite in sorted(suites.items()):
            print(f"{name:20s} {suite.title}")
        return 0
    unknown = set(args.suites) - set(suites)
    if unknown:
        parser.error(f"unknown suites {sorted(unknown)}; --list shows them")
    chosen = args.suites or sorted(suites)
    if args.charts_only:
        return charts_only(suites, args.out / "results.json", chosen)
    args.out.mkdir(parents=True, exist_ok=True)
    write_doc = not args.no_doc and not args.quick
    command = "python scripts/bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    # read once, before the run writes its sections: every section of this run names it
    commit = report.ckptstore_version()
    if write_doc and "uncommitted" in commit:
        raise SystemExit(
            f"ckptstore is at {commit}: commit first, so every section of docs/benchmarks.md "
            "names a commit that reproduces it (or pass --no-doc)"
        )
    all_rows: list[dict[str, object]] = []
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)  # as --out is
    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="ckptstore-bench-") as scratch:
        for name in chosen:
            suite = suites[name]
            workdir = Path(scratch) / name
            workdir.mkdir()
            ctx = Context(
                repeat=args.repeat,
                workdir=workdir,
                quick=args.quick,
                workloads=tuple(w for w in args.workloads.split(",") if w),
            )
            print(f"== {name}: {suite.title}", flush=True)
            rows = suite.run(ctx)
            if "skipped" in ctx.options:  # nothing it needs here: its section stays as it was
                print(f"   skipped: {ctx.options['skipped']}", flush=True)
                shutil.rmtree(workdir, ignore_errors=True)
                continue
            print(table(rows), flush=True)
            extra = str(ctx.options.get("summary", ""))
            if extra:
                print(extra, flush=True)
            # A suite's servers and files go before the next suite starts: the dcp suite
            # leaves ~30 GiB in its SeaweedFS, whose write-back then slowed the disk under
            # the next suite's server (SeaweedFS answered 500 to every retry of a part).
            shutil.rmtree(workdir, ignore_errors=True)
            dicts = [r.as_dict() for r in rows]
            if write_doc:
                if rows:
                    draw_chart(suite, dicts)
                write_section(suite, rows, command.strip(), commit, extra)
            all_rows += dicts
    merge_results(args.out / "results.json", chosen, all_rows)
    if write_doc:
        write_header()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
