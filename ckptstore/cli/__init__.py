"""The ``ckptstore`` command and its operator tools.

* :mod:`~ckptstore.cli.main`: the parser and the commands (``ls``, ``show``, ``verify``,
  ``cp``, ``gc``, ``rm``, ``tune``).
* :mod:`~ckptstore.cli.tune`: the store tuner behind ``ckptstore tune``, which measures part
  sizes and concurrencies against one store (not the peer benchmark, ``scripts/bench.py``).

What the commands do to checkpoints (verify, copy) lives in :mod:`ckptstore.layout.maintenance`,
where other code (replication between tiers) reuses it.
"""

from __future__ import annotations

from ckptstore.cli.main import EXIT_DAMAGED, EXIT_ERROR, EXIT_OK, EXIT_USAGE, main

__all__ = ["EXIT_DAMAGED", "EXIT_ERROR", "EXIT_OK", "EXIT_USAGE", "main"]
