"""Every Python code block in README.md and docs/ runs, and the docs site builds cleanly.

Blocks of one page run in order in one namespace, in a scratch working directory, so a page
reads like a session. A block preceded by ``<!-- doc-test: skip (reason) -->`` is not run;
the reason must say why (e.g. it needs real cloud credentials).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
BLOCK = re.compile(
    r"(<!-- doc-test: skip \((?P<why>[^)]+)\) -->\s*)?```python\n(?P<code>.*?)```", re.S
)


def python_blocks(page: Path) -> list[str]:
    return [m["code"] for m in BLOCK.finditer(page.read_text()) if not m["why"]]


@pytest.mark.parametrize(
    "page",
    [p for p in PAGES if python_blocks(p)],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_code_blocks_run(page: Path, tmp_path: Path) -> None:
    script = "\n\n".join(python_blocks(page))
    (tmp_path / "page.py").write_text(script)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "page.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, f"{page.name}:\n{result.stdout}\n{result.stderr}"


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
