"""docs/reference.md names every scheme, Settings field and backend option the code has.

The reference is hand-written; these tests introspect the code so that a new option or field
added without documenting it fails here instead of leaving the page silently stale.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

from ckptstore.config import Settings
from ckptstore.store.registry import _BACKENDS, registered_schemes

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "reference.md"

# Constructor parameters that are the URL's own parts, not options a user passes.
URL_PARTS = {"self", "bucket", "prefix", "root", "fs", "name", "scheme", "settings"}


def sections() -> dict[str, str]:
    """Heading text -> the body under that ``##`` heading."""
    out: dict[str, str] = {}
    for chunk in REFERENCE.read_text().split("\n## ")[1:]:
        heading, _, body = chunk.partition("\n")
        out[heading] = body
    return out


def table_options(body: str) -> set[str]:
    """Names in the first column of the markdown tables in ``body``."""
    names = set()
    for line in body.splitlines():
        match = re.match(r"\|\s*`([a-z_0-9]+)`\s*\|", line)
        if match:
            names.add(match.group(1))
    return names


def section(title_start: str) -> str:
    found = [body for heading, body in sections().items() if heading.startswith(title_start)]
    assert len(found) == 1, f"reference.md needs one section starting {title_start!r}"
    return found[0]


def constructor_options(target: str) -> set[str]:
    module_name, _, class_name = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except ImportError as exc:
        pytest.skip(f"{target} needs a package that is not installed: {exc}")
    return set(inspect.signature(cls.__init__).parameters) - URL_PARTS


def test_every_settings_field_is_documented_with_its_variable_and_default() -> None:
    body = section("Settings")
    documented = table_options(body)
    fields = set(Settings.field_names())
    assert fields - documented == set(), "Settings fields missing from docs/reference.md"
    assert documented - fields == set(), "docs/reference.md lists Settings fields the code lacks"
    for field in fields:
        row = next(line for line in body.splitlines() if line.startswith(f"| `{field}`"))
        assert f"`CKPTSTORE_{field.upper()}`" in row, f"{field}: environment variable not named"


@pytest.mark.parametrize(
    ("title", "target"),
    [
        ("`s3://`", "ckptstore.store.s3:S3Store"),
        ("`gs://`", "ckptstore.store.gcs:GCSStore"),
        ("fsspec", "ckptstore.store.fsspec:FsspecStore"),
    ],
)
def test_every_backend_option_is_documented(title: str, target: str) -> None:
    documented = table_options(section(title))
    options = constructor_options(target)
    assert options - documented == set(), f"{target} options missing from docs/reference.md"


def test_backends_without_options_take_none() -> None:
    # The page says local, nfs and memory take only Settings: that must stay true.
    for scheme in ("file", "nfs", "memory"):
        assert constructor_options(_BACKENDS[scheme].target) == set(), scheme


def test_every_registered_scheme_is_documented() -> None:
    body = section("Schemes")
    for scheme in registered_schemes():
        assert f"`{scheme}://" in body, f"scheme {scheme}:// missing from docs/reference.md"


def test_table_parser_sees_option_rows() -> None:
    # Guards the helpers above: if the parser found nothing, every check would pass vacuously.
    assert table_options("| `part_size` | size |\n| not an option |\n") == {"part_size"}


def test_tests_named_by_the_commit_page_exist() -> None:
    # docs/commit.md cites tests as evidence; a renamed or deleted test must not leave it stale.
    page = (ROOT / "docs" / "commit.md").read_text()
    names = set(re.findall(r"`(?:[A-Z][A-Za-z]*Tests\.)?(test_[a-z0-9_]+)", page))
    assert len(names) > 10
    sources = [*(ROOT / "tests").glob("*.py"), *(ROOT / "ckptstore" / "testing").glob("*_tests.py")]
    defined = {
        m for path in sources for m in re.findall(r"def (test_[a-z0-9_]+)\(", path.read_text())
    }
    assert names - defined == set(), "docs/commit.md names tests that do not exist"


def test_every_manager_option_is_documented() -> None:
    from ckptstore.manager import CheckpointManager

    page = (ROOT / "docs" / "async.md").read_text()
    _, _, body = page.partition("## All options")
    section_body = body.split("\n## ")[0]
    starred = set(re.findall(r"\|\s*`\*\*([a-z_]+)`", section_body))
    documented = table_options(section_body) | starred
    params = set(inspect.signature(CheckpointManager.__init__).parameters) - {"self"}
    assert params - documented == set(), "CheckpointManager options missing from docs/async.md"


def test_every_page_is_in_the_nav_and_linked_from_the_index() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    index = (ROOT / "docs" / "index.md").read_text()
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name != "index.md")
    assert len(pages) >= 12
    for page in pages:
        assert f": {page}" in nav, f"{page} missing from mkdocs.yml nav"
        assert f"({page})" in index, f"{page} not linked from docs/index.md"
