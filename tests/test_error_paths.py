"""Every error path closes what it opened (issue 30): each face's failing calls (a missing
step, a missing bucket, a refused argument, the CLI's commands) run against a real server in
a child process, which reports every store client still open after each call and, at exit,
every "Unclosed ..." warning aiohttp gives (tests/error_paths_child.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.children import python_path

CHILD = Path(__file__).with_name("error_paths_child.py")

#: What each scenario must raise: a piece of its message (every other scenario fails too,
#: except the first save).
EXPECTED = {
    "save": None,
    "load a missing step": "step 99",
    "load from a missing bucket": "does not exist",
    "save to a missing bucket": "does not exist",
    "manager refusing preemption=": "preemption=[999]",
    "dcp load of a step never committed": "step 5",
    "dcp save to a missing bucket": "does not exist",
    "manager refusing local= the same root": "same root",
    "cli ls of a missing bucket": "SystemExit",
    "cli cp to a missing bucket": "SystemExit",
}


def _run(dialect: str, url: str, nobucket: str, options: dict[str, Any], scratch: Path) -> Any:
    env = {
        **os.environ,
        "CKPTSTORE_TEST_STORE_OPTIONS": json.dumps(options),
        "PYTHONPATH": python_path(),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-W",
            "always::ResourceWarning",
            str(CHILD),
            dialect,
            url,
            nobucket,
            str(scratch),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line.removeprefix("RESULT ")), proc.stderr


def _check(results: dict[str, Any], stderr: str) -> None:
    control = results.pop("control: a store left open")
    assert control["error"] is None, control
    assert len(control["open"]) == 1, control  # the harness sees a client left open
    for name, result in results.items():
        assert not result["open"], f"{name}: left open {result['open']} ({result['error']})"
        expected = EXPECTED.get(name, "")
        if expected is None:
            assert result["error"] is None, f"{name}: {result['error']}"
        else:
            assert result["error"] is not None, f"{name} did not fail"
            assert expected in result["error"], f"{name}: {result['error']}"
    unclosed = [line for line in stderr.splitlines() if "Unclosed" in line]
    assert not unclosed, "\n".join(unclosed)


@pytest.mark.s3
@pytest.mark.torch
def test_every_failing_call_closes_its_s3_clients(moto_s3: Any, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    url = f"s3://{moto_s3.bucket}/errors-{uuid.uuid4().hex[:8]}"
    _check(*_run("s3", url, "s3://no-such-bucket-here/run", moto_s3.options(), tmp_path))


@pytest.mark.gcs
@pytest.mark.torch
@pytest.mark.slow
def test_every_failing_call_closes_its_gcs_clients(
    fake_gcs: Any, gcs_bucket: str, tmp_path: Path
) -> None:
    pytest.importorskip("torch")
    url = f"gs://{gcs_bucket}/errors-{uuid.uuid4().hex[:8]}"
    options = {"endpoint_url": fake_gcs.endpoint, "token": "anon"}
    _check(*_run("gcs", url, "gs://no-such-bucket-here/run", options, tmp_path))
