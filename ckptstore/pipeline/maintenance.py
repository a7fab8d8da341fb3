"""What the command line and the tiers do to whole steps: summarize, verify, copy.

Part of the engine's interface (docs/design.md, "The engine's interface"). ``ckptstore show``,
``ls``, ``verify`` and ``cp`` and the tiered manager's copies call these; the work itself
(which objects a step holds, how a copy references what the destination already has, what
counts as damage) lives in :mod:`ckptstore.layout.maintenance`.
"""

from __future__ import annotations

from ckptstore.layout.maintenance import (
    CopyReport,
    Damage,
    RootTotals,
    VerifyReport,
    copy_step,
    plain_values,
    retained_records,
    summarize_step,
    total_stored,
    uncommitted,
    verify_manifest,
)

__all__ = [
    "CopyReport",
    "Damage",
    "RootTotals",
    "VerifyReport",
    "copy_step",
    "plain_values",
    "retained_records",
    "summarize_step",
    "total_stored",
    "uncommitted",
    "verify_manifest",
]
