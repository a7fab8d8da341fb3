"""The fault proxy's rule schedule: the part of the test harness other tests count on."""

from __future__ import annotations

import random

import pytest

from ckptstore.testing.proxy import ProxyFault, _RuleCounts


def _hits(fault: ProxyFault, requests: int, seed: int = 0) -> list[int]:
    counts, rng = _RuleCounts(), random.Random(seed)
    return [n for n in range(1, requests + 1) if counts.admits(fault, rng)]


def test_every_hits_one_in_n_whatever_the_seed() -> None:
    fault = ProxyFault("503", every=4)
    assert _hits(fault, 20, seed=1) == _hits(fault, 20, seed=2) == [4, 8, 12, 16, 20]


def test_every_counts_from_after_and_stops_at_times() -> None:
    assert _hits(ProxyFault("500", every=3, after=2), 12) == [5, 8, 11]
    assert _hits(ProxyFault("500", every=3, times=2), 30) == [3, 6]


def test_rate_draws_from_the_seed() -> None:
    fault = ProxyFault("503", rate=0.3)
    assert _hits(fault, 200, seed=5) == _hits(fault, 200, seed=5)
    assert _hits(fault, 200, seed=5) != _hits(fault, 200, seed=6)


@pytest.mark.parametrize(
    ("changes", "message"),
    [({"every": 0}, "every must be at least 1"), ({"every": 5, "rate": 0.5}, "not both")],
)
def test_bad_schedules_are_refused(changes: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ProxyFault("503", **changes)  # type: ignore[arg-type]
