"""The benchmark report's generated parts: chart, header, --charts-only, section embedding."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

from ckptstore.config import default_settings

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import bench  # noqa: E402
from benchlib import Context, Result, Suite, report  # noqa: E402


def rows() -> list[dict[str, object]]:
    def row(system: str, op: str, seconds: float) -> dict[str, object]:
        return Result(
            suite="demo",
            workload="1 GiB",
            target="local",
            system=system,
            op=op,
            nbytes=1 << 30,
            seconds=seconds,
            runs=[seconds],
            cpu_seconds=0.1,
        ).as_dict()

    return [row("ckptstore", "save", 0.5), row("peer", "save", 1.0), row("ckptstore", "load", 0.25)]


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG file"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_chart_is_drawn_from_result_rows(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="charts need matplotlib (the bench extra)")
    out = report.chart(rows(), tmp_path / "bench-demo.png", title="demo")
    width, height = png_size(out)
    assert width > 100
    assert height > 100


def test_chart_refuses_no_rows(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="charts need matplotlib (the bench extra)")
    with pytest.raises(ValueError, match="no rows"):
        report.chart([], tmp_path / "empty.png")


def test_header_names_the_command_machine_and_versions() -> None:
    versions = report.library_versions()
    for name in ("ckptstore", "numpy", "torch", "jax", "orbax-checkpoint", "s3fs"):
        assert name in versions
    for name in ("aiobotocore", "gcsfs", "s3torchconnector"):
        assert name in versions
    assert "seaweedfs (weed version)" in versions
    assert "fake-gcs-server" in versions
    import numpy

    assert versions["numpy"] == numpy.__version__  # read at run time, not written down
    block = report.header_block(versions, report.machine_facts())
    assert block.startswith(report.HEADER_START)
    assert block.endswith(report.HEADER_END)
    assert "python scripts/bench.py\n" in block
    assert f"| numpy | {numpy.__version__} |" in block
    assert "cores" in block
    assert "kernel" in block


def test_replace_header_keeps_sections() -> None:
    old = "# Benchmarks\n\nold prose\n\n<!-- suite:a -->\nA\n<!-- /suite:a -->\n"
    once = report.replace_header(old, f"{report.HEADER_START}\nnew\n{report.HEADER_END}")
    assert "old prose" not in once
    assert "<!-- suite:a -->\nA\n<!-- /suite:a -->" in once
    twice = report.replace_header(once, f"{report.HEADER_START}\nnewer\n{report.HEADER_END}")
    assert "newer" in twice
    assert "\nnew\n" not in twice
    assert twice.count("suite:a -->") == 2


def test_charts_only_draws_and_embeds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib", reason="charts need matplotlib (the bench extra)")
    doc = tmp_path / "docs" / "benchmarks.md"
    doc.parent.mkdir()
    doc.write_text("<!-- suite:demo -->\n## Demo\n\ntable\n<!-- /suite:demo -->\n")
    monkeypatch.setattr(bench, "DOC", doc)
    monkeypatch.setattr(bench, "IMG", tmp_path / "docs" / "img")
    suite = Suite(name="demo", title="Demo", run=lambda ctx: [])
    results = tmp_path / "results.json"
    results.write_text(json.dumps(rows()))

    assert bench.charts_only({"demo": suite}, results, ["demo"]) == 0
    png = tmp_path / "docs" / "img" / "bench-demo.png"
    assert png_size(png)[0] > 100
    text = doc.read_text()
    assert "![Demo: GiB/s per system](img/bench-demo.png)" in text
    assert text.index("img/bench-demo.png") < text.index("<!-- /suite:demo -->")
    bench.charts_only({"demo": suite}, results, ["demo"])  # again: embedded once, not twice
    assert doc.read_text().count("img/bench-demo.png") == 1


def test_charts_only_without_results_fails(tmp_path: Path) -> None:
    suite = Suite(name="demo", title="Demo", run=lambda ctx: [])
    assert bench.charts_only({"demo": suite}, tmp_path / "missing.json", ["demo"]) == 2


def test_merge_results_keeps_other_suites(tmp_path: Path) -> None:
    path = tmp_path / "results.json"
    path.write_text(json.dumps([{"suite": "a", "x": 1}, {"suite": "b", "x": 2}]))
    bench.merge_results(path, ["b"], [{"suite": "b", "x": 3}])
    assert json.loads(path.read_text()) == [{"suite": "a", "x": 1}, {"suite": "b", "x": 3}]


def test_a_measured_section_embeds_its_chart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib", reason="charts need matplotlib (the bench extra)")
    doc = tmp_path / "docs" / "benchmarks.md"
    monkeypatch.setattr(bench, "DOC", doc)
    monkeypatch.setattr(bench, "IMG", tmp_path / "docs" / "img")
    suite = Suite(name="demo", title="Demo", run=lambda ctx: [])
    results = [
        Result(**{k: v for k, v in r.items() if k in Result.__annotations__}) for r in rows()
    ]

    bench.write_section(suite, results, "python scripts/bench.py demo", "git abc", "")
    assert "appears on the next run of `python scripts/bench.py demo`" in doc.read_text()
    assert bench.draw_chart(suite, rows())
    bench.write_section(suite, results, "python scripts/bench.py demo", "git abc", "")
    text = doc.read_text()
    assert "![Demo: GiB/s per system](img/bench-demo.png)" in text
    assert "appears on the next run" not in text
    assert "| 1 GiB | local | peer | save | 1.000 | 1.00 |" in text


def test_rows_of_one_system_on_two_targets_get_groups_of_their_own() -> None:
    base = rows()[0]
    on_memory = {**base, "target": "memory", "seconds": 0.25}
    groups, systems, value = report.bar_groups([base, on_memory])
    assert groups == [("1 GiB, local", "save"), ("1 GiB, memory", "save")]
    assert systems == ["ckptstore"]
    assert value[("1 GiB, local", "save"), "ckptstore"] == pytest.approx(2.0)
    assert value[("1 GiB, memory", "save"), "ckptstore"] == pytest.approx(4.0)
    # one target: the label stays the workload alone
    assert report.bar_groups(rows())[0] == [("1 GiB", "save"), ("1 GiB", "load")]


def test_every_section_names_its_commit_and_the_header_lists_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    doc = tmp_path / "docs" / "benchmarks.md"
    monkeypatch.setattr(bench, "DOC", doc)
    monkeypatch.setattr(bench, "draw_chart", lambda suite, rows: None)
    old = "<!-- suite:old -->\n## Old\n\n`python scripts/bench.py` on 2026-11-20 10:00 UTC; vm.\n"
    doc.parent.mkdir()
    doc.write_text(old + "<!-- /suite:old -->\n")
    result = [Result(**{k: v for k, v in r.items() if k in Result.__annotations__}) for r in rows()]
    for name, commit in (("a", "git 111"), ("b", "git 222")):
        suite = Suite(name=name, title=f"Suite {name}", run=lambda ctx: [])
        bench.write_section(suite, result, f"python scripts/bench.py {name}", commit, "")
    text = doc.read_text()
    assert "`python scripts/bench.py a` at ckptstore git 111 on " in text
    assert "`python scripts/bench.py b` at ckptstore git 222 on " in text
    runs = report.section_runs(text)
    assert [(title, commit) for title, commit, _ in runs] == [
        ("Old", "not recorded"),
        ("Suite a", "git 111"),
        ("Suite b", "git 222"),
    ]
    assert runs[0][2] == "2026-11-20 10:00 UTC"

    bench.write_header()
    header = doc.read_text().split(report.HEADER_END)[0]
    # three runs: the header says so and names each, and claims no single commit
    assert "The 3 sections below cannot be taken as one run: 1 at ckptstore git 111; " in header
    assert "1 with no recorded commit" in header
    assert "| Suite a | git 111 |" in header
    assert "| Old | not recorded | 2026-11-20 10:00 UTC |" in header
    assert "\n| ckptstore | git" not in header  # no library row claims one commit


def test_a_page_of_one_run_says_so() -> None:
    block = report.header_block(
        {"ckptstore": "git 999", "numpy": "2"},
        {"cores": "2"},
        sections=[("A", "git 999", "t1"), ("B", "git 999", "t2")],
    )
    assert "Every section below was measured at ckptstore git 999." in block


def test_the_page_is_not_written_from_uncommitted_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench, "DOC", tmp_path / "benchmarks.md")
    monkeypatch.setattr(report, "ckptstore_version", lambda: "git 123 (with uncommitted changes)")
    # bench.main turns incremental saves off for its run, in os.environ and so in the default
    # Settings read meanwhile (cached for the process): undo both, or every later test of
    # the session saves in full
    monkeypatch.setenv("CKPTSTORE_INCREMENTAL", "0")
    try:
        with pytest.raises(SystemExit, match="uncommitted changes"):
            bench.main(["store-local", "--out", str(tmp_path / "out")])
    finally:
        default_settings.cache_clear()
    assert not (tmp_path / "benchmarks.md").exists()


def test_workloads_choose_a_suites_workloads_in_its_order_and_refuse_unknown_ones(
    tmp_path: Path,
) -> None:
    from benchlib import Context

    names = ("1GiB", "transformer")
    assert Context(1, tmp_path).chosen(names) == ["1GiB", "transformer"]
    assert Context(1, tmp_path, workloads=("transformer",)).chosen(names) == ["transformer"]
    both = Context(1, tmp_path, workloads=("transformer", "1GiB"))
    assert both.chosen(names) == ["1GiB", "transformer"]
    with pytest.raises(SystemExit, match=r"--workloads \['small'\]: this suite runs"):
        Context(1, tmp_path, workloads=("small", "transformer")).chosen(names)


def test_a_workdir_that_does_not_exist_yet_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--workdir`` is made as ``--out`` is: a run once died at its start, after the
    checks, on a scratch directory not created beforehand."""
    seen: list[Path] = []

    def run(ctx: Context) -> list[Result]:
        seen.append(ctx.workdir)
        return []

    monkeypatch.setattr(bench, "discover", lambda: {"probe": Suite("probe", "a probe", run)})
    monkeypatch.setenv("CKPTSTORE_INCREMENTAL", "0")  # bench.main sets it (see above)
    try:
        assert (
            bench.main(
                [
                    "probe",
                    "--no-doc",
                    "--out",
                    str(tmp_path / "out"),
                    "--workdir",
                    str(tmp_path / "not" / "yet"),
                ]
            )
            == 0
        )
    finally:
        default_settings.cache_clear()
    assert len(seen) == 1
    assert seen[0].parent.parent == tmp_path / "not" / "yet"
