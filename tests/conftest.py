from __future__ import annotations

import pytest

from tests import matrix

# Test servers, each a module of session-scoped fixtures.
pytest_plugins = [
    "tests.servers.moto",
    "tests.servers.seaweed",
    "tests.servers.fakegcs",
    # where the multi-process (gloo) tests save: the `target` fixture
    "tests.multirank",
]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full",
        action="store_true",
        default=False,
        help="the full matrix: also the tests marked slow, and every trial loop at its full "
        "count (tests/matrix.py); .ci/run runs it",
    )


def pytest_configure(config: pytest.Config) -> None:
    # Before collection imports any test module (xdist workers configure on their own).
    matrix.FULL = bool(config.getoption("--full"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if matrix.FULL:
        # The full matrix runs trial loops at up to 10x their default count, beside the other
        # worker's servers on a 2-core machine: the SIGKILL loop of tests/test_tiers_crash.py
        # takes 91 s alone and passed 300 s under CI's load. The hang guard scales with it.
        for item in items:
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(matrix.FULL_TIMEOUT))
        return
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if item.get_closest_marker("slow") is None]


def pytest_report_header(config: pytest.Config) -> str:
    if matrix.FULL:
        return "ckptstore: the full matrix (--full)"
    return "ckptstore: the default run; the slow matrix and full trial counts need --full"
