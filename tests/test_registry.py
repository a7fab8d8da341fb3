"""open_store: which backend a URL reaches, and the errors for URLs nothing can serve."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptstore import (
    InvalidURLError,
    MissingDependencyError,
    open_store,
    register_backend,
)
from ckptstore.store import registry
from ckptstore.store.local import LocalStore
from ckptstore.store.memory import MemoryStore
from ckptstore.store.nfs import NFSStore
from tests.children import python_path


@pytest.fixture
def scratch_registry() -> Iterator[None]:
    """Backends registered by a test are removed after it."""
    saved = dict(registry._BACKENDS)
    yield
    registry._BACKENDS.clear()
    registry._BACKENDS.update(saved)


def test_plain_paths_are_local(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for url in (str(tmp_path / "a"), tmp_path / "a"):
        store = open_store(url)
        assert type(store) is LocalStore
        assert store.root == str(tmp_path / "a")
        assert store.url == f"file://{tmp_path}/a"
    monkeypatch.chdir(tmp_path)
    relative = open_store("rel/dir")
    assert isinstance(relative, LocalStore)
    assert relative.root == str(tmp_path / "rel" / "dir")
    monkeypatch.setenv("HOME", str(tmp_path))
    home = open_store("~/ckpts")
    assert isinstance(home, LocalStore)
    assert home.root == str(tmp_path / "ckpts")
    # '?' and '#' are ordinary characters in a plain path
    odd = open_store(str(tmp_path / "what?#"))
    assert isinstance(odd, LocalStore)
    assert odd.root == str(tmp_path / "what?#")


async def test_file_urls(tmp_path: Path) -> None:
    for url in (f"file://{tmp_path}/x", f"FILE://{tmp_path}/x", f"file://localhost{tmp_path}/x"):
        store = open_store(url)
        assert type(store) is LocalStore, url
        assert store.root == f"{tmp_path}/x"
    encoded = open_store(f"file://{tmp_path}/a%20b%3Fc")
    assert isinstance(encoded, LocalStore)
    assert encoded.root == f"{tmp_path}/a b?c"
    async with encoded:
        await encoded.put("k", b"v")
    assert (tmp_path / "a b?c" / "k").read_bytes() == b"v"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("file://server/share/x", "host 'server' is not supported"),
        ("file://", "names no directory"),
        ("file:///tmp/x?durable=false", r"take no \?query"),
        ("file:///tmp/x?part_size=8MiB", r"pass options as keywords"),
        ("file:///tmp/x#frag", r"take no \?query"),
    ],
)
def test_bad_file_urls(url: str, message: str) -> None:
    with pytest.raises(InvalidURLError, match=message) as info:
        open_store(url)
    assert isinstance(info.value, ValueError)


def test_nfs_and_memory_urls(tmp_path: Path) -> None:
    nfs = open_store(f"nfs://{tmp_path}/mnt")
    assert type(nfs) is NFSStore
    assert nfs.root == f"{tmp_path}/mnt"
    memory = open_store("memory://registry-test/run")
    assert type(memory) is MemoryStore
    assert memory.url == "memory://registry-test/run"


def test_unknown_scheme_names_the_known_ones() -> None:
    with pytest.raises(InvalidURLError) as info:
        open_store("nosuchscheme://bucket/x")
    message = str(info.value)
    assert "no backend for nosuchscheme:// URLs" in message
    for scheme in ("file", "memory", "nfs", "s3", "gs"):
        assert scheme in message
    assert "fsspec" in message


@pytest.mark.parametrize("url", ["", "://x", "sp ace://x", "a_b://x"])
def test_malformed_urls(url: str) -> None:
    with pytest.raises(InvalidURLError):
        open_store(url)


def test_missing_dependency_names_the_install_command(
    scratch_registry: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "ckptstore_fake_backend.py").write_text(
        "import ckptstore_client_that_is_not_installed\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    register_backend("fakeblob", "ckptstore_fake_backend:FakeStore", "pip install 'fake[blob]'")
    assert "fakeblob" in registry.registered_schemes()
    with pytest.raises(MissingDependencyError) as info:
        open_store("fakeblob://bucket/prefix")
    assert isinstance(info.value, ImportError)
    message = str(info.value)
    assert "fakeblob://" in message
    assert "'ckptstore_client_that_is_not_installed'" in message
    assert "pip install 'fake[blob]'" in message


def test_registered_backend_is_used_and_gets_query_options(
    scratch_registry: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "ckptstore_fake_query.py").write_text(
        "from ckptstore.store.memory import MemoryStore\n"
        "class QueryStore(MemoryStore):\n"
        "    url_query_options = True\n"
        "    seen = {}\n"
        "    @classmethod\n"
        "    def from_url(cls, url, **options):\n"
        "        cls.seen = dict(options, url=url)\n"
        "        return MemoryStore.from_url('memory://' + url.split('://', 1)[1])\n"
        "class NotAStore:\n"
        "    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    register_backend("Qry", "ckptstore_fake_query:QueryStore")
    store = open_store("qry://ns/x?region=eu&part_size=8MiB", retries="3")
    assert isinstance(store, MemoryStore)
    import ckptstore_fake_query

    assert ckptstore_fake_query.QueryStore.seen == {
        "url": "qry://ns/x",
        "region": "eu",
        "part_size": "8MiB",
        "retries": "3",
    }
    with pytest.raises(InvalidURLError, match="both in the URL query and as a keyword"):
        open_store("qry://ns/x?region=eu", region="us")
    register_backend("notastore", "ckptstore_fake_query:NotAStore")
    with pytest.raises(TypeError, match="not a ckptstore Store subclass"):
        open_store("notastore://x")


@pytest.mark.parametrize("scheme", ["", "s3://", "caf\u00e9"])
def test_register_backend_refuses_bad_schemes(scheme: str) -> None:
    with pytest.raises(ValueError, match="invalid scheme"):
        register_backend(scheme, "x:Y")


def test_open_store_imports_no_client_library() -> None:
    # the registry names classes by path; opening a local store imports no cloud client
    import subprocess
    import sys

    code = (
        "import sys, ckptstore; ckptstore.open_store('/tmp/x'); "
        "print(sorted(m for m in ('aiobotocore', 'botocore', 'gcsfs', 'torch', 'jax') "
        "if m in sys.modules))"
    )
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": python_path(root)},
    ).stdout
    assert out.strip() == "[]"


def test_a_scheme_with_a_backend_is_taken_over_only_when_asked(scratch_registry: None) -> None:
    s3 = registry._BACKENDS["s3"].target
    with pytest.raises(ValueError, match=r"s3:// URLs already go to .*replace=True"):
        register_backend("S3", "somewhere_else:FakeS3")
    assert registry._BACKENDS["s3"].target == s3  # refused: nothing changed
    register_backend("s3", s3)  # the same target again is no takeover
    register_backend("mine", "pkg_a:Store")
    with pytest.raises(ValueError, match="mine:// URLs already go to pkg_a:Store"):
        register_backend("mine", "pkg_b:Store")
    register_backend("mine", "pkg_b:Store", replace=True)
    assert registry._BACKENDS["mine"].target == "pkg_b:Store"
    register_backend("s3", "somewhere_else:FakeS3", replace=True)
    assert registry._BACKENDS["s3"].target == "somewhere_else:FakeS3"
