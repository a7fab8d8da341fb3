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
from tests.servers.moto import MotoS3

RUNS = Path(__file__).with_name("tree_adapters.py")


def run(which: str, options: dict[str, Any]) -> dict[int, float]:
    """One training run in a new process; its losses by step."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, str(RUNS), which, json.dumps(options)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("LOSSES "))
    return {int(k): v for k, v in json.loads(line.removeprefix("LOSSES ")).items()}


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
