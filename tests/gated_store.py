"""A store wrapper that lets one rank's writes pass, holds them, fails them, or waits to be
SIGKILLed in them, switched by the test while the rank runs (tests/test_distributed_manager.py,
tests/manager_ranks.py)."""

from __future__ import annotations

import asyncio
import threading

from ckptstore.errors import StoreError
from ckptstore.store.base import Store
from ckptstore.store.wrappers import StoreWrapper
from tests.multirank import KILL_ME

#: seconds a held write waits for its release (or a rank for its SIGKILL) before failing
HELD_FOR = 120.0


class Gate(StoreWrapper):
    """One rank's view of the shared store. Its writes (puts, multipart uploads) in mode

    * ``pass``: go through;
    * ``hold``: wait for :meth:`release` (:attr:`held` is set once one waits);
    * ``fail``: raise :class:`~ckptstore.errors.StoreError`;
    * ``kill``: print :data:`~tests.multirank.KILL_ME` and wait for the SIGKILL.
    """

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.mode = "pass"
        self.released = threading.Event()
        self.held = threading.Event()

    def hold(self) -> None:
        self.released.clear()
        self.held.clear()
        self.mode = "hold"

    def release(self) -> None:
        self.mode = "pass"
        self.released.set()

    async def _hook(self, op: str, key: str, nbytes: int) -> None:
        if op not in ("put", "create_multipart"):
            return
        if self.mode == "fail":
            raise StoreError(f"injected failure of the put of {key!r}")
        if self.mode == "kill":
            print(KILL_ME, flush=True)
            await asyncio.wait_for(asyncio.Event().wait(), timeout=HELD_FOR)
        if self.mode == "hold":
            self.held.set()
            if not await asyncio.to_thread(self.released.wait, HELD_FOR):
                raise TimeoutError("the test never released the held write")
