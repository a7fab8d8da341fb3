"""The linters and the type checker are part of the test suite, so one command checks all."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "command",
    [
        ["ruff", "check", "ckptstore", "tests", "scripts"],
        ["ruff", "format", "--check", "ckptstore", "tests", "scripts"],
        [sys.executable, "-m", "mypy"],
    ],
    ids=["ruff-check", "ruff-format", "mypy-strict"],
)
def test_tool_passes(command: list[str]) -> None:
    if shutil.which(command[0]) is None and command[0] != sys.executable:
        pytest.fail(f"{command[0]} is not installed; pip install -e '.[test]'")
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
