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
    assert settings.transport.part_size == 8 << 20
    assert settings.transport.durable is False
    assert settings.transport.io_threads == 3
    assert settings.transport.max_inflight_bytes == 16 << 20
    assert (
        settings.transport.max_concurrency == Settings().transport.max_concurrency
    )  # untouched fields keep defaults
    store = open_store(tmp_path)
    assert store.settings == settings
    # keywords beat the environment, for one store only
    tuned = open_store(tmp_path, part_size="4MiB", durable=True)
    assert (tuned.settings.transport.part_size, tuned.settings.transport.durable) == (4 << 20, True)
    assert tuned.settings.transport.io_threads == 3
    assert default_settings().transport.part_size == 8 << 20


def test_environment_is_read_once(fresh_env: pytest.MonkeyPatch) -> None:
    fresh_env.setenv("CKPTSTORE_IO_THREADS", "5")
    assert default_settings().transport.io_threads == 5
    fresh_env.setenv("CKPTSTORE_IO_THREADS", "6")
    assert default_settings().transport.io_threads == 5


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
    assert (store.settings.transport.io_threads, store.settings.transport.part_size) == (2, 1 << 20)


def test_every_setting_lies_in_exactly_one_group_and_is_set_by_its_name() -> None:
    """Settings is split by the layer that reads it; a user still names a setting alone."""
    from ckptstore.config import GcSettings, LayoutSettings, TransportSettings

    groups = {"transport": TransportSettings, "layout": LayoutSettings, "gc": GcSettings}
    names = [f for cls in groups.values() for f in cls.__dataclass_fields__]
    assert len(names) == len(set(names)) == len(Settings.field_names())
    assert set(names) == Settings.field_names()
    settings = Settings(part_size=4 << 20, pack_size=2 << 20, save_lease_seconds=30)
    assert settings.transport.part_size == 4 << 20
    assert settings.layout.pack_size == 2 << 20
    assert settings.gc.save_lease_seconds == 30
    values = settings.values()
    assert set(values) == Settings.field_names()
    assert Settings(**values) == settings
    # a whole group, then a setting by name over it
    layout = LayoutSettings(pack_threshold=4096)
    combined = Settings(layout=layout, pack_size=1 << 20)
    assert (combined.layout.pack_threshold, combined.layout.pack_size) == (4096, 1 << 20)
    assert combined.transport == TransportSettings()
    # replace keeps the other groups and takes strings
    changed = settings.replace(retry_attempts="3", incremental="no")
    assert changed.transport.retry_attempts == 3
    assert changed.layout.incremental is False
    assert changed.gc == settings.gc
    assert changed.layout.pack_size == 2 << 20
    with pytest.raises(ValueError, match="save_lease_seconds must be at least 4"):
        settings.replace(save_lease_seconds=1)
    with pytest.raises(TypeError, match="unknown setting 'transport_size'"):
        Settings(transport_size=1)
