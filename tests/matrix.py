"""The two sizes of the test suite: the default run and the full matrix (``--full``).

``python -m pytest`` runs every layer, backend and face, and the crash, race, corruption and
hostile-manifest checks at a smaller trial count, in minutes; ``python -m pytest --full`` (what
``.ci/run`` runs) adds the tests marked ``slow`` (8-rank worlds, multi-GiB objects, the same
scenario on more backends) and runs every trial loop at its full count. tests/conftest.py sets
:data:`FULL` from the command line before any test module is imported, so a module may size its
parameters with :func:`trials` at import time.
"""

from __future__ import annotations

#: Whether this run is the full matrix (``--full``); set by tests/conftest.py.
FULL = False
#: The per-test hang guard (pytest-timeout) under ``--full``, in seconds; the default run keeps
#: pyproject.toml's 300.
FULL_TIMEOUT = 900


def trials(full: int, quick: int) -> int:
    """How many trials a randomized or repeated check runs: ``full`` under ``--full``,
    ``quick`` by default."""
    if quick > full:
        raise ValueError(f"the quick count {quick} exceeds the full count {full}")
    return full if FULL else quick
