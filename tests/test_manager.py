"""CheckpointManager: async saves of torch and JAX states, retention, crashes, restore."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptstore
from ckptstore import CommitConflictError, NotFoundError, StoreError
from ckptstore.layout.manifest import Manifest
from ckptstore.manager import CheckpointManager
from ckptstore.store.memory import MemoryStore
from ckptstore.store.wrappers import Fault, FaultStore
from tests.children import python_path


def bits(array: Any) -> bytes:
    if type(array).__module__.startswith("torch"):
        import torch

        t = array.detach().cpu().contiguous()
        return bytes(t.view(-1).view(torch.uint8).numpy())
    return np.ascontiguousarray(np.asarray(array)).tobytes()


def assert_same_state(got: Any, want: Any, path: str = "") -> None:
    """Same structure, same leaf types, arrays bit-exact (dtype, shape, bytes)."""
    if isinstance(want, dict):
        assert isinstance(got, dict), path
        assert list(got) == list(want), path
        for key in want:
            assert_same_state(got[key], want[key], f"{path}/{key}")
    elif isinstance(want, list | tuple):
        assert type(got) is type(want), path
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same_state(g, w, f"{path}/{i}")
    elif hasattr(want, "shape") and hasattr(want, "dtype"):
        assert type(got) is type(want), (path, type(got), type(want))
        assert got.dtype == want.dtype, path
        assert tuple(got.shape) == tuple(want.shape), path
        assert bits(got) == bits(want), path
    else:
        assert got == want, path
        assert type(got) is type(want), path


def memory_store(name: str) -> MemoryStore:
    return MemoryStore.from_url(f"memory://{name}-{time.monotonic_ns()}")  # type: ignore[return-value]


# -- torch ------------------------------------------------------------------------------


def torch_training_state(seed: int = 0) -> tuple[Any, Any]:
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.ReLU(), torch.nn.Linear(64, 8)
    )
    model[3].to(torch.bfloat16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(3):
        x = torch.randn(16, 32)
        out = model[3](model[:3](x).to(torch.bfloat16)).float()
        loss = out.square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, opt


@pytest.mark.torch
def test_torch_model_and_adam_state_round_trip_bit_exact(tmp_path: Path) -> None:
    import torch

    model, opt = torch_training_state()
    state = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "step": 3,
        "rng": torch.get_rng_state(),
    }
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        assert mgr.save(3, state, metadata={"epoch": 1})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [3]
        restored = mgr.restore()
        assert mgr.metadata(3) == {"epoch": 1}
    assert_same_state(restored, state)
    assert restored["model"]["3.weight"].dtype == torch.bfloat16
    # the optimizer's int-keyed state and param groups load back into a fresh optimizer
    fresh_model, fresh_opt = torch_training_state(seed=1)
    fresh_model.load_state_dict(restored["model"])
    fresh_opt.load_state_dict(restored["optim"])
    for p, q in zip(fresh_model.parameters(), model.parameters(), strict=True):
        assert bits(p) == bits(q)
        assert bits(fresh_opt.state[p]["exp_avg_sq"]) == bits(opt.state[q]["exp_avg_sq"])


@pytest.mark.torch
def test_requires_grad_and_parameters_restored_as_saved(tmp_path: Path) -> None:
    import torch

    state = {
        "p": torch.nn.Parameter(torch.randn(3, 3)),
        "frozen": torch.nn.Parameter(torch.randn(2), requires_grad=False),
        "t": torch.randn(4).requires_grad_(),
        "buf": torch.ones(2, dtype=torch.float16),
    }
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(0, state)
        out = mgr.restore(0)
    assert isinstance(out["p"], torch.nn.Parameter)
    assert out["p"].requires_grad
    assert isinstance(out["frozen"], torch.nn.Parameter)
    assert not out["frozen"].requires_grad
    assert out["t"].requires_grad
    assert not isinstance(out["t"], torch.nn.Parameter)
    assert not out["buf"].requires_grad
    assert bits(out["p"]) == bits(state["p"])


@pytest.mark.torch
def test_mutating_tensors_after_save_returns_does_not_change_what_is_written() -> None:
    import torch

    # every data write waits 0.3 s, so the mutation surely happens before the bytes are written
    store = FaultStore(
        memory_store("mut"), [Fault(ops=frozenset({"put", "put_part"}), latency=0.3)]
    )
    weights = {"w": torch.randn(256, 256), "b": torch.randn(256).to(torch.bfloat16)}
    expected = {k: v.clone() for k, v in weights.items()}
    with CheckpointManager(store) as mgr:
        mgr.save(1, weights)
        assert mgr.last_handle is not None
        assert not mgr.last_handle.done()
        with torch.no_grad():
            weights["w"].fill_(7.0)
            weights["b"].zero_()
        del weights
        restored = mgr.restore(1)
    assert_same_state(restored, expected)


@pytest.mark.torch
def test_background_write_error_is_raised_on_next_save_and_step_stays_invisible() -> None:
    import torch

    inner = memory_store("err")
    fault = Fault(ops=frozenset({"put", "put_part"}), error=StoreError("injected"), key=r"^2/")
    store = FaultStore(inner, [fault])
    state = {"w": torch.arange(10.0)}
    mgr = CheckpointManager(store)
    mgr.save(1, state)
    mgr.save(2, state)  # fails in the background
    with pytest.raises(StoreError, match="injected"):
        mgr.save(3, state)
    assert mgr.all_steps() == [1]  # step 2 never became visible; step 3 was not started
    mgr.save(2, state)  # a retry of the failed step goes through the fault again
    with pytest.raises(StoreError, match="injected"):
        mgr.wait_until_finished()
    mgr.save(3, state)
    mgr.wait_until_finished()
    assert mgr.all_steps() == [1, 3]
    with pytest.raises(CommitConflictError, match="newest step of this root is 3"):
        mgr.save(2, state)  # now below the newest step: refused in the call itself
    mgr.close()


def test_close_raises_an_unreported_background_error() -> None:
    store = FaultStore(memory_store("close"), [Fault(ops=frozenset({"put"}), error=OSError("x"))])
    mgr = CheckpointManager(store)
    mgr.save(0, {"a": np.ones(3)})
    with pytest.raises(OSError, match="x"):
        mgr.close()
    with pytest.raises(RuntimeError, match="closed"):
        mgr.save(1, {"a": np.ones(3)})


def test_unstorable_leaves_and_metadata_fail_the_save_call_itself() -> None:
    with CheckpointManager(memory_store("bad")) as mgr:
        with pytest.raises(TypeError, match="bad/leaf"):
            mgr.save(0, {"bad": {"leaf": object()}, "ok": np.ones(4)})
        with pytest.raises(TypeError, match="JSON"):
            mgr.save(0, {"ok": np.ones(4)}, metadata={"when": object()})
        assert mgr._stager.pool.stats().lent_bytes == 0  # the staged buffer went back
        mgr.save(0, {"ok": np.ones(4)})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [0]


# -- JAX --------------------------------------------------------------------------------


@pytest.mark.jax
def test_jax_pytree_round_trip_bit_exact(tmp_path: Path) -> None:
    import jax
    import jax.numpy as jnp

    key = jax.random.PRNGKey(0)
    params = {
        "dense": {"w": jax.random.normal(key, (64, 32)), "b": jnp.zeros(32, jnp.bfloat16)},
        "layers": [jax.random.normal(key, (8,)).astype(jnp.bfloat16), jnp.arange(5)],
        "count": jnp.int32(7),
        "name": "model",
    }
    with CheckpointManager(f"file://{tmp_path}") as mgr:
        mgr.save(10, params)
        out = mgr.restore()
    assert_same_state(out["dense"], params["dense"])
    assert isinstance(out["layers"][0], jax.Array)
    assert bits(out["layers"][0]) == bits(params["layers"][0])
    assert out["name"] == "model"
    assert int(out["count"]) == 7


@pytest.mark.jax
@pytest.mark.torch
def test_restore_into_a_different_target_type(tmp_path: Path) -> None:
    import jax
    import jax.numpy as jnp
    import torch

    saved = {"w": torch.randn(6, 4).to(torch.bfloat16), "n": torch.arange(3)}
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(0, saved)
        as_numpy = mgr.restore(0, target="numpy")
        as_jax = mgr.restore(0, target={"w": jnp.zeros((6, 4), jnp.bfloat16), "n": None})
        only_w = mgr.restore(0, keys=["w"], target="jax")
        saved_jax = jnp.linspace(0, 1, 24).reshape(6, 4)
        mgr.save(1, {"w": saved_jax})
        as_torch = mgr.restore(1, target={"w": torch.empty(6, 4)})
        with pytest.raises(ValueError, match="shape"):
            mgr.restore(1, target={"w": torch.empty(4, 6)})
    assert isinstance(as_numpy["w"], np.ndarray)
    assert bits(as_numpy["w"]) == bits(saved["w"])
    assert isinstance(as_jax["w"], jax.Array)
    assert bits(as_jax["w"]) == bits(saved["w"])
    assert isinstance(as_jax["n"], torch.Tensor)  # not named by the target: as saved
    assert set(only_w) == {"w"}
    assert isinstance(only_w["w"], jax.Array)
    assert isinstance(as_torch["w"], torch.Tensor)
    assert bits(as_torch["w"]) == bits(saved_jax)


# -- when to save, retention --------------------------------------------------------------


def saves(mgr: CheckpointManager, steps: range | list[int], **kwargs: Any) -> None:
    for step in steps:
        mgr.save(step, {"x": np.full(4, step)}, **kwargs)
    mgr.wait_until_finished()


def test_save_interval_and_force() -> None:
    with CheckpointManager(memory_store("interval"), save_interval_steps=5) as mgr:
        started = [mgr.save(s, {"x": np.ones(2)}) for s in range(12)]
        assert mgr.save(13, {"x": np.ones(2)}, force=True)
        mgr.wait_until_finished()
        assert started == [s % 5 == 0 for s in range(12)]
        assert mgr.all_steps() == [0, 5, 10, 13]
        assert mgr.latest_step() == 13


def test_max_to_keep_keeps_the_newest() -> None:
    with CheckpointManager(memory_store("keep"), max_to_keep=3) as mgr:
        saves(mgr, range(7))
        assert mgr.all_steps() == [4, 5, 6]
        assert int(mgr.restore(4)["x"][0]) == 4
        with pytest.raises(NotFoundError):
            mgr.restore(3)


@pytest.mark.parametrize("manifest_bytes", [0, 3_500_000], ids=["small", "3.5-MB"])
def test_retention_parses_each_manifest_once(
    monkeypatch: pytest.MonkeyPatch, manifest_bytes: int
) -> None:
    """Retention reads the kept steps' manifests every save (to decide, and again after
    marking), and each save reads its base's: each manifest's bytes are parsed and
    validated once (Manifest.parse_shared), not at every read; with manifests as large as
    a 20,000-tensor torch state's too (3.5 MB, here made of metadata), three of which the
    process's cache once could not hold."""
    parsed: list[int | None] = []
    parse = Manifest.parse.__func__  # type: ignore[attr-defined]

    def counted(cls: type[Manifest], data: bytes, **kwargs: Any) -> Manifest:
        parsed.append(kwargs.get("step"))
        return parse(cls, data, **kwargs)  # type: ignore[no-any-return]

    monkeypatch.setattr(Manifest, "parse", classmethod(counted))
    with CheckpointManager(memory_store("parse-once"), max_to_keep=2) as mgr:
        for step in range(8):
            mgr.save(step, {"x": np.full(4, step)}, metadata="m" * manifest_bytes)
            mgr.wait_until_finished()
        assert mgr.all_steps() == [6, 7]
        assert int(mgr.restore(6)["x"][0]) == 6
    # once per step, and once more for the restore, which reads its own (Manifest.parse)
    assert sorted(parsed) == sorted([*range(8), 6]), parsed


def test_metrics_a_user_changes_do_not_reach_another_manager(tmp_path: Path) -> None:
    """The manifests retention parses once are shared (Manifest.parse_shared); the metrics
    a manager hands out come from a manifest of their own."""
    with CheckpointManager(tmp_path, max_to_keep=3) as mgr:
        mgr.save(1, {"x": np.ones(2)}, metrics={"loss": 0.5})
    with CheckpointManager(tmp_path, max_to_keep=3) as first:
        first.metrics(1)["loss"] = 99.0
    with CheckpointManager(tmp_path, max_to_keep=3) as second:
        assert second.metrics(1) == {"loss": 0.5}


def test_keep_period_keeps_every_nth_forever() -> None:
    with CheckpointManager(memory_store("period"), max_to_keep=2, keep_period=4) as mgr:
        saves(mgr, range(11))
        assert mgr.all_steps() == [0, 4, 8, 9, 10]


def test_best_fn_keeps_the_best_and_the_newest() -> None:
    losses = {0: 5.0, 1: 1.0, 2: 4.0, 3: 0.5, 4: 3.0, 5: 9.0}
    with CheckpointManager(
        memory_store("best"), max_to_keep=2, best_fn=lambda m: m["loss"], best_mode="min"
    ) as mgr:
        for step, loss in losses.items():
            mgr.save(step, {"x": np.ones(1)}, metrics={"loss": loss})
        mgr.wait_until_finished()
        # the two lowest losses (3, 1) plus the newest step (5), never deleted
        assert mgr.all_steps() == [1, 3, 5]
        assert mgr.metrics(3) == {"loss": 0.5}


def test_keep_time_interval_keeps_one_step_per_interval() -> None:
    with CheckpointManager(memory_store("time"), max_to_keep=1, keep_time_interval=100) as mgr:
        clock = iter([0.0, 30.0, 60.0, 110.0, 150.0, 230.0])
        mgr._clock = lambda: next(clock)
        saves(mgr, range(6))
        # kept by time: step 0 (t=0), step 3 (t=110, 110 s after step 0); step 5 is the newest
        assert mgr.all_steps() == [0, 3, 5]


def test_retention_reads_metrics_of_steps_saved_by_an_earlier_manager() -> None:
    store = memory_store("reopen")
    kwargs: dict[str, Any] = {"max_to_keep": 1, "best_fn": lambda m: m, "best_mode": "max"}
    with CheckpointManager(store, **kwargs) as mgr:
        mgr.save(0, {"x": np.ones(1)}, metrics=10.0)
    with CheckpointManager(store, **kwargs) as mgr:
        mgr.save(1, {"x": np.ones(1)}, metrics=1.0)
        mgr.save(2, {"x": np.ones(1)}, metrics=2.0)
        mgr.wait_until_finished()
        assert mgr.all_steps() == [0, 2]  # 0 is best (read from its manifest), 2 is newest


def test_delete_and_metadata() -> None:
    with CheckpointManager(memory_store("delete")) as mgr:
        saves(mgr, [1, 2], metadata={"note": "hi"})
        assert mgr.metadata(2) == {"note": "hi"}
        mgr.delete(1)
        assert mgr.all_steps() == [2]
        with pytest.raises(NotFoundError):
            mgr.metadata(1)


def test_restore_with_nothing_saved_says_so() -> None:
    with CheckpointManager(memory_store("empty")) as mgr:
        assert mgr.latest_step() is None
        with pytest.raises(NotFoundError, match="no committed checkpoint"):
            mgr.restore()


def test_sync_mode_commits_before_returning() -> None:
    with CheckpointManager(memory_store("sync"), async_save=False) as mgr:
        mgr.save(0, {"x": np.ones(3)})
        assert mgr.last_handle is not None
        assert mgr.last_handle.done()


# -- crashes ------------------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import sys, numpy as np
    from ckptstore.manager import CheckpointManager
    from ckptstore.store import open_store
    from ckptstore.store.wrappers import Fault, FaultStore
    root, phase = sys.argv[1], sys.argv[2]
    state = lambda s: {{"w": np.full(1 << 16, s, np.float32), "s": s}}
    faults = []
    if phase == "mid-save":      # data of step 3 crawls: the parent kills us while it writes
        faults = [Fault(ops=frozenset({{"put", "put_part"}}), latency=60, key=r"^3/attempt")]
    elif phase == "retention":   # deletes crawl: killed after step 3 committed, before cleanup
        # (retention deletes a step's manifest first; a save's own lease delete runs freely)
        faults = [Fault(ops=frozenset({{"delete"}}), latency=60, key="manifest.json")]
    store = FaultStore(open_store(root), faults)
    mgr = CheckpointManager(store, max_to_keep=2)
    for step in (1, 2):
        mgr.save(step, state(step))
    mgr.wait_until_finished()
    print("saved", flush=True)
    mgr.save(3, state(3))
    with open(sys.argv[3], "w") as marker:  # staged; the write goes on in the background
        marker.write("staged 3")
    mgr.wait_until_finished()
    print("finished", flush=True)
    """
)


def run_child_until(
    root: Path, marker: Path, phase: str, ready: Any, deadline_s: float = 60
) -> None:
    """Start the child, wait until ``ready()`` holds, then SIGKILL it."""
    env = {**os.environ, "PYTHONPATH": python_path()}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD.format(), str(root), phase, str(marker)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + deadline_s
        while not ready():
            if child.poll() is not None:
                out, err = child.communicate()
                pytest.fail(f"child exited early ({child.returncode}): {out!r} {err!r}")
            if time.monotonic() > deadline:
                pytest.fail("child did not reach the crash point in time")
            time.sleep(0.02)
        os.kill(child.pid, signal.SIGKILL)
        child.communicate(timeout=10)
        assert child.returncode == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
        child.communicate()


def test_crash_mid_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    root, marker = tmp_path / "run", tmp_path / "marker"

    def writing_step_3() -> bool:
        return marker.exists() and marker.read_text() == "staged 3"

    run_child_until(root, marker, "mid-save", writing_step_3)
    with CheckpointManager(root, max_to_keep=2) as mgr:
        assert mgr.all_steps() == [1, 2]
        restored = mgr.restore()
        assert restored["s"] == 2
        assert np.array_equal(restored["w"], np.full(1 << 16, 2, np.float32))
        mgr.save(3, {"w": np.zeros(4), "s": 3})  # the step the crash lost can be saved again
        mgr.wait_until_finished()
        assert mgr.all_steps() == [2, 3]


def test_crash_between_commit_and_retention_is_cleaned_up_by_the_next_save(
    tmp_path: Path,
) -> None:
    root, marker = tmp_path / "run", tmp_path / "marker"
    run_child_until(root, marker, "retention", lambda: (root / "3" / "manifest.json").exists())
    with CheckpointManager(root, max_to_keep=2) as mgr:
        assert mgr.all_steps() == [1, 2, 3]  # committed, retention never ran
        for step in (1, 2, 3):
            assert mgr.restore(step)["s"] == step
        mgr.save(4, {"w": np.zeros(4), "s": 4})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [3, 4]


def test_failed_retention_is_reported_and_keeps_the_new_step() -> None:
    store = FaultStore(
        memory_store("ret"),
        # retention's first delete (a step's manifest); a save's own lease delete runs freely
        [
            Fault(
                ops=frozenset({"delete"}),
                error=StoreError("delete refused"),
                times=1,
                key="manifest.json",
            )
        ],
    )
    with CheckpointManager(store, max_to_keep=1) as mgr:
        mgr.save(1, {"x": np.ones(1)})
        mgr.save(2, {"x": np.ones(1)})
        with pytest.raises(StoreError, match="delete refused"):
            mgr.wait_until_finished()
        assert 2 in mgr.all_steps()
        mgr.save(3, {"x": np.ones(1)})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [3]


def test_commit_conflict_is_reported() -> None:
    store = memory_store("conflict")
    with CheckpointManager(store) as mgr:
        mgr.save(1, {"x": np.ones(1)})
        mgr.wait_until_finished()
        with pytest.raises(CommitConflictError, match="newest step of this root is 1"):
            mgr.save(1, {"x": np.zeros(1)}, force=True)  # its own step: refused in the call
        # another writer commits step 2 after this manager looked: the commit protocol
        # refuses the second commit, and the background error says so
        ckptstore.save(store, {"x": np.full(1, 2.0)}, step=2)
        mgr.save(2, {"x": np.zeros(1)})
        with pytest.raises(CommitConflictError, match="already committed"):
            mgr.wait_until_finished()
        assert np.array_equal(mgr.restore(1)["x"], np.ones(1))
        assert np.array_equal(mgr.restore(2)["x"], np.full(1, 2.0))


def _run_script(code: str, root: Path, *, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter with ``root`` as its argument, as a user's script."""
    return subprocess.run(
        [sys.executable, "-c", code, str(root)],
        env={**os.environ, "PYTHONPATH": python_path()},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


_NEVER_CLOSED = textwrap.dedent(
    """
    import sys
    import numpy as np
    from ckptstore.manager import CheckpointManager
    from ckptstore.store.local import LocalStore
    from ckptstore.store.wrappers import Fault, FaultStore

    # every put waits: the last save is still writing when the script ends
    store = FaultStore(LocalStore(sys.argv[1]), [Fault(frozenset({"put"}), latency=0.2)])
    mgr = CheckpointManager(store, max_to_keep=3)
    for step in range(5):
        mgr.save(step, {"w": np.full(1000, step, np.float32)})
    assert mgr.last_handle is not None
    print("last save done at exit:", mgr.last_handle.done(), flush=True)
    """
)


def test_a_manager_never_closed_still_commits_every_save_at_exit(tmp_path: Path) -> None:
    root = tmp_path / "run"
    out = _run_script(_NEVER_CLOSED, root, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "last save done at exit: False" in out.stdout  # the exit hook had work to do
    assert out.stderr == ""  # no "Task was destroyed but it is pending!", no traceback
    with CheckpointManager(root) as mgr:
        assert mgr.all_steps() == [2, 3, 4]
        assert mgr.restore(4)["w"].tolist() == [4.0] * 1000


_ASYNC_SAVED_NEVER_WAITED = textwrap.dedent(
    """
    import sys
    import torch
    import torch.distributed.checkpoint as dcp
    import ckptstore.dcp

    torch.manual_seed(0)
    model = torch.nn.Linear(512, 512)
    # DCP runs the save in a pool that the interpreter joins at exit; the script never waits
    dcp.async_save({"model": model.state_dict()}, storage_writer=ckptstore.dcp.Writer(sys.argv[1]))
    """
)


@pytest.mark.torch
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_an_async_dcp_save_never_waited_for_is_committed_at_exit(tmp_path: Path) -> None:
    """Once the main thread ends, every ThreadPoolExecutor refuses new work: the save that
    ``dcp.async_save`` runs in its pool, joined at exit, failed in ckptstore's own pools,
    unseen, and the step was lost. ckptstore's pools keep working until it is done."""
    torch = pytest.importorskip("torch")
    root = tmp_path / "run"
    out = _run_script(_ASYNC_SAVED_NEVER_WAITED, root, timeout=120)
    assert out.returncode == 0, out.stderr
    assert ckptstore.list_steps(root) == [0]
    import torch.distributed.checkpoint as dcp

    from ckptstore.dcp import Reader

    torch.manual_seed(0)
    expected = torch.nn.Linear(512, 512).state_dict()
    loaded = {"model": {k: torch.zeros_like(v) for k, v in expected.items()}}
    dcp.load(loaded, storage_reader=Reader(root))
    assert all(torch.equal(loaded["model"][k], v) for k, v in expected.items())


_FORKS_WHILE_SAVING = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    from ckptstore.manager import CheckpointManager
    from ckptstore.store.local import LocalStore
    from ckptstore.store.wrappers import Fault, FaultStore

    store = FaultStore(LocalStore(sys.argv[1]), [Fault(frozenset({"put"}), latency=0.2)])
    mgr = CheckpointManager(store)
    mgr.save(1, {"w": np.ones(1000, np.float32)})
    child = os.fork()
    if child == 0:  # a data-loader worker, say: it ends without touching the manager
        sys.exit(0)
    _, status = os.waitpid(child, 0)
    print("child exit", os.waitstatus_to_exitcode(status), flush=True)
    """
)


def test_a_forked_child_leaves_its_parents_manager_alone_at_exit(tmp_path: Path) -> None:
    root = tmp_path / "run"
    out = _run_script(_FORKS_WHILE_SAVING, root, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "child exit 0" in out.stdout, out.stdout + out.stderr
    assert "ckptstore:" not in out.stderr  # the child tried no close of the parent's manager
    with CheckpointManager(root) as mgr:
        assert mgr.all_steps() == [1]  # the parent's exit committed it
