"""Every Python code block in README.md and docs/ runs, the docs site builds cleanly, and
the docs stay true to the pages they cite.

Blocks of one page run in order in one namespace, in a scratch working directory, so a page
reads like a session. A block preceded by ``<!-- doc-test: skip (reason) -->`` is not run;
the reason must say why (e.g. it needs real cloud credentials).

Measured figures live in ``docs/benchmarks.md`` (the benchmark script writes it) and in the
example runs of ``docs/cli.md``. Any other page that quotes one cites the section it comes
from with a link in the same paragraph or list item;
:func:`test_quoted_figures_are_in_the_section_they_cite` fails when a quoted figure (a
ratio like ``1.65x``, a share like ``99%``, a time, a throughput) in a paragraph with a link
no longer appears in the section that link names, so re-running the benchmarks cannot leave
a stale figure behind.
Every link to an anchor must name a heading of its page (``mkdocs --strict`` checks neither
the README nor, by default, anchors).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import pytest

from ckptstore.testing.servers import SeaweedFS, free_ports
from tests.children import python_path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
BLOCK = re.compile(r"(?:<!-- doc-test: (?P<spec>[^>]*?) -->\s*)?```python\n(?P<code>.*?)```", re.S)
#: The endpoint the docs write for a local S3 server; the test server's replaces it.
DOCS_ENDPOINT = "http://127.0.0.1:8333"


@dataclass(frozen=True)
class Block:
    """A Python block of a page and how the docs test runs it.

    ``<!-- doc-test: skip (reason) -->`` before a block: not run. ``<!-- doc-test: s3 -->``:
    it needs an S3 server; it runs against the test SeaweedFS (``DOCS_ENDPOINT`` replaced by
    its endpoint, the buckets it names created first) and must not be needed by the page's
    other blocks. ``<!-- doc-test: s3, ranks N -->``: a complete script a launcher such as
    torchrun starts on N ranks; it runs on N processes with torchrun's environment.
    ``<!-- doc-test: ranks N -->``: the same without a server, after the page's local blocks.
    """

    code: str
    skip: bool = False
    s3: bool = False
    ranks: int = 0


def python_blocks(page: Path) -> list[Block]:
    out = []
    for m in BLOCK.finditer(page.read_text()):
        spec = m["spec"] or ""
        ranks = re.search(r"\branks (\d+)", spec)
        out.append(
            Block(
                m["code"],
                skip=spec.startswith("skip"),
                s3=bool(re.match(r"s3\b", spec)),
                ranks=int(ranks[1]) if ranks else 0,
            )
        )
    return out


def run_script(script: str, cwd: Path, name: str = "page.py") -> subprocess.CompletedProcess[str]:
    (cwd / name).write_text(script)
    return subprocess.run(
        [sys.executable, name],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": python_path()},
        capture_output=True,
        text=True,
        timeout=600,
    )


def local_blocks(page: Path) -> list[str]:
    return [b.code for b in python_blocks(page) if not (b.skip or b.s3 or b.ranks)]


def local_scripts(page: Path) -> list[Block]:
    """The page's scripts for several processes that need no server."""
    return [b for b in python_blocks(page) if b.ranks and not (b.skip or b.s3)]


@pytest.mark.parametrize(
    "page",
    [p for p in PAGES if local_blocks(p) or local_scripts(p)],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_code_blocks_run(page: Path, tmp_path: Path) -> None:
    result = run_script("\n\n".join(local_blocks(page)), tmp_path)
    assert result.returncode == 0, f"{page.name}:\n{result.stdout}\n{result.stderr}"
    for block in local_scripts(page):
        run_ranks(block.code, block.ranks, tmp_path)


def run_ranks(script: str, ranks: int, cwd: Path) -> list[str]:
    """``script`` on ``ranks`` processes with the environment torchrun gives each rank;
    returns each rank's output, after asserting that every rank exited 0."""
    (cwd / "ranks.py").write_text(script)
    port = free_ports(1)[0]
    procs = [
        subprocess.Popen(
            [sys.executable, "ranks.py"],
            cwd=cwd,
            env={
                **os.environ,
                "PYTHONPATH": python_path(),
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(ranks),
                "LOCAL_WORLD_SIZE": str(ranks),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "GLOO_SOCKET_IFNAME": "lo",
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(ranks)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=300)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    failed = [
        f"rank {i}:\n{out}"
        for i, (p, out) in enumerate(zip(procs, outputs, strict=True))
        if p.returncode
    ]
    assert failed == [], "\n".join(failed)
    return outputs


@pytest.mark.s3
@pytest.mark.parametrize(
    "page",
    [p for p in PAGES if any(b.s3 for b in python_blocks(p))],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_server_code_blocks_run(page: Path, tmp_path: Path, seaweedfs: SeaweedFS) -> None:
    """The page's examples that need an S3 server, against the test SeaweedFS, after the
    page's other blocks (in page order); scripts for several ranks that need the server run
    last."""
    blocks = [b for b in python_blocks(page) if not b.skip]
    to_server = {b.code: b.code.replace(DOCS_ENDPOINT, seaweedfs.s3_endpoint) for b in blocks}
    for code in to_server.values():
        for bucket in set(re.findall(r"s3://([a-z0-9][a-z0-9.-]+)/", code)):
            seaweedfs.create_bucket(bucket)
    assert all(DOCS_ENDPOINT in b.code for b in blocks if b.s3), "an s3 block names no server"
    session = [to_server[b.code] for b in blocks if not b.ranks]
    result = run_script("\n\n".join(session), tmp_path)
    assert result.returncode == 0, f"{page.name}:\n{result.stdout}\n{result.stderr}"
    for block in (b for b in blocks if b.ranks and b.s3):
        run_ranks(to_server[block.code], block.ranks, tmp_path)


def test_docs_site_builds_without_warnings(tmp_path: Path) -> None:
    if shutil.which("mkdocs") is None:
        pytest.fail("mkdocs is not installed; pip install -e '.[test]'")
    result = subprocess.run(
        ["mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" not in result.stderr, result.stderr


# ----------------------------------------------------------------- links and figures

LINK = re.compile(r"\]\((?P<page>[^)#\s]*\.md)?(?:#(?P<anchor>[^)\s]+))?\)")
HEADING = re.compile(r"^(?P<level>#{1,6})[ \t]+(?P<text>.+?)[ \t]*$", re.M)
CODE_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
#: A measured figure: a ratio (1.65x), a share (99%), a time (0.742 s, 49 ms) or a
#: throughput (1.22 GiB/s, 242 MiB/s).
FIGURE = re.compile(
    r"(?<![\w.,])(?P<num>\d[\d,]*(?:\.\d+)?)(?P<unit>x\b|%|\s?ms\b|\s?s\b|\s?[GM]iB/s)"
)


def slug(heading: str) -> str:
    """The anchor Python-Markdown's toc extension (mkdocs' default) gives a heading."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def prose(page: Path) -> str:
    """A page without its code blocks (their text is output, not claims)."""
    return CODE_FENCE.sub("", page.read_text())


def sections(page: Path) -> dict[str, str]:
    """Each heading's anchor mapped to its section's text (up to the next heading of the
    same or a higher level); ``""`` maps to the whole page."""
    text = page.read_text()
    headings = list(HEADING.finditer(prose(page)))
    out = {"": text}
    for i, h in enumerate(headings):
        level = len(h["level"])
        start = text.find(h.group(0))
        end = len(text)
        for later in headings[i + 1 :]:
            if len(later["level"]) <= level:
                end = text.find(later.group(0), start + 1)
                break
        out[slug(h["text"])] = text[start:end]
    return out


def blocks(page: Path) -> list[str]:
    """Paragraphs and list items of a page's prose: the unit a citation covers."""
    out = []
    for paragraph in re.split(r"\n\s*\n", prose(page)):
        out += [b for b in re.split(r"\n(?=\s*(?:[-*]|\d+\.)\s)", paragraph) if b.strip()]
    return out


def cited(page: Path, block: str) -> list[tuple[Path, str]]:
    """``(page, anchor)`` of every link to a markdown page in ``block``."""
    return [
        ((page.parent / m["page"]).resolve() if m["page"] else page, m["anchor"] or "")
        for m in LINK.finditer(block)
        if m["page"] or m["anchor"]
    ]


def figure_in(figure: re.Match[str], text: str) -> bool:
    number, unit = figure["num"], figure["unit"].strip()
    if unit in {"x", "%"}:  # a ratio is quoted as printed: 1.65x, not 1.6x
        return re.search(rf"(?<![\d.]){re.escape(number + unit)}", text) is not None
    return re.search(rf"(?<![\d.,]){re.escape(number)}(?![\d])", text) is not None


def test_every_anchor_link_names_a_heading() -> None:
    dead = []
    for page in PAGES:
        for block in blocks(page):
            for target, anchor in cited(page, block):
                if not target.exists():
                    dead.append(f"{page.relative_to(ROOT)}: no page {target}")
                elif anchor and anchor not in sections(target):
                    dead.append(f"{page.relative_to(ROOT)}: {target.name}#{anchor}")
    assert dead == [], "links to missing pages or headings:\n" + "\n".join(dead)


def test_quoted_figures_are_in_the_section_they_cite() -> None:
    stale = []
    checked = 0
    for page in PAGES:
        for block in blocks(page):
            sources = [
                (target, anchor)
                for target, anchor in cited(page, block)
                if target != page and target.exists()
            ]
            if not sources:
                continue
            texts = [sections(target).get(anchor, "") for target, anchor in sources]
            for figure in FIGURE.finditer(block):
                checked += 1
                if not any(figure_in(figure, text) for text in texts):
                    where = ", ".join(f"{t.name}#{a}" if a else t.name for t, a in sources)
                    stale.append(f"{page.relative_to(ROOT)}: {figure.group(0)!r} not in {where}")
    assert stale == [], "figures that are not in the section they cite:\n" + "\n".join(stale)
    assert checked >= 20  # the check reads the pages it should (README, tuning, ...)


def test_figure_check_catches_a_stale_figure_and_a_dead_anchor(tmp_path: Path) -> None:
    """The two checks above fail on what they are for."""
    bench = tmp_path / "benchmarks.md"
    bench.write_text(
        "# Benchmarks\n\n## Local disk\n\nwrite **99%**, 0.742 s, 1.65x\n\n## Other\n\n5.5x\n"
    )
    page = tmp_path / "tuning.md"
    page.write_text(
        "Reached 99% and 1.65x in 0.742 s ([local](benchmarks.md#local-disk)).\n\n"
        "Reached 131% and 5.5x ([local](benchmarks.md#local-disk)).\n\n"
        "See [gone](benchmarks.md#no-such-section).\n"
    )
    found = {b: [f.group(0) for f in FIGURE.finditer(b)] for b in blocks(page)}
    good, bad, _ = blocks(page)
    text = sections(bench)["local-disk"]
    assert all(figure_in(f, text) for f in FIGURE.finditer(good)), found
    assert [f.group(0) for f in FIGURE.finditer(bad) if not figure_in(f, text)] == ["131%", "5.5x"]
    assert "no-such-section" not in sections(bench)
    assert slug("Checkpoint format: save and load vs torch.save, DCP, Orbax and raw I/O") == (
        "checkpoint-format-save-and-load-vs-torchsave-dcp-orbax-and-raw-io"
    )
    assert slug("Measure first: `ckptstore tune URL`") == "measure-first-ckptstore-tune-url"
