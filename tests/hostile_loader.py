"""Load hostile manifests in a process whose address space is capped; started by
tests/test_manifest_hostile.py.

Usage: ``python tests/hostile_loader.py ROOT CASES HEADROOM``. ROOT is a local checkpoint
root whose step 1 holds the data objects of the test's state; CASES is a directory of
manifest files (``*.json``, loaded in name order, each in turn as step 1's manifest); HEADROOM
is how many bytes of address space the process may add after its imports.

After importing everything it needs (numpy, torch and JAX reserve a lot of address space up
front), the process caps its address space (``RLIMIT_AS``) at what it uses plus HEADROOM, so
a load that tries to allocate what a manifest merely claims fails with ``MemoryError``
instead of paging the machine to death or succeeding as a lazy giant mapping. The test runs
it with ``MALLOC_ARENA_MAX=2``: otherwise each new thread that allocates may reserve a 64 MiB
malloc arena, which would eat the headroom without any allocation being large.

Each case is restored with :meth:`CheckpointManager.restore` (which rebuilds every leaf as
its attributes say it was saved: torch tensors on their device, JAX arrays, numpy arrays)
through a store that records every key it reads. One JSON line is printed per case::

    {"case": "0007.json", "outcome": "loaded" | "refused" | "escaped",
     "error": "<type>: <message>", "keys": [keys read]}

``refused`` is a ckptstore error; ``escaped`` is anything else (a ``MemoryError``, a
``RuntimeError`` from torch...), which the test treats as a failure.
"""

from __future__ import annotations

import json
import re
import resource
import sys
from pathlib import Path

import jax  # noqa: F401  (imported before the cap, like everything a load uses)
import numpy  # noqa: F401
import torch  # noqa: F401

from ckptstore.errors import CkptStoreError
from ckptstore.layout.keys import manifest_key
from ckptstore.manager.checkpoint_manager import CheckpointManager
from ckptstore.store.base import Store
from ckptstore.store.local import LocalStore
from ckptstore.store.wrappers import StoreWrapper


class ReadRecorder(StoreWrapper):
    """Records the key of every request."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.keys: list[str] = []

    async def _hook(self, op: str, key: str, nbytes: int) -> None:
        self.keys.append(key)


def _address_space() -> int:
    status = Path("/proc/self/status").read_text()
    match = re.search(r"^VmSize:\s+(\d+) kB", status, re.MULTILINE)
    assert match is not None
    return int(match.group(1)) << 10


def main(root: str, cases: str, headroom: int) -> None:
    local = LocalStore(root)
    recorder = ReadRecorder(local)
    manager = CheckpointManager(recorder, async_save=False)
    # Honest restores first, one per framework: they start the threads and pools a load
    # uses (torch's and XLA's among them), so their reservations are made before the cap.
    for target in (None, "torch", "jax"):
        manager.restore(1, target=target)
    resource.setrlimit(resource.RLIMIT_AS, (_address_space() + headroom, resource.RLIM_INFINITY))
    manifest = Path(root) / manifest_key(1)
    for case in sorted(Path(cases).glob("*.json")):
        manifest.write_bytes(case.read_bytes())
        recorder.keys.clear()
        outcome, error = "loaded", ""
        try:
            manager.restore(1)
        except CkptStoreError as exc:
            outcome, error = "refused", f"{type(exc).__name__}: {exc}"
        except BaseException as exc:  # anything else is what the test looks for
            outcome, error = "escaped", f"{type(exc).__name__}: {exc}"
        line = {"case": case.name, "outcome": outcome, "error": error[:500]}
        line["vm"] = _address_space() >> 20
        line["keys"] = sorted(set(recorder.keys))
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
