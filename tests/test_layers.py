"""The layers hold: faces reach ``layout/`` and ``stage/`` only through the engine's interface.

docs/design.md ("The engine's interface") lists what a face (``cli/``, ``integrations/``,
``manager/``, the top-level modules) and the multi-rank runtime may take from ``pipeline/``.
These tests read every module's imports (no module is imported), so a face that reaches past
the interface, a name used but not listed, or a listed name that no longer exists fails here.
"""

from __future__ import annotations

import ast
import importlib
import re
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "ckptstore"
DESIGN = PACKAGE.parent / "docs" / "design.md"

#: The engine's internals: no face imports them.
INTERNAL = ("ckptstore.layout", "ckptstore.stage")

#: One import: (line, absolute module, [(name, alias)]).
Import = tuple[int, str, list[tuple[str, str | None]]]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _faces() -> list[Path]:
    top = list(PACKAGE.glob("*.py"))
    nested = [
        p for folder in ("cli", "integrations", "manager") for p in (PACKAGE / folder).rglob("*.py")
    ]
    return sorted(top + nested)


def _imports(path: Path, source: str | None = None) -> list[Import]:
    """Every import of ``path`` (or of ``source`` as if it were ``path``): (line, absolute
    module, [(name, alias)]); ``import a.b`` gives module ``a.b`` and no names."""
    text = path.read_text() if source is None else source
    module_parts = _module_name(path).split(".")
    package = module_parts if path.name == "__init__.py" else module_parts[:-1]
    out: list[Import] = []
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                module = ".".join([*base, module] if module else base)
            out.append((node.lineno, module, [(a.name, a.asname) for a in node.names]))
    return out


def _is_internal(module: str, names: list[tuple[str, str | None]]) -> bool:
    if any(module == m or module.startswith(m + ".") for m in INTERNAL):
        return True
    return module == "ckptstore" and any(f"ckptstore.{name}" in INTERNAL for name, _ in names)


def test_no_face_imports_the_layout_or_the_stager() -> None:
    reached = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}"
        for path in _faces()
        for line, module, names in _imports(path)
        if _is_internal(module, names)
    ]
    assert not reached, "faces must go through ckptstore.pipeline:\n" + "\n".join(reached)


@pytest.mark.parametrize(
    ("layer", "above"),
    [
        ("store", ("layout", "stage", "pipeline", "manager", "integrations", "cli")),
        ("layout", ("stage", "pipeline", "manager", "integrations", "cli")),
        ("stage", ("pipeline", "manager", "integrations", "cli")),
        ("pipeline", ("manager", "integrations", "cli")),
    ],
)
def test_a_layer_imports_nothing_above_it(layer: str, above: tuple[str, ...]) -> None:
    upward = [
        f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}"
        for path in sorted((PACKAGE / layer).rglob("*.py"))
        for line, module, names in _imports(path)
        for up in above
        if module.startswith(f"ckptstore.{up}")
        or (module == "ckptstore" and any(name == up for name, _ in names))
    ]
    assert not upward, "\n".join(upward)


def _documented() -> dict[str, set[str]]:
    """The interface table of docs/design.md: module -> the names listed for it."""
    text = DESIGN.read_text()
    section = text.split("## The engine's interface", 1)[1].split("\n## ", 1)[0]
    listed: dict[str, set[str]] = {}
    for row in re.findall(r"^\| `pipeline\.(\w+)` \|[^|]*\|(.*)\|$", section, re.MULTILINE):
        listed[row[0]] = set(re.findall(r"`(\w+)`", row[1]))
    assert listed, "docs/design.md has no interface table"
    return listed


def _used_from_pipeline() -> dict[str, dict[str, list[str]]]:
    """module -> name -> where faces take it, from ``from ckptstore.pipeline.m import name``
    and from ``alias.name`` where ``from ckptstore.pipeline import m as alias``."""
    used: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in _faces():
        where = str(path.relative_to(PACKAGE.parent))
        aliases: dict[str, str] = {}
        for _, module, names in _imports(path):
            if module.startswith("ckptstore.pipeline."):
                for name, _alias in names:
                    used[module.removeprefix("ckptstore.pipeline.")][name].append(where)
            elif module == "ckptstore.pipeline":
                aliases.update({alias or name: name for name, alias in names})
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
            ):
                used[aliases[node.value.id]][node.attr].append(where)
    return used


def test_every_name_a_face_takes_from_the_engine_is_documented() -> None:
    listed = _documented()
    missing = [
        f"pipeline.{module}.{name} (used by {', '.join(sorted(set(where)))})"
        for module, names in _used_from_pipeline().items()
        for name, where in names.items()
        if name not in listed.get(module, set())
    ]
    assert not missing, "add these to docs/design.md, 'The engine's interface':\n" + "\n".join(
        missing
    )


def test_every_documented_name_is_public_in_its_module() -> None:
    pytest.importorskip("torch")  # pipeline.tensors imports torch
    stale: list[str] = []
    for module, names in _documented().items():
        public = set(importlib.import_module(f"ckptstore.pipeline.{module}").__all__)
        stale.extend(f"pipeline.{module}.{name}" for name in sorted(names - public))
    assert not stale, "listed in docs/design.md but not in the module's __all__:\n" + "\n".join(
        stale
    )


@pytest.mark.parametrize(
    "line",
    [
        "from ckptstore.layout.commit import latest_step",
        "import ckptstore.stage.torch",
        "from ckptstore import layout",
        "from ..layout import keys",
        "from ..stage.stager import Stager",
    ],
)
def test_the_check_sees_every_spelling_of_a_reach_past_the_engine(line: str) -> None:
    face = PACKAGE / "integrations" / "probe.py"
    assert any(_is_internal(module, names) for _, module, names in _imports(face, line))


def test_the_check_lets_the_engine_through() -> None:
    face = PACKAGE / "integrations" / "probe.py"
    for line in ("from ckptstore.pipeline.steps import latest_step", "from ..pipeline import save"):
        assert not any(_is_internal(m, names) for _, m, names in _imports(face, line)), line


#: The Settings groups a layer may read: its own and those of the layers below it.
SETTINGS_READ_BY = {
    "store": {"transport"},
    "stage": {"transport", "layout"},
    "layout": {"transport", "layout", "gc"},
}


@pytest.mark.parametrize("layer", sorted(SETTINGS_READ_BY))
def test_a_layer_reads_only_its_own_settings_and_those_below(layer: str) -> None:
    """``Settings`` is split by layer (ckptstore/config.py): the store transport reads
    ``settings.transport`` alone, never the layout's packing policy or the gc's lease."""
    from ckptstore.config import Settings

    allowed = SETTINGS_READ_BY[layer]
    groups = set(Settings.__dataclass_fields__)
    pattern = re.compile(r"settings(?:\(\))?\.(" + "|".join(sorted(groups)) + r")\.")
    wrong = [
        f"{path.relative_to(PACKAGE.parent)}:{number}: settings.{match.group(1)}"
        for path in sorted((PACKAGE / layer).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        for match in pattern.finditer(line)
        if match.group(1) not in allowed
    ]
    assert not wrong, f"{layer}/ reads settings of a layer above it:\n" + "\n".join(wrong)
    reads = sum(len(pattern.findall(path.read_text())) for path in (PACKAGE / layer).rglob("*.py"))
    assert reads, f"no module of {layer}/ reads its settings: the pattern is stale"
