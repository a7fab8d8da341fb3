"""Preemption: turn a termination notice or a wall-clock limit into a last durable save.

Spot instances, SLURM and Kubernetes tell a job it is about to end: SIGTERM some seconds or
minutes before the kill (Kubernetes: ``terminationGracePeriodSeconds``, 30 s by default;
SLURM: ``--signal=TERM@120`` sends it 120 s before the time limit), or a time limit the job
knows in advance. A :class:`~ckptstore.CheckpointManager` made with ``preemption=`` or
``save_before=`` watches for both (:class:`PreemptionWatch`); the next ``save()`` call after
the notice saves that very step whatever the interval, waits until it is durable, and raises
:class:`Preempted`, a ``SystemExit`` whose code says why (``128 + signal``: 143 for SIGTERM,
as a process killed by it reports; 124 for the time limit, as ``timeout(1)`` does), so an
uncaught one ends the script with that status once ``with`` blocks and ``finally`` clauses
have run.

The signal handler only records the notice: nothing is saved from inside a handler (the
state may be half updated at that moment); the training loop reaches its next ``save()``
within a step. A handler replaces the one installed before it and is put back by ``close()``.
Handlers can only be installed from the main thread.
"""

from __future__ import annotations

import datetime
import logging
import signal
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from types import FrameType
from typing import Any, NoReturn

__all__ = [
    "DEADLINE_STATUS",
    "Notice",
    "notice_elsewhere",
    "Preempted",
    "PreemptionWatch",
    "save_margin",
    "signals_of",
    "stop",
    "watch",
]

_log = logging.getLogger("ckptstore.preemption")

#: The exit status for a wall-clock limit (``timeout(1)``'s).
DEADLINE_STATUS = 124


@dataclass(frozen=True, slots=True)
class Notice:
    """Why the job must end: a signal's name, or ``"save_before"``, and the exit status."""

    reason: str
    status: int


class Preempted(SystemExit):
    """Raised by ``save()`` once the step saved after a preemption notice is durable.

    Attributes:
        step: the step saved (or already saved) last.
        notice: why.
    """

    def __init__(self, step: int, notice: Notice, where: str) -> None:
        super().__init__(notice.status)
        self.step = step
        self.notice = notice
        self.message = (
            f"{where}: step {step} is durable; stopping on {notice.reason} "
            f"(exit status {notice.status})"
        )

    def __str__(self) -> str:
        return self.message


class PreemptionWatch:
    """Watches for the signals and the time limit of one manager.

    Args:
        signals: signal numbers that give notice (their handlers are replaced until
            :meth:`close`).
        save_before: the wall-clock limit (seconds since the epoch or an aware
            ``datetime``): notice is given at the first check where the time left is less
            than the ``margin`` the caller passes (its estimate of a save's duration).

    Raises:
        ValueError: signals outside the main thread, or a ``save_before`` in the past.
    """

    def __init__(
        self,
        signals: Iterable[int] = (),
        save_before: float | datetime.datetime | None = None,
    ) -> None:
        self._signals, self.save_before = self.check(signals, save_before)
        self._notice: Notice | None = None
        self._previous: dict[signal.Signals, Any] = {}
        for sig in self._signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    @staticmethod
    def check(
        signals: Iterable[int], save_before: float | datetime.datetime | None
    ) -> tuple[list[signal.Signals], float | None]:
        """The signals and the time limit, validated (nothing installed): a caller checks
        them before it opens anything.

        Raises:
            ValueError: a number that is no signal here, a naive or past ``save_before``,
                or signals to watch from a thread other than the main one.
        """
        checked = []
        for number in signals:
            try:
                checked.append(signal.Signals(number))
            except ValueError:
                raise ValueError(
                    f"preemption={list(signals)!r}: {number!r} is not a signal of this "
                    "platform (give True for SIGTERM, or signal numbers such as signal.SIGUSR1)"
                ) from None
        if isinstance(save_before, datetime.datetime):
            if save_before.tzinfo is None:
                raise ValueError("save_before must be an aware datetime (with a time zone)")
            save_before = save_before.timestamp()
        if save_before is not None and not save_before > time.time():
            raise ValueError(f"save_before={save_before} is not in the future")
        if checked and threading.current_thread() is not threading.main_thread():
            raise ValueError(
                "preemption= installs signal handlers, which only the main thread can do; "
                "make the CheckpointManager in the main thread"
            )
        return checked, save_before

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._notice is None:
            self._notice = Notice(signal.Signals(signum).name, 128 + signum)

    def notice(self, margin: float = 0.0) -> Notice | None:
        """The notice given so far, if any: a signal received, or less than ``margin``
        seconds left before ``save_before``."""
        limit = self.save_before
        if self._notice is None and limit is not None and time.time() + margin >= limit:
            when = datetime.datetime.fromtimestamp(limit, datetime.UTC)
            self._notice = Notice(f"save_before={when:%Y-%m-%dT%H:%M:%SZ}", DEADLINE_STATUS)
        return self._notice

    def close(self) -> None:
        """Put the handlers that were there before back (from the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._on_signal:
                signal.signal(sig, previous)
        self._previous.clear()


def stop(step: int, notice: Notice, where: str) -> NoReturn:
    """End the job after its last save: log why (a WARNING on ``ckptstore.preemption``) and
    raise :class:`Preempted`. What every face that saves on a notice calls last."""
    stopped = Preempted(step, notice, where)
    _log.warning("%s", stopped)
    raise stopped


def signals_of(preemption: bool | int | Iterable[int]) -> list[int]:
    """The signals a ``preemption=`` option names: ``True`` is SIGTERM, ``False`` none."""
    if isinstance(preemption, bool):
        return [signal.SIGTERM] if preemption else []
    if isinstance(preemption, int):
        return [preemption]
    return list(preemption)


def watch(
    preemption: bool | int | Iterable[int], save_before: float | datetime.datetime | None
) -> PreemptionWatch | None:
    """The watch a face's ``preemption=`` and ``save_before=`` options ask for, installed;
    ``None`` when they ask for none.

    Raises:
        ValueError: as :meth:`PreemptionWatch.check`.
    """
    signals = signals_of(preemption)
    if not signals and save_before is None:
        return None
    return PreemptionWatch(signals, save_before)


def notice_elsewhere(preemption: bool | int | Iterable[int]) -> Notice:
    """The notice of a process that learnt of another's through a collective: it cannot know
    which notice that was; the exit status is the first watched signal's (the time limit's
    when no signal is watched)."""
    signals = signals_of(preemption)
    if not signals:
        return Notice("a notice on another process (save_before)", DEADLINE_STATUS)
    first = signal.Signals(signals[0])
    return Notice(f"a notice on another process ({first.name})", 128 + first)


def save_margin(observed: list[float]) -> float:
    """Seconds to keep before ``save_before``: twice the longest save seen (staging, write
    and commit), at least 1 s; a minute before any save has been timed."""
    return 60.0 if not observed else max(1.0, 2 * max(observed))
