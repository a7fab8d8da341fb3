"""The newcomer's path of docs/getting-started.md, run exactly as the page writes it.

The page's commands are read from the page itself, so the test fails when they stop
working and cannot drift from what a reader types: start the local S3 server, run the main
job against the URL it prints, then ``ckptstore ls``, ``verify`` and ``cp`` to a local
directory, and stop the server. Everything runs in subprocesses through ``bash``, in a
scratch directory, as a shell session would. The only change made to the page's commands:
if port 8333 is taken on this shared machine, the server picks another port and prints
its URL, and that URL replaces the page's (which is what the page tells the reader to do).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import ckptstore
from ckptstore.testing.servers import process_is
from tests.children import python_path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "getting-started.md"
BASH_BLOCK = re.compile(
    r"(?P<mark><!-- doc-test: newcomer path[^>]*-->\s*)?```bash\n(?P<code>.*?)```", re.S
)

pytestmark = [pytest.mark.s3, pytest.mark.torch]


def page_commands() -> tuple[str, str]:
    """The page's ``local_s3 start`` command line and its marked newcomer-path block."""
    blocks = list(BASH_BLOCK.finditer(PAGE.read_text()))
    starts = [
        line
        for b in blocks
        for line in b["code"].splitlines()
        if line.startswith("python -m ckptstore.testing.local_s3 start")
    ]
    path = [b["code"] for b in blocks if b["mark"]]
    assert len(starts) == 1, starts
    assert len(path) == 1, "getting-started.md lost its marked newcomer-path block"
    return starts[0], path[0]


def shell(script: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    scripts = sysconfig.get_path("scripts")  # where pip put the ckptstore command
    env = {
        **os.environ,
        "PYTHONPATH": python_path(),
        "PATH": f"{scripts}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHON": sys.executable,
    }
    # ``python`` is this interpreter, as it is for a reader inside their environment.
    script = f'python() {{ "$PYTHON" "$@"; }}\nset -euo pipefail\n{script}'
    return subprocess.run(
        ["bash", "-c", script],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_newcomer_path_runs_as_written(tmp_path: Path) -> None:
    start, path = page_commands()
    state_file = tmp_path / "local-s3" / "state.json"
    started = shell(start, tmp_path, timeout=180)
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        printed = re.findall(r"^\s+(s3://\S+)$", started.stdout, re.M)
        assert len(printed) == 1, started.stdout
        url = printed[0]
        assert re.fullmatch(
            r"s3://ckpt/run1\?endpoint_url=http://127\.0\.0\.1:\d+&anonymous=true", url
        )
        state = json.loads(state_file.read_text())
        assert f"stop --dir {tmp_path / 'local-s3'}" in started.stdout  # the exact stop hint
        written = re.search(r"^URL='(?P<url>[^']+)'$", path, re.M)
        assert written is not None, path
        script = path.replace(written["url"], url)  # the same URL unless 8333 was taken

        done = shell(script, tmp_path, timeout=600)
        out = done.stdout
        assert done.returncode == 0, out + done.stderr
    finally:
        if state_file.exists():  # the path failed before its own stop: stop by PID
            shell(
                f"python -m ckptstore.testing.local_s3 stop --dir {tmp_path / 'local-s3'}",
                tmp_path,
                timeout=120,
            )
    # The main job saved, restored bit-exact and kept the last three checkpoints...
    assert "OK: step 99 restored bit-exact" in out
    assert "checkpoints kept: [60, 80, 99]" in out
    # ...ls listed them, verify checked every byte, cp copied them to ./run1-copy...
    listed = [line.split()[0] for line in out.splitlines() if re.match(r"^(60|80|99)\s+\d", line)]
    assert listed == ["60", "80", "99"], out
    assert "all 3 steps intact" in out
    assert out.count("verified, committed") == 3
    copy = tmp_path / "run1-copy"
    assert ckptstore.list_steps(copy) == [60, 80, 99]
    restored = ckptstore.load(copy, 99)
    assert restored["step"] == 99
    # ...and the server is stopped, its state file gone, its data kept.
    assert "stopped SeaweedFS" in out
    assert not process_is(state["pid"], "weed")
    assert not state_file.exists()
    assert (tmp_path / "local-s3" / "data").is_dir()


def test_local_s3_takes_a_free_port_when_8333_is_taken_and_says_so(tmp_path: Path) -> None:
    import socket

    from ckptstore.testing.local_s3 import DEFAULT_PORT

    command = "python -m ckptstore.testing.local_s3"
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past a TIME_WAIT
    try:
        with contextlib.suppress(OSError):  # a listener holds it already: just as good
            holder.bind(("127.0.0.1", DEFAULT_PORT))
            holder.listen()
        started = shell(f"{command} start --dir ./s3 --bucket other", tmp_path, timeout=180)
        try:
            assert started.returncode == 0, started.stdout + started.stderr
            assert f"(port {DEFAULT_PORT} is taken, so another one)" in started.stdout
            (url,) = re.findall(r"^\s+(s3://\S+)$", started.stdout, re.M)
            assert url.startswith("s3://other/run1?endpoint_url=http://127.0.0.1:")
            assert f":{DEFAULT_PORT}&" not in url
            ckptstore.save(url, {"x": list(range(3))}, step=1)  # the printed URL works
            assert ckptstore.list_steps(url) == [1]
            again = shell(f"{command} start --dir ./s3", tmp_path, timeout=60)
            assert again.returncode == 1
            assert "already running" in again.stderr
            assert url in again.stderr  # and it says how to use the running one
        finally:
            stopped = shell(f"{command} stop --dir ./s3", tmp_path, timeout=120)
        assert stopped.returncode == 0, stopped.stderr
        nothing = shell(f"{command} stop --dir ./s3", tmp_path, timeout=60)
        assert nothing.returncode == 1
        assert "nothing to stop" in nothing.stderr
    finally:
        holder.close()


def test_local_s3_needs_nothing_from_the_test_extra(tmp_path: Path) -> None:
    """The page installs '.[torch,local-s3]', without pytest or hypothesis: the command must
    not import them (ckptstore.testing's suites do, so the package loads them lazily)."""
    blocked = "import sys; sys.modules['pytest'] = sys.modules['hypothesis'] = None; "
    run = "import runpy; runpy.run_module('ckptstore.testing.local_s3', run_name='__main__')"
    result = subprocess.run(
        [sys.executable, "-c", blocked + run, "status", "--dir", str(tmp_path / "none")],
        env={**os.environ, "PYTHONPATH": python_path()},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1, result.stderr  # 1: not running, and no ImportError
    assert "not running (no state file at" in result.stdout
    assert "Error" not in result.stderr
