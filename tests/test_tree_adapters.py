"""The adapters that carry other libraries' checkpoint directories to a store, each with the
real library on CPU (a tiny model built from a config, nothing downloaded): Hugging Face
Trainer and Accelerate against moto's S3, resumed in a new process; Orbax against SeaweedFS.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptstore
from ckptstore import files
from ckptstore.testing.servers import SeaweedFS
from tests.children import python_path
from tests.servers.moto import MotoS3

RUNS = Path(__file__).with_name("tree_adapters.py")


def _child(which: str, options: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    # the checkout on the path: the script imports tests.multirank for its ranks
    env = {
        **os.environ,
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": python_path(),
    }
    return subprocess.run(
        [sys.executable, str(RUNS), which, json.dumps(options)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )


def run(which: str, options: dict[str, Any]) -> dict[int, float]:
    """One training run in a new process; its losses by step."""
    done = _child(which, options)
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("LOSSES "))
    return {int(k): v for k, v in json.loads(line.removeprefix("LOSSES ")).items()}


def run_refused(which: str, options: dict[str, Any]) -> str:
    """A training run that must fail; the last line of its error."""
    done = _child(which, options)
    assert done.returncode != 0, done.stdout[-2000:]
    return done.stderr.strip().splitlines()[-1]


@pytest.mark.s3
@pytest.mark.torch
def test_hf_trainer_checkpoints_to_s3_and_resumes_in_a_new_process(
    tmp_path: Path, moto_s3: MotoS3
) -> None:
    pytest.importorskip("transformers")
    url = f"s3://{moto_s3.bucket}/hf-run"
    store = moto_s3.options()
    schedule = {"max_steps": 6, "save_steps": 3, "store_options": store}
    first = run("hf", {**schedule, "output_dir": str(tmp_path / "first"), "upload_to": url})
    assert sorted(first) == [1, 2, 3, 4, 5, 6]
    assert ckptstore.list_steps(url, **store) == [3, 6]
    manifest = ckptstore.read_manifest(url, 3, **store)
    assert files.is_tree_step(manifest)
    assert "trainer_state.json" in manifest.paths
    assert any(p.endswith(".safetensors") for p in manifest.paths)
    shutil.rmtree(tmp_path / "first")  # the local checkpoints are gone: only the store has them

    resumed = run(
        "hf",
        {
            **schedule,
            "output_dir": str(tmp_path / "second"),
            "resume_from": url,
            "step": 3,
            "upload_to": f"s3://{moto_s3.bucket}/hf-run-2",
        },
    )
    assert sorted(resumed) == [4, 5, 6]
    assert resumed[4] == first[4]  # the next step's loss, bit for bit
    assert resumed == {step: first[step] for step in (4, 5, 6)}


@pytest.mark.s3
@pytest.mark.torch
@pytest.mark.slow
def test_hf_trainer_restarted_in_the_same_output_dir_reuses_its_checkpoint(
    tmp_path: Path, moto_s3: MotoS3
) -> None:
    """Issue 29: the second run of a script in the same output_dir, told to resume from the
    store, finds output_dir/checkpoint-8 still there (it used to fail with
    AlreadyExistsError): the copy is verified and reused, and training goes on exactly as a
    resume on a new node (an empty output_dir, so a download) does."""
    pytest.importorskip("transformers")
    url = f"s3://{moto_s3.bucket}/hf-same-node"
    store = moto_s3.options()
    out = tmp_path / "out"
    schedule = {"save_steps": 3, "store_options": store, "upload_to": url}
    run("hf", {**schedule, "max_steps": 8, "output_dir": str(out)})
    assert ckptstore.list_steps(url, **store) == [3, 6, 8]  # the Trainer saves at the end
    assert (out / "checkpoint-8").is_dir()
    resume = {**schedule, "max_steps": 10, "resume_from": url, "step": 8}
    same_node = run("hf", {**resume, "output_dir": str(out)})
    # reused: a copy that did not hold the step exactly would have been moved aside
    # (the Trainer's save_total_limit has removed checkpoint-8 since)
    assert not (out / files.REPLACED_DIR).exists()
    new_node = run("hf", {**resume, "output_dir": str(tmp_path / "new"), "upload_to": f"{url}-new"})
    assert sorted(same_node) == [9, 10]
    assert same_node == new_node


@pytest.mark.s3
@pytest.mark.torch
@pytest.mark.slow
def test_hf_trainer_resumes_with_its_own_resume_from_checkpoint_true(
    tmp_path: Path, moto_s3: MotoS3
) -> None:
    """Issue 29, native adapters: ``StoreCallback(url, resume=True)`` and the Trainer's own
    ``train(resume_from_checkpoint=True)``. A job stopped at step 6 of 9 restarts on a new
    node (an empty output_dir) with the same script and schedule, resumes from the store's
    step 6 and trains 7-9 exactly as an uninterrupted run does, uploading to the same root."""
    pytest.importorskip("transformers")
    url = f"s3://{moto_s3.bucket}/hf-native"
    store = moto_s3.options()
    schedule = {"max_steps": 9, "save_steps": 3, "store_options": store, "native_resume": True}
    whole = run("hf", {**schedule, "output_dir": str(tmp_path / "whole"), "upload_to": url + "-w"})
    first = run(
        "hf", {**schedule, "output_dir": str(tmp_path / "a"), "upload_to": url, "stop_at": 6}
    )
    assert sorted(first) == [1, 2, 3, 4, 5, 6]  # a first run: last_checkpoint was None
    assert ckptstore.list_steps(url, **store) == [3, 6]
    resumed = run(
        "hf",
        {**schedule, "output_dir": str(tmp_path / "b"), "upload_to": url, "expect_checkpoint": 1},
    )
    assert resumed == {step: whole[step] for step in (7, 8, 9)}
    assert ckptstore.list_steps(url, **store) == [3, 6, 9]


@pytest.mark.s3
@pytest.mark.torch
@pytest.mark.slow
def test_hf_trainer_rerun_is_refused_and_a_rollback_trains_the_steps_again(
    tmp_path: Path, moto_s3: MotoS3
) -> None:
    """Issue 29, restart and roll back with the Trainer's own calls. A rerun of the script
    in the same root, from scratch, is refused at its first save, before the Trainer writes
    it (it used to fail one save late, in the background). ``StoreCallback(url, resume=3,
    rollback=True)`` sets steps 6 and 9 aside, moves their local directories out of the
    Trainer's sight, and ``resume_from_checkpoint=True`` trains 4-9 exactly as before."""
    pytest.importorskip("transformers")
    url = f"s3://{moto_s3.bucket}/hf-rollback"
    store = moto_s3.options()
    out = tmp_path / "out"
    schedule = {"max_steps": 9, "save_steps": 3, "store_options": store, "upload_to": url}
    whole = run("hf", {**schedule, "output_dir": str(out), "save_total_limit": 3})
    assert ckptstore.list_steps(url, **store) == [3, 6, 9]
    first_nine = ckptstore.read_manifest(url, 9, **store).attempt

    error = run_refused("hf", {**schedule, "output_dir": str(tmp_path / "rerun")})
    assert "cannot upload step 3: the newest step of this root is 9" in error
    assert "StoreCallback(url, resume=<step>, rollback=True)" in error
    assert not (tmp_path / "rerun" / "checkpoint-3").exists()  # refused before the write
    assert ckptstore.list_steps(url, **store) == [3, 6, 9]

    rolled = run(
        "hf",
        {
            **schedule,
            "output_dir": str(out),
            "save_total_limit": 3,
            "native_resume": True,
            "resume_step": 3,
            "rollback": True,
            "expect_checkpoint": 1,  # the Trainer's own resume_from_checkpoint=True
        },
    )
    assert rolled == {step: whole[step] for step in range(4, 10)}
    assert ckptstore.list_steps(url, **store) == [3, 6, 9]
    assert ckptstore.read_manifest(url, 9, **store).attempt != first_nine
    moved = sorted(p.name.rsplit("-", 2)[0] for p in (out / files.REPLACED_DIR).iterdir())
    assert moved == ["checkpoint-6", "checkpoint-9"]
    from ckptstore.integrations.transformers import StoreCallback

    with pytest.raises(ValueError, match="needs the step"):
        StoreCallback(url, resume=True, rollback=True, **store)


@pytest.mark.s3
@pytest.mark.torch
def test_accelerate_states_to_s3_and_resume_in_a_new_process(
    tmp_path: Path, moto_s3: MotoS3
) -> None:
    pytest.importorskip("accelerate")
    url = f"s3://{moto_s3.bucket}/accelerate-run"
    schedule = {"url": url, "max_steps": 5, "store_options": moto_s3.options()}
    first = run("accelerate", {**schedule, "local_dir": str(tmp_path / "first"), "save_at": [2, 4]})
    assert ckptstore.list_steps(url, **moto_s3.options()) == [2, 4]
    shutil.rmtree(tmp_path / "first")

    resumed = run(
        "accelerate",
        {**schedule, "local_dir": str(tmp_path / "second"), "resume": True, "step": 2},
    )
    assert sorted(resumed) == [3, 4, 5]
    assert resumed == {step: first[step] for step in (3, 4, 5)}
    assert (tmp_path / "second" / "step-2" / "random_states_0.pkl").is_file()


@pytest.mark.s3
@pytest.mark.torch
@pytest.mark.slow
def test_accelerate_own_save_state_and_load_state_mirrored_to_s3(
    tmp_path: Path, moto_s3: MotoS3
) -> None:
    """Issue 29, native adapters: a script that calls only ``accelerator.save_state()`` and
    ``load_state()`` (automatic checkpoint naming) after ``mirror_states``: its checkpoints
    are committed as steps 0, 1...; a restart on the same node reuses its local copy, one on
    a new node downloads it; both train on exactly as the first run did, and the next save
    is the next step, not a collision with the one loaded."""
    pytest.importorskip("accelerate")
    url = f"s3://{moto_s3.bucket}/accelerate-native"
    store = moto_s3.options()
    schedule = {"url": url, "max_steps": 5, "store_options": store, "native": True}
    same = tmp_path / "node-a"
    first = run("accelerate", {**schedule, "local_dir": str(same), "save_at": [2, 4]})
    assert ckptstore.list_steps(url, **store) == [0, 1]  # checkpoint_0 and checkpoint_1
    again = run("accelerate", {**schedule, "local_dir": str(same), "resume": True})
    assert again == {5: first[5]}
    assert not (same / files.REPLACED_DIR).exists()  # its own copy, verified and reused
    moved = run(
        "accelerate",
        {**schedule, "local_dir": str(tmp_path / "node-b"), "resume": True, "save_at": [5]},
    )
    assert moved == {5: first[5]}
    assert ckptstore.list_steps(url, **store) == [0, 1, 2]
    from accelerate import Accelerator

    from ckptstore.integrations.accelerate import mirror_states

    plain = Accelerator(cpu=True)
    with pytest.raises(ValueError, match="automatic_checkpoint_naming=True"):
        mirror_states(plain, url, **store)


@pytest.mark.s3
@pytest.mark.torch
@pytest.mark.slow
def test_accelerate_rerun_is_refused_and_rollbacks_train_the_steps_again(
    tmp_path: Path, moto_s3: MotoS3
) -> None:
    """Issue 29, restart and roll back, both Accelerate faces: ``StoreStates`` and the
    Accelerator's own calls after ``mirror_states``. A rerun from scratch into the same root
    is refused at its first save, before Accelerate writes anything; a roll-back to an older
    step sets the newer ones aside, moves their local directories aside, and trains the
    same losses again."""
    pytest.importorskip("accelerate")
    store = moto_s3.options()
    url = f"s3://{moto_s3.bucket}/accelerate-rollback"
    schedule = {"url": url, "max_steps": 6, "store_options": store, "save_at": [2, 4, 6]}
    whole = run("accelerate", {**schedule, "local_dir": str(tmp_path / "a")})
    assert ckptstore.list_steps(url, **store) == [2, 4, 6]
    error = run_refused("accelerate", {**schedule, "local_dir": str(tmp_path / "rerun")})
    assert "cannot upload step 2: the newest step of this root is 6" in error
    assert "states.load_state(step, rollback=True)" in error
    assert not (tmp_path / "rerun" / "step-2").exists()
    again = run(
        "accelerate",
        {**schedule, "local_dir": str(tmp_path / "a"), "resume": True, "step": 2, "rollback": True},
    )
    assert again == {step: whole[step] for step in range(3, 7)}
    assert ckptstore.list_steps(url, **store) == [2, 4, 6]
    moved = sorted(
        p.name.rsplit("-", 2)[0] for p in (tmp_path / "a" / files.REPLACED_DIR).iterdir()
    )
    assert moved == ["step-4", "step-6"]

    # the Accelerator's own save_state()/load_state(): checkpoint_0, _1, _2 are steps 0-2
    native_url = f"s3://{moto_s3.bucket}/accelerate-native-rollback"
    native = {**schedule, "url": native_url, "native": True, "total_limit": 3}
    project = tmp_path / "project"
    first = run("accelerate", {**native, "local_dir": str(project)})
    assert ckptstore.list_steps(native_url, **store) == [0, 1, 2]
    error = run_refused("accelerate", {**native, "local_dir": str(tmp_path / "other")})
    assert "cannot upload step 0: the newest step of this root is 2" in error
    assert "accelerator.load_state(step=<step>, rollback=True)" in error
    back = run("accelerate", {**native, "local_dir": str(project), "step": 0, "rollback": True})
    assert back == {step: first[step] for step in range(3, 7)}  # checkpoint_0 was at step 2
    assert ckptstore.list_steps(native_url, **store) == [0, 1, 2]
    moved = sorted(p.name.rsplit("-", 2)[0] for p in (project / files.REPLACED_DIR).iterdir())
    assert moved == ["checkpoint_1", "checkpoint_2"]


@pytest.mark.s3
@pytest.mark.jax
def test_orbax_steps_mirrored_to_seaweedfs_and_restored_after_local_deletion(
    tmp_path: Path, seaweedfs: SeaweedFS
) -> None:
    ocp = pytest.importorskip("orbax.checkpoint")
    jnp = pytest.importorskip("jax.numpy")
    from ckptstore.integrations.orbax import OrbaxMirror

    bucket = "orbax-" + uuid.uuid4().hex[:8]
    seaweedfs.create_bucket(bucket)
    url = f"s3://{bucket}/run"
    store = {"endpoint_url": seaweedfs.s3_endpoint, "anonymous": True}

    def state(step: int) -> dict[str, Any]:
        return {
            "params": {"w": jnp.arange(12.0).reshape(3, 4) * step, "b": jnp.ones(4) * step},
            "step": jnp.asarray(step),
        }

    local = tmp_path / "orbax"
    options = ocp.CheckpointManagerOptions(max_to_keep=2)
    with ocp.CheckpointManager(local, options=options) as manager:
        mirror = OrbaxMirror(manager, url, **store)
        for step in (1, 2, 3):
            mirror.save(step, args=ocp.args.StandardSave(state(step)))
        mirror.close()
        assert manager.all_steps() == [2, 3]  # Orbax's own retention
    # every step reached the store, step 1 too, although Orbax deleted it locally
    assert ckptstore.list_steps(url, **store) == [1, 2, 3]
    assert files.is_tree_step(ckptstore.read_manifest(url, 3, **store))

    shutil.rmtree(local)
    with ocp.CheckpointManager(local, options=options) as manager:
        mirror = OrbaxMirror(manager, url, **store)
        assert manager.all_steps() == []
        assert mirror.all_steps() == [1, 2, 3]
        abstract = state(0)
        restored = mirror.restore(None, args=ocp.args.StandardRestore(abstract))
        np.testing.assert_array_equal(restored["params"]["w"], state(3)["params"]["w"])
        assert int(restored["step"]) == 3
        old = mirror.restore(1, args=ocp.args.StandardRestore(abstract))
        np.testing.assert_array_equal(old["params"]["b"], state(1)["params"]["b"])
        assert manager.all_steps() == [1, 3]
        mirror.close()

    # in one process: saved, rolled back to 1, and steps 2 and 3 saved and uploaded again
    url = f"s3://{bucket}/same-process"
    with ocp.CheckpointManager(tmp_path / "same", options=options) as manager:
        mirror = OrbaxMirror(manager, url, **store)
        for step in (1, 2, 3):
            mirror.save(step, args=ocp.args.StandardSave(state(step)))
        mirror.wait_until_finished()
        first = ckptstore.read_manifest(url, 3, **store).attempt
        mirror.restore(1, args=ocp.args.StandardRestore(abstract), rollback=True)
        assert ckptstore.list_steps(url, **store) == [1]
        for step in (2, 3):
            mirror.save(step, args=ocp.args.StandardSave(state(10 * step)))
        mirror.close()
    assert ckptstore.list_steps(url, **store) == [1, 2, 3]
    assert ckptstore.read_manifest(url, 3, **store).attempt != first


@pytest.mark.s3
@pytest.mark.jax
@pytest.mark.slow
def test_orbax_manager_own_calls_resume_refuse_and_roll_back(
    tmp_path: Path, seaweedfs: SeaweedFS
) -> None:
    """Issue 29, native Orbax: a JAX loop that calls only the CheckpointManager's own
    ``save``, ``latest_step``, ``restore`` and ``wait_until_finished`` after
    ``mirror_manager`` (steps named ``ckpt_<N>``). A rerun from scratch into the same root is
    refused in ``manager.save``; a new node rolls back to step 2 (downloaded under Orbax's
    own name for it) and trains 3-8 exactly as the first run; the first node rolls back to
    4 with its newer directories moved aside; a plain resume continues from the newest."""
    pytest.importorskip("orbax.checkpoint")
    bucket = "orbax-" + uuid.uuid4().hex[:8]
    seaweedfs.create_bucket(bucket)
    url = f"s3://{bucket}/run"
    store = {"endpoint_url": seaweedfs.s3_endpoint, "anonymous": True}
    schedule = {"url": url, "store_options": store, "max_steps": 8, "save_at": [2, 4, 6, 8]}
    first = tmp_path / "node-a"
    whole = run("orbax", {**schedule, "local_dir": str(first)})
    assert sorted(whole) == list(range(1, 9))
    assert ckptstore.list_steps(url, **store) == [2, 4, 6, 8]
    assert sorted(p.name for p in first.iterdir() if p.name.startswith("ckpt_")) == [
        "ckpt_4",
        "ckpt_6",
        "ckpt_8",
    ]

    error = run_refused("orbax", {**schedule, "local_dir": str(tmp_path / "rerun")})
    assert "cannot upload step 2: the newest step of this root is 8" in error
    assert "manager.restore(step, ..., rollback=True)" in error
    assert not (tmp_path / "rerun" / "ckpt_2").exists()

    new_node = tmp_path / "node-b"
    back = run("orbax", {**schedule, "local_dir": str(new_node), "step": 2, "rollback": True})
    assert back == {step: whole[step] for step in range(3, 9)}
    assert ckptstore.list_steps(url, **store) == [2, 4, 6, 8]  # 4, 6 and 8 saved again
    assert not (new_node / files.REPLACED_DIR).exists()  # nothing newer was on this node

    back = run("orbax", {**schedule, "local_dir": str(first), "step": 4, "rollback": True})
    assert back == {step: whole[step] for step in range(5, 9)}
    moved = sorted(p.name.rsplit("-", 2)[0] for p in (first / files.REPLACED_DIR).iterdir())
    assert moved == ["ckpt_6", "ckpt_8"]

    resumed = run(
        "orbax", {**schedule, "local_dir": str(tmp_path / "node-c"), "resume": True, "max_steps": 9}
    )
    assert sorted(resumed) == [9]  # from step 8, downloaded: latest_step() counts the store's
