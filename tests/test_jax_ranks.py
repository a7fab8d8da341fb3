"""JAX multi-process saves and loads: N real processes joined by ``jax.distributed`` on
127.0.0.1, 8 CPU devices in all, save arrays sharded and replicated across the processes
through ``ckptstore.distributed.save`` (its collectives: the coordination service's key-value
store, :class:`~ckptstore.manager.jax_collectives.JaxCollectives`), and another number of
processes loads them onto another mesh and replicated, bit-exact. A process SIGKILLed mid-save
leaves no step and the others a clear error.

Each test starts N copies of tests/jax_ranks.py (see tests/multirank.py). 2 and 4 processes
on local disk run by default; 8 processes and SeaweedFS are marked slow.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("jax")

import ckptstore
from ckptstore import background
from ckptstore.store.registry import open_store
from tests.multirank import Target, assert_all_ok, run_and_sigkill, run_ranks

pytestmark = pytest.mark.jax

WORKER = Path(__file__).with_name("jax_ranks.py")
_ON_S3 = [pytest.mark.s3, pytest.mark.slow]


#: 2 processes on local disk by default; 4, and SeaweedFS, in the slow matrix
_SMALL_WORLDS = pytest.mark.parametrize(
    ("target", "world"),
    [
        pytest.param("local", 2, id="local-2"),
        pytest.param("local", 4, marks=pytest.mark.slow, id="local-4"),
        pytest.param("seaweedfs", 2, marks=_ON_S3, id="seaweedfs-2"),
    ],
    indirect=["target"],
)


def _env(target: Target, world: int) -> dict[str, str]:
    """Each of ``world`` processes gets ``8 / world`` CPU devices: 8 in the job."""
    return {
        **target.env(),
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={8 // world}",
        "JAX_PLATFORMS": "cpu",
    }


def _manifest(target: Target, step: int) -> ckptstore.Manifest:
    async def read() -> ckptstore.Manifest:
        async with open_store(target.base, **target.options) as store:
            return await ckptstore.aread_manifest(store, step)

    return background.run(read())


@pytest.mark.parametrize(
    ("target", "saving", "loading"),
    [
        pytest.param("local", 2, 4, id="local-2to4"),
        pytest.param("local", 4, 2, id="local-4to2"),
        pytest.param("local", 8, 2, marks=pytest.mark.slow, id="local-8to2"),
        pytest.param("seaweedfs", 4, 2, marks=_ON_S3, id="seaweedfs-4to2"),
    ],
    indirect=["target"],
)
def test_arrays_across_processes_save_once_and_load_onto_another_mesh(
    target: Target, saving: int, loading: int, tmp_path: Path
) -> None:
    from tests.jax_ranks import full

    logs = tmp_path / "logs"
    saved = assert_all_ok(
        run_ranks(WORKER, saving, "save", target.base, "3", logs=logs, env=_env(target, saving))
    )
    assert len({result["attempt"] for result in saved}) == 1  # one commit, on every process
    for result in saved:
        assert "ckptstore.distributed.save" in result["refused"]  # ckptstore.save says how
        assert result["left"] == 0  # the collectives' keys are gone from the coordinator

    manifest = _manifest(target, 3)
    assert manifest.chunks is not None
    chunks = manifest.chunks
    boxes = {
        manifest.paths[leaf]: sorted(tuple(chunks.start[c]) for c in rows)
        for leaf, rows in chunks.by_leaf.items()
    }
    # x: the 8 boxes of the 4 x 2 mesh; y: 2 boxes, each on 4 devices (of different
    # processes), written once; r, replicated everywhere, is one whole leaf
    assert {path: len(starts) for path, starts in boxes.items()} == {"x": 8, "y": 2}
    assert all(len(set(starts)) == len(starts) for starts in boxes.values())
    arrays = full()
    for leaf, rows in chunks.by_leaf.items():
        itemsize = arrays[manifest.paths[leaf]].itemsize
        assert (
            sum(math.prod(chunks.shape[c]) * itemsize for c in rows) == manifest.leaf_length[leaf]
        )
    assert manifest.leaf_object[manifest.paths.index("r")] >= 0
    # the processes wrote the objects the manifest names and nothing more: no replica twice
    written = sum(result["written"] for result in saved)
    data = sum(manifest.object_lengths)
    assert data <= written < data + 64 * 1024  # plus the manifest and the attempt record
    assert data < sum(a.nbytes for a in arrays.values()) + 64 * 1024

    loaded = assert_all_ok(
        run_ranks(WORKER, loading, "load", target.base, "3", logs=logs, env=_env(target, loading))
    )
    for rank, result in enumerate(loaded):
        for name in ("2x4", "replicated"):
            load = result[name]
            assert load["exact"] is True, (rank, name)
            assert load["sharding"] is True, (rank, name)
            assert load["global"] is True, (rank, name)
            # only the 4 KiB blocks around the boxes this process's devices hold
            assert load["needed"] <= load["read"] <= 1.1 * load["needed"], (rank, name)

    # one process, no mesh: every leaf as a full array
    async def whole() -> dict[str, object]:
        async with open_store(target.base, **target.options) as store:
            return await ckptstore.aload(store, 3, target="numpy")

    got = background.run(whole())
    for key, array in arrays.items():
        value = got[key]
        assert isinstance(value, np.ndarray)
        assert value.dtype == array.dtype
        assert value.tobytes() == array.tobytes(), key
    assert got["step"] == 0


def test_read_once_broadcast_through_the_coordination_service(tmp_path: Path) -> None:
    target = Target(str(tmp_path / "ckpts"), {})
    logs = tmp_path / "logs"
    assert_all_ok(run_ranks(WORKER, 2, "save", target.base, "1", logs=logs, env=_env(target, 2)))
    loaded = assert_all_ok(
        run_ranks(WORKER, 4, "broadcast", target.base, "1", logs=logs, env=_env(target, 4))
    )
    assert [result["exact"] for result in loaded] == [True] * 4
    # the 8 KiB replicated leaf came from the store once and reached the others as bytes
    assert sorted(result["read"] for result in loaded) == [0, 0, 0, 8192]


@_SMALL_WORLDS
def test_process_sigkilled_mid_save_leaves_no_step_and_a_clear_error(
    target: Target, world: int, tmp_path: Path
) -> None:
    errors = run_and_sigkill(
        WORKER,
        world,
        "sigkill",
        target.base,
        "1",
        victim=1,
        logs=tmp_path / "logs",
        env=_env(target, world),
    )
    assert target.steps() == [1]  # step 2 never became visible
    for error in errors:
        assert error.startswith("CkptStoreError"), error
        assert "step 2 was not saved" in error, error
        assert "process 1 of the jax.distributed job did not reach" in error, error
    # the killed process had begun to write; every survivor removed its own objects
    keys = target.keys(target.base)
    assert {k.split("/")[2].split("-")[0] for k in keys if k.startswith("2/")} <= {"r1"}
    assert _manifest(target, 1).step == 1  # the previous step still loads


@_SMALL_WORLDS
def test_the_multi_rank_manager_saves_in_the_background_on_jax_collectives(
    target: Target, world: int, tmp_path: Path
) -> None:
    from tests.jax_ranks import own_part

    results = assert_all_ok(
        run_ranks(
            WORKER,
            world,
            "manager",
            target.base,
            "1",
            logs=tmp_path / "logs",
            env=_env(target, world),
        )
    )
    for result in results:
        assert result["in flight at return"] is True
        assert result["exact"] is True  # every process's part, as it was at its save call
        assert result["steps"] == [2, 3]  # max_to_keep=2
    assert target.steps() == [2, 3]

    async def read(step: int) -> dict[str, object]:
        async with open_store(target.base, **target.options) as store:
            return await ckptstore.aload(store, step, target="numpy")

    for step in (2, 3):
        got = background.run(read(step))
        assert got["step"] == step
        for rank in range(world):
            expected = own_part(rank, step)
            for key in (f"jax{rank}", f"host{rank}"):
                assert np.asarray(got[key]).tobytes() == np.asarray(expected[key]).tobytes()


def test_jax_collectives_need_jax_distributed() -> None:
    from ckptstore.manager.jax_collectives import JaxCollectives

    with pytest.raises(RuntimeError, match=r"jax\.distributed\.initialize"):
        JaxCollectives()


@pytest.mark.slow
def test_a_stalled_process_fails_the_others_within_the_collective_deadline(
    tmp_path: Path,
) -> None:
    """Issue 30, on JaxCollectives: process 1 stays alive and silent; process 0's save of
    step 2 fails within the collectives' timeout plus 10% (and a second for the save's own
    work before its first collective), naming process 1, and step 2 is not committed."""
    from tests.jax_ranks import STALL_TIMEOUT

    root = tmp_path / "ckpts"
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    outcomes = run_ranks(WORKER, 2, "stall", str(root), "1", logs=tmp_path / "logs", env=env)
    for rank, outcome in enumerate(outcomes):
        assert outcome.returncode == 0, f"process {rank}:\n{outcome.log[-4000:]}"
    assert outcomes[1].results[-1] == {"stalled": True}
    result = outcomes[0].results[-1]
    assert "process 1 of the jax.distributed job did not reach" in result["error"], result
    assert "step 2 was not saved" in result["error"], result
    assert result["seconds"] <= STALL_TIMEOUT * 1.1 + 1.0, result
    assert ckptstore.list_steps(root) == [1]
