"""What a test's Python child (a rank, a writer killed mid-save, a documented script) needs to
import this checkout's ckptstore and whatever the test process itself imports."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def python_path(*first: str | os.PathLike[str]) -> str:
    """``PYTHONPATH`` for a child: ``first`` (by default the checkout), then the entries of
    this process's own ``PYTHONPATH``.

    A child whose path held the checkout alone lost what the parent found on its path: on a
    lent GPU machine whose wheels (orjson among them) lay in a directory named there, two
    tests failed in their child for want of orjson while the test process had it.
    """
    entries = [os.fspath(entry) for entry in first] or [str(ROOT)]
    for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        if entry and entry not in entries:
            entries.append(entry)
    return os.pathsep.join(entries)
