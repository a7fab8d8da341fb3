"""Settings: defaults, CKPTSTORE_* environment overrides, and the errors for bad values."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptstore import Settings, default_settings, open_store
from ckptstore.config import parse_size
from ckptstore.store.local import LocalStore


@pytest.fixture
def fresh_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """default_settings() reads the environment once; re-read it for this test and after."""
    for name in Settings.field_names():
        monkeypatch.delenv(f"CKPTSTORE_{name.upper()}", raising=False)
    default_settings.cache_clear()
    yield monkeypatch
    default_settings.cache_clear()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        ("64MiB", 64 << 20),
        ("8M", 8 << 20),
        ("8mb", 8 << 20),
        ("1GiB", 1 << 30),
        (" 2 K ", 2 << 10),
        ("3T", 3 << 40),
        (0, 0),
        (17, 17),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "1.5GiB", "-3", "12 parsecs", "MiB"])
def test_parse_size_refuses_nonsense(text: str) -> None:
    with pytest.raises(ValueError, match="cannot parse size"):
        parse_size(text)


def test_parse_size_refuses_negative_ints() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        parse_size(-1)


def test_environment_overrides_defaults(fresh_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fresh_env.setenv("CKPTSTORE_PART_SIZE", "8MiB")
    fresh_env.setenv("CKPTSTORE_DURABLE", "false")
    fresh_env.setenv("CKPTSTORE_IO_THREADS", "3")
    fresh_env.setenv("CKPTSTORE_MAX_INFLIGHT_BYTES", "16MiB")  # below the default part size
    settings = default_settings()
    assert settings.part_size == 8 << 20
    assert settings.durable is False
    assert settings.io_threads == 3
    assert settings.max_inflight_bytes == 16 << 20
    assert settings.max_concurrency == Settings().max_concurrency  # untouched fields keep defaults
    store = open_store(tmp_path)
    assert store.settings == settings
    # keywords beat the environment, for one store only
    tuned = open_store(tmp_path, part_size="4MiB", durable=True)
    assert (tuned.settings.part_size, tuned.settings.durable) == (4 << 20, True)
    assert tuned.settings.io_threads == 3
    assert default_settings().part_size == 8 << 20


def test_environment_is_read_once(fresh_env: pytest.MonkeyPatch) -> None:
    fresh_env.setenv("CKPTSTORE_IO_THREADS", "5")
    assert default_settings().io_threads == 5
    fresh_env.setenv("CKPTSTORE_IO_THREADS", "6")
    assert default_settings().io_threads == 5


@pytest.mark.parametrize(
    ("variable", "value", "error", "message"),
    [
        ("CKPTSTORE_PART_SIZE", "lots", ValueError, "CKPTSTORE_PART_SIZE: cannot parse size"),
        ("CKPTSTORE_DURABLE", "maybe", ValueError, "CKPTSTORE_DURABLE: .* not a boolean"),
        ("CKPTSTORE_IO_THREADS", "0", ValueError, "CKPTSTORE_.*io_threads must be > 0"),
        ("CKPTSTORE_PART_SIZE", "0", ValueError, "part_size must be > 0"),
        ("CKPTSTORE_MAX_INFLIGHT_BYTES", "1MiB", ValueError, "at least one part_size"),
    ],
)
def test_bad_environment_values_name_the_variable(
    fresh_env: pytest.MonkeyPatch,
    variable: str,
    value: str,
    error: type[Exception],
    message: str,
) -> None:
    fresh_env.setenv(variable, value)
    with pytest.raises(error, match=message):
        default_settings()


def test_settings_errors() -> None:
    with pytest.raises(ValueError, match="part_size must be > 0"):
        Settings(part_size=0)
    with pytest.raises(ValueError, match="io_threads must be > 0"):
        Settings(io_threads=0)
    with pytest.raises(ValueError, match="max_concurrency"):
        Settings(max_concurrency=-1)
    with pytest.raises(ValueError, match="at least one part_size"):
        Settings(part_size=64 << 20, max_inflight_bytes=1 << 20)
    with pytest.raises(TypeError, match="io_threads must be an int"):
        Settings(io_threads="4")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="part_size must be an int"):
        Settings(part_size=True)
    with pytest.raises(TypeError, match=r"unknown setting 'part_sise'; known: .*part_size"):
        Settings().replace(part_sise=1)
    with pytest.raises(ValueError, match="not a boolean"):
        Settings().replace(durable="perhaps")
    assert Settings().replace(part_size="1MiB", durable="no") == Settings(
        part_size=1 << 20, durable=False
    )


def test_store_keywords_validate_settings(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="unknown options \\['colour'\\]"):
        open_store(tmp_path, colour="blue")
    with pytest.raises(ValueError, match="cannot parse size"):
        open_store(tmp_path, part_size="big")
    with pytest.raises(TypeError, match=r"settings must be a ckptstore\.Settings"):
        open_store(tmp_path, settings={"part_size": 1})
    store = open_store(tmp_path, settings=Settings(io_threads=2), part_size=1 << 20)
    assert isinstance(store, LocalStore)
    assert (store.settings.io_threads, store.settings.part_size) == (2, 1 << 20)
