"""AsyncSaver: staging blocks, writes run on the background loop, no error is lost."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest

from ckptstore import background
from ckptstore.manager.async_save import AsyncSaver
from ckptstore.stage import StagedState, Stager


def test_save_returns_after_staging_and_writes_in_the_background() -> None:
    saver = AsyncSaver()
    stager = Stager()
    release = threading.Event()
    written: list[bytes] = []
    state = {"w": np.arange(1000, dtype=np.float32)}

    async def write(staged: StagedState) -> None:
        await asyncio.to_thread(release.wait)  # held open until the test lets it go
        written.append(staged.tree["w"].tobytes())

    handle = saver.submit(1, lambda: stager.stage(state), write)
    assert handle.timing.staged >= 0
    assert not handle.done()
    assert saver.in_flight == 1
    expected = state["w"].tobytes()
    state["w"] += 5  # mutating the source after save returned
    release.set()
    saver.wait_until_finished()
    assert written == [expected]
    assert stager.pool.stats().lent_bytes == 0  # the buffer went back after the write


def test_only_one_save_in_flight_by_default() -> None:
    saver = AsyncSaver()
    release = threading.Event()
    order: list[str] = []

    async def slow(staged: StagedState) -> None:
        await asyncio.to_thread(release.wait)
        order.append("write1")

    async def fast(staged: StagedState) -> None:
        order.append("write2")

    def stage2() -> StagedState:
        order.append("stage2")
        return Stager().stage({})

    saver.submit(1, lambda: Stager().stage({}), slow)
    blocked = threading.Thread(target=lambda: saver.submit(2, stage2, fast))
    blocked.start()
    blocked.join(0.2)
    assert blocked.is_alive()  # the second save waits for the first
    assert order == []
    release.set()
    blocked.join(10)
    saver.wait_until_finished()
    assert order == ["write1", "stage2", "write2"]


def test_background_error_raised_on_next_save_and_on_wait_once_each() -> None:
    saver = AsyncSaver()
    stages: list[int] = []

    async def fail(staged: StagedState) -> None:
        raise OSError("disk on fire")

    async def ok(staged: StagedState) -> None:
        return None

    def stage(step: int) -> Any:
        def run() -> StagedState:
            stages.append(step)
            return Stager().stage({})

        return run

    saver.submit(1, stage(1), fail)
    with pytest.raises(OSError, match="disk on fire") as info:
        saver.submit(2, stage(2), ok)
    assert stages == [1]  # step 2 was not staged
    assert any("step 1" in note for note in info.value.__notes__)
    saver.submit(3, stage(3), fail)
    with pytest.raises(OSError, match="disk on fire"):
        saver.wait_until_finished()
    saver.wait_until_finished()  # reported once, then gone
    saver.submit(4, stage(4), ok)
    saver.wait_until_finished()
    assert stages == [1, 3, 4]


def test_errors_of_several_saves_in_flight_are_all_reported() -> None:
    saver = AsyncSaver(max_in_flight=3)
    release = threading.Event()

    async def fail(staged: StagedState) -> None:
        await asyncio.to_thread(release.wait)
        raise ValueError("bad")

    for step in range(3):
        saver.submit(step, lambda: Stager().stage({}), fail)
    assert saver.in_flight == 3
    release.set()
    raised = 0
    for _ in range(3):
        try:
            saver.wait_until_finished()
        except ValueError:
            raised += 1
    assert raised == 3
    saver.wait_until_finished()


def test_writes_run_on_the_background_loop() -> None:
    saver = AsyncSaver()
    seen: list[asyncio.AbstractEventLoop] = []

    async def write(staged: StagedState) -> None:
        seen.append(asyncio.get_running_loop())

    saver.submit(0, lambda: Stager().stage({}), write).result(10)
    assert seen == [background.loop()]


def test_the_handle_reports_the_commit_and_the_work_after_it_is_still_waited_for() -> None:
    saver = AsyncSaver()
    stager = Stager()
    release = threading.Event()
    order: list[str] = []

    async def write(staged: StagedState) -> str:
        order.append("write")
        return "committed"

    async def after() -> None:
        assert stager.pool.stats().lent_bytes == 0  # the staged buffers went back first
        await asyncio.to_thread(release.wait)
        order.append("after")

    handle = saver.submit(1, lambda: stager.stage({"w": np.ones(1000)}), write, after)
    assert handle.result(10) == "committed"  # while ``after`` is still held
    assert handle.done()
    assert handle.write_seconds is not None
    assert saver.in_flight == 1  # the save's work is not over
    second = threading.Thread(target=lambda: saver.submit(2, lambda: stager.stage({}), write))
    second.start()
    second.join(0.2)
    assert second.is_alive()  # the next save waits for ``after`` too
    release.set()
    second.join(10)
    saver.wait_until_finished()
    assert order == ["write", "after", "write"]


def test_an_error_after_the_commit_is_raised_once_by_the_next_save_not_by_the_handle() -> None:
    saver = AsyncSaver()

    async def write(staged: StagedState) -> int:
        return 7

    async def after() -> None:
        raise OSError("retention failed")

    handle = saver.submit(1, lambda: Stager().stage({}), write, after)
    assert handle.result(10) == 7
    with pytest.raises(OSError, match="retention failed") as info:
        saver.submit(2, lambda: Stager().stage({}), write)
    assert any("step 1" in note for note in info.value.__notes__)
    saver.wait_until_finished()  # reported once


def test_a_failed_write_fails_the_handle_and_skips_what_follows() -> None:
    saver = AsyncSaver()
    ran: list[str] = []

    async def write(staged: StagedState) -> None:
        raise ValueError("write failed")

    async def after() -> None:
        ran.append("after")

    handle = saver.submit(1, lambda: Stager().stage({}), write, after)
    with pytest.raises(ValueError, match="write failed"):
        handle.result(10)
    with pytest.raises(ValueError, match="write failed"):
        saver.wait_until_finished()
    assert ran == []
