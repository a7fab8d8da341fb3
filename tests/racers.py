"""Racing processes: N copies of a child that each try to commit the same thing, released
together, so that exactly one may win. Used on local disk, on the FUSE mount and on S3.

A child prints ``ready``, waits for a line on stdin, tries, and prints ``ok <id>`` if it won
or ``conflict`` if it lost; :func:`race` returns each child's words.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from tests.children import python_path

#: ``ckptstore.save`` of step 7 under ``ROOT_URL``; the winner prints its attempt id.
SAVE_RACER = textwrap.dedent(
    """
    import sys
    import numpy as np
    import ckptstore
    root, who = sys.argv[1], int(sys.argv[2])
    state = {"who": who, "data": np.full(200_000, who, np.int64), "small": np.arange(who + 1)}
    print("ready", flush=True)
    sys.stdin.readline()
    try:
        info = ckptstore.save(root, state, step=7)
    except ckptstore.CommitConflictError:
        print("conflict", flush=True)
    else:
        print("ok", info.attempt, flush=True)
    """
)

#: A put-if-absent of ``race/object`` (``who`` repeated ``size`` times) straight to the store,
#: so an object over the store's multipart threshold races as a multipart upload.
CREATE_RACER = textwrap.dedent(
    """
    import asyncio, sys
    from ckptstore.errors import AlreadyExistsError
    from ckptstore.store.registry import open_store
    url, who, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

    async def main() -> None:
        async with open_store(url) as store:
            data = bytes([who]) * size
            print("ready", flush=True)
            await asyncio.to_thread(sys.stdin.readline)
            try:
                await store.put("race/object", data, mode="create")
            except AlreadyExistsError:
                print("conflict", flush=True)
            else:
                print("ok", who, flush=True)

    asyncio.run(main())
    """
)


def race(code: str, argvs: list[list[str]], *, timeout: float = 120.0) -> list[list[str]]:
    """Start one child per argument list, wait until all are ready, release them together,
    and return the words each printed after ``ready``."""
    env = {**os.environ, "PYTHONPATH": python_path()}
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", code, *argv],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for argv in argvs
    ]
    try:
        for racer in racers:
            assert racer.stdout is not None
            assert racer.stdout.readline().strip() == "ready"
        for racer in racers:  # release them together
            assert racer.stdin is not None
            racer.stdin.write("go\n")
            racer.stdin.flush()
        return [racer.communicate(timeout=timeout)[0].split() for racer in racers]
    finally:
        for racer in racers:
            if racer.poll() is None:
                racer.kill()
                racer.wait()


def one_winner(outputs: list[list[str]]) -> tuple[int, str]:
    """The index of the one child that won and what it printed after ``ok``; every other
    child must have lost with a conflict."""
    winners = [(i, out) for i, out in enumerate(outputs) if out[:1] == ["ok"]]
    assert len(winners) == 1, outputs
    assert sum(out == ["conflict"] for out in outputs) == len(outputs) - 1, outputs
    who, (_ok, said) = winners[0]
    return who, said
