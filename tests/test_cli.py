"""The ``ckptstore`` command, run in-process through ``main([...])`` and as a subprocess.

Every command runs against a local directory and S3 on moto, and cp also against GCS on
fake-gcs-server (marked s3 and gcs); bad input checks the exit status and that the message is
one line with no traceback.
"""

from __future__ import annotations

import asyncio
import fcntl
import importlib
import json
import os
import pty
import re
import struct
import subprocess
import sys
import sysconfig
import termios
import threading
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptstore
from ckptstore import cli
from ckptstore.store import registry
from tests.children import python_path

COMMANDS = ["ls", "show", "verify", "cp", "gc", "rm", "tune"]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def run_refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run a command that must fail with status 1 having printed nothing on stdout; returns
    its stderr."""
    status, out, err = run(capsys, *argv)
    assert status == cli.EXIT_ERROR, err
    assert out == ""
    return err


def assert_one_line_error(err: str, *fragments: str) -> None:
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "error:" in lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


# ----------------------------------------------------------------- framework


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "--help")
    assert status == 0
    for command in COMMANDS:
        assert command in out


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_help_shows_examples(
    capsys: pytest.CaptureFixture[str], command: str
) -> None:
    status, out, _ = run(capsys, command, "--help")
    assert status == 0
    assert "examples:" in out
    assert f"ckptstore {command} " in out.split("examples:", 1)[1]


def test_bad_command_line_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run(capsys, "tune")  # URL missing
    assert status == cli.EXIT_USAGE
    assert "required" in err
    status, _, err = run(capsys, "tune", "memory://x", "--size", "lots")
    assert status == cli.EXIT_USAGE
    assert "cannot parse size" in err


def test_unknown_scheme_is_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    err = run_refused(capsys, "tune", "nosuchscheme://bucket/x")
    assert_one_line_error(err, "nosuchscheme://", "no backend")


def test_unknown_store_option_is_one_line_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    status, _, err = run(capsys, "tune", str(tmp_path), "-o", "colour=blue")
    assert status == cli.EXIT_ERROR
    assert_one_line_error(err, "colour")


def test_missing_optional_dependency_is_one_line_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "cli_needs_dep.py").write_text("import ckptstore_dependency_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(
        registry._BACKENDS,
        "needsdep",
        registry.BackendSpec("cli_needs_dep:Store", "pip install 'ckptstore[needsdep]'"),
    )
    status, _, err = run(capsys, "tune", "needsdep://bucket/x")
    assert status == cli.EXIT_ERROR
    assert_one_line_error(err, "ckptstore_dependency_not_installed", "pip install")


def test_a_bug_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    async def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug in ckptstore")

    monkeypatch.setattr("ckptstore.cli.tune.tune_store", broken)
    with pytest.raises(RuntimeError, match="a bug in ckptstore"):
        cli.main(["tune", str(tmp_path), "--size", "1MiB", "--part-sizes", "1MiB"])


def test_setup_errors_of_client_libraries_are_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    botocore_exceptions = pytest.importorskip("botocore.exceptions")

    async def no_credentials(*args: object, **kwargs: object) -> None:
        raise botocore_exceptions.NoCredentialsError()

    monkeypatch.setattr("ckptstore.cli.tune.tune_store", no_credentials)
    status, _, err = run(capsys, "tune", str(tmp_path), "--size", "1MiB", "--part-sizes", "1MiB")
    assert status == cli.EXIT_ERROR
    assert_one_line_error(err, "no AWS credentials")


# ----------------------------------------------------------------- checkpoints


def make_state(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "model": {
            "w": rng.standard_normal((256, 300)).astype(np.float32),  # its own object
            "b": rng.standard_normal(300).astype(np.float16),  # packed
        },
        "opt": [np.arange(10, dtype=np.int64), {"lr": 0.1}],
        "empty": np.zeros((0, 3)),
        "step": seed,
    }


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A checkpoint root with steps 5 and 10 (step 10 carries metadata), each a full save so
    the tests that damage a step's files find all of its bytes there."""
    root = tmp_path / "run"
    ckptstore.save(root, make_state(5), step=5)
    ckptstore.save(root, make_state(10), step=10, metadata={"loss": 0.25}, full=True)
    return root


def data_files(root: Path, step: int) -> list[Path]:
    return sorted(p for p in (root / str(step)).glob("attempt-*/*") if p.is_file())


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def assert_states_equal(a: Any, b: Any) -> None:
    if isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_states_equal(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_states_equal(x, y)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype
        assert a.shape == b.shape
        assert a.tobytes() == b.tobytes()
    else:
        assert a == b


def test_ls_lists_steps_with_sizes(capsys: pytest.CaptureFixture[str], run_dir: Path) -> None:
    status, out, _ = run(capsys, "ls", str(run_dir), "--json")
    assert status == 0
    listing = json.loads(out)
    assert [row["step"] for row in listing["steps"]] == [5, 10]
    manifest = ckptstore.read_manifest(run_dir, 10)
    row = listing["steps"][1]
    assert row["nbytes"] == manifest.nbytes >= 256 * 300 * 4 + 300 * 2 + 80  # packs are aligned
    assert row["objects"] == len(manifest.object_keys)
    assert row["leaves"] == 4
    assert row["created"] == manifest.created
    status, out, _ = run(capsys, "ls", str(run_dir))
    assert status == 0
    lines = out.splitlines()
    assert lines[0].split() == [
        "step", "size", "own", "referenced", "objects", "leaves", "committed", "(UTC)"
    ]  # fmt: skip
    assert lines[1].split()[0] == "5"
    assert lines[2].split()[0] == "10"


def test_ls_of_an_empty_root(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    status, out, _ = run(capsys, "ls", str(tmp_path))
    assert status == 0
    assert "no committed checkpoints" in out


def test_ls_of_a_missing_directory(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    err = run_refused(capsys, "ls", str(tmp_path / "nope"))
    assert_one_line_error(err, "no such directory")


def test_ls_marks_an_invalid_manifest(capsys: pytest.CaptureFixture[str], run_dir: Path) -> None:
    (run_dir / "5" / "manifest.json").write_bytes(b'{"format":"ckptstore","version":1')
    status, out, _ = run(capsys, "ls", str(run_dir))
    assert status == 0
    assert "INVALID" in out.splitlines()[1]
    assert "step 5:" in out
    assert "invalid manifest" in out


def test_show_lists_leaves_values_and_metadata(
    capsys: pytest.CaptureFixture[str], run_dir: Path
) -> None:
    status, out, _ = run(capsys, "show", str(run_dir), "latest", "--json")
    assert status == 0
    shown = json.loads(out)
    assert shown["step"] == 10
    assert shown["metadata"] == {"loss": 0.25}
    leaves = {leaf["path"]: leaf for leaf in shown["leaves"]}
    assert leaves["model/w"]["shape"] == [256, 300]
    assert leaves["model/w"]["nbytes"] == 256 * 300 * 4
    assert leaves["model/b"]["nbytes"] == 600
    assert leaves["empty"]["shape"] == [0, 3]
    assert leaves["empty"]["nbytes"] == 0
    assert {v["path"]: v["value"] for v in shown["values"]} == {"opt/1/lr": 0.1, "step": 10}
    assert sum(o["nbytes"] for o in shown["objects"]) == shown["nbytes"]
    status, out, _ = run(capsys, "show", str(run_dir), "5")
    assert status == 0
    assert "step 5" in out.splitlines()[0]
    assert any(line.split()[:3] == ["model/w", "<f4", "256x300"] for line in out.splitlines())


def test_show_tells_a_typed_value_from_a_string_of_its_name(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    torch = pytest.importorskip("torch")
    state = {"dt": torch.bfloat16, "dev": torch.device("cuda", 1), "name": "torch.bfloat16"}
    ckptstore.save(tmp_path, state, step=1)
    status, out, _ = run(capsys, "show", str(tmp_path), "1", "--json")
    assert status == 0
    assert json.loads(out)["values"] == [
        {"path": "dt", "value": "bfloat16", "kind": "torch.dtype"},
        {"path": "dev", "value": "cuda:1", "kind": "torch.device"},
        {"path": "name", "value": "torch.bfloat16"},
    ]
    status, out, _ = run(capsys, "show", str(tmp_path), "1")
    rows = {line.split()[0]: line.split(maxsplit=1)[1] for line in out.splitlines()[-3:]}
    assert rows == {
        "dt": "torch.bfloat16",
        "dev": "torch.device('cuda:1')",
        "name": '"torch.bfloat16"',
    }


def test_show_of_a_missing_step(capsys: pytest.CaptureFixture[str], run_dir: Path) -> None:
    status, _, err = run(capsys, "show", str(run_dir), "7")
    assert status == cli.EXIT_ERROR
    assert_one_line_error(err, "step 7 is not committed")


def test_verify_intact(capsys: pytest.CaptureFixture[str], run_dir: Path) -> None:
    status, out, _ = run(capsys, "verify", str(run_dir), "--all", "--json")
    assert status == 0
    report = json.loads(out)
    assert report["ok"] is True
    assert [s["step"] for s in report["steps"]] == [5, 10]
    manifest = ckptstore.read_manifest(run_dir, 5)
    assert report["steps"][0]["nbytes"] == manifest.nbytes
    assert report["steps"][0]["objects"] == len(manifest.object_keys)
    status, out, _ = run(capsys, "verify", str(run_dir))  # the latest step only
    assert status == 0
    assert out.splitlines()[0].startswith("step 10: ok")


@pytest.mark.parametrize("which", [0, -1])
def test_verify_detects_a_flipped_byte(
    capsys: pytest.CaptureFixture[str], run_dir: Path, which: int
) -> None:
    victim = data_files(run_dir, 10)[which]
    flip_byte(victim, victim.stat().st_size // 2)
    status, out, _ = run(capsys, "verify", str(run_dir), "--all")
    assert status == cli.EXIT_DAMAGED
    assert "step 5: ok" in out
    assert "step 10: DAMAGED" in out
    assert f"object 10/{victim.parent.name}/{victim.name}: crc32c mismatch" in out
    status, out, _ = run(capsys, "verify", str(run_dir), "10", "--json")
    assert status == cli.EXIT_DAMAGED
    report = json.loads(out)
    assert report["ok"] is False
    kinds = {d["kind"] for d in report["steps"][0]["damage"]}
    assert kinds == {"object", "leaf"}  # the object and the leaf inside it both fail


def test_verify_reads_in_chunks_across_leaf_boundaries(run_dir: Path) -> None:
    """Small chunks cut leaves in pieces; the pieces' checksums still add up."""
    from ckptstore.layout.maintenance import verify_manifest

    async def check(chunk: int) -> tuple[bool, int]:
        async with ckptstore.open_store(run_dir) as store:
            manifest = await ckptstore.aread_manifest(store, 10)
            report = await verify_manifest(store, manifest, chunk_size=chunk)
            return report.ok, report.nbytes

    for chunk in (4093, 64 << 10, 1 << 20):  # 4093: never aligned with a leaf
        assert asyncio.run(check(chunk)) == (True, ckptstore.read_manifest(run_dir, 10).nbytes)
    flip_byte(data_files(run_dir, 10)[-1], 3)
    assert asyncio.run(check(4093))[0] is False


def test_verify_reports_a_missing_object(capsys: pytest.CaptureFixture[str], run_dir: Path) -> None:
    victim = data_files(run_dir, 5)[0]
    victim.unlink()
    status, out, _ = run(capsys, "verify", str(run_dir), "5")
    assert status == cli.EXIT_DAMAGED
    assert f"{victim.name}: missing" in out


def test_verify_reports_a_corrupt_manifest(
    capsys: pytest.CaptureFixture[str], run_dir: Path
) -> None:
    flip_byte(run_dir / "10" / "manifest.json", 200)
    status, out, _ = run(capsys, "verify", str(run_dir), "10")
    assert status == cli.EXIT_DAMAGED
    assert "manifest 10/manifest.json" in out
    assert "invalid manifest" in out


def test_verify_checks_references_as_a_restore_does(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Step 2 of an incremental run references step 1's frozen leaf. With step 1's manifest
    gone its bytes are intact but no longer a committed object: a load refuses the step, and
    verify, a restore into a sink, reports it (it read every byte and passed it before)."""
    root = tmp_path / "run"
    frozen = np.arange(1 << 18, dtype=np.float32)
    ckptstore.save(root, {"frozen": frozen, "head": np.zeros(8)}, step=1)
    ckptstore.save(root, {"frozen": frozen, "head": np.ones(8)}, step=2)
    assert ckptstore.read_manifest(root, 2).references()  # the frozen leaf is referenced
    status, out, _ = run(capsys, "verify", str(root), "2")
    assert (status, out.splitlines()[0][:11]) == (0, "step 2: ok ")
    (root / "1" / "manifest.json").unlink()
    with pytest.raises(ckptstore.errors.BrokenReferenceError):
        ckptstore.load(root, 2)
    status, out, _ = run(capsys, "verify", str(root), "2", "--json")
    assert status == cli.EXIT_DAMAGED
    damage = json.loads(out)["steps"][0]["damage"]
    assert [d["kind"] for d in damage] == ["reference"], damage
    assert damage[0]["name"] == "2/manifest.json"


@pytest.mark.parametrize("damage", ["flip", "short", "long", "gone"])
def test_verify_and_a_load_refuse_the_same_damage_in_the_same_words(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, damage: str
) -> None:
    """One read engine: what a load refuses, verify reports, with the load's own words."""
    root = tmp_path / "run"
    ckptstore.save(root, {"w": np.arange(1 << 16, dtype=np.float32)}, step=1)
    (victim,) = data_files(root, 1)
    data = victim.read_bytes()
    if damage == "flip":
        flip_byte(victim, 100)
    elif damage == "gone":
        victim.unlink()
    else:
        victim.write_bytes(data[:-4] if damage == "short" else data + b"\0" * 4)
    with pytest.raises(ckptstore.errors.CorruptCheckpointError) as refused:
        ckptstore.load(root, 1)
    status, out, _ = run(capsys, "verify", str(root), "1", "--json")
    assert status == cli.EXIT_DAMAGED
    problems = [d["problem"] for d in json.loads(out)["steps"][0]["damage"]]
    assert problems
    for problem in problems:
        if problem != "missing":  # a load says "is missing"
            assert problem.split(" in ")[0] in str(refused.value), (problem, refused.value)
    if damage == "gone":
        assert problems == ["missing"]
        assert "is missing" in str(refused.value)


def test_verify_of_a_missing_step(capsys: pytest.CaptureFixture[str], run_dir: Path) -> None:
    status, _, err = run(capsys, "verify", str(run_dir), "11")
    assert status == cli.EXIT_ERROR
    assert_one_line_error(err, "step 11 is not committed")


def test_cp_local_to_local_is_bit_exact(
    capsys: pytest.CaptureFixture[str], run_dir: Path, tmp_path: Path
) -> None:
    dst = tmp_path / "copy"
    status, out, err = run(capsys, "cp", str(run_dir), str(dst), "--json")
    assert status == 0, err
    assert [s["step"] for s in json.loads(out)["steps"]] == [5, 10]
    assert ckptstore.list_steps(dst) == [5, 10]
    for step in (5, 10):
        assert_states_equal(ckptstore.load(run_dir, step), ckptstore.load(dst, step))
        src_manifest = ckptstore.read_manifest(run_dir, step)
        dst_manifest = ckptstore.read_manifest(dst, step)
        assert dst_manifest.attempt != src_manifest.attempt  # a fresh attempt at the copy
        assert dst_manifest.object_crcs == src_manifest.object_crcs
        assert dst_manifest.metadata == src_manifest.metadata
    assert [p.read_bytes() for p in data_files(run_dir, 10)] == [
        p.read_bytes() for p in data_files(dst, 10)
    ]
    # Copying again is a no-op: the destination already holds the same checkpoints.
    status, out, _ = run(capsys, "cp", str(run_dir), str(dst), "--step", "10")
    assert status == 0
    assert "skipped" in out
    assert len(list((dst / "10").glob("attempt-*"))) == 1


def test_cp_refuses_a_different_step_at_the_destination(
    capsys: pytest.CaptureFixture[str], run_dir: Path, tmp_path: Path
) -> None:
    dst = tmp_path / "other"
    ckptstore.save(dst, make_state(99), step=10)
    status, _, err = run(capsys, "cp", str(run_dir), str(dst), "--step", "10")
    assert status == cli.EXIT_ERROR
    assert_one_line_error(err, "already exists at the destination")
    assert ckptstore.load(dst, 10)["step"] == 99


def test_cp_never_commits_a_corrupt_source(
    capsys: pytest.CaptureFixture[str], run_dir: Path, tmp_path: Path
) -> None:
    flip_byte(data_files(run_dir, 10)[0], 100)
    dst = tmp_path / "copy"
    status, _, err = run(capsys, "cp", str(run_dir), str(dst), "--step", "10")
    assert status == cli.EXIT_ERROR
    assert_one_line_error(err, "fails its crc32c")
    assert ckptstore.list_steps(dst) == []
    assert [files for _, _, files in os.walk(dst) if files] == []  # partial copy removed


def test_cp_of_a_missing_step(
    capsys: pytest.CaptureFixture[str], run_dir: Path, tmp_path: Path
) -> None:
    status, _, err = run(capsys, "cp", str(run_dir), str(tmp_path / "copy"), "--step", "3")
    assert status == cli.EXIT_ERROR
    assert_one_line_error(err, "step 3 is not committed")


def test_gc_removes_only_abandoned_attempts(
    capsys: pytest.CaptureFixture[str], run_dir: Path
) -> None:
    abandoned = run_dir / "15" / "attempt-000000000001-0123456789abcdef"
    abandoned.mkdir(parents=True)
    (abandoned / "pack-000000").write_bytes(b"half a save")
    status, out, _ = run(capsys, "gc", str(run_dir), "--json")
    assert status == 0
    assert json.loads(out)["removed"] == []  # within the default grace period (mtime is now)
    assert abandoned.exists()
    status, out, _ = run(capsys, "gc", str(run_dir), "--grace", "0", "--json")
    assert status == 0
    report = json.loads(out)
    assert report["removed"] == ["15/attempt-000000000001-0123456789abcdef/"]
    assert report["removed_objects"] == 1
    assert not abandoned.exists()
    assert ckptstore.list_steps(run_dir) == [5, 10]
    status, _, _ = run(capsys, "verify", str(run_dir), "--all")
    assert status == 0  # committed data untouched
    status, _, err = run(capsys, "gc", str(run_dir), "--grace", "-1")
    assert status == cli.EXIT_USAGE
    assert "must be a finite number >= 0" in err


def test_rm_deletes_steps(capsys: pytest.CaptureFixture[str], run_dir: Path) -> None:
    status, out, _ = run(capsys, "rm", str(run_dir), "5")
    assert status == 0
    assert out.strip() == "removed step 5"
    assert ckptstore.list_steps(run_dir) == [10]
    assert not (run_dir / "5").exists() or data_files(run_dir, 5) == []
    status, _, err = run(capsys, "rm", str(run_dir), "5")
    assert status == cli.EXIT_ERROR
    assert_one_line_error(err, "no step 5")
    status, _, err = run(capsys, "rm", str(run_dir), "latest")
    assert status == cli.EXIT_USAGE


def test_rm_checks_every_step_before_deleting_any(
    capsys: pytest.CaptureFixture[str], run_dir: Path
) -> None:
    err = run_refused(capsys, "rm", str(run_dir), "5", "100", "10", "7")
    assert_one_line_error(err, "no steps 100, 7 to delete", "nothing was deleted")
    assert ckptstore.list_steps(run_dir) == [5, 10]
    assert data_files(run_dir, 5)
    assert data_files(run_dir, 10)


def test_rm_deletes_a_repeated_step_once(capsys: pytest.CaptureFixture[str], run_dir: Path) -> None:
    status, out, err = run(capsys, "rm", str(run_dir), "10", "5", "10")
    assert status == 0, err
    assert out.splitlines() == ["removed step 10", "removed step 5"]
    assert ckptstore.list_steps(run_dir) == []


@pytest.mark.parametrize("json_flag", [False, True])
def test_rm_reports_exactly_what_it_deleted_when_a_delete_fails(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    json_flag: bool,
) -> None:
    from ckptstore.store.wrappers import Fault, FaultStore, transient_error

    root = tmp_path / "run"
    for step in (60, 80, 100):
        ckptstore.save(root, make_state(step), step=step)
    command = importlib.import_module("ckptstore.cli.main")  # the module, not main()
    opened = command.open_store

    def faulty(url: str, **options: Any) -> Any:  # step 80's manifest cannot be deleted
        fault = Fault(frozenset({"delete"}), error=transient_error, key="^80/manifest")
        return FaultStore(opened(url, **options), [fault])

    monkeypatch.setattr(command, "open_store", faulty)
    argv = ["rm", str(root), "60", "80", "100", *(["--json"] if json_flag else [])]
    status, out, err = run(capsys, *argv)
    assert status == cli.EXIT_ERROR
    assert_one_line_error(err, "step 80:", "injected fault", "deleted step 60 before it")
    assert "not deleted: 80, 100" in err
    if json_flag:
        assert json.loads(out) == {
            "url": root.as_uri(),
            "removed": [60],
            "not_removed": [80, 100],
        }
    else:
        assert out.splitlines() == ["removed step 60"]
    assert ckptstore.list_steps(root) == [80, 100]


def test_ls_of_a_file_says_it_is_a_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("not a checkpoint root")
    status, _, err = run(capsys, "ls", str(readme))
    assert status == cli.EXIT_ERROR
    assert_one_line_error(err, "is a file, not a checkpoint root")
    assert "no such directory" not in err


def test_counts_are_singular_for_one(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    root = tmp_path / "run"
    ckptstore.save(root, {"w": np.arange(4.0)}, step=1)
    status, out, _ = run(capsys, "verify", str(root), "--all")
    assert status == 0
    assert out.splitlines() == [
        "step 1: ok (1 object, 1 leaf, 32 B checked)",
        "step 1 intact",
    ]
    abandoned = root / "2" / "attempt-000000000001-0123456789abcdef"
    abandoned.mkdir(parents=True)
    (abandoned / "pack-000000").write_bytes(b"half a save")
    status, out, _ = run(capsys, "gc", str(root), "--grace", "0")
    assert status == 0
    assert "removed 1 abandoned attempt (1 object), 0 stale in-progress writes" in out
    status, out, _ = run(capsys, "cp", str(root), str(tmp_path / "copy"))
    assert status == 0
    assert "copied 1 object," in out


def test_verify_names_every_missing_step_and_checks_nothing(
    capsys: pytest.CaptureFixture[str], run_dir: Path
) -> None:
    err = run_refused(capsys, "verify", str(run_dir), "5", "6", "10", "11")
    assert_one_line_error(err, "steps 6, 11 are not committed", "committed: 5, 10")


def test_cp_checks_named_steps_before_copying_any(
    capsys: pytest.CaptureFixture[str], run_dir: Path, tmp_path: Path
) -> None:
    dst = tmp_path / "copy"
    err = run_refused(capsys, "cp", str(run_dir), str(dst), "--step", "5", "--step", "3")
    assert_one_line_error(err, "step 3 is not committed", "nothing was copied")
    assert ckptstore.list_steps(dst) == []


def damage_step(root: Path, step: int, how: str) -> None:
    if how == "data":
        flip_byte(data_files(root, step)[0], 100)
    else:
        (root / str(step) / "manifest.json").write_bytes(b'{"format":"ckptstore","version":1')


@pytest.mark.parametrize("how", ["data", "manifest"])
def test_cp_copies_the_intact_steps_and_names_the_damaged_one(
    capsys: pytest.CaptureFixture[str], run_dir: Path, tmp_path: Path, how: str
) -> None:
    """A crc-damaged step and an invalid manifest are treated alike: the step is reported
    and not committed, its partial copy is removed, and every other step is copied."""
    ckptstore.save(run_dir, make_state(15), step=15)
    damage_step(run_dir, 10, how)
    dst = tmp_path / "copy"
    status, out, err = run(capsys, "cp", str(run_dir), str(dst))
    assert status == cli.EXIT_ERROR
    assert_one_line_error(err, "1 of 3 steps not copied: step 10:", "--step N", "verify")
    assert "copied or already there: steps 5, 15" in err
    lines = out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["step 5", "step 10", "step 15"]
    assert lines[1].startswith("step 10: NOT copied:")
    assert ckptstore.list_steps(dst) == [5, 15]
    assert not (dst / "10").exists() or data_files(dst, 10) == []
    status, out, _ = run(capsys, "cp", str(run_dir), str(dst), "--json")
    assert status == cli.EXIT_ERROR
    report = json.loads(out)
    assert [s["step"] for s in report["steps"]] == [5, 15]
    assert all(s["skipped"] for s in report["steps"])
    assert [f["step"] for f in report["failed"]] == [10]
    assert report["not_attempted"] == []


def test_cp_stops_at_an_error_of_the_destination_and_says_what_it_copied(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    run_dir: Path,
    tmp_path: Path,
) -> None:
    """An error that is not about one step (here every write of step 10 at the destination
    fails) stops cp: later steps are not attempted, and the report says exactly that."""
    from ckptstore.store.wrappers import Fault, FaultStore, transient_error

    ckptstore.save(run_dir, make_state(15), step=15)
    dst = tmp_path / "copy"
    command = importlib.import_module("ckptstore.cli.main")
    opened = command.open_store

    def faulty(url: str, **options: Any) -> Any:
        store = opened(url, **options)
        if url != str(dst):
            return store
        return FaultStore(store, [Fault(frozenset({"put"}), error=transient_error, key="^10/")])

    monkeypatch.setattr(command, "open_store", faulty)
    status, out, err = run(capsys, "cp", str(run_dir), str(dst), "--json")
    assert status == cli.EXIT_ERROR
    assert_one_line_error(err, "step 10 not copied:", "injected fault")
    assert "copied or already there: step 5; not attempted: 15." in err
    report = json.loads(out)
    assert [s["step"] for s in report["steps"]] == [5]
    assert [f["step"] for f in report["failed"]] == [10]
    assert report["not_attempted"] == [15]
    assert ckptstore.list_steps(dst) == [5]
    assert not (dst / "10").exists() or data_files(dst, 10) == []  # its attempt removed


def test_a_refused_cp_leaves_nothing_at_the_destination(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Many objects copy at once; the first fails its crc32c while others are being written.
    Every write must have ended before the attempt is removed, or files appear after it."""
    src = tmp_path / "run"
    rng = np.random.default_rng(0)
    state = {f"w{i}": rng.standard_normal(160_000) for i in range(24)}  # 1.2 MiB: one object each
    ckptstore.save(src, state, step=1)
    flip_byte(data_files(src, 1)[0], 10)
    for attempt in range(3):  # the race lost most runs before the fix; three make it certain
        dst = tmp_path / f"copy{attempt}"
        status, _, err = run(capsys, "cp", str(src), str(dst))
        assert status == cli.EXIT_ERROR
        assert_one_line_error(err, "step 1 not copied", "fails its crc32c")
        assert [files for _, _, files in os.walk(dst) if files] == []


def test_cp_to_memory_warns_that_the_copy_is_not_kept(
    capsys: pytest.CaptureFixture[str], run_dir: Path
) -> None:
    status, out, err = run(capsys, "cp", str(run_dir), f"memory://cli-{uuid.uuid4().hex}")
    assert status == 0
    assert "step 10: copied" in out
    assert err.startswith("ckptstore cp: warning:")
    assert "gone when the command exits" in err
    status, out, _ = run(capsys, "ls", f"memory://cli-{uuid.uuid4().hex}")
    assert status == 0
    assert "no committed checkpoints (a memory:// store lives inside one process" in out


# ----------------------------------------------------------------- tune

TUNE_SMALL = [
    "--size",
    "4MiB",
    "--part-sizes",
    "512KiB,1MiB,2MiB",
    "--concurrency",
    "2,4",
    "--small-count",
    "40",
]


def test_tune_local_reports_trials_and_suggestion(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    status, out, err = run(capsys, "tune", str(tmp_path), *TUNE_SMALL, "--json")
    assert status == 0, err
    report = json.loads(out)
    # stage 1: three part sizes at one concurrency; stage 2: the other concurrency.
    assert len(report["large"]) == 3 + 1
    assert {t["part_size"] for t in report["large"][:3]} == {512 << 10, 1 << 20, 2 << 20}
    stage1 = report["large"][0]["concurrency"]
    assert all(t["concurrency"] == stage1 for t in report["large"][:3])
    assert report["large"][3]["concurrency"] != stage1
    best = min(report["large"], key=lambda t: t["write_seconds"] + t["read_seconds"])
    assert report["best"] == best
    assert report["suggested_settings"] == {
        "part_size": best["part_size"],
        "max_concurrency": best["concurrency"],
    }
    for trial in report["large"]:
        assert trial["nbytes"] == 4 << 20
        assert trial["write_mib_s"] == pytest.approx(4 / trial["write_seconds"])
    assert [t["concurrency"] for t in report["small"]] == [2, 4]
    assert all(t["count"] == 40 and t["puts_per_s"] > 0 for t in report["small"])
    assert list(tmp_path.iterdir()) == []  # scratch objects removed


def test_tune_text_names_the_suggestion(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "tune", "memory://cli-tune", *TUNE_SMALL)
    assert status == 0
    assert "<- best" in out
    assert "suggested: part_size=" in out
    assert "CKPTSTORE_PART_SIZE=" in out


def test_tune_refuses_part_sizes_that_do_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run(capsys, "tune", "memory://x", "--size", "1MiB", "--part-sizes", "4MiB")
    assert status == cli.EXIT_ERROR
    assert_one_line_error(err, "no candidate part size fits", "at most 1MiB (the object size")
    status, _, err = run(capsys, "tune", "memory://x", "--size", "1KiB")
    assert status == cli.EXIT_ERROR
    assert_one_line_error(err, "tried --part-sizes 8MiB,16MiB,32MiB,64MiB", "--size")
    assert "4611686018427387904" not in err  # a backend without a maximum names none


def test_bench_is_the_old_name_of_tune(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys, "bench", "memory://cli-bench-alias", *TUNE_SMALL, "--json")
    assert status == 0
    assert "'bench' is the old name of 'ckptstore tune'" in err
    assert set(json.loads(out)["suggested_settings"]) == {"part_size", "max_concurrency"}
    status, out, _ = run(capsys, "--help")
    assert "the old name of 'tune'" in out


# ----------------------------------------------------------------- entry points


def _entry_point_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": python_path()}


def test_python_dash_m_runs_the_command(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ckptstore", "tune", "nosuchscheme://x"],
        capture_output=True,
        text=True,
        env=_entry_point_env(),
        timeout=120,
    )
    assert result.returncode == cli.EXIT_ERROR
    assert_one_line_error(result.stderr, "nosuchscheme")


def test_console_script_runs_the_command(tmp_path: Path) -> None:
    script = Path(sysconfig.get_path("scripts")) / "ckptstore"
    if not script.exists():
        pytest.fail("the ckptstore entry point is not installed; pip install -e '.[test]'")
    result = subprocess.run(
        [str(script), "tune", str(tmp_path), *TUNE_SMALL, "--json"],
        capture_output=True,
        text=True,
        env=_entry_point_env(),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["url"] == tmp_path.as_uri()
    assert result.stderr == ""  # no progress bar: stderr is not a terminal


def _on_a_terminal(
    args: list[str], columns: int, *, stdout_too: bool = False
) -> tuple[subprocess.CompletedProcess[bytes], str]:
    """Run ``python -m ckptstore *args`` with stderr (and with ``stdout_too`` stdout) on a
    pseudo-terminal of ``columns`` columns; the process and what the terminal received."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, columns, 0, 0))
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: the child closed its end
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        result = subprocess.run(
            [sys.executable, "-m", "ckptstore", *args],
            stdout=slave if stdout_too else subprocess.PIPE,
            stderr=slave,
            env={**_entry_point_env(), "COLUMNS": "", "LINES": ""},
            timeout=300,
        )
    finally:
        os.close(slave)
    reader.join(timeout=30)
    os.close(master)
    return result, b"".join(chunks).decode(errors="replace")


@pytest.mark.parametrize("columns", [100, 0])
def test_cp_progress_clears_before_each_line_and_counts_in_binary_units(
    run_dir: Path, tmp_path: Path, columns: int
) -> None:
    """The bar cleared itself only at the end, so ``step 5: copied ...`` was printed onto
    it; it said ``MB/s`` beside MiB figures; a terminal reporting 0 columns got no bar."""
    result, drawn = _on_a_terminal(
        ["cp", str(run_dir), str(tmp_path / "dst")], columns, stdout_too=True
    )
    assert result.returncode == 0, drawn
    segments = re.split(r"[\r\n]+", drawn)
    bars = [seg for seg in segments if seg.startswith("copy+verify:")]
    assert bars, drawn  # drawn, 0 columns or not
    assert all("%|" in bar for bar in bars)
    assert any(re.search(r"\d+\.\d (KiB|MiB)/\d+\.\d MiB, ", bar) for bar in bars), bars
    assert not re.search(r"\d(kB|MB|GB)\b", drawn), drawn  # one unit system
    # each result line is a segment of its own: the bar was cleared before it
    for step in (5, 10):
        assert any(seg.startswith(f"step {step}: copied") for seg in segments), segments
    assert ckptstore.list_steps(tmp_path / "dst") == [5, 10]


def test_progress_bar_is_drawn_on_a_terminal(tmp_path: Path) -> None:
    result, drawn = _on_a_terminal(["tune", str(tmp_path), *TUNE_SMALL], 100)
    assert result.returncode == 0, drawn
    assert "tune" in drawn
    assert "trial" in drawn  # tqdm's unit, so the bar itself was drawn
    assert b"suggested" in result.stdout  # the report still goes to stdout


# ----------------------------------------------------------------- S3 (moto)
# ``moto_s3`` is the fixture of tests/servers/moto.py (a MotoS3: endpoint, bucket, region).


def s3_options(moto: Any) -> list[str]:
    return ["-o", f"endpoint_url={moto.endpoint}", "-o", f"region={moto.region}"]


@pytest.mark.s3
def test_every_command_on_s3_and_cp_round_trip_is_bit_exact(
    capsys: pytest.CaptureFixture[str], moto_s3: Any, run_dir: Path, tmp_path: Path
) -> None:
    url = f"s3://{moto_s3.bucket}/run"
    opts = s3_options(moto_s3)
    dst_opts = [o.replace("-o", "--dst-option") for o in opts]

    status, out, err = run(capsys, "cp", str(run_dir), url, *dst_opts, "--json")
    assert status == 0, err
    assert [s["step"] for s in json.loads(out)["steps"]] == [5, 10]

    status, out, _ = run(capsys, "ls", url, *opts, "--json")
    assert status == 0
    assert [row["step"] for row in json.loads(out)["steps"]] == [5, 10]
    status, out, _ = run(capsys, "show", url, "10", *opts, "--json")
    assert status == 0
    assert json.loads(out)["metadata"] == {"loss": 0.25}
    status, out, _ = run(capsys, "verify", url, "--all", *opts)
    assert status == 0, out
    assert "all 2 steps intact" in out

    back = tmp_path / "back"
    status, _, err = run(capsys, "cp", url, str(back), *opts)
    assert status == 0, err
    for step in (5, 10):
        assert_states_equal(ckptstore.load(run_dir, step), ckptstore.load(back, step))
        assert [p.read_bytes() for p in data_files(run_dir, step)] == [
            p.read_bytes() for p in data_files(back, step)
        ]

    status, out, _ = run(capsys, "gc", url, *opts, "--json")
    assert status == 0
    assert json.loads(out)["removed"] == []
    status, out, _ = run(capsys, "rm", url, "5", *opts)
    assert status == 0
    status, out, _ = run(capsys, "ls", url, *opts, "--json")
    assert [row["step"] for row in json.loads(out)["steps"]] == [10]


@pytest.mark.s3
def test_verify_on_s3_detects_a_flipped_byte(
    capsys: pytest.CaptureFixture[str], moto_s3: Any, run_dir: Path
) -> None:
    url = f"s3://{moto_s3.bucket}/run"
    opts = s3_options(moto_s3)
    assert (
        cli.main(
            [
                "cp",
                str(run_dir),
                url,
                "--step",
                "10",
                "--dst-option",
                f"endpoint_url={moto_s3.endpoint}",
            ]
        )
        == 0
    )
    capsys.readouterr()
    client: Any = moto_s3.client()
    listed = client.list_objects_v2(Bucket=moto_s3.bucket, Prefix="run/10/attempt-")
    key = sorted(obj["Key"] for obj in listed["Contents"])[0]
    body = bytearray(client.get_object(Bucket=moto_s3.bucket, Key=key)["Body"].read())
    body[len(body) // 3] ^= 0x10
    client.put_object(Bucket=moto_s3.bucket, Key=key, Body=bytes(body))
    client.close()
    status, out, _ = run(capsys, "verify", url, "10", *opts)
    assert status == cli.EXIT_DAMAGED
    assert f"object {key.removeprefix('run/')}: crc32c mismatch" in out


@pytest.mark.s3
def test_s3_without_credentials_is_one_line_error(
    capsys: pytest.CaptureFixture[str],
    moto_s3: Any,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    for name in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # never ask 169.254.169.254
    err = run_refused(capsys, "ls", f"s3://{moto_s3.bucket}/run", *s3_options(moto_s3))
    assert_one_line_error(err, "credentials")


@pytest.mark.s3
def test_s3_missing_bucket_is_one_line_error(
    capsys: pytest.CaptureFixture[str], moto_s3: Any
) -> None:
    status, _, err = run(capsys, "ls", "s3://no-such-bucket/run", *s3_options(moto_s3))
    assert status == cli.EXIT_ERROR
    assert_one_line_error(err, "no-such-bucket")


@pytest.mark.s3
def test_tune_on_s3(capsys: pytest.CaptureFixture[str], moto_s3: Any) -> None:
    url = f"s3://{moto_s3.bucket}/scratch"
    argv = ["--size", "10MiB", "--part-sizes", "1MiB,5MiB", "--concurrency", "2,4"]
    status, out, err = run(
        capsys, "tune", url, *s3_options(moto_s3), *argv, "--small-count", "16", "--json"
    )
    assert status == 0, err
    report = json.loads(out)
    assert [t["part_size"] for t in report["large"]][:1] == [5 << 20]  # 1 MiB < S3's minimum
    assert report["suggested_settings"]["part_size"] == 5 << 20
    client: Any = moto_s3.client()
    assert client.list_objects_v2(Bucket=moto_s3.bucket).get("KeyCount", 0) == 0  # cleaned up
    client.close()


@pytest.mark.s3
def test_cp_to_s3_streams_large_objects_as_multipart(
    capsys: pytest.CaptureFixture[str], moto_s3: Any, tmp_path: Path
) -> None:
    src = tmp_path / "big"
    state = {"w": np.random.default_rng(1).standard_normal(12 << 17)}  # 12 MiB of float64
    ckptstore.save(src, state, step=1)
    url = f"s3://{moto_s3.bucket}/big"
    parts = ["part_size=5MiB", "multipart_threshold=5MiB"]
    status, _, err = run(
        capsys,
        "cp",
        str(src),
        url,
        "--dst-option",
        f"endpoint_url={moto_s3.endpoint}",
        *(arg for p in parts for arg in ("--dst-option", p)),
    )
    assert status == 0, err
    client: Any = moto_s3.client()
    listed = client.list_objects_v2(Bucket=moto_s3.bucket, Prefix="big/1/attempt-")
    (obj,) = listed["Contents"]
    assert obj["Size"] == 12 << 20
    assert obj["ETag"].strip('"').endswith("-3")  # three 5 MiB parts: a multipart upload
    client.close()
    back = tmp_path / "back"
    status, _, err = run(capsys, "cp", url, str(back), *s3_options(moto_s3), "-o", parts[0])
    assert status == 0, err
    assert ckptstore.load(back, 1)["w"].tobytes() == state["w"].tobytes()


def test_json_flag_before_the_command(capsys: pytest.CaptureFixture[str], run_dir: Path) -> None:
    status, out, _ = run(capsys, "--json", "ls", str(run_dir))
    assert status == 0
    assert [row["step"] for row in json.loads(out)["steps"]] == [5, 10]


def test_bad_setting_value_is_one_line_error(
    capsys: pytest.CaptureFixture[str], run_dir: Path
) -> None:
    status, _, err = run(capsys, "verify", str(run_dir), "-o", "part_size=lots")
    assert status == cli.EXIT_ERROR
    assert_one_line_error(err, "cannot parse size")


@pytest.mark.gcs
def test_cp_local_to_gcs_and_back_is_bit_exact(
    capsys: pytest.CaptureFixture[str],
    fake_gcs: Any,
    gcs_bucket: str,
    run_dir: Path,
    tmp_path: Path,
) -> None:
    url = f"gs://{gcs_bucket}/cli-{uuid.uuid4().hex[:8]}"
    opts = ["-o", f"endpoint_url={fake_gcs.endpoint}", "-o", "token=anon"]
    dst_opts = [o.replace("-o", "--dst-option") for o in opts]
    status, _, err = run(capsys, "cp", str(run_dir), url, "--step", "10", *dst_opts)
    assert status == 0, err
    status, out, _ = run(capsys, "ls", url, *opts, "--json")
    assert status == 0
    assert [row["step"] for row in json.loads(out)["steps"]] == [10]
    status, out, _ = run(capsys, "verify", url, *opts)
    assert status == 0, out
    back = tmp_path / "back"
    status, _, err = run(capsys, "cp", url, str(back), *opts)
    assert status == 0, err
    assert_states_equal(ckptstore.load(run_dir, 10), ckptstore.load(back, 10))
    assert [p.read_bytes() for p in data_files(run_dir, 10)] == [
        p.read_bytes() for p in data_files(back, 10)
    ]


@pytest.mark.s3
@pytest.mark.parametrize("server", ["moto", "seaweedfs"])
def test_cp_to_a_misspelled_bucket_says_it_does_not_exist_and_writes_nothing(
    capsys: pytest.CaptureFixture[str],
    request: pytest.FixtureRequest,
    run_dir: Path,
    server: str,
) -> None:
    if server == "moto":
        moto = request.getfixturevalue("moto_s3")
        endpoint, bucket, extra = moto.endpoint, moto.bucket, f"region={moto.region}"
    else:  # anonymous SeaweedFS answers a PUT into a bucket that is not there with 403
        seaweed = request.getfixturevalue("seaweedfs")
        endpoint, bucket, extra = seaweed.s3_endpoint, "ckptstore-cli-real", "anonymous=true"
        seaweed.create_bucket(bucket)
    url = f"s3://{bucket}x/run?endpoint_url={endpoint}&{extra}"
    err = run_refused(capsys, "cp", str(run_dir), url)
    assert_one_line_error(err, f"bucket '{bucket}x': the bucket does not exist")
    assert "access denied" not in err
    status, _, err = run(capsys, "ls", url)  # what ls says of the same URL
    assert status == cli.EXIT_ERROR
    assert_one_line_error(err, f"bucket '{bucket}x': the bucket does not exist")


def _fine_tuning(tmp_path: Path, steps: int = 3) -> Path:
    """A run whose steps share a frozen 8 MiB leaf: each after the first is incremental."""
    root = tmp_path / "run"
    frozen = np.arange(2 * 2**20, dtype=np.float32)
    for step in range(1, steps + 1):
        ckptstore.save(root, {"frozen": frozen, "head": np.full(64, step, np.float32)}, step=step)
    return root


def test_cp_of_incremental_steps_references_what_the_destination_holds(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A run copied step by step copied every referenced object again at each step (a
    fine-tuning run grew by its frozen weights per step at the destination); a step now
    references the destination's copy of what it references, and still loads bit-exact
    once the steps it references are deleted and collected."""
    src, dst = _fine_tuning(tmp_path), tmp_path / "copy"
    status, out, err = run(capsys, "cp", str(src), str(dst), "--json")
    assert status == 0, err
    reports = {s["step"]: s for s in json.loads(out)["steps"]}
    assert reports[1]["referenced"] == 0
    assert reports[1]["nbytes"] >= 8 * 2**20
    for step in (2, 3):
        assert reports[step]["referenced"] >= 1, reports[step]
        assert reports[step]["nbytes"] < 2**20, reports[step]
        copy = ckptstore.read_manifest(dst, step)
        assert {copy.object_step(i) for i in copy.references()} == {1}
    status, out, _ = run(capsys, "cp", str(src), str(tmp_path / "again"), "--step", "1")
    status, out, err = run(capsys, "cp", str(src), str(tmp_path / "again"), "--step", "3")
    assert status == 0, err
    assert "of earlier steps referenced at the destination" in out
    for step in (1, 2):
        ckptstore.delete_step(dst, step)
    assert ckptstore.gc(dst, grace=0).kept_referenced
    assert_states_equal(ckptstore.load(src, 3), ckptstore.load(dst, 3))
    status, _, err = run(capsys, "verify", str(dst))
    assert status == 0, err


def test_cp_copies_whole_what_the_destination_does_not_hold_as_a_copy(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A step whose base the destination lacks, or holds as another save of the same
    state (other objects), is copied whole: a copy never names an object it cannot vouch
    for."""
    src = _fine_tuning(tmp_path, steps=2)
    alone = tmp_path / "alone"
    status, out, err = run(capsys, "cp", str(src), str(alone), "--step", "2", "--json")
    assert status == 0, err
    (report,) = json.loads(out)["steps"]
    assert report["referenced"] == 0
    assert ckptstore.read_manifest(alone, 2).references() == []
    other = tmp_path / "other"
    state1 = ckptstore.load(src, 1)
    # the same leaves, other objects: the frozen leaf packed with the head
    ckptstore.save(other, state1, step=1, pack_threshold=16 << 20, pack_size=16 << 20)
    theirs, ours = (ckptstore.read_manifest(r, 1) for r in (src, other))
    assert theirs.leaf_crc == ours.leaf_crc
    assert theirs.object_lengths != ours.object_lengths
    status, out, err = run(capsys, "cp", str(src), str(other), "--step", "2", "--json")
    assert status == 0, err
    assert json.loads(out)["steps"][0]["referenced"] == 0
    assert_states_equal(ckptstore.load(src, 2), ckptstore.load(other, 2))
