"""What the example jobs share: their command line and how they end on an error.

A newcomer runs an example before anything else, often against a URL typed by hand, so an
example must behave like the ``ckptstore`` command: ``--help`` names the real command
(``python -m ckptstore.examples.train``, not ``train.py``) and shows every default, and a
mistake the user can fix (a wrong URL, an unreachable endpoint, a missing bucket, missing
credentials) ends in one line on stderr and exit status 1, not a traceback. Anything else
is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from ckptstore.cli.main import reporting_errors

__all__ = ["job_parser", "run_job"]


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults after every option's help; the description keeps its line breaks."""


def job_parser(module: str, doc: str | None) -> argparse.ArgumentParser:
    """The parser of ``python -m <module>``, described by the first paragraphs of ``doc``."""
    return argparse.ArgumentParser(
        prog=f"python -m {module}",
        description=(doc or "").split("\n\n")[0],
        formatter_class=_HelpFormatter,
    )


def run_job(prog: str, job: Callable[[], int]) -> int:
    """Run ``job`` and return its exit status; a user's error becomes one line and status 1."""
    with reporting_errors(prog) as failure:
        return job()
    return failure.status if failure.status is not None else 1
