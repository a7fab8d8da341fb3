"""A writer killed with SIGKILL in the middle of a large write leaves nothing visible under
the final key, and its temp file is recognisable (by prefix and writer pid) for cleanup.

The writer is a real child process (``sys.executable``); the test watches the store's
directory, kills the child once its temp file is being written, then inspects what is left.
Each test runs on local disk and on a network filesystem (SeaweedFS over FUSE,
the ``nfs://`` backend), where a crash must be survived by what the filesystem's server holds.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ckptstore.errors import NotFoundError
from ckptstore.store.base import TEMP_PREFIX
from ckptstore.store.local import LocalStore, temp_files
from ckptstore.store.nfs import NFSStore
from ckptstore.testing.servers import FuseMount
from tests.children import python_path

# 2 GiB through one I/O thread in 16 MiB parts: seconds of writing, so the kill lands while
# the put is still under way (the test checks that the child did not finish).
PUT_CHILD = textwrap.dedent(
    """
    import asyncio, sys
    import numpy as np
    from ckptstore.config import Settings
    from ckptstore.store.local import LocalStore
    from ckptstore.store.nfs import NFSStore

    async def main() -> None:
        settings = Settings(io_threads=1, part_size=16 << 20, durable=True)
        backend = {"local": LocalStore, "nfs": NFSStore}[sys.argv[3]]
        async with backend(sys.argv[1], settings=settings) as store:
            data = np.zeros(int(sys.argv[2]), dtype=np.uint8)
            await store.put("step-1/big.bin", data)
        print("finished", flush=True)

    asyncio.run(main())
    """
)

MULTIPART_CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from ckptstore.config import Settings
    from ckptstore.store.local import LocalStore
    from ckptstore.store.nfs import NFSStore

    async def main() -> None:
        part = 8 << 20
        chunk = bytes(range(256)) * (part // 256)
        backend = {"local": LocalStore, "nfs": NFSStore}[sys.argv[3]]
        async with backend(sys.argv[1], settings=Settings(durable=True)) as store:
            upload = await store.create_multipart("step-1/parts.bin", part_size=part)
            for index in range(int(sys.argv[2])):
                await upload.put_part(index, chunk)
                print(f"part {index}", flush=True)
            await upload.complete()
        print("finished", flush=True)

    asyncio.run(main())
    """
)


@pytest.fixture(params=["local", pytest.param("nfs", marks=pytest.mark.nfs)])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, Path]:
    """The backend's name and a fresh directory for its store: on local disk, or on the
    SeaweedFS FUSE mount."""
    if request.param == "local":
        return "local", tmp_path
    mount: FuseMount = request.getfixturevalue("seaweedfs_mount")
    path = mount.path / "crash-tests" / tmp_path.name
    path.mkdir(parents=True)
    return "nfs", path


def _spawn(code: str, *args: str) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "PYTHONPATH": python_path(),
    }
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _poll(condition: Callable[[], bool], child: subprocess.Popen[str], what: str) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        if child.poll() is not None:
            out, err = child.communicate()
            pytest.fail(f"the writer exited before {what}: {out}{err}")
        if time.monotonic() > deadline:
            child.kill()
            child.wait()
            pytest.fail(f"timed out waiting until {what}")
        time.sleep(0.001)


def _kill(child: subprocess.Popen[str]) -> str:
    child.send_signal(signal.SIGKILL)
    out, _ = child.communicate(timeout=30)
    assert child.returncode == -signal.SIGKILL
    return out


async def _store_shows_nothing(root: Path, key: str, name: str) -> None:
    async with {"local": LocalStore, "nfs": NFSStore}[name](root) as store:
        assert await store.list_keys() == []
        assert await store.list_prefixes() == []
        assert not await store.exists(key)
        with pytest.raises(NotFoundError):
            await store.get(key)


def _assert_nothing_visible(root: Path, key: str, pid: int, name: str) -> list[str]:
    assert not (root / key).exists()
    asyncio.run(_store_shows_nothing(root, key, name))
    leftovers = list(temp_files(root))
    assert len(leftovers) == 1
    temp_name = os.path.basename(leftovers[0])
    assert temp_name.startswith(f"{TEMP_PREFIX}{pid}.")  # the dead writer's pid, for cleanup tools
    assert os.path.dirname(leftovers[0]) == str(root / os.path.dirname(key))
    return leftovers


def test_sigkill_during_large_put_leaves_no_partial_object(backend: tuple[str, Path]) -> None:
    name, base = backend
    root = base / "store"
    size = 2 << 30
    child = _spawn(PUT_CHILD, str(root), str(size), name)

    def temp_is_being_written() -> bool:
        return any(os.path.getsize(p) > 0 for p in temp_files(root)) if root.exists() else False

    _poll(temp_is_being_written, child, "its temp file was being written")
    out = _kill(child)
    assert "finished" not in out
    leftovers = _assert_nothing_visible(root, "step-1/big.bin", child.pid, name)
    assert 0 < os.path.getsize(leftovers[0]) < size  # killed part-way through the bytes
    os.unlink(leftovers[0])


def test_sigkill_during_multipart_upload_leaves_no_partial_object(
    backend: tuple[str, Path],
) -> None:
    name, base = backend
    root = base / "store"
    parts = 256  # 2 GiB; the child is killed after its third part
    child = _spawn(MULTIPART_CHILD, str(root), str(parts), name)
    assert child.stdout is not None
    seen: list[str] = []

    def three_parts_written() -> bool:
        assert child.stdout is not None
        line = child.stdout.readline()
        if line:
            seen.append(line.strip())
        return "part 2" in seen

    _poll(three_parts_written, child, "three parts were written")
    out = _kill(child)
    assert "finished" not in out
    leftovers = _assert_nothing_visible(root, "step-1/parts.bin", child.pid, name)
    written = os.path.getsize(leftovers[0])
    assert 3 * (8 << 20) <= written < parts * (8 << 20)
    os.unlink(leftovers[0])
