"""The environment tests give their Python children (tests/children.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.children import ROOT, python_path


def test_a_child_finds_the_checkout_and_what_the_parent_path_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a module only a directory on the parent's PYTHONPATH holds, as a machine's wheels
    # installed with --target are
    wheels = tmp_path / "site"
    wheels.mkdir()
    (wheels / "only_on_the_parent_path.py").write_text("VALUE = 42\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(wheels), str(ROOT), ""]))
    path = python_path()
    assert path.split(os.pathsep) == [str(ROOT), str(wheels)]  # the checkout first, once
    code = (
        "import ckptstore, only_on_the_parent_path; "
        "print(ckptstore.__file__); print(only_on_the_parent_path.VALUE)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": path},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.split()
    assert Path(out[0]).resolve().is_relative_to(ROOT)
    assert out[1] == "42"


def test_entries_given_replace_the_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    # a test that runs another tree's ckptstore (an old commit's) names it instead
    monkeypatch.setenv("PYTHONPATH", "/wheels")
    assert python_path("/old/tree").split(os.pathsep) == ["/old/tree", "/wheels"]
    monkeypatch.delenv("PYTHONPATH")
    assert python_path("/old/tree") == "/old/tree"
