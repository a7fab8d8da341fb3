"""The request-level store wrappers (ckptstore.store.wrappers)."""

from __future__ import annotations

import math

import pytest

from ckptstore.errors import StoreError
from ckptstore.store.memory import MemoryStore
from ckptstore.store.wrappers import Fault, FaultStore, transient_error

CALLS = 1000


async def _failing_puts(seed: int, rate: float) -> list[int]:
    """Indices of the puts, out of CALLS, that a FaultStore with ``rate`` and ``seed`` failed;
    checks that the others landed and that gets (not selected by the fault) never fail."""
    fault = Fault(frozenset({"put"}), transient_error, rate=rate)
    async with FaultStore(MemoryStore(), [fault], seed=seed) as store:
        failed: list[int] = []
        for i in range(CALLS):
            try:
                await store.put(f"k/{i:04d}", b"%d" % i)
            except StoreError:
                failed.append(i)
        assert store.injected["put"] == len(failed)
        landed = [i for i in range(CALLS) if i not in set(failed)]
        assert await store.list_keys("k/") == [f"k/{i:04d}" for i in landed]
        assert [await store.get(f"k/{i:04d}") for i in landed] == [b"%d" % i for i in landed]
        return failed


@pytest.mark.parametrize("rate", [0.1, 0.25])
async def test_fault_rate_is_seeded_and_near_the_rate(rate: float) -> None:
    first = await _failing_puts(seed=5, rate=rate)
    assert await _failing_puts(seed=5, rate=rate) == first  # a failing run replays
    assert await _failing_puts(seed=6, rate=rate) != first
    # within three standard deviations of the rate (0.028 at 0.1, 0.041 at 0.25)
    assert abs(len(first) / CALLS - rate) <= 3 * math.sqrt(rate * (1 - rate) / CALLS), len(first)


async def test_rate_zero_never_fails_and_rate_one_always_does() -> None:
    assert await _failing_puts(seed=5, rate=0.0) == []
    assert await _failing_puts(seed=5, rate=1.0) == list(range(CALLS))
