"""The ``ckptstore`` command, run in-process through ``main([...])`` and as a subprocess.

Every command runs against a local directory (and S3 on moto where marked); bad input checks
the exit status and that the message is one line with no traceback.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import sysconfig
import termios
import threading
from pathlib import Path

import pytest

from ckptstore import cli
from ckptstore.store import registry

ROOT = Path(__file__).resolve().parent.parent


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def assert_one_line_error(err: str, *fragments: str) -> None:
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "error:" in lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


# ----------------------------------------------------------------- framework


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "--help")
    assert status == 0
    for command in ("bench",):
        assert command in out


@pytest.mark.parametrize("command", ["bench"])
def test_every_command_help_shows_examples(
    capsys: pytest.CaptureFixture[str], command: str
) -> None:
    status, out, _ = run(capsys, command, "--help")
    assert status == 0
    assert "examples:" in out
    assert f"ckptstore {command} " in out.split("examples:", 1)[1]


def test_bad_command_line_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run(capsys, "bench")  # URL missing
    assert status == cli.EXIT_USAGE
    assert "required" in err
    status, _, err = run(capsys, "bench", "memory://x", "--size", "lots")
    assert status == cli.EXIT_USAGE
    assert "cannot parse size" in err


def test_unknown_scheme_is_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys, "bench", "nosuchscheme://bucket/x")
    assert status == cli.EXIT_ERROR
    assert out == ""
    assert_one_line_error(err, "nosuchscheme://", "no backend")


def test_unknown_store_option_is_one_line_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    status, _, err = run(capsys, "bench", str(tmp_path), "-o", "colour=blue")
    assert status == cli.EXIT_ERROR
    assert_one_line_error(err, "colour")


def test_missing_optional_dependency_is_one_line_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "cli_needs_dep.py").write_text("import ckptstore_dependency_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(
        registry._BACKENDS,
        "needsdep",
        registry.BackendSpec("cli_needs_dep:Store", "pip install 'ckptstore[needsdep]'"),
    )
    status, _, err = run(capsys, "bench", "needsdep://bucket/x")
    assert status == cli.EXIT_ERROR
    assert_one_line_error(err, "ckptstore_dependency_not_installed", "pip install")


def test_a_bug_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    async def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug in ckptstore")

    monkeypatch.setattr("ckptstore.bench.bench_store", broken)
    with pytest.raises(RuntimeError, match="a bug in ckptstore"):
        cli.main(["bench", str(tmp_path), "--size", "1MiB", "--part-sizes", "1MiB"])


def test_setup_errors_of_client_libraries_are_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    botocore_exceptions = pytest.importorskip("botocore.exceptions")

    async def no_credentials(*args: object, **kwargs: object) -> None:
        raise botocore_exceptions.NoCredentialsError()

    monkeypatch.setattr("ckptstore.bench.bench_store", no_credentials)
    status, _, err = run(capsys, "bench", str(tmp_path), "--size", "1MiB", "--part-sizes", "1MiB")
    assert status == cli.EXIT_ERROR
    assert_one_line_error(err, "no AWS credentials")


# ----------------------------------------------------------------- bench

BENCH_SMALL = [
    "--size",
    "4MiB",
    "--part-sizes",
    "512KiB,1MiB,2MiB",
    "--concurrency",
    "2,4",
    "--small-count",
    "40",
]


def test_bench_local_reports_trials_and_suggestion(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    status, out, err = run(capsys, "bench", str(tmp_path), *BENCH_SMALL, "--json")
    assert status == 0, err
    report = json.loads(out)
    # stage 1: three part sizes at one concurrency; stage 2: the other concurrency.
    assert len(report["large"]) == 3 + 1
    assert {t["part_size"] for t in report["large"][:3]} == {512 << 10, 1 << 20, 2 << 20}
    stage1 = report["large"][0]["concurrency"]
    assert all(t["concurrency"] == stage1 for t in report["large"][:3])
    assert report["large"][3]["concurrency"] != stage1
    best = min(report["large"], key=lambda t: t["write_seconds"] + t["read_seconds"])
    assert report["best"] == best
    assert report["suggested_settings"] == {
        "part_size": best["part_size"],
        "max_concurrency": best["concurrency"],
    }
    for trial in report["large"]:
        assert trial["nbytes"] == 4 << 20
        assert trial["write_mib_s"] == pytest.approx(4 / trial["write_seconds"])
    assert [t["concurrency"] for t in report["small"]] == [2, 4]
    assert all(t["count"] == 40 and t["puts_per_s"] > 0 for t in report["small"])
    assert list(tmp_path.iterdir()) == []  # scratch objects removed


def test_bench_text_names_the_suggestion(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "bench", "memory://cli-bench", *BENCH_SMALL)
    assert status == 0
    assert "<- best" in out
    assert "suggested: part_size=" in out
    assert "CKPTSTORE_PART_SIZE=" in out


def test_bench_refuses_part_sizes_that_do_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run(capsys, "bench", "memory://x", "--size", "1MiB", "--part-sizes", "4MiB")
    assert status == cli.EXIT_ERROR
    assert_one_line_error(err, "part size")


# ----------------------------------------------------------------- entry points


def _entry_point_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def test_python_dash_m_runs_the_command(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ckptstore", "bench", "nosuchscheme://x"],
        capture_output=True,
        text=True,
        env=_entry_point_env(),
        timeout=120,
    )
    assert result.returncode == cli.EXIT_ERROR
    assert_one_line_error(result.stderr, "nosuchscheme")


def test_console_script_runs_the_command(tmp_path: Path) -> None:
    script = Path(sysconfig.get_path("scripts")) / "ckptstore"
    if not script.exists():
        pytest.fail("the ckptstore entry point is not installed; pip install -e '.[test]'")
    result = subprocess.run(
        [str(script), "bench", str(tmp_path), *BENCH_SMALL, "--json"],
        capture_output=True,
        text=True,
        env=_entry_point_env(),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["url"] == tmp_path.as_uri()
    assert result.stderr == ""  # no progress bar: stderr is not a terminal


def test_progress_bar_is_drawn_on_a_terminal(tmp_path: Path) -> None:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))  # 100 columns
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: the child closed its end
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        result = subprocess.run(
            [sys.executable, "-m", "ckptstore", "bench", str(tmp_path), *BENCH_SMALL],
            stdout=subprocess.PIPE,
            stderr=slave,
            env=_entry_point_env(),
            timeout=300,
        )
    finally:
        os.close(slave)
    reader.join(timeout=30)
    os.close(master)
    drawn = b"".join(chunks).decode(errors="replace")
    assert result.returncode == 0, drawn
    assert "bench" in drawn
    assert "trial" in drawn  # tqdm's unit, so the bar itself was drawn
    assert b"suggested" in result.stdout  # the report still goes to stdout
