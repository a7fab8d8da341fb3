"""Interrupted work cleans up (issue 29): ``ckptstore cp`` stopped by Ctrl-C or SIGTERM
removes its attempt, plain ``ckptstore gc`` removes an attempt whose owner is gone (its lease
expired) without waiting for the grace period, and ``ckptstore ls`` says how much
uncommitted data a root holds.

Before: an interrupted cp exited 130 and left 32-300 MiB that ``ls`` did not mention and
``gc`` kept for 6 hours; SIGTERM killed it with its temp files in place.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptstore
from ckptstore.cli.main import main
from ckptstore.layout.keys import new_attempt_id
from ckptstore.testing.proxy import FaultProxy, ProxyFault
from tests.children import python_path
from tests.matrix import trials

#: The step cp copies: 8 objects of 16 MiB (leaf-000000 ... leaf-000007).
STATE = {
    f"w{i}": np.random.default_rng(i).standard_normal(4 << 20).astype(np.float32) for i in range(8)
}
#: Every object but the first answered this late, so a signal sent once the first object (or
#: the lease) is at the destination always lands mid-copy, however loaded the machine.
LATE = 3.0
LATE_OBJECTS = r"leaf-00000[1-7]"


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("interrupts") / "src"
    ckptstore.save(root, STATE, step=1)
    return root


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


#: ``python -m ckptstore``, with Ctrl-C delivered as in a terminal: a test run started in the
#: background (``bash .ci/run &``, CI runners) inherits SIGINT ignored, and Python keeps it so.
_AS_A_TERMINAL_WOULD = """
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
from ckptstore.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def _interrupt_cp(src: str, dst: str, sig: int, started: Any, *options: str) -> tuple[int, str]:
    """Run ``ckptstore cp src dst``, send ``sig`` once ``started()`` says so, and return the
    exit status and stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _AS_A_TERMINAL_WOULD, "cp", src, dst, "--no-progress", *options],
        env={**os.environ, "PYTHONPATH": python_path()},
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not started():
        assert proc.poll() is None, f"cp ended before it was interrupted: {proc.communicate()}"
        assert time.monotonic() < deadline, "cp never started writing"
        time.sleep(0.005)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


@pytest.mark.s3
@pytest.mark.parametrize(
    ("sig", "status", "said"),
    [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")],
    ids=["SIGINT", "SIGTERM"],
)
def test_an_interrupted_cp_to_a_directory_leaves_nothing(
    moto_s3: Any, tmp_path: Path, sig: int, status: int, said: str
) -> None:
    """From S3 (the objects after the first answered late) to a local directory, the signal
    sent once the lease is written, then once the first object is."""
    src = f"s3://{moto_s3.bucket}/cp-src-{uuid.uuid4().hex[:8]}"
    ckptstore.save(src, STATE, step=1, **moto_s3.options())
    late = ProxyFault("delay", ops=frozenset({"get"}), path=LATE_OBJECTS, seconds=LATE)
    dst = tmp_path / "dst"

    def lease_written() -> bool:
        return any(p.name == "lease.json" for p in _files(dst))

    def data_written() -> bool:
        return any(p.name.startswith("leaf-") for p in _files(dst))

    with FaultProxy(moto_s3.endpoint, [late]) as proxy:
        options = ["-o", f"endpoint_url={proxy.endpoint}", "-o", f"region={moto_s3.region}"]
        for started in (lease_written, data_written):
            returncode, err = _interrupt_cp(src, str(dst), sig, started, *options)
            assert returncode == status, err
            assert err.strip() == f"ckptstore cp: {said}"
            assert _files(dst) == []


@pytest.mark.s3
def test_an_interrupted_cp_to_s3_leaves_no_object_and_no_upload(source: Path, moto_s3: Any) -> None:
    """To S3, the uploads after the first answered late (the objects exist upstream before
    the answer): the cleanup waits for them, then removes them."""
    client: Any = moto_s3.client()
    prefix = f"cp-{uuid.uuid4().hex[:8]}"
    late = ProxyFault("delay", ops=frozenset({"put_object"}), path=LATE_OBJECTS, seconds=LATE)

    def under(prefix: str) -> tuple[list[str], list[str]]:
        keys = client.list_objects_v2(Bucket=moto_s3.bucket, Prefix=prefix).get("Contents", [])
        ups = client.list_multipart_uploads(Bucket=moto_s3.bucket, Prefix=prefix)
        return [k["Key"] for k in keys], [u["Key"] for u in ups.get("Uploads", [])]

    def data_written() -> bool:
        keys, uploads = under(prefix + "/1/")
        return bool(uploads) or any(not k.endswith("lease.json") for k in keys)

    try:
        with FaultProxy(moto_s3.endpoint, [late]) as proxy:
            options = ["--dst-option", f"endpoint_url={proxy.endpoint}"]
            options += ["--dst-option", f"region={moto_s3.region}"]
            dst = f"s3://{moto_s3.bucket}/{prefix}"
            returncode, err = _interrupt_cp(str(source), dst, signal.SIGINT, data_written, *options)
        assert returncode == 130, err
        assert under(prefix + "/") == ([], [])
    finally:
        client.close()


def _write_attempt(root: Path, step: int, *, lease_expires: float | None, age: float) -> Path:
    """An uncommitted attempt of ``step`` started ``age`` seconds ago, with a lease that
    expires at ``lease_expires`` (none if ``None``) and a 1 MiB object."""
    attempt = root / str(step) / new_attempt_id(time.time() - age)
    attempt.mkdir(parents=True)
    (attempt / "leaf-000000").write_bytes(b"\0" * (1 << 20))
    if lease_expires is not None:
        body = {"expires": lease_expires, "period": 120, "pid": 1, "host": "h", "refs": []}
        (attempt / "lease.json").write_text(json.dumps(body))
    return attempt


def test_gc_removes_an_attempt_whose_owner_is_gone_without_waiting_for_the_grace_period(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "run"
    ckptstore.save(root, {"w": np.ones(10)}, step=1)
    gone = _write_attempt(root, 2, lease_expires=time.time() - 600, age=700)
    running = _write_attempt(root, 3, lease_expires=time.time() + 100, age=700)
    unleased = _write_attempt(root, 4, lease_expires=None, age=700)  # grace applies
    just_expired = _write_attempt(root, 5, lease_expires=time.time() - 5, age=700)  # skew

    assert main(["ls", str(root)]) == 0
    out = capsys.readouterr().out
    assert "uncommitted: 4.0 MiB in 7 objects of 4 attempts" in out

    report = ckptstore.gc(root)  # the default grace: 6 hours
    assert report.removed == [f"2/{gone.name}/"]
    assert not gone.exists()
    for kept in (running, unleased, just_expired):
        assert kept.exists()
    assert ckptstore.load(root)["w"].tolist() == [1.0] * 10


def test_ls_names_uncommitted_data_and_set_aside_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "run"
    for step in (1, 2, 3):
        ckptstore.save(root, {"w": np.full(1 << 18, step, np.float32)}, step=step)
    ckptstore.rollback(root, 1)
    assert main(["ls", str(root), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["uncommitted"]["set_aside"] == [2, 3]
    assert len(data["uncommitted"]["attempts"]) == 2
    assert data["uncommitted"]["nbytes"] > 2 << 20
    assert main(["ls", str(root)]) == 0
    out = capsys.readouterr().out
    assert "set aside by a roll-back: steps 2, 3" in out
    assert "uncommitted: 2.0 MiB" in out

    clean = tmp_path / "clean"
    ckptstore.save(clean, {"w": np.ones(3)}, step=1)
    assert main(["ls", str(clean)]) == 0
    assert "uncommitted" not in capsys.readouterr().out


_SAVE = """
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (see above)
import asyncio
import numpy as np
import ckptstore
from ckptstore.store.local import LocalStore
from ckptstore.store.wrappers import Fault, FaultStore

class NeverCommits(FaultStore):
    # the manifest put waits until it is cancelled: the signal, sent once a data object is
    # on disk, lands before the commit however loaded the machine (a 1 s wait before it was
    # overtaken once in a full run)
    async def _hook(self, op, key, nbytes):
        if key.endswith("manifest.json") and op == "put":
            await asyncio.Event().wait()
        return await super()._hook(op, key, nbytes)

# every data put waits 1 s first, so the signal lands while they are being written
store = NeverCommits(LocalStore(sys.argv[1]), [Fault(frozenset({"put"}), latency=1.0)])
if sys.argv[2] == "other-thread":
    # the kernel may hand a process's SIGINT to any thread that does not block it: make it
    # another one, as a loaded machine did, so only Python's handler flag tells the caller
    from ckptstore import background
    background.loop()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
rng = np.random.default_rng(0)
state = {f"w{i}": rng.standard_normal(1 << 20).astype(np.float32) for i in range(8)}
ckptstore.save(store, state, step=1)
"""


@pytest.mark.parametrize("delivered", ["main-thread", "other-thread"])
@pytest.mark.parametrize("wanted", [1, 8], ids=["while-writing", "at-the-commit"])
def test_ctrl_c_in_a_plain_save_removes_its_attempt(
    tmp_path: Path, wanted: int, delivered: str
) -> None:
    """ckptstore.save runs on the background loop: Ctrl-C in the caller left the save
    running until the interpreter stopped the loop half-way, its attempt left behind. Now
    the save is cancelled and removes what it wrote before the KeyboardInterrupt goes on.
    A SIGINT the kernel delivered to another thread went unnoticed while the caller waited
    (a full run hung 120 s on it): the caller now wakes to check for one."""
    root = tmp_path / "run"
    for _ in range(trials(3, 1)):
        proc = subprocess.Popen(
            [sys.executable, "-c", _SAVE, str(root), delivered],
            env={**os.environ, "PYTHONPATH": python_path()},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 60
        while sum(p.name.startswith("leaf-") for p in _files(root)) < wanted:
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "the save never wrote"
            time.sleep(0.002)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert "KeyboardInterrupt" in err
        assert _files(root) == []
        assert ckptstore.list_steps(root) == []
