"""A training job with a tiered CheckpointManager, run as a child process that tests SIGKILL.

``python -m tests.tier_child LOCAL PERSISTENT_URL STEPS`` saves steps ``0..STEPS-1`` (each
one locally, the even ones copied to the persistent tier, retention on both tiers), prints
``ready`` once the manager is open, every log line of :mod:`ckptstore.manager.tiers` (so the
parent learns which copies committed before it killed the job), and ``done`` at the end.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import numpy as np

#: How the job's manager is configured; the parent checks retention against these.
LOCAL_MAX_TO_KEEP = 1
MAX_TO_KEEP = 2
PERSISTENT_EVERY = 2


def state(step: int) -> dict[str, Any]:
    """The state saved at ``step``: a large leaf, packed small ones, a plain value."""
    rng = np.random.default_rng(step)
    return {
        "model": {"w": rng.standard_normal((256, 256), dtype=np.float32)},
        "optim": [rng.standard_normal(64).astype(np.float16) for _ in range(16)],
        "step": step,
    }


def manager(local: str, url: str) -> Any:
    """The job's CheckpointManager."""
    from ckptstore.manager import CheckpointManager

    return CheckpointManager(
        url,
        local=local,
        persistent_every=PERSISTENT_EVERY,
        local_max_to_keep=LOCAL_MAX_TO_KEEP,
        max_to_keep=MAX_TO_KEEP,
    )


class _Say(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        print(record.getMessage(), flush=True)


def main(argv: list[str]) -> None:
    local, url, steps = argv[0], argv[1], int(argv[2])
    log = logging.getLogger("ckptstore.tiers")
    log.setLevel(logging.INFO)
    log.addHandler(_Say())
    mgr = manager(local, url)
    print("ready", flush=True)
    for step in range(steps):
        mgr.save(step, state(step))
    mgr.close()
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
