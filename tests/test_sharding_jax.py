"""A JAX mesh change: arrays sharded over a 4 x 2 mesh of 8 CPU devices, saved through
``ckptstore.distributed.save``, load bit-exact onto other meshes and shardings (see
tests/jax_shards.py, run in a process of its own so that JAX sees 8 devices)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.children import python_path

pytest.importorskip("jax")

pytestmark = pytest.mark.jax

ROOT = Path(__file__).resolve().parent.parent


def test_jax_arrays_sharded_on_one_mesh_load_onto_another(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": python_path(),
    }
    run = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "jax_shards.py"), str(tmp_path / "ckpt")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    line = next(x for x in run.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    # x: 8 distinct boxes; y: 4 boxes, each on 2 devices, written once
    assert result["chunks"] == {"x": 8, "y": 4}
    assert result["full"] is True
    assert set(result["loads"]) == {"2x4 transposed", "8 by columns", "replicated"}
    for name, load in result["loads"].items():
        assert load["exact"] is True, name
        assert load["sharding"] is True, name
        # one process holds every box of the new sharding: each byte is read about once
        assert result["nbytes"] <= load["read"] <= 1.1 * result["nbytes"], name
