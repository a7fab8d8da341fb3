"""The ``ckptstore`` command: look at, check, copy and clean up checkpoints from a terminal.

Every command takes a store URL (a path, ``file://``, ``nfs://``, ``s3://``, ``gs://``,
``memory://`` or any fsspec URL), prints a human-readable answer, or one JSON document with
``--json`` for scripts, and exits with a status a script can test:

* 0: done (for ``verify``: every byte intact);
* 1: an error the user can fix (bad URL, missing step, no credentials, missing client
  library, a server that refuses): one line on stderr, no traceback;
* 2: a command line argparse rejects;
* 3: ``verify`` found damage.

Anything else that escapes is a bug in ckptstore and keeps its traceback. Progress bars (tqdm,
from the ``cli`` extra) are drawn on stderr only when stderr is a terminal.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import json
import os
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, Protocol, TypeVar

from ckptstore.config import parse_size
from ckptstore.errors import (
    CkptStoreError,
    CommitConflictError,
    CorruptCheckpointError,
    InvalidURLError,
    NotFoundError,
)
from ckptstore.store.base import Store
from ckptstore.store.registry import open_store
from ckptstore.store.transport import redact, redact_data, redact_url

if TYPE_CHECKING:
    from ckptstore.pipeline.maintenance import RootTotals
    from ckptstore.pipeline.steps import Manifest

__all__ = [
    "EXIT_DAMAGED",
    "EXIT_ERROR",
    "EXIT_OK",
    "EXIT_USAGE",
    "Failure",
    "error_message",
    "main",
    "reporting_errors",
]

_T = TypeVar("_T")

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_DAMAGED = 3

#: Exceptions of client libraries that mean "fix your setup", not "ckptstore has a bug"
#: (matched by qualified name, so the libraries need not be imported to test for them).
_SETUP_ERRORS = {
    "botocore.exceptions.NoCredentialsError": "no AWS credentials found",
    "botocore.exceptions.PartialCredentialsError": "incomplete AWS credentials",
    "botocore.exceptions.ProfileNotFound": "AWS profile not found",
    "google.auth.exceptions.DefaultCredentialsError": "no Google Cloud credentials found",
}


class UsageError(Exception):
    """A command-line value that cannot be used; reported in one line, exit status 1."""


@dataclass
class Outcome:
    """What a command produced: a JSON-able document, its text rendering and an exit status.

    A command that did part of its work and then failed returns its report of what it did
    with ``error`` set (and status 1): the report is printed, then ``error`` as the one-line
    error, so the user learns exactly what was done before the failure.
    """

    data: Any
    text: str
    status: int = EXIT_OK
    error: str | None = None


class Progress(Protocol):
    def update(self, n: int = 1) -> Any: ...

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> Any: ...

    def write(self, line: str) -> None: ...


class _NoProgress:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def write(self, line: str) -> None:
        print(line, flush=True)


#: Columns of a bar when the terminal reports none (some CI consoles and serial lines say 0).
FALLBACK_COLUMNS = 80


def _terminal_columns() -> int:
    """Columns of the terminal stderr is on, or 0 when it does not say."""
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns
    except (OSError, ValueError):
        return 0


class _Bar:
    """A tqdm bar on stderr that counts bytes in the units of everything else the CLI prints
    (KiB, MiB, GiB: tqdm's own labels a 1024-based count "MB" and its rate 1000-based "MB/s"),
    and that a line of output clears first, so a result is never printed onto the bar."""

    def __init__(self, total: int | None, desc: str, unit: str) -> None:
        from tqdm import tqdm

        self._bytes = unit == "B"
        self._total = total
        self._done = 0
        self._started = time.monotonic()
        columns = _terminal_columns()
        self._bar = tqdm(
            total=total,
            desc=desc,
            unit=unit,
            file=sys.stderr,
            leave=False,
            # a terminal that reports 0 columns would get a bar of 0 columns: nothing drawn
            dynamic_ncols=columns > 0,
            ncols=None if columns > 0 else FALLBACK_COLUMNS,
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {postfix}" if self._bytes else None,
        )

    def update(self, n: int = 1) -> None:
        self._done += n
        if self._bytes:
            rate = self._done / max(time.monotonic() - self._started, 1e-9)
            total = "?" if self._total is None else format_bytes(self._total)
            # set without a redraw; tqdm redraws at its own pace on update
            self._bar.set_postfix_str(
                f"{format_bytes(self._done)}/{total}, {format_bytes(rate)}/s", refresh=False
            )
        self._bar.update(n)

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self._bar.set_postfix_str(s, refresh=refresh)

    def write(self, line: str) -> None:
        with self._bar.external_write_mode(file=sys.stderr):
            print(line, flush=True)

    def close(self) -> None:
        self._bar.close()


@contextlib.contextmanager
def progress_bar(
    args: argparse.Namespace, total: int | None, desc: str, *, unit: str = "it"
) -> Iterator[Progress]:
    """A tqdm bar on stderr when stderr is a terminal, tqdm is installed and not
    ``--no-progress``; otherwise a bar that draws nothing. Lines printed while it is up go
    through its ``write``, which clears the bar first."""
    if getattr(args, "no_progress", False) or not sys.stderr.isatty():
        yield _NoProgress()
        return
    try:
        import tqdm  # noqa: F401
    except ImportError:  # the cli extra is optional; without it there are no bars
        yield _NoProgress()
        return
    bar = _Bar(total, desc, unit)
    try:
        yield bar
    finally:
        bar.close()


# ----------------------------------------------------------------- formatting


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``count(1, "step")`` -> ``"1 step"``, ``count(2, "step")`` -> ``"2 steps"``."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def step_list(steps: Sequence[int]) -> str:
    """``[5]`` -> ``"step 5"``, ``[5, 10]`` -> ``"steps 5, 10"``."""
    return f"step {steps[0]}" if len(steps) == 1 else "steps " + ", ".join(map(str, steps))


def render_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain text table; columns after the first are right-aligned."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        parts = [
            cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i]) for i, cell in enumerate(row)
        ]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


# ----------------------------------------------------------------- argument types


def _size_arg(text: str) -> int:
    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0, got {text!r}")
    return value


def _size_list_arg(text: str) -> list[int]:
    return [_size_arg(part) for part in text.split(",") if part.strip()]


def _positive_int_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _int_list_arg(text: str) -> list[int]:
    return [_positive_int_arg(part) for part in text.split(",") if part.strip()]


def _seconds_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _option_arg(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name.strip(), value


def _options(pairs: Sequence[tuple[str, str]] | None) -> dict[str, str]:
    return dict(pairs or ())


# ----------------------------------------------------------------- stores


@contextlib.asynccontextmanager
async def cli_store(
    url: str, options: dict[str, str], *, must_exist: bool = True
) -> AsyncIterator[Store]:
    """Open ``url`` for a command and close it afterwards; option mistakes become one-line
    usage errors.

    With ``must_exist`` a local directory that does not exist is an error (an object store
    prefix cannot be told from an empty one, so only the backend's own errors apply there).
    """
    try:
        store = open_store(url, **options)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, CkptStoreError):
            raise
        raise UsageError(f"cannot open {redact_url(url)}: {_one_line(exc)}") from None
    async with store:
        root = getattr(store, "root", None)
        local = store.capabilities.local_path and isinstance(root, str)
        if must_exist and local and not await asyncio.to_thread(os.path.isdir, str(root)):
            raise await asyncio.to_thread(_not_a_root, store.url, str(root))
        yield store


def _not_a_root(url: str, path: str) -> CkptStoreError:
    """The error for a local checkpoint root that is not a directory."""
    if os.path.exists(path):
        return InvalidURLError(
            f"{url}: is a file, not a checkpoint root (give the directory that holds the "
            "numbered step folders)"
        )
    return NotFoundError(f"{url}: no such directory")


def _is_memory(store: Store) -> bool:
    return store.url.startswith("memory://")


#: Said wherever a memory:// store matters to a command run from a shell.
_MEMORY_NOTE = (
    "a memory:// store lives inside one process: this command starts with an empty one and "
    "its contents are gone when the command exits"
)


# ----------------------------------------------------------------- steps


def _step_arg(text: str) -> int | None:
    """A step number, or ``None`` for ``latest``."""
    if text == "latest":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a step is a number or 'latest', not {text!r}") from None
    if not 0 <= value < 1 << 63:
        raise argparse.ArgumentTypeError(f"steps are in [0, 2**63), got {value}")
    return value


def _step_number_arg(text: str) -> int:
    step = _step_arg(text)
    if step is None:
        raise argparse.ArgumentTypeError("give a step number, not 'latest'")
    return step


def _when(created: float) -> str:
    return datetime.datetime.fromtimestamp(created, datetime.UTC).strftime("%Y-%m-%d %H:%M:%SZ")


async def _resolve_step(store: Store, step: int | None) -> int:
    from ckptstore.manager.functions import alist_steps

    if step is not None:
        return step
    steps = await alist_steps(store)
    if not steps:
        raise NotFoundError(f"{store.url}: no committed checkpoint")
    return steps[-1]


async def _named_steps(store: Store, requested: Sequence[int | None], verb: str) -> list[int]:
    """The committed steps ``requested`` names (``None`` is the latest), in order, without
    repeats. Raises naming *every* one that is not committed, before the command does any
    work, so one mistyped step never leaves a multi-step command half done."""
    from ckptstore.pipeline.steps import committed_steps, manifest_key

    latest = await _resolve_step(store, None) if None in requested else -1
    steps = list(dict.fromkeys(latest if s is None else s for s in requested))
    present = await _per_step(store, steps, lambda step: store.exists(manifest_key(step)))
    missing = [step for step, ok in zip(steps, present, strict=True) if not ok]
    if missing:
        known = await committed_steps(store)  # listed only to say what there is
        there = (
            "none"
            if not known
            else ", ".join(map(str, known))
            if len(known) <= 6
            else f"{len(known)}, the latest {', '.join(map(str, known[-3:]))}"
        )
        raise NotFoundError(
            f"{store.url}: {step_list(missing)} {'is' if len(missing) == 1 else 'are'} not "
            f"committed (committed: {there}); nothing was {verb}"
        )
    return steps


async def _per_step(
    store: Store, steps: Sequence[int], request: Callable[[int], Awaitable[_T]]
) -> list[_T]:
    """``request(step)`` for every step, at most ``max_concurrency`` at a time (a command
    may name hundreds of steps), in the order of ``steps``."""
    slots = asyncio.Semaphore(max(1, store.settings.transport.max_concurrency))

    async def bounded(step: int) -> _T:
        async with slots:
            return await request(step)

    return list(await asyncio.gather(*(bounded(step) for step in steps)))


async def _manifests(store: Store, steps: Sequence[int]) -> list[Manifest | CkptStoreError]:
    """The manifest of each step, or the error that reading it raised (invalid ones)."""
    from ckptstore.manager.functions import aread_manifest

    async def read(step: int) -> Manifest | CkptStoreError:
        try:
            return await aread_manifest(store, step)
        except CorruptCheckpointError as exc:
            return exc

    return await _per_step(store, steps, read)


async def _ls(args: argparse.Namespace) -> Outcome:
    from ckptstore.manager.functions import alist_steps
    from ckptstore.pipeline.maintenance import (
        retained_records,
        summarize_step,
        total_stored,
        uncommitted,
    )

    if args.local is not None:
        return await _ls_tiers(args)
    async with cli_store(args.url, _options(args.option)) as store:
        steps = await alist_steps(store)
        manifests = await _manifests(store, steps)
        valid = [m for m in manifests if not isinstance(m, CkptStoreError)]
        totals = total_stored(valid, await retained_records(store, valid))
        # an invalid step's attempts are not counted as uncommitted: gc leaves them alone
        invalid_steps = [s for s, m in zip(steps, manifests, strict=True) if m not in valid]
        loose = await uncommitted(store, valid, skip_steps=invalid_steps)
        url = store.url
    rows: list[dict[str, Any]] = []
    table: list[tuple[object, ...]] = []
    invalid: list[str] = []
    for step, manifest in zip(steps, manifests, strict=True):
        if isinstance(manifest, CkptStoreError):
            rows.append({"step": step, "error": _one_line(manifest)})
            table.append(_invalid_cells(step))
            invalid.append(f"step {step}: {_one_line(manifest)}")
            continue
        summary = summarize_step(manifest)
        rows.append({**dataclasses.asdict(summary), "created_utc": _when(summary.created)})
        table.append(_summary_cells(manifest))
    if not steps:
        text = f"{url}: no committed checkpoints"
        if url.startswith("memory://"):
            text += f" ({_MEMORY_NOTE})"
    else:
        text = "\n".join([render_table(_LS_HEADERS, table), _totals_line(totals), *invalid])
    if loose.attempts:
        text += (
            f"\nuncommitted: {format_bytes(loose.nbytes)} in "
            f"{count(loose.objects, 'object')} of {count(len(loose.attempts), 'attempt')} "
            "(saves or copies in progress, interrupted or failed, and steps set aside); "
            "'ckptstore gc' removes those whose owner is gone or that were idle for the grace "
            "period"
        )
    if loose.set_aside:
        text += (
            f"\nset aside by a roll-back: {step_list(loose.set_aside)} (recoverable with "
            "ckptstore.recover_step until gc removes them)"
        )
    data = {
        "url": url,
        "steps": rows,
        "total": dataclasses.asdict(totals),
        "uncommitted": dataclasses.asdict(loose),
    }
    return Outcome(data, text)


#: ``size`` is what a restore of the step reads: its ``own`` objects plus the objects of
#: earlier steps it ``referenced`` (an incremental save's).
_LS_HEADERS = ["step", "size", "own", "referenced", "objects", "leaves", "committed (UTC)"]


def _invalid_cells(step: int) -> tuple[object, ...]:
    """The ``ls`` table cells of a step whose manifest fails validation."""
    return (step, "INVALID", *[""] * (len(_LS_HEADERS) - 2))


def _totals_line(totals: RootTotals) -> str:
    """The lines under the ``ls`` table: what the steps store, each object counted once."""
    line = (
        f"total: {format_bytes(totals.nbytes)} stored in {count(totals.objects, 'object')}, "
        "each counted once"
    )
    if totals.retained_bytes:
        line += (
            f": {format_bytes(totals.own_bytes)} written by these steps, "
            f"{format_bytes(totals.retained_bytes)} kept of deleted steps they reference"
        )
    if totals.steps_nbytes != totals.nbytes:
        line += (
            "\n(a step's size includes the objects it references, so the sizes above add up "
            f"to {format_bytes(totals.steps_nbytes)})"
        )
    return line


def _summary_cells(manifest: Manifest) -> tuple[object, ...]:
    """The ``ls`` table cells of a step."""
    from ckptstore.pipeline.maintenance import summarize_step

    summary = summarize_step(manifest)
    return (
        summary.step,
        format_bytes(summary.nbytes),
        format_bytes(summary.own_bytes),
        format_bytes(summary.referenced_bytes) if summary.referenced_bytes else "-",
        summary.objects,
        summary.leaves,
        _when(summary.created),
    )


async def _ls_tiers(args: argparse.Namespace) -> Outcome:
    """``ls URL --local DIR``: the steps of a tiered manager's two tiers, which tier holds
    each, and which still await their copy to the persistent tier."""
    from ckptstore.manager.tiers import list_tiers
    from ckptstore.pipeline.maintenance import summarize_step

    async with (
        cli_store(args.url, _options(args.option), must_exist=False) as persistent,
        cli_store(args.local, _options(args.local_option)) as local,
    ):
        listing = await list_tiers(local, persistent)
        on_local = [s for s in listing.steps if s in listing.local]
        elsewhere = [s for s in listing.steps if s not in listing.local]
        read = await _manifests(local, on_local) + await _manifests(persistent, elsewhere)
        urls = {"local": local.url, "persistent": persistent.url}
    manifests = dict(zip(on_local + elsewhere, read, strict=True))
    rows: list[dict[str, Any]] = []
    table: list[tuple[object, ...]] = []
    invalid: list[str] = []
    for step in listing.steps:
        tiers = listing.tiers_of(step)
        if step in listing.pending:
            replication = "pending"
        elif len(tiers) == 2:
            replication = "done"
        else:
            replication = None  # not meant for the persistent tier, or gone from the local one
        where = {"tiers": tiers, "replication": replication}
        cells = (" + ".join(tiers), replication or "-")
        manifest = manifests[step]
        if isinstance(manifest, CkptStoreError):
            rows.append({"step": step, **where, "error": _one_line(manifest)})
            table.append((*_invalid_cells(step), *cells))
            invalid.append(f"step {step} ({tiers[0]}): {_one_line(manifest)}")
            continue
        summary = summarize_step(manifest)
        rows.append({**dataclasses.asdict(summary), "created_utc": _when(summary.created), **where})
        table.append((*_summary_cells(manifest), *cells))
    lines = [render_table([*_LS_HEADERS, "tiers", "replication"], table)] if table else []
    if not listing.steps:
        lines.append(f"{urls['local']}, {urls['persistent']}: no committed checkpoints")
    lines += invalid
    if listing.pending:
        lines.append(
            f"{step_list(listing.pending)} committed on the local tier but not yet on the "
            f"persistent tier: a CheckpointManager with this local tier copies "
            f"{'it' if len(listing.pending) == 1 else 'them'} when it starts (or 'ckptstore "
            "cp' does, by hand)"
        )
    data = {"url": urls["persistent"], "local": urls["local"], "steps": rows}
    return Outcome({**data, "pending": listing.pending}, "\n".join(lines))


async def _show(args: argparse.Namespace) -> Outcome:
    from ckptstore.manager.functions import aread_manifest
    from ckptstore.pipeline.maintenance import plain_values, summarize_step

    async with cli_store(args.url, _options(args.option)) as store:
        step = await _resolve_step(store, args.step)
        manifest = await aread_manifest(store, step)
        url = store.url
    summary = summarize_step(manifest)
    leaves = [
        {
            "path": manifest.paths[i],
            "dtype": manifest.dtypes[i],
            "shape": list(manifest.shapes[i]),
            "nbytes": manifest.leaf_length[i],
            "object": manifest.object_key(manifest.leaf_object[i])
            if manifest.leaf_object[i] >= 0
            else None,
            "offset": manifest.leaf_offset[i],
            "crc32c": manifest.leaf_crc[i],
        }
        for i in range(len(manifest.paths))
    ]
    values = [
        {"path": path, "value": value}
        if kind is None
        else {"path": path, "value": value, "kind": kind}
        for path, value, kind in plain_values(manifest.tree)
    ]
    referenced = set(manifest.references())
    objects = [
        {
            "key": manifest.object_key(i),
            "nbytes": manifest.object_lengths[i],
            "crc32c": manifest.object_crcs[i],
            "referenced": i in referenced,
        }
        for i in range(len(manifest.object_keys))
    ]
    data = {
        "url": url,
        **dataclasses.asdict(summary),
        "created_utc": _when(summary.created),
        "metadata": manifest.metadata,
        "leaves": leaves,
        "values": values,
        "objects": objects,
    }
    lines = [
        f"{url} step {step}",
        f"  committed  {_when(summary.created)} (attempt {summary.attempt})",
        f"  size       {format_bytes(summary.nbytes)} in {count(summary.objects, 'object')}, "
        f"{count(summary.leaves, 'array')}, {count(len(values), 'plain value')}",
        f"  own        {format_bytes(summary.own_bytes)} written by this step",
        f"  referenced {format_bytes(summary.referenced_bytes)} of earlier steps' objects, "
        f"from {count(len(manifest.referenced_attempts()), 'attempt')}",
        f"  metadata   {json.dumps(manifest.metadata)}",
        "",
        render_table(
            ["path", "dtype", "shape", "size"],
            [
                (
                    manifest.paths[i],
                    manifest.dtypes[i],
                    "x".join(map(str, manifest.shapes[i])) or "()",
                    format_bytes(manifest.leaf_length[i]),
                )
                for i in range(len(manifest.paths))
            ],
        )
        if leaves
        else "  (no arrays)",
    ]
    if values:
        lines += [
            "",
            render_table(["path", "value"], [(v["path"], _shown_value(v)) for v in values]),
        ]
    return Outcome(data, "\n".join(lines))


def _shown_value(value: dict[str, Any]) -> str:
    """A plain value as JSON; a typed value as Python writes it (``torch.bfloat16``,
    ``torch.device('cuda:1')``), so it does not read as a string."""
    kind = value.get("kind")
    if kind is None:
        return json.dumps(value["value"])
    if kind == "torch.dtype":
        return f"torch.{value['value']}"
    return f"{kind}({value['value']!r})"


async def _verify(args: argparse.Namespace) -> Outcome:
    from ckptstore.manager.functions import alist_steps
    from ckptstore.pipeline.maintenance import Damage, VerifyReport, verify_manifest

    async with cli_store(args.url, _options(args.option)) as store:
        if args.all:
            steps = await alist_steps(store)
        else:
            steps = await _named_steps(store, args.steps or [None], "verified")
        manifests = await _manifests(store, steps)
        total = sum(m.nbytes for m in manifests if not isinstance(m, CkptStoreError))
        reports: list[VerifyReport] = []
        with progress_bar(args, total, "verify", unit="B") as bar:
            for step, manifest in zip(steps, manifests, strict=True):
                if isinstance(manifest, CkptStoreError):
                    reports.append(
                        VerifyReport(
                            step,
                            damage=[
                                Damage("manifest", f"{step}/manifest.json", _one_line(manifest))
                            ],
                        )
                    )
                    continue
                reports.append(
                    await verify_manifest(store, manifest, progress=bar.update, references=True)
                )
        url = store.url
    damaged = [r for r in reports if not r.ok]
    lines = []
    for r in reports:
        state = "ok" if r.ok else "DAMAGED"
        lines.append(
            f"step {r.step}: {state} ({count(r.objects, 'object')}, "
            f"{count(r.leaves, 'leaf', 'leaves')}, {format_bytes(r.nbytes)} checked)"
        )
        lines += [f"  {d.kind} {d.name}: {d.problem}" for d in r.damage]
    if not reports:
        lines.append(f"{url}: no committed checkpoints to verify")
    elif damaged:
        lines.append(f"{len(damaged)} of {count(len(reports), 'step')} DAMAGED")
    elif len(reports) == 1:
        lines.append(f"step {reports[0].step} intact")
    else:
        lines.append(f"all {len(reports)} steps intact")
    data = {
        "url": url,
        "ok": not damaged,
        "steps": [
            {
                "step": r.step,
                "ok": r.ok,
                "objects": r.objects,
                "leaves": r.leaves,
                "nbytes": r.nbytes,
                "damage": [dataclasses.asdict(d) for d in r.damage],
            }
            for r in reports
        ],
    }
    return Outcome(data, "\n".join(lines), EXIT_DAMAGED if damaged else EXIT_OK)


#: Errors that concern one step only (its bytes, its manifest, its place at the
#: destination): ``cp`` reports the step and goes on with the others. Anything else (the
#: network, credentials, a full disk) would fail every step alike, so ``cp`` stops there.
_STEP_ERRORS = (CorruptCheckpointError, NotFoundError, CommitConflictError)


async def _cp(args: argparse.Namespace) -> Outcome:
    from ckptstore.manager.functions import alist_steps
    from ckptstore.pipeline.maintenance import CopyReport, copy_step

    out: list[Progress] = [_NoProgress()]  # the bar while it is up: it clears itself first

    def say(line: str) -> None:
        if not args.json:  # said as each step is done, so a later failure keeps it
            out[0].write(line)

    def refused(step: int, why: str) -> None:
        failed[step] = why
        if len(steps) > 1:  # with one step, the error line says it all
            say(f"step {step}: NOT copied: {why}")

    async with (
        cli_store(args.src, _options(args.option)) as src,
        cli_store(args.dst, _options(args.dst_option), must_exist=False) as dst,
    ):
        if args.steps:
            steps = await _named_steps(src, args.steps, "copied")
        else:
            steps = await alist_steps(src)
            if not steps:
                raise NotFoundError(f"{src.url}: no committed checkpoints to copy")
        # One listing of the destination before any write: a misspelled bucket is "does not
        # exist" here, as for ls and save, where the first write's answer (SeaweedFS: 403
        # AccessDenied to a PUT into a bucket that is not there) blamed the credentials.
        await alist_steps(dst)
        if _is_memory(dst):
            print(
                f"ckptstore cp: warning: {dst.url}: {_MEMORY_NOTE}; the copy is verified but "
                "not kept (copy to a directory or a bucket to keep it)",
                file=sys.stderr,
                flush=True,
            )
        manifests = await _manifests(src, steps)
        total = 2 * sum(m.nbytes for m in manifests if not isinstance(m, CkptStoreError))
        reports: list[CopyReport] = []
        failed: dict[int, str] = {}  # step -> why it was not copied
        stopped: int | None = None  # the step an error that would fail every step hit
        with progress_bar(args, total, "copy+verify", unit="B") as bar:
            out[0] = bar
            for step, manifest in zip(steps, manifests, strict=True):
                if isinstance(manifest, CkptStoreError):
                    refused(step, _one_line(manifest))
                    continue
                try:
                    r = await copy_step(src, dst, step, progress=bar.update)
                except _STEP_ERRORS as exc:
                    refused(step, _one_line(exc))
                    continue
                except (CkptStoreError, OSError) as exc:
                    failed[step] = _one_line(exc)
                    stopped = step
                    break
                reports.append(r)
                say(
                    f"step {r.step}: already at the destination (identical), skipped"
                    if r.skipped
                    else f"step {r.step}: copied {count(r.objects, 'object')}, "
                    f"{format_bytes(r.nbytes)}, "
                    + ("verified, " if r.read_back else "verified by the destination's crc32c, ")
                    + (
                        f"{count(r.referenced, 'object')} of earlier steps referenced at the "
                        "destination, "
                        if r.referenced
                        else ""
                    )
                    + f"committed (attempt {r.attempt})"
                )
        src_url, dst_url = src.url, dst.url
    done = [r.step for r in reports]
    untried = [s for s in steps if s not in failed and s not in done]
    data = {
        "src": src_url,
        "dst": dst_url,
        "steps": [dataclasses.asdict(r) for r in reports],
        "failed": [{"step": s, "error": why} for s, why in failed.items()],
        "not_attempted": untried,
    }
    if not failed and stopped is None:
        return Outcome(data, "")
    copied = f"copied or already there: {step_list(done)}" if done else "nothing was copied"
    damage = f"'ckptstore verify {args.src} {' '.join(map(str, failed))}' shows the damage"
    if stopped is not None:
        others = [s for s in failed if s != stopped]
        also = f" (also not copied: {step_list(others)})" if others else ""
        rest = f"; not attempted: {', '.join(map(str, untried))}" if untried else ""
        error = (
            f"step {stopped} not copied: {failed[stopped]}{also}; {copied}{rest}. Once fixed, "
            "run the same command again: steps already at the destination are skipped"
        )
    else:
        first, why = next(iter(failed.items()))
        if len(steps) == 1:
            error = f"step {first} not copied: {why}; {damage}"
        else:
            others = [s for s in failed if s != first]
            also = f" (also not copied: {step_list(others)})" if others else ""
            error = (
                f"{len(failed)} of {len(steps)} steps not copied: step {first}: {why}{also}; "
                f"{copied}. {damage}; --step N copies chosen steps only"
            )
    return Outcome(data, "", EXIT_ERROR, error=error)


async def _gc(args: argparse.Namespace) -> Outcome:
    from ckptstore.manager.functions import agc

    async with cli_store(args.url, _options(args.option)) as store:
        report = await agc(store, grace=args.grace)
        url = store.url
    data = {"url": url, **dataclasses.asdict(report)}
    lines = [
        f"{url}: removed {count(len(report.removed), 'abandoned attempt')} "
        f"({count(report.removed_objects, 'object')}), "
        f"{count(report.stale_writes, 'stale in-progress write')}",
        *(f"  removed {p}" for p in report.removed),
    ]
    if report.kept_recent:
        lines.append(
            f"kept {count(len(report.kept_recent), 'uncommitted attempt')} within the grace "
            "period or still leased by a running save"
        )
    if report.reclaimed or report.kept_referenced:
        lines.append(
            f"removed {count(len(report.reclaimed), 'attempt')} of deleted steps that nothing "
            f"references any more; kept {count(len(report.kept_referenced), 'attempt')} of "
            "deleted steps that later steps reference"
        )
    if report.invalid_steps:
        lines.append(
            f"left steps with an invalid manifest untouched: {report.invalid_steps} "
            "(ckptstore verify shows why)"
        )
    return Outcome(data, "\n".join(lines))


async def _rm(args: argparse.Namespace) -> Outcome:
    from ckptstore.pipeline.steps import delete_step, is_own_key, step_prefix

    steps = list(dict.fromkeys(args.steps))
    removed: list[int] = []
    async with cli_store(args.url, _options(args.option)) as store:
        url = store.url
        # Every named step is checked before any is deleted: a mistyped step must not
        # leave the others half done.
        listings = await _per_step(store, steps, lambda step: store.list_keys(step_prefix(step)))
        missing = [
            s for s, keys in zip(steps, listings, strict=True) if not any(map(is_own_key, keys))
        ]
        if missing:
            raise NotFoundError(f"{url}: no {step_list(missing)} to delete; nothing was deleted")
        for step in steps:
            try:
                await delete_step(store, step)
            except (CkptStoreError, OSError) as exc:
                rest = [s for s in steps if s not in removed]
                done = f"deleted {step_list(removed)} before it" if removed else "nothing deleted"
                return Outcome(
                    {"url": url, "removed": removed, "not_removed": rest},
                    "",
                    EXIT_ERROR,
                    error=f"step {step}: {_one_line(exc)}; {done}; not deleted: "
                    f"{', '.join(map(str, rest))}",
                )
            removed.append(step)
            if not args.json:  # said as each step goes, so an interrupted rm has told
                print(f"removed step {step}", flush=True)
    return Outcome({"url": url, "removed": removed}, "")


# ----------------------------------------------------------------- directory trees


async def _upload(args: argparse.Namespace) -> Outcome:
    from ckptstore.integrations.files import aupload

    if not await asyncio.to_thread(os.path.isdir, args.dir):
        raise UsageError(f"{args.dir}: not a directory (upload takes a checkpoint directory)")
    try:
        metadata = None if args.metadata is None else json.loads(args.metadata)
    except ValueError as exc:
        raise UsageError(f"--metadata is not JSON: {_one_line(exc)}") from None
    async with cli_store(args.url, _options(args.option), must_exist=False) as store:
        info = await aupload(args.dir, store, step=args.step, metadata=metadata)
        url = store.url
    return Outcome(
        {"url": url, **dataclasses.asdict(info)},
        f"step {info.step}: uploaded {count(info.files, 'file')} "
        f"({format_bytes(info.nbytes)}) in {count(info.objects, 'object')}, committed "
        f"(attempt {info.attempt})",
    )


async def _download(args: argparse.Namespace) -> Outcome:
    from ckptstore.integrations.files import adownload

    async with cli_store(args.url, _options(args.option)) as store:
        step = await _resolve_step(store, args.step)
        path = await adownload(store, args.dir, step=step)
        url = store.url
    return Outcome(
        {"url": url, "step": step, "path": str(path)},
        f"step {step}: every byte verified, now in {path}",
    )


async def _export(args: argparse.Namespace) -> Outcome:
    from ckptstore.integrations.safetensors import aexport_safetensors

    async with cli_store(args.url, _options(args.option)) as store:
        step = await _resolve_step(store, args.step)
        info = await aexport_safetensors(
            store,
            args.dest,
            step=step,
            keys=args.keys,
            max_shard_size=args.max_shard_size,
            overwrite=args.overwrite,
        )
        url = store.url
    files = [str(path) for path in info.files]
    return Outcome(
        {
            "url": url,
            "step": step,
            "format": args.format,
            "files": files,
            "tensors": info.tensors,
            "bytes": info.nbytes,
        },
        f"step {step}: {info.tensors} tensor{'' if info.tensors == 1 else 's'}, "
        f"{format_bytes(info.nbytes)}, every byte verified, exported to {', '.join(files)}",
    )


# ----------------------------------------------------------------- tune


async def _bench(args: argparse.Namespace) -> Outcome:
    """``bench``: the old name of ``tune``, kept so scripts that call it keep working."""
    print(
        "ckptstore bench: note: 'bench' is the old name of 'ckptstore tune'; it runs the same "
        "store tuner (scripts/bench.py is the benchmark against other libraries)",
        file=sys.stderr,
        flush=True,
    )
    return await _tune(args)


async def _tune(args: argparse.Namespace) -> Outcome:
    from ckptstore.cli.tune import size_name, tune_store, usable_part_sizes

    options = _options(args.option)
    async with cli_store(args.url, options, must_exist=False) as store:
        caps = store.capabilities
    try:
        part_sizes = usable_part_sizes(caps, args.size, args.part_sizes)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    total = len(part_sizes) + 2 * len(set(args.concurrency)) - 1
    with progress_bar(args, total, "tune", unit="trial") as bar:

        def step(done: int, total: int, label: str) -> None:
            bar.update(1)
            bar.set_postfix_str(label)

        report = await tune_store(
            args.url,
            size=args.size,
            part_sizes=part_sizes,
            concurrencies=args.concurrency,
            small_count=args.small_count,
            small_size=args.small_size,
            repeat=args.repeat,
            options=options,
            progress=step,
        )
    best = report.best
    large_rows = [
        (
            f"{size_name(t.part_size)} x{t.concurrency}" + ("  <- best" if t is best else ""),
            f"{t.write_mib_s:.0f}",
            f"{t.read_mib_s:.0f}",
            f"{t.write_cpu_seconds / (t.nbytes / (1 << 30)):.2f}",
            f"{t.read_cpu_seconds / (t.nbytes / (1 << 30)):.2f}",
        )
        for t in report.large
    ]
    small_rows = [
        (f"x{t.concurrency}", f"{t.puts_per_s:.0f}", f"{t.gets_per_s:.0f}") for t in report.small
    ]
    suggested = report.suggested_settings
    part_text = size_name(suggested["part_size"])
    lines = [
        f"{report.url}: {format_bytes(args.size)} object per trial, median of {report.repeat}",
        "",
        render_table(
            [
                "part size x concurrency",
                "write MiB/s",
                "read MiB/s",
                "write CPU s/GiB",
                "read CPU s/GiB",
            ],
            large_rows,
        ),
        "",
        render_table(
            [
                f"{count(args.small_count, 'object')} of {format_bytes(args.small_size)}",
                "PUT/s",
                "GET/s",
            ],
            small_rows,
        ),
        "",
        f"suggested: part_size={part_text} max_concurrency={suggested['max_concurrency']} "
        f"(write {best.write_mib_s:.0f} MiB/s, read {best.read_mib_s:.0f} MiB/s)",
        f"  environment: CKPTSTORE_PART_SIZE={part_text} "
        f"CKPTSTORE_MAX_CONCURRENCY={suggested['max_concurrency']}",
        *(f"note: {note}" for note in report.notes),
    ]
    return Outcome(report.as_dict(), "\n".join(lines))


# ----------------------------------------------------------------- parser

_EXAMPLES: dict[str, str] = {
    "ls": """
        ckptstore ls ./checkpoints
        ckptstore ls s3://bucket/run7 -o endpoint_url=http://127.0.0.1:8333
        ckptstore ls gs://bucket/run7 --json | jq '.steps[].step'
        ckptstore ls s3://bucket/run7 --local /nvme/run7   # a tiered manager's two tiers
    """,
    "show": """
        ckptstore show ./checkpoints 1000
        ckptstore show s3://bucket/run7 latest --json > step.json
    """,
    "verify": """
        ckptstore verify ./checkpoints              # the latest step
        ckptstore verify ./checkpoints 900 1000
        ckptstore verify s3://bucket/run7 --all || echo "damaged or unreadable"
    """,
    "cp": """
        ckptstore cp ./checkpoints s3://bucket/run7 --step 1000
        ckptstore cp s3://bucket/run7 /scratch/run7          # every committed step
        ckptstore cp ./ckpts s3://bucket/run7 --dst-option endpoint_url=http://127.0.0.1:8333
    """,
    "upload": """
        ckptstore upload out/checkpoint-500 s3://bucket/hf-run 500
        ckptstore upload /nvme/orbax/1000 ./mirror 1000 --metadata '{"note": "best"}'
    """,
    "download": """
        ckptstore download s3://bucket/hf-run latest out/checkpoint-500
        ckptstore download ./mirror 1000 /nvme/orbax/1000
    """,
    "export": """
        ckptstore export s3://bucket/run7 latest ./hf-model --keys model
        ckptstore export ./checkpoints 1000 /models/step1000 --max-shard-size 2GB
    """,
    "gc": """
        ckptstore gc ./checkpoints
        ckptstore gc s3://bucket/run7 --grace 3600
    """,
    "rm": """
        ckptstore rm ./checkpoints 100
        ckptstore rm s3://bucket/run7 100 200 300
    """,
    "tune": """
        ckptstore tune /scratch/ckpt
        ckptstore tune s3://bucket/scratch -o endpoint_url=http://127.0.0.1:8333
        ckptstore tune s3://bucket/scratch --size 1GiB --part-sizes 16MiB,64MiB \\
            --concurrency 8,32 --json > tune.json
    """,
}

_DESCRIPTIONS: dict[str, str] = {
    "ls": "List the committed steps under a checkpoint root with their size, object count, "
    "leaf count and commit time. A step whose manifest fails validation is listed as INVALID. "
    "With --local DIR, URL is the persistent tier of a tiered CheckpointManager and DIR its "
    "local tier: each step says which tiers hold it and whether its copy to the persistent "
    "tier is done or still pending.",
    "show": "Show one step: its metadata, every array leaf (path, dtype, shape, size) and every "
    "plain value. STEP is a number or 'latest'.",
    "verify": "Re-read every byte of the given steps (default: the latest; --all: every "
    "committed step) and check the crc32c of every object and every leaf. Exit status 0 "
    "means all intact, 3 means damage was found (each problem is listed).",
    "cp": "Copy committed steps (default: all; --step N for one) from SRC to DST, between any "
    "two backends. Objects stream in parallel parts with their crc32c checked on the way, the "
    "copy is read back and verified at DST, and only then committed there with the same "
    "put-if-absent manifest write a save uses. A step DST already holds identically is "
    "skipped; a different one is an error. A named step that is not committed stops the "
    "command before anything is copied; a damaged step (invalid manifest, a failed "
    "checksum) is reported, its partial copy removed, and the other steps are copied; the "
    "exit status is then 1.",
    "upload": "Upload a directory another library wrote (a Hugging Face, Accelerate, Orbax or "
    "DeepSpeed checkpoint) as one committed step: small files packed, large ones in parallel "
    "parts, every file crc32c'd, one put-if-absent commit. FIFOs, sockets, devices and "
    "symlinks leaving the tree are refused, and so is a tree that changes during the upload.",
    "download": "Download a directory-tree step (STEP is a number or 'latest') into DIR, which "
    "must not exist or be empty: it is written beside DIR, every byte verified, then renamed "
    "into place, so DIR never holds a partial or unverified tree.",
    "export": "Export the arrays of one step (STEP is a number or 'latest'), or of the subtree "
    "--keys names, as safetensors files in DEST that safetensors and transformers load without "
    "ckptstore: model.safetensors, or model-0000K-of-0000N.safetensors and their "
    "model.safetensors.index.json past --max-shard-size. A tensor's name is its path below "
    "--keys with '.' between levels, so a state saved as {'model': model.state_dict(), ...} "
    "exported with --keys model has the state dict's names. Every byte is verified on the "
    "way; each file is written under a temporary name and renamed once durable.",
    "gc": "Remove save attempts that never committed (crashed or preempted saves) once they "
    "are older than the grace period, and stale in-progress writes. An attempt whose save "
    "still renews its lease is kept whatever --grace says, so gc can run beside training. "
    "Committed steps and keys ckptstore did not write are never touched.",
    "rm": "Delete committed steps: the manifest first, so a step is never half visible, then "
    "its data objects. Every named step is checked first: if one does not exist, nothing is "
    "deleted. Each step is reported as it is deleted.",
    "tune": (
        "Measure write and read throughput of large multipart objects and the request rate "
        "of small objects on a store, and suggest part_size and max_concurrency. Scratch "
        "objects go under a fresh .ckptstore-tune-<id>/ prefix and are deleted afterwards."
    ),
}

#: Old command names that still work, and the command each now runs.
_ALIASES = {"bench": "tune"}

Command = Callable[[argparse.Namespace], Coroutine[Any, Any, Outcome]]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _common(*, options: bool = True) -> _Parser:
    common = _Parser(add_help=False)
    common.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="print one JSON document"
    )
    common.add_argument(
        "--no-progress",
        action="store_true",
        default=argparse.SUPPRESS,
        help="never draw progress bars (they are drawn only when stderr is a terminal)",
    )
    if options:
        common.add_argument(
            "-o",
            "--option",
            action="append",
            type=_option_arg,
            metavar="NAME=VALUE",
            help="a store option or Settings field, e.g. endpoint_url=http://127.0.0.1:9000 "
            "or part_size=64MiB (repeatable)",
        )
    return common


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``ckptstore`` command."""
    from ckptstore import __version__
    from ckptstore.cli.tune import DEFAULT_CONCURRENCIES, DEFAULT_PART_SIZES, size_name

    parser = _Parser(
        prog="ckptstore",
        description="Look at, check, copy and clean up checkpoints on any store:\na local or "
        "NFS directory, s3://, gs://, memory:// or any fsspec URL.",
        epilog="Run 'ckptstore COMMAND --help' for a command's options and examples.\n\n"
        "Exit status: 0 ok; 1 error (one line on stderr); 2 bad command line; "
        "3 verify found damage.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"ckptstore {__version__}")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument("--no-progress", action="store_true", help="never draw progress bars")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, help_text: str, func: Command, **kwargs: Any) -> argparse.ArgumentParser:
        sub = commands.add_parser(
            name,
            help=help_text,
            description=textwrap.fill(_DESCRIPTIONS[_ALIASES.get(name, name)], 79),
            epilog="examples:\n"
            + textwrap.indent(textwrap.dedent(_EXAMPLES[_ALIASES.get(name, name)]).strip(), "  "),
            formatter_class=argparse.RawDescriptionHelpFormatter,
            parents=[_common(**kwargs)],
        )
        sub.set_defaults(func=func)
        return sub

    ls = add("ls", "list committed steps", _ls)
    ls.add_argument(
        "url", metavar="URL", help="checkpoint root (with --local: the persistent tier)"
    )
    ls.add_argument(
        "--local",
        metavar="DIR",
        default=None,
        help="the local tier of a tiered CheckpointManager whose persistent tier is URL",
    )
    ls.add_argument(
        "--local-option",
        action="append",
        type=_option_arg,
        metavar="NAME=VALUE",
        help="a store option for the --local tier (-o applies to URL)",
    )

    show = add("show", "show one step's leaves, dtypes, shapes, sizes and metadata", _show)
    show.add_argument("url", metavar="URL", help="checkpoint root")
    show.add_argument("step", metavar="STEP", type=_step_arg, help="step number or 'latest'")

    verify = add("verify", "re-read every byte and check its crc32c", _verify)
    verify.add_argument("url", metavar="URL", help="checkpoint root")
    verify.add_argument(
        "steps", metavar="STEP", type=_step_arg, nargs="*", help="steps (default: latest)"
    )
    verify.add_argument("--all", action="store_true", help="verify every committed step")

    cp = add("cp", "copy steps between any two stores, verified and committed", _cp)
    cp.add_argument("src", metavar="SRC", help="source checkpoint root")
    cp.add_argument("dst", metavar="DST", help="destination checkpoint root")
    cp.add_argument(
        "--step",
        dest="steps",
        type=_step_arg,
        action="append",
        metavar="N",
        help="a step to copy, or 'latest' (repeatable; default: every committed step)",
    )
    cp.add_argument(
        "--dst-option",
        action="append",
        type=_option_arg,
        metavar="NAME=VALUE",
        help="a store option for DST (-o applies to SRC)",
    )

    upload = add("upload", "upload a checkpoint directory as one committed step", _upload)
    upload.add_argument("dir", metavar="DIR", help="the directory tree to upload")
    upload.add_argument("url", metavar="URL", help="checkpoint root")
    upload.add_argument("step", metavar="STEP", type=_step_number_arg, help="step number")
    upload.add_argument("--metadata", metavar="JSON", help="JSON stored with the step")

    download = add("download", "download a directory-tree step, verified", _download)
    download.add_argument("url", metavar="URL", help="checkpoint root")
    download.add_argument("step", metavar="STEP", type=_step_arg, help="step number or 'latest'")
    download.add_argument("dir", metavar="DIR", help="directory to create (absent or empty)")

    export = add("export", "export a step's arrays as safetensors files, verified", _export)
    export.add_argument("url", metavar="URL", help="checkpoint root")
    export.add_argument("step", metavar="STEP", type=_step_arg, help="step number or 'latest'")
    export.add_argument("dest", metavar="DEST", help="directory to write the files into")
    export.add_argument(
        "--format",
        choices=["safetensors"],
        default="safetensors",
        help="the file format (default: safetensors)",
    )
    export.add_argument(
        "--keys",
        default=None,
        metavar="KEY",
        help="the subtree to export, e.g. 'model' (default: every array); tensor names are "
        "paths below it, joined with '.'",
    )
    export.add_argument(
        "--max-shard-size",
        type=_size_arg,
        default=5 << 30,
        metavar="SIZE",
        help="the largest file, e.g. 2GB (default: 5GiB); more files get an index",
    )
    export.add_argument(
        "--overwrite", action="store_true", help="replace files of the same names in DEST"
    )

    gc = add("gc", "remove abandoned save attempts", _gc)
    gc.add_argument("url", metavar="URL", help="checkpoint root")
    gc.add_argument(
        "--grace",
        type=_seconds_arg,
        default=None,
        metavar="SECONDS",
        help="leave attempts younger than this alone (default: Settings.gc_grace_seconds)",
    )

    rm = add("rm", "delete committed steps", _rm)
    rm.add_argument("url", metavar="URL", help="checkpoint root")
    rm.add_argument("steps", metavar="STEP", type=_step_number_arg, nargs="+", help="steps")

    def add_tuner(name: str, help_text: str, func: Command) -> None:
        tune = add(name, help_text, func)
        tune.add_argument(
            "url", metavar="URL", help="store to measure (scratch objects are removed)"
        )
        tune.add_argument(
            "--size",
            type=_size_arg,
            default=256 << 20,
            help="bytes of the large object each trial writes and reads (default 256MiB)",
        )
        tune.add_argument(
            "--part-sizes",
            type=_size_list_arg,
            default=list(DEFAULT_PART_SIZES),
            metavar="SIZES",
            help="comma-separated part sizes to try (default "
            + ",".join(size_name(p) for p in DEFAULT_PART_SIZES)
            + ")",
        )
        tune.add_argument(
            "--concurrency",
            type=_int_list_arg,
            default=list(DEFAULT_CONCURRENCIES),
            metavar="NS",
            help="comma-separated concurrencies to try (default "
            + ",".join(map(str, DEFAULT_CONCURRENCIES))
            + ")",
        )
        tune.add_argument(
            "--small-count",
            type=_positive_int_arg,
            default=512,
            help="small objects per small-object trial (default 512)",
        )
        tune.add_argument(
            "--small-size",
            type=_size_arg,
            default=4 << 10,
            help="bytes per small object (default 4KiB)",
        )
        tune.add_argument(
            "--repeat",
            type=_positive_int_arg,
            default=1,
            help="runs per figure, median kept (default 1)",
        )

    add_tuner("tune", "measure a store and suggest part size and concurrency", _tune)
    add_tuner("bench", "the old name of 'tune'", _bench)
    return parser


def _one_line(exc: BaseException) -> str:
    """The error's message on one line, credentials removed (a client library's message may
    quote a URL or an option it was given)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return redact(text)


def _setup_error(exc: BaseException) -> str | None:
    """The one-line message for a client library's setup error, else None."""
    for cls in type(exc).__mro__:
        what = _SETUP_ERRORS.get(f"{cls.__module__}.{cls.__qualname__}")
        if what is not None:
            return f"{what}: {_one_line(exc)}"
    return None


def error_message(exc: BaseException) -> str | None:
    """The one-line message for an error the user can fix (a ckptstore error or a client
    library's setup error), or None for anything else, which is a bug and keeps its
    traceback."""
    if isinstance(exc, CkptStoreError | UsageError):
        return _one_line(exc)
    return _setup_error(exc)


class Terminated(KeyboardInterrupt):
    """The command was stopped by SIGTERM (a scheduler, ``kill``, a container stop): it
    unwinds as an interrupt does, removing what it had begun, and exits with status 143."""


async def _terminable(work: Coroutine[Any, Any, _T]) -> _T:
    """``await work``, with SIGTERM cancelling it as asyncio's SIGINT handling does, so the
    command's cleanup (an interrupted ``cp`` removing its attempt) runs either way."""
    import signal

    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    terminated = False

    def on_sigterm() -> None:
        nonlocal terminated
        terminated = True
        task.cancel()

    try:
        loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, Windows
        return await work
    try:
        return await work
    except asyncio.CancelledError:
        if terminated:
            raise Terminated from None
        raise
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


@dataclass
class Failure:
    """The exit status :func:`reporting_errors` chose, or None if the work succeeded."""

    status: int | None = None


@contextlib.contextmanager
def reporting_errors(prog: str) -> Iterator[Failure]:
    """Report an error the user can fix as one line ``PROG: error: ...`` on stderr (status
    1) and an interrupt as ``PROG: interrupted`` (status 130), in the yielded
    :class:`Failure`; anything else is a bug and propagates with its traceback. Other
    commands (the example jobs) report errors the way ``ckptstore`` does through it."""
    failure = Failure()
    try:
        yield failure
    except Terminated:
        print(f"{prog}: terminated", file=sys.stderr)
        failure.status = 128 + 15
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        failure.status = 130
    except Exception as exc:
        message = error_message(exc)
        if message is None:
            raise
        print(f"{prog}: error: {message}", file=sys.stderr)
        failure.status = EXIT_ERROR


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``ckptstore`` command with ``argv`` (default: ``sys.argv[1:]``); returns the exit
    status instead of exiting, so tests and scripts can call it in-process."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version and usage errors
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    command: Command = args.func
    with reporting_errors(f"ckptstore {args.command}") as failure:
        outcome = asyncio.run(_terminable(command(args)))
    if failure.status is not None:
        return failure.status
    try:
        # Output, like errors, never carries a credential: a command may echo the URL or
        # the options it was given (bench reports the URL it measured).
        if args.json:
            print(json.dumps(redact_data(outcome.data), indent=2, sort_keys=False))
        elif outcome.text:
            print(redact(outcome.text))
        sys.stdout.flush()
    except BrokenPipeError:  # `ckptstore show ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if outcome.error is not None:
        print(f"ckptstore {args.command}: error: {redact(outcome.error)}", file=sys.stderr)
    return outcome.status
