"""Running one scenario on N real processes (gloo over 127.0.0.1), and where they save.

A test starts N copies of a worker script (tests/dcp_ranks.py, tests/native_ranks.py), one
per rank, and reads the ``RESULT <json>`` lines each prints. Rank 0 serves the gloo group's
store on a port the kernel picks and tells the others through a file (:func:`join_group`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import ckptstore
from ckptstore import background
from ckptstore.store.registry import open_store
from tests.children import python_path

#: seconds each rank has to finish its scenario before the test fails
RANK_TIMEOUT = 240.0

#: what a worker's rank prints when it is mid-save and waits to be SIGKILLed from outside
KILL_ME = "KILL ME"

During = Callable[[list[subprocess.Popen[bytes]], list[Path]], None]


@dataclass
class RankOutcome:
    returncode: int
    results: list[dict[str, Any]]
    log: str


def rank_main(scenarios: dict[str, Callable[..., dict[str, Any]]]) -> None:
    """A worker script's main: join the gloo group its environment names, run the scenario
    named by the first argument with the rest, and print its result as ``RESULT <json>``."""
    import torch.distributed as dist

    scenario, *args = sys.argv[1:]
    join_group(timedelta(seconds=60))
    try:
        result = scenarios[scenario](*args)
        print("RESULT " + json.dumps(result), flush=True)
    finally:
        dist.destroy_process_group()


def outcome_of(call: Callable[[], Any]) -> str:
    """``"succeeded"``, or the error ``call()`` raised as ``"<type>: <message>"``: what a
    rank reports of a call that may fail."""
    try:
        call()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "succeeded"


def join_group(timeout: timedelta) -> None:
    """Join the gloo group of this rank's environment. Rank 0 serves the group's TCPStore on
    a port the kernel picks and publishes it in the file ``CKPTSTORE_TEST_RENDEZVOUS``
    names; the other ranks wait for that file. A port chosen free beforehand
    (``MASTER_PORT``) can be taken by another test's server before rank 0 binds it."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    published = Path(os.environ["CKPTSTORE_TEST_RENDEZVOUS"])
    if rank == 0:
        store = dist.TCPStore(
            "127.0.0.1", 0, world, is_master=True, timeout=timeout, wait_for_workers=False
        )
        scratch = published.with_suffix(".tmp")
        scratch.write_text(str(store.port))
        scratch.rename(published)  # the others never see a half-written port
    else:
        deadline = time.monotonic() + timeout.total_seconds()
        while not published.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 published no port in {published} within {timeout}")
            time.sleep(0.01)
        port = int(published.read_text())
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_ranks(
    worker: Path,
    world: int,
    scenario: str,
    *args: str,
    logs: Path,
    env: dict[str, str] | None = None,
    during: During | None = None,
) -> list[RankOutcome]:
    """Run one scenario of ``worker`` on ``world`` processes; return each rank's exit code
    and results.

    ``during``, if given, is called with the rank processes and their log files once all
    are started, while they run (to signal one of them from outside, say); each rank then
    has :data:`RANK_TIMEOUT` to exit before it is killed and the test fails.
    """
    port = free_port()  # for workers that need one chosen up front (jax's coordinator)
    logs.mkdir(parents=True, exist_ok=True)
    rendezvous = logs / f"{scenario}-{world}-{uuid.uuid4().hex[:8]}.port"
    procs = []
    files = []
    paths = [logs / f"{scenario}-{world}-rank{rank}.log" for rank in range(world)]
    for rank in range(world):
        log = open(paths[rank], "w+")  # noqa: SIM115
        files.append(log)
        rank_env = {
            **os.environ,
            **(env or {}),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "CKPTSTORE_TEST_RENDEZVOUS": str(rendezvous),
            "GLOO_SOCKET_IFNAME": "lo",
            "PYTHONPATH": python_path(),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(worker), scenario, *args],
                env=rank_env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    outcomes = []
    try:
        if during is not None:
            during(procs, paths)
        for proc, log in zip(procs, files, strict=True):
            proc.wait(timeout=RANK_TIMEOUT)
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


def sigkill_when_ready(victim: int) -> During:
    """A ``during`` for :func:`run_ranks`: wait until rank ``victim`` prints :data:`KILL_ME`,
    then SIGKILL it from outside, as a preemption or the OOM killer would. The wait has the
    deadline a rank has to finish (:data:`RANK_TIMEOUT`): once, at a load average of 15 on two
    cores, the ranks took more than 120 s to get there."""

    def during(procs: list[subprocess.Popen[bytes]], logs: list[Path]) -> None:
        deadline = time.monotonic() + RANK_TIMEOUT
        while KILL_ME not in logs[victim].read_text():
            assert procs[victim].poll() is None, "the rank exited before it could be killed"
            assert time.monotonic() < deadline, f"rank {victim} never reached mid-save"
            time.sleep(0.05)
        os.kill(procs[victim].pid, signal.SIGKILL)

    return during


def run_and_sigkill(
    worker: Path,
    world: int,
    scenario: str,
    *args: str,
    victim: int,
    logs: Path,
    env: dict[str, str],
) -> list[str]:
    """Run a scenario whose rank ``victim`` prints :data:`KILL_ME` mid-save, SIGKILL it from
    outside, and check that it died by the signal and that every survivor returned (not hung:
    :func:`run_ranks` bounds each rank's run) with an error as its last ``killed`` result.
    Returns the survivors' errors, by rank."""
    outcomes = run_ranks(
        worker, world, scenario, *args, logs=logs, env=env, during=sigkill_when_ready(victim)
    )
    errors = []
    for rank, outcome in enumerate(outcomes):
        if rank == victim:
            assert outcome.returncode == -signal.SIGKILL, outcome.log[-4000:]
            continue
        assert outcome.returncode == 0, f"rank {rank}:\n{outcome.log[-4000:]}"
        assert outcome.results, f"rank {rank} printed no result:\n{outcome.log[-4000:]}"
        assert outcome.results[-1]["killed"] != "succeeded", f"rank {rank}"
        errors.append(outcome.results[-1]["killed"])
    return errors


def assert_all_ok(outcomes: list[RankOutcome]) -> list[dict[str, Any]]:
    for rank, outcome in enumerate(outcomes):
        assert outcome.returncode == 0, f"rank {rank} failed:\n{outcome.log[-4000:]}"
        assert outcome.results, f"rank {rank} printed no result:\n{outcome.log[-4000:]}"
    return [outcome.results[-1] for outcome in outcomes]


def assert_stalled_rank_failed_the_others(
    outcomes: list[RankOutcome], stalled: int, timeout: float
) -> None:
    """The stalled-rank scenarios' verdict: every rank exited cleanly; ``stalled`` reports
    that it stalled; every other rank's call failed saying a rank died or stalled, within
    ``timeout`` plus 10% (and a second for the call's own work before its collectives)."""
    for rank, result in enumerate(assert_all_ok(outcomes)):
        if rank == stalled:
            assert result == {"stalled": True}
            continue
        assert "another rank died or stalled" in result["error"], result
        assert result["seconds"] <= timeout * 1.1 + 1.0, result


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


_ON_S3 = [pytest.mark.s3, pytest.mark.slow]

#: ``(target, world)`` for scenarios run on 2 and 4 ranks, with
#: ``parametrize(("target", "world"), ..., indirect=["target"])``: every target on 2 ranks,
#: local disk on 4 as well. 4 ranks add survivors that are not the coordinator; each object
#: store is covered on 2, and 4 more processes per store would add minutes to CI. The default
#: run has local disk on 2 ranks; the rest is the full matrix (``--full``), except where a
#: scenario asks for :data:`WITH_4_RANKS`.
TARGETS_AND_WORLDS = [
    pytest.param("local", 2, id="local-2"),
    pytest.param("local", 4, marks=pytest.mark.slow, id="local-4"),
    pytest.param("moto", 2, marks=_ON_S3, id="moto-2"),
    pytest.param("seaweedfs", 2, marks=_ON_S3, id="seaweedfs-2"),
]
#: :data:`TARGETS_AND_WORLDS` with local disk on 4 ranks in the default run too: a failure
#: whose survivors include ranks that are not the coordinator, by default.
WITH_4_RANKS = [
    pytest.param("local", 4, id="local-4") if p.id == "local-4" else p for p in TARGETS_AND_WORLDS
]


#: Every target of the :func:`target` fixture without the slow mark, for
#: ``parametrize("target", EVERY_TARGET, indirect=True)``: a scenario cheap enough, or cut
#: down enough by default (tests/matrix.py), to run on every store in the default run.
EVERY_TARGET = [
    "local",
    pytest.param("moto", marks=pytest.mark.s3),
    pytest.param("seaweedfs", marks=pytest.mark.s3),
]


#: :data:`EVERY_TARGET` for the soak and crash loops, which take 10-40 s a target: local
#: disk and SeaweedFS (the S3 dialect) by default, moto as well under ``--full``.
SOAK_TARGETS = [
    "local",
    pytest.param("moto", marks=[pytest.mark.s3, pytest.mark.slow]),
    pytest.param("seaweedfs", marks=pytest.mark.s3),
]


@pytest.fixture(
    params=[
        "local",
        pytest.param("moto", marks=_ON_S3),
        pytest.param("seaweedfs", marks=_ON_S3),
    ]
)
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Target:
    """The root checkpoints go under, on each backend."""
    prefix = f"ranks-{uuid.uuid4().hex[:8]}"
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
        bucket = "ckptstore-ranks"
        server.create_bucket(bucket)
        return Target(
            f"s3://{bucket}/{prefix}", {"endpoint_url": server.s3_endpoint, "anonymous": True}
        )
    return Target(str(tmp_path / "ckpts"), {})
