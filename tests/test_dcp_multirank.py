"""DCP through ckptstore with several real processes on gloo over 127.0.0.1.

Each test starts N copies of tests/dcp_ranks.py (one per rank) with a fresh free port and
reads the ``RESULT`` line each prints. The state holds a row-sharded DTensor, so saving on 4
ranks and loading on 2 makes DCP reshard.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

import ckptstore
from ckptstore import background
from ckptstore.store.registry import open_store

pytestmark = pytest.mark.torch

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).with_name("dcp_ranks.py")
WEIGHT_BYTES = 1024 * 256 * 4  # dcp_ranks.ROWS x COLS float32


@dataclass
class RankOutcome:
    returncode: int
    results: list[dict[str, Any]]
    log: str


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_ranks(
    world: int, scenario: str, *args: str, logs: Path, env: dict[str, str] | None = None
) -> list[RankOutcome]:
    """Run one scenario on ``world`` processes; return each rank's exit code and results."""
    port = free_port()
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    files = []
    for rank in range(world):
        log = open(logs / f"{scenario}-{world}-rank{rank}.log", "w+")  # noqa: SIM115
        files.append(log)
        rank_env = {
            **os.environ,
            **(env or {}),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": "lo",
            "PYTHONPATH": str(ROOT),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), scenario, *args],
                env=rank_env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    outcomes = []
    try:
        for proc, log in zip(procs, files, strict=True):
            proc.wait(timeout=240)
            log.seek(0)
            text = log.read()
            results = [
                json.loads(line.removeprefix("RESULT "))
                for line in text.splitlines()
                if line.startswith("RESULT ")
            ]
            outcomes.append(RankOutcome(proc.returncode, results, text))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in files:
            log.close()
    return outcomes


def assert_all_ok(outcomes: list[RankOutcome]) -> list[dict[str, Any]]:
    for rank, outcome in enumerate(outcomes):
        assert outcome.returncode == 0, f"rank {rank} failed:\n{outcome.log[-4000:]}"
        assert outcome.results, f"rank {rank} printed no result:\n{outcome.log[-4000:]}"
    return [outcome.results[-1] for outcome in outcomes]


@dataclass
class Target:
    """Where checkpoints go: a base URL and the store options that reach it."""

    base: str
    options: dict[str, Any]

    def env(self) -> dict[str, str]:
        return {"CKPTSTORE_TEST_STORE_OPTIONS": json.dumps(self.options)}

    def keys(self, url: str) -> list[str]:
        async def run() -> list[str]:
            async with open_store(url, **self.options) as store:
                return await store.list_keys()

        return background.run(run())

    def steps(self) -> list[int]:
        async def run() -> list[int]:
            async with open_store(self.base, **self.options) as store:
                return await ckptstore.alist_steps(store)

        return background.run(run())


@pytest.fixture(
    params=[
        "local",
        pytest.param("moto", marks=[pytest.mark.s3, pytest.mark.slow]),
        pytest.param("seaweedfs", marks=[pytest.mark.s3, pytest.mark.slow]),
    ]
)
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Target:
    """The root checkpoints go under, on each backend."""
    prefix = f"dcp-{uuid.uuid4().hex[:8]}"
    if request.param == "moto":
        moto = request.getfixturevalue("moto_s3")
        options = {
            **moto.options(),
            "access_key_id": moto.access_key,
            "secret_access_key": moto.secret_key,
        }
        return Target(f"s3://{moto.bucket}/{prefix}", options)
    if request.param == "seaweedfs":
        server = request.getfixturevalue("seaweedfs")
        bucket = "ckptstore-dcp"
        server.create_bucket(bucket)
        return Target(
            f"s3://{bucket}/{prefix}", {"endpoint_url": server.s3_endpoint, "anonymous": True}
        )
    return Target(str(tmp_path / "ckpts"), {})


def test_save_on_4_ranks_load_on_2_reshards_bit_exact(target: Target, tmp_path: Path) -> None:
    url = f"{target.base}/7"  # step 7 of the root
    logs, env = tmp_path / "logs", target.env()
    saved = assert_all_ok(run_ranks(4, "save", url, "7", logs=logs, env=env))
    assert saved == [{"saved": True}] * 4
    keys = target.keys(target.base)
    # every rank wrote its own objects under one attempt of step 7; one manifest
    assert "7/manifest.json" in keys
    data = [key.split("/") for key in keys if key != "7/manifest.json"]
    assert {rank_object.split("-")[0] for _, _, rank_object in data} == {"r0", "r1", "r2", "r3"}
    assert len({attempt for _, attempt, _ in data}) == 1
    assert target.steps() == [7]

    loaded = assert_all_ok(run_ranks(2, "load", url, "7", logs=logs, env=env))
    for result in loaded:
        assert result["exact"] is True
        # each of 2 ranks reads its half of the sharded weight plus small replicated items,
        # never the other half
        assert WEIGHT_BYTES // 2 <= result["bytes_read"] < WEIGHT_BYTES // 2 + 64 * 1024


def test_failing_or_dying_rank_leaves_no_checkpoint_and_previous_loads(
    target: Target, tmp_path: Path
) -> None:
    good, failed, died = (f"{target.base}/{step}" for step in (1, 2, 3))
    logs, env = tmp_path / "logs", target.env()
    outcomes = run_ranks(2, "failures", good, failed, died, logs=logs, env=env)
    rank0, rank1 = outcomes
    assert rank0.returncode == 0, rank0.log[-4000:]
    assert rank0.results[-1]["raise"] == "CheckpointException"
    assert rank0.results[-1]["die"] != "succeeded"  # the survivor's save fails, it does not hang
    assert rank1.returncode == 17  # it really died mid-save
    assert rank1.results[-1] == {"raise": "CheckpointException"}

    assert target.steps() == [1]  # neither failed save is visible
    # rank 1 had uploaded objects of its own before it died: a real mid-save death
    assert any("/r1-" in key for key in target.keys(died))

    loaded = assert_all_ok(run_ranks(2, "load", good, "1", logs=logs, env=env))
    assert all(result["exact"] for result in loaded)


def test_async_save_thread_and_process_executors_on_2_ranks(target: Target, tmp_path: Path) -> None:
    thread_url, process_url = f"{target.base}/10", f"{target.base}/20"
    outcomes = run_ranks(
        2, "async", thread_url, process_url, logs=tmp_path / "logs", env=target.env()
    )
    assert assert_all_ok(outcomes) == [{"exact": [True, True]}] * 2
    assert target.steps() == [10, 20]
