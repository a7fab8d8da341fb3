"""Streaming restore: the call returns once the first part is in place, the rest is read in
the background, and every fence (a torch optimizer step, ``fence()``, a save) waits for it.

What happens before the fence is decided by the test, not the scheduler: a :class:`ReadGate`
holds every read of the objects that hold only optimizer state until the test releases it,
so a test sees the restore return while those bytes are provably not read yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptstore
from ckptstore import CorruptCheckpointError, NotFoundError
from ckptstore.errors import DeadlineExceededError
from ckptstore.manager import CheckpointManager
from ckptstore.pipeline import streaming
from ckptstore.store import open_store
from ckptstore.store.base import Store
from ckptstore.store.wrappers import StoreWrapper

torch = pytest.importorskip("torch")

#: How long a test waits for something that should happen at once, before it fails.
DEADLINE = 30.0


class ReadGate(StoreWrapper):
    """Holds the reads of ``keys`` until :meth:`release`; :attr:`held` is set once one waits."""

    def __init__(self, inner: Store, keys: set[str]) -> None:
        super().__init__(inner)
        self.keys = keys
        self.held = threading.Event()
        self.released = threading.Event()
        self.fail: Exception | None = None

    def release(self) -> None:
        self.released.set()

    async def _hook(self, op: str, key: str, nbytes: int) -> None:
        if op in ("get", "read") and key in self.keys:
            self.held.set()
            if not await asyncio.to_thread(self.released.wait, DEADLINE):
                raise TimeoutError("the test never released the held read")
            if self.fail is not None:
                raise self.fail


@pytest.fixture(autouse=True)
def _nothing_pending() -> Any:
    yield
    with contextlib.suppress(Exception):
        streaming.wait_all()
    assert not streaming.pending()


def _model() -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256)
    )


def _batch() -> tuple[Any, Any]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(8, 256, generator=gen), torch.randn(8, 256, generator=gen)


def _train(model: Any, opt: Any, steps: int) -> None:
    x, y = _batch()
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _trained() -> tuple[Any, Any]:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    _train(model, opt, 3)
    return model, opt


def _save(root: Path) -> dict[str, Any]:
    model, opt = _trained()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 7}
    ckptstore.save(root, state, step=3)
    return state


def _optimizer_only_keys(root: Path, step: int = 3) -> set[str]:
    """Keys of the objects of ``step`` that hold nothing but optimizer state."""
    manifest = ckptstore.read_manifest(root, step)
    by_object: dict[int, list[str]] = {}
    for path, obj in zip(manifest.paths, manifest.leaf_object, strict=True):
        by_object.setdefault(obj, []).append(path)
    keys = {
        manifest.object_key(obj)
        for obj, paths in by_object.items()
        if obj >= 0 and all(streaming.is_optimizer_path(p) for p in paths)
    }
    assert keys, "the test state must put some optimizer leaves in objects of their own"
    return keys


def _resume(state: dict[str, Any]) -> tuple[Any, Any]:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    return model, opt


def _after_one_step(model: Any, opt: Any) -> list[Any]:
    _train(model, opt, 1)
    return [p.detach().clone() for p in model.parameters()]


def test_the_restore_returns_before_the_optimizer_state_is_read(tmp_path: Path) -> None:
    saved = _save(tmp_path)
    gate = ReadGate(open_store(str(tmp_path)), _optimizer_only_keys(tmp_path))
    state = ckptstore.load(gate, 3, stream=True)
    # returned while the optimizer's own objects are held: the model is in place
    assert not gate.released.is_set()
    assert streaming.pending()
    for name, tensor in saved["model"].items():
        assert torch.equal(state["model"][name], tensor)
    assert state["epoch"] == 7
    gate.release()
    ckptstore.fence()
    assert not streaming.pending()
    for index, moments in saved["optim"]["state"].items():
        for name, tensor in moments.items():
            assert torch.equal(state["optim"]["state"][index][name], tensor), (index, name)


def test_the_optimizer_step_waits_for_the_background_part(tmp_path: Path) -> None:
    _save(tmp_path)
    full = ckptstore.load(tmp_path, 3)
    expected = _after_one_step(*_resume(full))

    gate = ReadGate(open_store(str(tmp_path)), _optimizer_only_keys(tmp_path))
    state = ckptstore.load(gate, 3, stream=True)
    model, opt = _resume(state)
    x, y = _batch()
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()  # needs only the weights
    assert gate.held.wait(DEADLINE)
    assert not gate.released.is_set()
    timer = threading.Timer(0.3, gate.release)
    timer.start()
    began = time.monotonic()
    opt.step()  # the pre-hook waits for the held reads, then the step sees their values
    assert time.monotonic() - began >= 0.2
    timer.join()
    got = [p.detach().clone() for p in model.parameters()]
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)  # bit-exact with a step after a full restore


def test_the_default_first_part_is_everything_but_the_optimizer(tmp_path: Path) -> None:
    _save(tmp_path)
    manifest = ckptstore.read_manifest(tmp_path, 3)
    store = open_store(str(tmp_path))
    try:
        selection = asyncio.run(_select(store, ckptstore.pipeline.restore.request(stream=True)))
    finally:
        asyncio.run(store.close())
    later = {manifest.paths[i] for i in selection.later}
    # every non-scalar optimizer leaf, nothing else (the 0-d "step" counters come first)
    assert later == {
        p
        for i, p in enumerate(manifest.paths)
        if p.startswith("optim/") and len(manifest.shapes[i]) > 0
    }
    assert later


async def _select(store: Store, asked: Any) -> Any:
    from ckptstore.pipeline.restore import select_step

    return await select_step(store, 3, asked)


def test_stream_keys_name_the_first_part(tmp_path: Path) -> None:
    saved = _save(tmp_path)
    keys = set(_optimizer_only_keys(tmp_path))
    gate = ReadGate(open_store(str(tmp_path)), keys)
    state = ckptstore.load(gate, 3, stream=["model/0.weight", "model/0.bias", "epoch"])
    assert torch.equal(state["model"]["0.weight"], saved["model"]["0.weight"])
    gate.release()
    ckptstore.fence()
    assert torch.equal(state["model"]["2.weight"], saved["model"]["2.weight"])
    assert state["epoch"] == 7


def test_bad_stream_arguments_fail_before_any_read(tmp_path: Path) -> None:
    _save(tmp_path)
    with pytest.raises(NotFoundError, match=r"'modle'.*stream="):
        ckptstore.load(tmp_path, 3, stream=["modle"])
    with pytest.raises(TypeError, match="stream is True"):
        ckptstore.load(tmp_path, 3, stream=5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="keys is empty"):
        ckptstore.load(tmp_path, 3, stream=[])
    assert not streaming.pending()


def _corrupt_optimizer_leaf(root: Path) -> str:
    """Flip a byte of the largest optimizer leaf's data; returns its path."""
    manifest = ckptstore.read_manifest(root, 3)
    leaf = max(
        (i for i, p in enumerate(manifest.paths) if streaming.is_optimizer_path(p)),
        key=lambda i: int(np.prod(manifest.shapes[i])),
    )
    obj = manifest.leaf_object[leaf]
    path = root / manifest.object_key(obj)
    data = bytearray(path.read_bytes())
    data[manifest.leaf_offset[leaf] + 100] ^= 0xFF
    path.write_bytes(bytes(data))
    return manifest.paths[leaf]


def test_a_corrupt_byte_of_the_background_part_is_raised_by_the_optimizer_step(
    tmp_path: Path,
) -> None:
    saved = _save(tmp_path)
    damaged = _corrupt_optimizer_leaf(tmp_path)
    state = ckptstore.load(tmp_path, 3, stream=True)  # the first part is intact
    assert torch.equal(state["model"]["0.weight"], saved["model"]["0.weight"])
    model, opt = _resume(state)
    _, moment, name = damaged.rsplit("/", 2)
    with pytest.raises(CorruptCheckpointError, match="background part of a streaming restore"):
        _train(model, opt, 1)
    # the arrays the background part was filling are NaN, not plausible numbers
    assert torch.isnan(state["optim"]["state"][int(moment)][name]).all()
    ckptstore.fence()  # raised once: a caller that handled it may go on


def test_a_save_waits_for_the_background_part(tmp_path: Path) -> None:
    saved = _save(tmp_path / "a")
    gate = ReadGate(open_store(str(tmp_path / "a")), _optimizer_only_keys(tmp_path / "a"))
    state = ckptstore.load(gate, 3, stream=True)
    threading.Timer(0.3, gate.release).start()
    ckptstore.save(tmp_path / "b", state, step=4)  # waits, then stages the filled state
    again = ckptstore.load(tmp_path / "b", 4)
    for index, moments in saved["optim"]["state"].items():
        for name, tensor in moments.items():
            assert torch.equal(again["optim"]["state"][index][name], tensor)


def test_the_manager_streams_and_fences(tmp_path: Path) -> None:
    model, opt = _trained()
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(3, {"model": model.state_dict(), "optim": opt.state_dict()})
        mgr.wait_until_finished()
        expected = _after_one_step(*_resume(mgr.restore(3)))
    gate = ReadGate(open_store(str(tmp_path)), _optimizer_only_keys(tmp_path))
    with CheckpointManager(gate) as mgr:
        state = mgr.restore(3, stream=True)
        assert gate.held.wait(DEADLINE)
        threading.Timer(0.2, gate.release).start()
        assert mgr.fence() is True  # it waited for the held reads
        assert mgr.fence() is False
        got = _after_one_step(*_resume(state))
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


def test_the_manager_close_waits_for_the_background_part(tmp_path: Path) -> None:
    _save(tmp_path)
    gate = ReadGate(open_store(str(tmp_path)), _optimizer_only_keys(tmp_path))
    mgr = CheckpointManager(gate)
    state = mgr.restore(3, stream=True)
    threading.Timer(0.3, gate.release).start()
    mgr.close()  # the reads end before the manager lets its store go
    assert not streaming.pending()
    assert not torch.isnan(state["optim"]["state"][0]["exp_avg"]).any()


def test_a_tiered_manager_streams_from_the_tier_it_read(tmp_path: Path) -> None:
    model, opt = _trained()
    with CheckpointManager(tmp_path / "remote", local=tmp_path / "local") as mgr:
        mgr.save(3, {"model": model.state_dict(), "optim": opt.state_dict()})
        mgr.wait_until_finished()
        state = mgr.restore(3, stream=True)
        assert mgr.last_restore is not None
        assert mgr.last_restore.tier == "local"
        mgr.fence()
    for name, tensor in opt.state_dict()["state"][0].items():
        assert torch.equal(state["optim"]["state"][0][name], tensor)


def test_a_tiered_background_part_falls_back_to_the_persistent_tier(tmp_path: Path) -> None:
    model, opt = _trained()
    with CheckpointManager(tmp_path / "remote", local=tmp_path / "local") as mgr:
        mgr.save(3, {"model": model.state_dict(), "optim": opt.state_dict()})
        mgr.wait_until_finished()
    damaged = _corrupt_optimizer_leaf(tmp_path / "local")  # only the local copy
    with CheckpointManager(tmp_path / "remote", local=tmp_path / "local") as mgr:
        state = mgr.restore(3, stream=True)
        assert mgr.last_restore is not None
        assert mgr.last_restore.tier == "local"  # its first part is intact
        mgr.fence()  # the rest came from the persistent tier, verified
    _, moment, name = damaged.rsplit("/", 2)
    expected = opt.state_dict()["state"][int(moment)][name]
    assert torch.equal(state["optim"]["state"][int(moment)][name], expected)
    for index, moments in opt.state_dict()["state"].items():
        for key, tensor in moments.items():
            assert torch.equal(state["optim"]["state"][index][key], tensor)


def test_the_background_part_is_bounded_by_the_restore_deadline(tmp_path: Path) -> None:
    _save(tmp_path)
    inner = open_store(str(tmp_path), restore_deadline=1.0)
    gate = ReadGate(inner, _optimizer_only_keys(tmp_path))
    state = ckptstore.load(gate, 3, stream=True)
    try:
        with pytest.raises(DeadlineExceededError, match="background part"):
            ckptstore.fence()
    finally:
        gate.release()
    assert torch.isnan(state["optim"]["state"][0]["exp_avg"]).all()


def test_into_arrays_are_filled_by_the_background_part(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    saved = {
        "params": {"w": rng.standard_normal((512, 1024), dtype=np.float32)},
        "opt_state": {"mu": rng.standard_normal((512, 1024), dtype=np.float32)},
    }
    ckptstore.save(tmp_path, saved, step=1)
    into = {
        "params": {"w": np.zeros((512, 1024), np.float32)},
        "opt_state": {"mu": np.zeros((512, 1024), np.float32)},
    }
    state = ckptstore.load(tmp_path, 1, into=into, stream=True)
    assert state["opt_state"]["mu"] is into["opt_state"]["mu"]
    ckptstore.fence()
    np.testing.assert_array_equal(into["opt_state"]["mu"], saved["opt_state"]["mu"])
    np.testing.assert_array_equal(into["params"]["w"], saved["params"]["w"])


def test_a_dtype_changing_target_is_copied_into_after_the_read(tmp_path: Path) -> None:
    saved = _save(tmp_path)
    target = {
        "model": {k: v.to(torch.float64) for k, v in saved["model"].items()},
        "optim": {
            "state": {
                i: {k: v.to(torch.float64) for k, v in m.items()}
                for i, m in saved["optim"]["state"].items()
            }
        },
    }
    state = ckptstore.load(tmp_path, 3, target=target, stream=True)
    ckptstore.fence()
    got = state["optim"]["state"][0]["exp_avg"]
    assert got.dtype == torch.float64
    assert torch.equal(got, saved["optim"]["state"][0]["exp_avg"].to(torch.float64))


def test_jax_leaves_of_the_background_part_are_placeholders_until_the_fence(
    tmp_path: Path,
) -> None:
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    rng = np.random.default_rng(3)
    params = {"w": jnp.asarray(rng.standard_normal((256, 1024), dtype=np.float32))}
    opt_state = {"mu": jnp.asarray(rng.standard_normal((256, 1024), dtype=np.float32))}
    ckptstore.save(tmp_path, {"params": params, "opt_state": opt_state}, step=1)
    gate = ReadGate(open_store(str(tmp_path)), _optimizer_only_keys(tmp_path, 1))
    state = ckptstore.load(gate, 1, stream=True)
    assert isinstance(state["params"]["w"], jax.Array)
    pending = state["opt_state"]["mu"]
    assert isinstance(pending, ckptstore.Pending)
    assert pending.shape == (256, 1024)
    assert pending.path == "opt_state/mu"
    with pytest.raises(TypeError):  # JAX refuses it: never read as zeros
        jax.jit(lambda x: x + 1)(pending)
    gate.release()
    state = ckptstore.fence(state)
    assert isinstance(state["opt_state"]["mu"], jax.Array)
    np.testing.assert_array_equal(np.asarray(state["opt_state"]["mu"]), np.asarray(opt_state["mu"]))


def test_a_failed_jax_placeholder_raises_every_time(tmp_path: Path) -> None:
    jax = pytest.importorskip("jax")
    rng = np.random.default_rng(4)
    state = {
        "params": {"w": jax.numpy.asarray(rng.standard_normal((256, 1024), dtype=np.float32))},
        "opt_state": {"mu": jax.numpy.asarray(rng.standard_normal((256, 1024), dtype=np.float32))},
    }
    ckptstore.save(tmp_path, state, step=3)
    _corrupt_optimizer_leaf(tmp_path)
    restored = ckptstore.load(tmp_path, 3, stream=True)
    with pytest.raises(CorruptCheckpointError):
        ckptstore.fence(restored)
    with pytest.raises(CorruptCheckpointError):
        ckptstore.fence(restored)


def test_the_distributed_load_streams_on_every_rank(tmp_path: Path) -> None:
    from ckptstore.manager import distributed as cd

    saved = _save(tmp_path)
    group = cd.LocalGroup(2, timeout=30)
    results: dict[int, Any] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            results[r] = cd.load(tmp_path, 3, comm=group.member(r), stream=True)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE)
    assert not errors, errors
    ckptstore.fence()
    for r in range(2):
        for name, tensor in saved["model"].items():
            assert torch.equal(results[r]["model"][name], tensor)
        for name, tensor in saved["optim"]["state"][0].items():
            assert torch.equal(results[r]["optim"]["state"][0][name], tensor)


def test_the_multi_rank_manager_streams_each_ranks_rest(tmp_path: Path) -> None:
    import ckptstore.distributed
    from tests.test_distributed import run_ranks

    saved = _save(tmp_path)
    optimizer_keys = _optimizer_only_keys(tmp_path)
    gates = [ReadGate(open_store(str(tmp_path)), optimizer_keys) for _ in range(2)]

    def rank_body(rank: int, comm: Any) -> dict[str, Any]:
        with ckptstore.distributed.CheckpointManager(gates[rank], comm=comm) as mgr:
            # returns while this rank's optimizer reads are held (a restore that waited for
            # them would fail when the gate times out)
            state = mgr.restore(3, stream=True)
            gates[rank].release()
            mgr.fence()
            return {"state": state}

    results = run_ranks(2, rank_body)
    for result in results:
        assert not isinstance(result, BaseException), repr(result)
        state = result["state"]
        for name, tensor in saved["model"].items():
            assert torch.equal(state["model"][name], tensor)
        for index, moments in saved["optim"]["state"].items():
            for name, tensor in moments.items():
                assert torch.equal(state["optim"]["state"][index][name], tensor)


def test_a_failed_background_part_raised_by_close_still_lets_its_saves_commit(
    tmp_path: Path,
) -> None:
    saved = _save(tmp_path / "old")
    _corrupt_optimizer_leaf(tmp_path / "old")
    gate = ReadGate(open_store(str(tmp_path / "old")), _optimizer_only_keys(tmp_path / "old"))
    from tests.gated_store import Gate

    writes = Gate(open_store(str(tmp_path / "new")))
    writes.hold()
    mgr = CheckpointManager(writes)
    mgr.save(5, {"model": saved["model"]})  # its writes held while the restore streams
    ckptstore.load(gate, 3, stream=True)
    gate.release()
    threading.Timer(0.5, writes.release).start()
    with pytest.raises(CorruptCheckpointError):
        mgr.close()  # raises the restore's error only once the save has committed
    again = ckptstore.load(tmp_path / "new", 5)
    assert torch.equal(again["model"]["0.weight"], saved["model"]["0.weight"])
