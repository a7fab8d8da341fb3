"""Golden checkpoints (issue 32): small checkpoints of every manifest version, each written
once by the commit that introduced that version (``tests/golden/<name>.json`` names it;
``tests/golden/make.py`` and ``tests/golden/README.md`` say how), and loaded here through
every face that reads a native checkpoint (``load``, the manager, the distributed load, the
CLI's ``verify``) and by the stand-alone reader (``scripts/read_checkpoint.py``, in a
process without ckptstore). A release that stops reading one fails here.

- ``v1-plain``: version 1, written by 549d180 (the first format): packed and whole leaves
  of every numpy dtype, both byte orders, 0-d and empty arrays, nested containers, int keys,
  escaped keys, plain values.
- ``v2-incremental``: version 2, written by f6970d7 (incremental saves): three steps, each
  referencing objects of the one before.
- ``v3-sharded``: version 3, written by 4d1e2e2 (sharded leaves): one leaf saved as chunks
  by two ranks, beside a replicated one.
- ``v4-typed``: version 4, written by the commit that introduced it (typed values and ordered
  dicts in the tree): ``OrderedDict`` s of arrays, torch dtypes and devices.
- ``dtypes`` (the ml_dtypes types), ``tree`` (a directory the file adapters uploaded),
  ``dcp`` (a ``torch.distributed.checkpoint`` save through ckptstore's Writer) and
  ``lightning`` (a checkpoint dict saved by ``StoreCheckpointIO``): written by the code of
  the session that added them (aac4441, bd15594), whose formats have not changed since.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptstore
import ckptstore.distributed
from ckptstore import CheckpointManager
from ckptstore.errors import CorruptCheckpointError
from ckptstore.layout import manifest as manifest_module
from tests import golden_states
from tests.children import python_path
from tests.test_standalone_reader import Typed, assert_same, read_in_child

GOLDEN = Path(__file__).resolve().parent / "golden"


def golden_states_dtypes() -> dict[str, Any]:
    """What the ``dtypes`` golden checkpoint holds: the ml_dtypes types and every numpy one."""
    import ml_dtypes

    state: dict[str, Any] = {
        name: np.frombuffer(golden_states.ml_dtype_bytes(name, 6), getattr(ml_dtypes, name))
        for name in golden_states.ML_DTYPES
    }
    state["numpy"] = golden_states.plain_state(1)["dtypes"]
    return state


#: The commit that introduced manifest version 4 and wrote ``v4-typed``.
_V4_COMMIT = "e3f1b49"

#: name -> (the commit that wrote it, its manifest version, {step: expected state})
CASES: dict[str, tuple[str, int, dict[int, Any]]] = {
    "v1-plain": ("549d180", 1, {1: golden_states.plain_state()}),
    "v2-incremental": (
        "f6970d7",
        2,
        dict(enumerate(golden_states.incremental_states(), start=1)),
    ),
    "dtypes": ("aac4441", 2, {2: golden_states_dtypes()}),
    "v3-sharded": (
        "4d1e2e2",
        3,
        {
            7: {
                "w": golden_states.sharded_global(),
                "step": 7,
                "replicated": golden_states.values("int32", 4, 1),
            }
        },
    ),
}


try:
    import torch
except ImportError:  # the version-4 golden holds torch values: without torch, it is skipped
    torch = None
else:
    CASES["v4-typed"] = (_V4_COMMIT, 4, {5: golden_states.typed_state()})


def as_the_reader_gives(state: Any) -> Any:
    """``state`` with its typed values as the stand-alone reader returns them, by name."""
    if torch is not None and isinstance(state, torch.dtype):
        return Typed("torch.dtype", str(state).removeprefix("torch."))
    if torch is not None and isinstance(state, torch.device):
        return Typed("torch.device", str(state))
    if isinstance(state, dict):
        return type(state)((k, as_the_reader_gives(v)) for k, v in state.items())
    if type(state) in (list, tuple):
        return type(state)(as_the_reader_gives(v) for v in state)
    return state


@pytest.fixture(params=sorted(CASES))
def golden(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, Path]:
    """A copy of one golden checkpoint (nothing a test does may touch the originals)."""
    name = request.param
    copy = tmp_path / name
    shutil.copytree(GOLDEN / name, copy)
    return name, copy


def test_each_was_written_by_the_commit_named_and_holds_its_version(
    golden: tuple[str, Path],
) -> None:
    name, root = golden
    commit, version, steps = CASES[name]
    written = json.loads((GOLDEN / f"{name}.json").read_text())
    assert written["commit"].startswith(commit)
    assert ckptstore.list_steps(root) == sorted(steps)
    for step in steps:
        envelope = (root / str(step) / "manifest.json").read_bytes()[:40]
        assert envelope.startswith(b'{"format":"ckptstore","version":%d,' % version)
    if name == "v2-incremental":  # each step references the one before
        assert [ckptstore.read_manifest(root, s).references() != [] for s in steps] == [
            False,
            True,
            True,
        ]


def test_ckptstore_load_and_the_manager_read_them_bit_exact(golden: tuple[str, Path]) -> None:
    name, root = golden
    for step, expected in CASES[name][2].items():
        assert_same(ckptstore.load(root, step), expected)
        with CheckpointManager(root) as mgr:
            assert_same(mgr.restore(step), expected)


def test_a_distributed_load_reads_them_bit_exact(golden: tuple[str, Path]) -> None:
    name, root = golden
    group = ckptstore.distributed.LocalGroup(1, timeout=60)
    for step, expected in CASES[name][2].items():
        got = ckptstore.distributed.load(root, step, comm=group.member(0))
        assert_same(got, expected)


def test_the_standalone_reader_reads_them_bit_exact_without_ckptstore(
    golden: tuple[str, Path],
) -> None:
    name, root = golden
    _, version, steps = CASES[name]
    for step, expected in steps.items():
        got, read_version = read_in_child(root, step)
        assert read_version == version
        assert_same(got, as_the_reader_gives(expected))


def test_the_cli_verifies_every_step(golden: tuple[str, Path]) -> None:
    _, root = golden
    done = subprocess.run(
        [sys.executable, "-m", "ckptstore", "verify", "--all", "--no-progress", str(root)],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": python_path(), "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("version", [1, 2, 3, 4])
def test_removing_a_versions_reader_fails_its_golden_checkpoint(
    version: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The golden checkpoints are what keeps each version readable: without the version in
    the readable set, its checkpoint is refused."""
    if version == 4 and torch is None:
        pytest.skip("the version-4 golden checkpoint holds torch values")
    name = next(n for n, case in CASES.items() if case[1] == version)
    root = tmp_path / name
    shutil.copytree(GOLDEN / name, root)
    readable = tuple(v for v in manifest_module.READABLE_VERSIONS if v != version)
    monkeypatch.setattr(manifest_module, "READABLE_VERSIONS", readable)
    with pytest.raises(CorruptCheckpointError, match=f"format version {version}"):
        ckptstore.load(root, max(CASES[name][2]))


def test_the_golden_directory_tree_downloads_byte_for_byte(tmp_path: Path) -> None:
    from ckptstore import files

    root = tmp_path / "tree"
    shutil.copytree(GOLDEN / "tree", root)
    dest = files.download(root, tmp_path / "checkpoint-3", step=3)
    found = {
        str(path.relative_to(dest)): path.read_bytes() for path in dest.rglob("*") if path.is_file()
    }
    assert found == golden_states.tree_files()
    got, version = read_in_child(root, 3)  # the stand-alone reader: the files as leaves
    assert version == 1
    assert got


@pytest.mark.torch
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_the_golden_dcp_checkpoint_loads_through_dcp(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    import ckptstore.dcp

    root = tmp_path / "dcp"
    shutil.copytree(GOLDEN / "dcp", root)
    expected = golden_states.dcp_state()
    state = {
        "model": {
            k: torch.zeros(v.shape, dtype=torch.from_numpy(v).dtype) for k, v in expected.items()
        },
        "step": 0,
    }
    dcp.load(state, storage_reader=ckptstore.dcp.Reader(f"{root}/4"))
    assert state["step"] == 4
    for key, value in expected.items():
        assert state["model"][key].numpy().tobytes() == value.tobytes(), key


@pytest.mark.torch
def test_the_golden_lightning_checkpoint_loads_through_the_plugin(tmp_path: Path) -> None:
    """``ckptstore.lightning/3``: tensors, torch dtypes and devices, an ``OrderedDict`` and
    int keys come back as Lightning saved them."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("lightning")
    from collections import OrderedDict

    from ckptstore.lightning import StoreCheckpointIO, checkpoints, last_checkpoint

    root = tmp_path / "lightning"
    shutil.copytree(GOLDEN / "lightning", root)
    assert checkpoints(root) == {"epoch=0-step=3.ckpt": 3}
    path = last_checkpoint(root)
    assert path == f"{root}/epoch=0-step=3.ckpt"
    got = StoreCheckpointIO().load_checkpoint(path)
    expected = golden_states.lightning_dict()
    assert type(got["state_dict"]) is OrderedDict
    for key, tensor in expected["state_dict"].items():  # type: ignore[attr-defined]
        assert torch.equal(got["state_dict"][key], tensor), key
        assert got["state_dict"][key].dtype == tensor.dtype, key
    moments = got["optimizer_states"][0]["state"][0]["exp_avg"]
    assert torch.equal(moments, expected["optimizer_states"][0]["state"][0]["exp_avg"])  # type: ignore[index]
    assert got["hyper_parameters"] == expected["hyper_parameters"]
    for key in ("epoch", "global_step", "pytorch-lightning_version", "loops"):
        assert got[key] == expected[key], key
