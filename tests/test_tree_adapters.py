"""The adapters that carry other libraries' checkpoint directories to a store, each with the
real library on CPU (a tiny model built from a config, nothing downloaded): Hugging Face
Trainer and Accelerate against moto's S3, resumed in a new process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import ckptstore
from ckptstore import files
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
    first = run(
        "hf",
        {
            "output_dir": str(tmp_path / "first"),
            "max_steps": 6,
            "save_steps": 3,
            "upload_to": url,
            "store_options": store,
        },
    )
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
            "output_dir": str(tmp_path / "second"),
            "max_steps": 6,
            "save_steps": 3,
            "resume_from": url,
            "step": 3,
            "upload_to": f"s3://{moto_s3.bucket}/hf-run-2",
            "store_options": store,
        },
    )
    assert sorted(resumed) == [4, 5, 6]
    assert resumed[4] == first[4]  # the next step's loss, bit for bit
    assert resumed == {step: first[step] for step in (4, 5, 6)}


@pytest.mark.s3
@pytest.mark.torch
def test_accelerate_states_to_s3_and_resume_in_a_new_process(
    tmp_path: Path, moto_s3: MotoS3
) -> None:
    pytest.importorskip("accelerate")
    url = f"s3://{moto_s3.bucket}/accelerate-run"
    store = moto_s3.options()
    first = run(
        "accelerate",
        {
            "url": url,
            "local_dir": str(tmp_path / "first"),
            "max_steps": 5,
            "save_at": [2, 4],
            "store_options": store,
        },
    )
    assert ckptstore.list_steps(url, **store) == [2, 4]
    shutil.rmtree(tmp_path / "first")

    resumed = run(
        "accelerate",
        {
            "url": url,
            "local_dir": str(tmp_path / "second"),
            "max_steps": 5,
            "resume": True,
            "step": 2,
            "store_options": store,
        },
    )
    assert sorted(resumed) == [3, 4, 5]
    assert resumed == {step: first[step] for step in (3, 4, 5)}
    assert (tmp_path / "second" / "step-2" / "random_states_0.pkl").is_file()
