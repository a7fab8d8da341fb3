"""Directory trees as committed steps (``ckptstore.files``): round trips, verification, hostile
manifests, trees that cannot be carried, and the CLI's ``cp``/``verify``/``show`` on them."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import stat
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptstore
from ckptstore import background, cli, files
from ckptstore.errors import (
    AlreadyExistsError,
    CheckpointFormatError,
    CommitConflictError,
    CorruptCheckpointError,
    NotFoundError,
    StoreError,
    UnsupportedTreeError,
)
from ckptstore.layout.keys import manifest_key
from ckptstore.layout.manifest import Manifest
from ckptstore.layout.tree import tree_paths
from ckptstore.store.base import PutMode
from ckptstore.store.memory import MemoryStore
from ckptstore.store.wrappers import Fault, FaultStore, StoreWrapper, transient_error
from tests.servers.moto import MotoS3

#: Small thresholds so "large" files (own objects, multipart) stay a few MiB in tests.
SMALL = {"pack_threshold": "256KiB", "pack_size": "1MiB"}


def make_tree(root: Path, *, small: int = 120, large: tuple[int, ...] = (3 << 20, 1 << 20)) -> None:
    """A checkpoint-like tree: many small files in nested directories, a few large ones, an
    empty file, an empty directory, an executable, an in-tree symlink."""
    rng = np.random.default_rng(7)
    for i in range(small):
        where = root / f"shard-{i % 4}" / f"part{i // 40}"
        where.mkdir(parents=True, exist_ok=True)
        (where / f"chunk~{i}.bin").write_bytes(rng.bytes(int(rng.integers(1, 20_000))))
    for i, size in enumerate(large):
        (root / f"model-{i}.safetensors").write_bytes(rng.bytes(size))
    (root / "empty.txt").write_bytes(b"")
    (root / "nothing" / "inside").mkdir(parents=True)
    (root / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (root / "run.sh").chmod(0o755)
    (root / "config.json").write_text('{"hidden_size": 8}')
    (root / "shard-0" / "config-link.json").symlink_to("../config.json")


def snapshot(root: Path) -> dict[str, Any]:
    """Everything about a tree the round trip must keep: each entry's kind, mode, content."""
    seen: dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            rel = str(path.relative_to(root))
            st = path.lstat()
            if stat.S_ISLNK(st.st_mode):
                seen[rel] = ("link", os.readlink(path))
            elif stat.S_ISDIR(st.st_mode):
                seen[rel] = ("dir",)
            else:
                seen[rel] = ("file", stat.S_IMODE(st.st_mode), path.read_bytes())
    return seen


def test_round_trip_local(tmp_path: Path) -> None:
    src, out, store = tmp_path / "src", tmp_path / "out", tmp_path / "store"
    make_tree(src)
    info = files.upload(src, store, step=7, metadata={"epoch": 2}, **SMALL)
    assert (info.step, info.files, info.links) == (7, 120 + 2 + 3, 1)
    assert info.directories == len([p for p in src.rglob("*") if p.is_dir() and not p.is_symlink()])
    assert info.nbytes == sum(
        p.stat().st_size for p in src.rglob("*") if p.is_file() and not p.is_symlink()
    )
    # packed: 120 small files in a handful of packs, plus one object per large file
    assert info.objects < 10

    assert files.download(store, out) == out.absolute()
    assert snapshot(out) == snapshot(src)
    assert not [p for p in tmp_path.iterdir() if ".ckptstore-tmp-" in p.name]

    manifest = ckptstore.read_manifest(store, 7)
    assert files.is_tree_step(manifest)
    assert manifest.metadata["user"] == {"epoch": 2}


def test_round_trip_s3_multipart_and_cli(
    tmp_path: Path, moto_s3: MotoS3, capsys: pytest.CaptureFixture[str]
) -> None:
    """Large files go up as parallel multipart uploads; ``cp`` and ``verify`` treat the step
    as any other; the copy downloads to the same tree."""
    src = tmp_path / "src"
    make_tree(src, small=30, large=(11 << 20,))
    url = f"s3://{moto_s3.bucket}/run"
    opts = {**moto_s3.options(), **SMALL, "multipart_threshold": "6MiB", "part_size": "5MiB"}
    files.upload(src, url, step=3, **opts)
    uploads = ckptstore.read_manifest(url, 3, **opts)
    big = uploads.paths.index("model-0.safetensors")
    client: Any = moto_s3.client()
    head = client.head_object(
        Bucket=moto_s3.bucket, Key="run/" + uploads.object_key(uploads.leaf_object[big])
    )
    client.close()
    assert "-" in head["ETag"]  # a multipart upload's ETag carries its part count

    cli_opts = ["-o", f"endpoint_url={moto_s3.endpoint}", "-o", f"region={moto_s3.region}"]
    copy = tmp_path / "copy"
    assert cli.main(["cp", *cli_opts, url, str(copy)]) == 0
    assert cli.main(["verify", str(copy), "3"]) == 0
    assert cli.main(["verify", *cli_opts, url, "3"]) == 0
    assert cli.main(["show", str(copy), "3"]) == 0
    shown = capsys.readouterr().out
    assert "ckptstore.files/1" in shown
    assert "model-0.safetensors" in shown

    files.download(copy, tmp_path / "from-copy")
    files.download(url, tmp_path / "from-s3", **opts)
    assert snapshot(tmp_path / "from-copy") == snapshot(src) == snapshot(tmp_path / "from-s3")


def test_load_returns_the_tree_as_nested_dicts(tmp_path: Path) -> None:
    src = tmp_path / "src"
    make_tree(src, small=3, large=(300_000,))
    files.upload(src, tmp_path / "store", step=1, **SMALL)
    state = ckptstore.load(tmp_path / "store")
    assert bytes(state["config.json"]) == (src / "config.json").read_bytes()
    assert bytes(state["model-0.safetensors"]) == (src / "model-0.safetensors").read_bytes()
    assert state["nothing"] == {"inside": {}}
    assert state["shard-0"]["part0"]["chunk~0.bin"].dtype == np.uint8


def test_large_files_are_streamed_not_read_whole(tmp_path: Path) -> None:
    """A 96 MiB file goes up mapped: the process allocates far less than the file's size."""
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "weights.bin", "wb") as fh:
        for _ in range(12):
            fh.write(os.urandom(8 << 20))
    tracemalloc.start()
    try:
        files.upload(src, tmp_path / "store", step=1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20
    tracemalloc.start()
    try:
        files.download(tmp_path / "store", tmp_path / "out")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20
    assert (tmp_path / "out" / "weights.bin").read_bytes() == (src / "weights.bin").read_bytes()


def _objects(store: Path, step: int) -> list[Path]:
    return sorted(p for p in (store / str(step)).rglob("*") if p.is_file() and "attempt" in str(p))


@pytest.mark.parametrize("which", ["pack", "large"])
def test_damaged_bytes_are_detected_and_nothing_appears(tmp_path: Path, which: str) -> None:
    src, store, out = tmp_path / "src", tmp_path / "store", tmp_path / "out"
    make_tree(src, small=20, large=(2 << 20,))
    files.upload(src, store, step=5, **SMALL)
    manifest = ckptstore.read_manifest(store, 5)
    big = manifest.leaf_object[manifest.paths.index("model-0.safetensors")]
    victim = next(
        store / manifest.object_key(i)
        for i in range(len(manifest.object_keys))
        if (i == big) == (which == "large")
    )
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.chmod(0o644)
    victim.write_bytes(bytes(data))

    with pytest.raises(CorruptCheckpointError, match="crc32c mismatch"):
        files.download(store, out)
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if ".ckptstore-tmp-" in p.name]
    assert cli.main(["verify", str(store), "5"]) != 0


def _rewrite_manifest(store: Path, step: int, change: Any) -> None:
    """Commit a hostile variant of a step's manifest: ``change(manifest)`` returns it."""
    manifest = change(ckptstore.read_manifest(store, step))
    key = store / manifest_key(step)
    key.chmod(0o644)
    key.write_bytes(manifest.encode())


def _renamed(manifest: Manifest, old: str, new: str) -> Manifest:
    tree = manifest.tree
    tree["d"] = [new if k == old else k for k in tree["d"]]
    paths, _ = tree_paths(tree, len(manifest.paths))
    return dataclasses.replace(manifest, tree=tree, paths=paths)


@pytest.mark.parametrize("name", ["..", ".", "", "/etc", "a/../../x", "evil\0"])
def test_hostile_names_are_refused_before_anything_is_written(tmp_path: Path, name: str) -> None:
    src, store, out = tmp_path / "src", tmp_path / "store", tmp_path / "sub" / "out"
    src.mkdir()
    (src / "victim").write_bytes(b"payload")
    files.upload(src, store, step=1)
    _rewrite_manifest(store, 1, lambda m: _renamed(m, "victim", name))
    with pytest.raises(CorruptCheckpointError):
        files.download(store, out)
    assert not out.exists()
    assert not list(tmp_path.rglob("x"))
    assert not list(tmp_path.rglob("*tmp*"))


def test_a_repeated_name_is_refused(tmp_path: Path) -> None:
    src, store = tmp_path / "src", tmp_path / "store"
    src.mkdir()
    (src / "a").write_bytes(b"first")
    (src / "b").write_bytes(b"second")
    files.upload(src, store, step=1)

    def repeat(manifest: Manifest) -> Manifest:
        tree = manifest.tree
        tree["d"] = ["a", "a"]
        return dataclasses.replace(manifest, tree=tree, paths=["a", "a"])

    _rewrite_manifest(store, 1, repeat)
    with pytest.raises(CorruptCheckpointError, match="repeat"):
        files.download(store, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("target", ["/etc/passwd", "../../../outside", "a/../../.."])
def test_hostile_symlinks_are_refused(tmp_path: Path, target: str) -> None:
    src, store, out = tmp_path / "src", tmp_path / "store", tmp_path / "out"
    src.mkdir()
    (src / "real").write_bytes(b"x")
    (src / "link").symlink_to("real")
    files.upload(src, store, step=1)

    def relink(manifest: Manifest) -> Manifest:
        attrs = list(manifest.attrs)
        attrs[manifest.paths.index("link")] = {"symlink": target}
        return dataclasses.replace(manifest, attrs=attrs)

    _rewrite_manifest(store, 1, relink)
    with pytest.raises(CorruptCheckpointError, match="symlink"):
        files.download(store, out)
    assert not out.exists()


def test_hostile_mode_is_refused(tmp_path: Path) -> None:
    src, store = tmp_path / "src", tmp_path / "store"
    src.mkdir()
    (src / "f").write_bytes(b"x")
    files.upload(src, store, step=1)
    _rewrite_manifest(store, 1, lambda m: dataclasses.replace(m, attrs=[{"mode": 0o4755}]))
    with pytest.raises(CorruptCheckpointError, match="mode"):
        files.download(store, tmp_path / "out")


def test_trees_that_cannot_be_carried(tmp_path: Path) -> None:
    store = tmp_path / "store"
    outside = tmp_path / "secret"
    outside.write_text("s")
    cases = {
        "escaping": lambda d: (d / "l").symlink_to("../secret"),
        "absolute": lambda d: (d / "l").symlink_to(outside),
        "chained": lambda d: (
            (d / "sub").mkdir(),
            (d / "sub" / "here").symlink_to("."),
            (d / "l").symlink_to("sub/here/../.."),
        ),
        "fifo": lambda d: os.mkfifo(d / "pipe"),
        "socket": _bind_socket,
    }
    for name, build in cases.items():
        src = tmp_path / name
        src.mkdir()
        (src / "fine.txt").write_text("ok")
        build(src)
        with pytest.raises(UnsupportedTreeError, match=str(src)):
            files.upload(src, store, step=1)
        assert not store.exists() or ckptstore.list_steps(store) == []
    with pytest.raises(NotADirectoryError):
        files.upload(outside, store, step=1)


def _bind_socket(directory: Path) -> None:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(directory / "sock"))  # the socket file stays after the socket closes


class _TouchingStore(StoreWrapper):
    """Appends to a file of the tree being uploaded on the first data put (the tree changing
    under its upload)."""

    def __init__(self, inner: Any, victim: Path) -> None:
        super().__init__(inner)
        self.victim = victim

    async def _put(self, key: str, data: memoryview, mode: PutMode) -> None:
        if "/attempt-" in key and self.victim.stat().st_size == 7:
            with self.victim.open("ab") as fh:
                fh.write(b"+more")
        await super()._put(key, data, mode)


def test_a_tree_changing_during_upload_is_not_committed(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_bytes(b"x" * 100)
    (src / "zz-late").write_bytes(b"payload")
    store = _TouchingStore(MemoryStore(), src / "zz-late")
    with pytest.raises(UnsupportedTreeError, match="changed while it was uploaded"):
        files.upload(src, store, step=1)
    assert ckptstore.list_steps(store) == []


def test_targets(tmp_path: Path) -> None:
    src, store = tmp_path / "src", tmp_path / "store"
    src.mkdir()
    (src / "f").write_bytes(b"data")
    files.upload(src, store, step=1)
    files.upload(src, store, step=2)
    with pytest.raises(CommitConflictError):
        files.upload(src, store, step=2)

    empty = tmp_path / "empty"
    empty.mkdir()
    files.download(store, empty, step=1)  # an empty directory is replaced
    assert (empty / "f").read_bytes() == b"data"

    full = tmp_path / "full"
    full.mkdir()
    (full / "mine").write_text("keep")
    with pytest.raises(AlreadyExistsError, match="not an empty directory"):
        files.download(store, full)
    assert [p.name for p in full.iterdir()] == ["mine"]
    with pytest.raises(AlreadyExistsError):
        files.download(store, full / "mine")

    nested = tmp_path / "a" / "b" / "c"
    files.download(store, nested, step=2)
    assert (nested / "f").read_bytes() == b"data"
    with pytest.raises(NotFoundError):
        files.download(store, tmp_path / "none", step=9)

    ckptstore.save(store, {"w": np.arange(3)}, step=3)
    with pytest.raises(CheckpointFormatError, match=r"ckptstore\.load"):
        files.download(store, tmp_path / "state")
    assert not (tmp_path / "state").exists()


def test_mirror_uploads_snapshots_in_order_and_raises_failures(tmp_path: Path) -> None:
    store = tmp_path / "store"
    first, second = tmp_path / "checkpoint-1", tmp_path / "checkpoint-2"
    make_tree(first, small=10, large=(400_000,))
    expected = snapshot(first)
    make_tree(second, small=3, large=())
    with files.TreeMirror(store, **SMALL) as mirror:
        mirror.submit(first, 1)
        shutil.rmtree(first)  # the library's retention: the queued snapshot is unaffected
        mirror.wait()
        files.upload(second, store, step=2)  # another writer commits step 2 meanwhile
        mirror.submit(second, 2)  # so this upload fails, in the background
        with pytest.raises(CommitConflictError):
            mirror.wait()
        mirror.submit(second, 3)
        mirror.wait()
        assert [info.step for info in mirror.uploaded] == [1, 3]
    assert ckptstore.list_steps(store) == [1, 2, 3]
    files.download(store, tmp_path / "back", step=1)
    assert snapshot(tmp_path / "back") == expected
    assert not [p for p in tmp_path.iterdir() if ".ckptstore-tmp-" in p.name]
    with pytest.raises(NotADirectoryError):
        files.TreeMirror(store).submit(tmp_path / "missing", 3)


def test_mirror_refuses_a_step_not_after_the_newest_before_writing(tmp_path: Path) -> None:
    """Issue 29: a rerun in the same root used to fail one save late, in the background."""
    store = tmp_path / "store"
    tree = tmp_path / "tree"
    make_tree(tree, small=2, large=())
    files.upload(tree, store, step=5)
    with files.TreeMirror(store, resume_advice="Resume it thus") as mirror:
        for old in (3, 5):
            with pytest.raises(CommitConflictError, match=rf"step {old}: the newest .* is 5"):
                mirror.submit(tree, old)
        assert not [p for p in tmp_path.iterdir() if ".ckptstore-tmp-" in p.name]
        mirror.submit(tree, 6)
        with pytest.raises(CommitConflictError, match=r"newest step of this root is 6.*thus"):
            mirror.check_step(6)  # queued counts as well as committed
        mirror.wait()
        files.upload(tree, store, step=7)  # another writer's step: found at upload time
        mirror.submit(tree, 7)
        with pytest.raises(CommitConflictError):
            mirror.wait()
        mirror.submit(tree, 8)  # the failed 7 never counted; the store has 7 all the same
        mirror.wait()
    assert ckptstore.list_steps(store) == [5, 6, 7, 8]


def test_adopt_uploads_a_resumed_step_only_this_node_holds(tmp_path: Path) -> None:
    store = tmp_path / "store"
    tree = tmp_path / "checkpoint-4"
    make_tree(tree, small=2, large=())
    files.upload(tree, store, step=2)
    with files.TreeMirror(store) as mirror:
        assert not mirror.adopt(tree, 2)  # the store holds it
        assert mirror.adopt(tree, 4)  # its upload died with the process that saved it
    assert ckptstore.list_steps(store) == [2, 4]
    with files.TreeMirror(store) as mirror:
        assert not mirror.adopt(tree, 3)  # older than the store's newest: nothing to do
    assert ckptstore.list_steps(store) == [2, 4]


def test_roll_back_sets_newer_steps_and_local_copies_aside(tmp_path: Path) -> None:
    store = tmp_path / "store"
    local = tmp_path / "out"
    for step in (1, 2, 3):
        make_tree(local / f"checkpoint-{step}", small=2, large=())
        files.upload(local / f"checkpoint-{step}", store, step=step)
    (local / "checkpoint-x").mkdir()  # not a step's name: kept where it is
    newer = files.numbered_after(local, "checkpoint-")
    with pytest.raises(NotFoundError):
        files.roll_back(store, 7, newer_copies=newer)
    assert sorted(p.name for p in local.iterdir()) == [f"checkpoint-{s}" for s in "123x"]
    mirror = files.TreeMirror(store)
    with pytest.raises(CommitConflictError, match="newest step of this root is 3"):
        mirror.check_step(2)
    assert files.roll_back(store, 1, newer_copies=newer) == [3, 2]
    assert ckptstore.list_steps(store) == [1]
    assert sorted(p.name for p in local.iterdir()) == [
        ".ckptstore-replaced",
        "checkpoint-1",
        "checkpoint-x",
    ]
    aside = sorted(p.name.rsplit("-", 2)[0] for p in (local / files.REPLACED_DIR).iterdir())
    assert aside == ["checkpoint-2", "checkpoint-3"]
    mirror.rolled_back(1)
    mirror.submit(local / "checkpoint-1", 2)  # step 2 saved again, from the older state
    mirror.close()
    assert ckptstore.list_steps(store) == [1, 2]
    assert ckptstore.recover_step(store, 3).step == 3  # set aside, not lost


def test_cli_upload_and_download(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src, store = tmp_path / "src", tmp_path / "store"
    make_tree(src, small=5, large=(300_000,))
    assert cli.main(["upload", str(src), str(store), "4", "--metadata", '{"note": "x"}']) == 0
    assert "step 4: uploaded 9 files" in capsys.readouterr().out
    assert ckptstore.read_manifest(store, 4).metadata["user"] == {"note": "x"}
    assert cli.main(["download", str(store), "latest", str(tmp_path / "out"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 4
    assert snapshot(tmp_path / "out") == snapshot(src)

    assert cli.main(["download", str(store), "4", str(tmp_path / "out")]) == 1
    assert "not an empty directory" in capsys.readouterr().err
    assert cli.main(["upload", str(src), str(store), "4"]) == 1
    assert "already committed" in capsys.readouterr().err
    assert cli.main(["upload", str(tmp_path / "none"), str(store), "5"]) == 1
    assert "not a directory" in capsys.readouterr().err
    assert cli.main(["upload", str(src), str(store), "6", "--metadata", "{"]) == 1
    assert "--metadata is not JSON" in capsys.readouterr().err


def test_a_failed_upload_or_download_leaves_nothing(tmp_path: Path) -> None:
    src = tmp_path / "src"
    make_tree(src, small=20, large=(2 << 20,))  # over the default pack_threshold: a leaf object
    inner = MemoryStore()
    broken = FaultStore(
        inner, [Fault(frozenset({"put"}), error=transient_error, key="leaf-", times=1)]
    )
    with pytest.raises(StoreError, match="injected fault"):
        files.upload(src, broken, step=1)
    assert ckptstore.list_steps(inner) == []
    keys = background.run(inner.list_keys(""))
    assert not [k for k in keys if "pack-" in k or "leaf-" in k]

    files.upload(src, inner, step=1)
    failing = FaultStore(
        inner, [Fault(frozenset({"read"}), error=transient_error, key="leaf-", times=1)]
    )
    with pytest.raises(StoreError, match="injected fault"):
        files.download(failing, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if ".ckptstore-tmp-" in p.name]


def test_local_copy_reuses_an_exact_copy_and_moves_anything_else_aside(tmp_path: Path) -> None:
    """A restart on the same node finds the step's directory still there: reused when it
    holds the step exactly, otherwise moved aside (never deleted or merged) and downloaded."""
    src, store, out = tmp_path / "src", tmp_path / "store", tmp_path / "out" / "checkpoint-7"
    make_tree(src, small=12)
    files.upload(src, store, step=7, **SMALL)

    assert files.local_copy(store, out) == out  # nothing there: downloaded
    assert snapshot(out) == snapshot(src)
    inode = (out / "model-0.safetensors").stat().st_ino
    assert files.local_copy(store, out, step=7) == out  # there already: reused, not rewritten
    assert (out / "model-0.safetensors").stat().st_ino == inode
    assert [p.name for p in out.parent.iterdir()] == ["checkpoint-7"]
    replaced = out.parent / files.REPLACED_DIR

    def damaged() -> None:  # same size, one byte changed: only the crc32c tells
        body = bytearray((out / "model-1.safetensors").read_bytes())
        body[1000] ^= 1
        (out / "model-1.safetensors").write_bytes(bytes(body))

    def extra() -> None:
        (out / "shard-1" / "stray.tmp").write_bytes(b"x")

    def missing() -> None:
        (out / "empty.txt").unlink()

    def relinked() -> None:
        (out / "shard-0" / "config-link.json").unlink()
        (out / "shard-0" / "config-link.json").symlink_to("../run.sh")

    for change in (damaged, extra, missing, relinked):
        change()
        before = snapshot(out)
        assert files.local_copy(store, out, step=7) == out
        assert snapshot(out) == snapshot(src), change.__name__
        aside = [p for p in replaced.iterdir() if p.name.startswith("checkpoint-7-")]
        assert len(aside) == 1, change.__name__
        assert snapshot(aside[0]) == before  # what was there is kept, as it was
        shutil.rmtree(aside[0])

    (tmp_path / "empty").mkdir()  # an empty directory is taken over, not moved aside
    assert files.local_copy(store, tmp_path / "empty") == tmp_path / "empty"
    assert snapshot(tmp_path / "empty") == snapshot(src)
    assert not (tmp_path / files.REPLACED_DIR).exists()


_EXIT_WITHOUT_CLOSE = """
import sys
from ckptstore import files
mirror = files.TreeMirror(sys.argv[1])
mirror.submit(sys.argv[2], 5)
"""


def test_a_mirror_never_closed_still_uploads_what_it_queued(tmp_path: Path) -> None:
    """Issue 29: a script that queues an upload and exits without close() used to lose it
    (the thread pools refuse new work at exit) and say nothing; now the step is committed
    at exit, and an upload that fails says so on stderr."""
    import subprocess
    import sys

    src = tmp_path / "src"
    make_tree(src, small=5, large=(1 << 20,))
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_WITHOUT_CLOSE, str(tmp_path / "store"), str(src)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert ckptstore.list_steps(tmp_path / "store") == [5]
    out = tmp_path / "out"
    files.download(tmp_path / "store", out)
    assert snapshot(out) == snapshot(src)

    (tmp_path / "a-file").write_bytes(b"")  # a root under a file cannot be written
    failed = subprocess.run(
        [sys.executable, "-c", _EXIT_WITHOUT_CLOSE, str(tmp_path / "a-file" / "store"), str(src)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "at exit: an upload failed, its step is not in the store" in failed.stderr
