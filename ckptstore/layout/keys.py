"""Where a checkpoint's objects live under the store root::

    <step>/<attempt-id>/pack-000000     data objects of one save attempt (immutable)
    <step>/<attempt-id>/leaf-000001
    <step>/manifest.json                the commit marker, written last with put-if-absent

``<step>`` is the step number in canonical decimal (no sign, no leading zeros). An attempt
id is ``attempt-<ms since the epoch, 12 hex digits>-<16 random hex digits>``: fresh for every
save, so no two attempts ever write the same key, and dated, so garbage collection can tell
an abandoned attempt from one in progress. Only names of exactly these shapes are ever
written or deleted by ckptstore; anything else under the root is left alone.
"""

from __future__ import annotations

import re
import secrets
import time

__all__ = [
    "ATTEMPT_RE",
    "MANIFEST_NAME",
    "attempt_prefix",
    "attempt_time",
    "manifest_key",
    "new_attempt_id",
    "parse_step",
    "step_prefix",
]

MANIFEST_NAME = "manifest.json"
ATTEMPT_RE = re.compile(r"attempt-([0-9a-f]{12})-[0-9a-f]{16}")
_STEP_RE = re.compile(r"0|[1-9][0-9]{0,18}")
#: Largest step number (fits a signed 64-bit integer).
MAX_STEP = (1 << 63) - 1


def check_step(step: object) -> int:
    """Return ``step`` if it is a valid step number, else raise ``ValueError``/``TypeError``."""
    if type(step) is not int:
        raise TypeError(f"step must be an int, not {type(step).__name__}")
    if not 0 <= step <= MAX_STEP:
        raise ValueError(f"step must be in [0, 2**63), got {step}")
    return step


def parse_step(segment: str) -> int | None:
    """The step a top-level segment names, or ``None`` if it is not a step directory."""
    segment = segment.rstrip("/")
    if not _STEP_RE.fullmatch(segment):
        return None
    step = int(segment)
    return step if step <= MAX_STEP else None


def step_prefix(step: int) -> str:
    return f"{step}/"


def manifest_key(step: int) -> str:
    return f"{step}/{MANIFEST_NAME}"


def attempt_prefix(step: int, attempt: str) -> str:
    return f"{step}/{attempt}/"


def new_attempt_id(now: float | None = None) -> str:
    """A fresh attempt id dated ``now`` (seconds since the epoch)."""
    millis = int((time.time() if now is None else now) * 1000)
    return f"attempt-{millis:012x}-{secrets.token_hex(8)}"


def attempt_time(attempt: str) -> float | None:
    """When an attempt started (seconds since the epoch), or ``None`` if not an attempt id."""
    match = ATTEMPT_RE.fullmatch(attempt)
    return int(match.group(1), 16) / 1000 if match else None
