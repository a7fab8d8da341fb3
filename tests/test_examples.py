"""The README's main job and the JAX example run end to end (small settings)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.children import python_path


def run(module: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": python_path()},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.torch
def test_torch_main_job_checkpoints_restores_and_resumes(tmp_path: Path) -> None:
    small = ("--steps", "12", "--save-every", "4", "--width", "64", "--keep", "2")
    first = run("ckptstore.examples.train", *small, cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "save blocked" in first.stdout
    assert "OK: step 11 restored bit-exact" in first.stdout
    assert "checkpoints kept: [8, 11]" in first.stdout
    assert (tmp_path / "checkpoints" / "11" / "manifest.json").exists()  # the default URL
    second = run("ckptstore.examples.train", *small, cwd=tmp_path)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resuming from step 11" in second.stdout
    assert "OK: step 23 restored bit-exact" in second.stdout
    # the resumed run (a streaming restore) trained exactly as one run of 24 steps does
    import torch

    import ckptstore

    whole = tmp_path / "whole"
    whole.mkdir()
    once = run("ckptstore.examples.train", "--steps", "24", *small[2:], cwd=whole)
    assert once.returncode == 0, once.stdout + once.stderr
    resumed = ckptstore.load(tmp_path / "checkpoints", 23)
    uninterrupted = ckptstore.load(whole / "checkpoints", 23)
    for name, tensor in uninterrupted["model"].items():
        assert torch.equal(resumed["model"][name], tensor), name
    for index, moments in uninterrupted["optim"]["state"].items():
        for name, tensor in moments.items():
            assert torch.equal(resumed["optim"]["state"][index][name], tensor), (index, name)


@pytest.mark.torch
def test_torch_main_job_fails_loudly_on_a_bad_url(tmp_path: Path) -> None:
    result = run("ckptstore.examples.train", "--url", "nosuchscheme://x", cwd=tmp_path)
    assert result.returncode == 1
    assert "nosuchscheme" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.torch
def test_torch_main_job_help_names_the_command_and_shows_defaults(tmp_path: Path) -> None:
    result = run("ckptstore.examples.train", "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: python -m ckptstore.examples.train ")
    assert "train.py" not in result.stdout
    for default in ("(default: ./checkpoints)", "(default: 100)", "(default: 20)"):
        assert default in result.stdout


@pytest.mark.torch
@pytest.mark.s3
def test_torch_main_job_reports_an_unreachable_s3_in_one_line(tmp_path: Path) -> None:
    from ckptstore.testing.servers import free_ports

    (port,) = free_ports(1)  # nothing listens there
    url = f"s3://ckpt/run1?endpoint_url=http://127.0.0.1:{port}&anonymous=true&max_attempts=1"
    result = run("ckptstore.examples.train", "--url", url, "--steps", "2", cwd=tmp_path)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("python -m ckptstore.examples.train: error: ")
    assert f"127.0.0.1:{port}" in lines[0]


@pytest.mark.jax
def test_jax_example_checkpoints_and_restores(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'ck'}"
    small = ("--steps", "6", "--save-every", "3", "--width", "32", "--url", url)
    result = run("ckptstore.examples.train_jax", *small, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK: step 5 restored bit-exact" in result.stdout
    again = run("ckptstore.examples.train_jax", *small, cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "resuming from step 5" in again.stdout
