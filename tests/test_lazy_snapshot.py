"""Lazy snapshots: ``save()`` returns before the copy, a fence waits for it, never torn.

Every test that needs the copy to be *not yet done* holds the background copy at a barrier
before the batch holding a chosen leaf (:class:`Hold`), so what happens before the fence is
decided by the test, not by the scheduler.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptstore import TornSnapshotError
from ckptstore.manager import CheckpointManager
from ckptstore.stage import Stager
from ckptstore.stage.lazy import LazyCopy

#: How long a test waits for something that should happen at once, before it fails.
DEADLINE = 30.0


class Hold:
    """Holds every lazy copy before the batch holding the leaf at ``path``, until released."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
        self.reached = threading.Event()
        self.go = threading.Event()
        original = LazyCopy._copying

        def copying(copy: LazyCopy, paths: list[str]) -> None:
            if path in paths and not self.reached.is_set():
                self.reached.set()
                if not self.go.wait(DEADLINE):
                    raise TimeoutError("the test never released the held copy")
            original(copy, paths)

        monkeypatch.setattr(LazyCopy, "_copying", copying)

    def wait_reached(self) -> None:
        assert self.reached.wait(DEADLINE), "the background copy never reached the leaf"

    def release(self) -> None:
        self.go.set()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "ckpt"


# ---------------------------------------------------------------------- stage layer


def test_a_lazy_stage_cannot_skip_the_copy() -> None:
    with pytest.raises(ValueError, match="lazy"):
        Stager().stage({"w": np.zeros(3)}, copy=False, lazy=True)


def test_snapshot_must_be_eager_or_lazy(root: Path) -> None:
    with pytest.raises(ValueError, match="snapshot must be 'eager' or 'lazy'"):
        CheckpointManager(root, snapshot="later")  # type: ignore[arg-type]


def test_numpy_leaves_have_no_counter_so_a_lazy_save_copies_them_in_the_call(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hold = Hold(monkeypatch, "never")  # nothing is held; only counts what goes lazily
    state = {"w": np.arange(1000, dtype=np.float32)}
    expected = state["w"].copy()
    with CheckpointManager(root, snapshot="lazy") as mgr:
        mgr.save(1, state)
        state["w"] += 1  # after save returned: must not reach the checkpoint
        mgr.wait_until_finished()
        np.testing.assert_array_equal(mgr.restore(1)["w"], expected)
    assert not hold.reached.is_set()


@pytest.mark.torch
def test_a_lazy_stage_copies_its_numpy_leaves_in_one_bulk_run_around_the_lazy_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The numpy leaves are copied in the call, all in one bulk call whose run spans the
    tensors' slots; the lazy copy fills those later."""
    import torch

    from ckptstore.stage import stager as stager_module

    runs: list[int] = []
    real = stager_module._bulk_copy

    def bulk_copy(arena: Any, run: Any) -> None:
        runs.append(len(run.leaves))
        real(arena, run)

    monkeypatch.setattr(stager_module, "_bulk_copy", bulk_copy)
    state: dict[str, Any] = {}
    for i in range(3):
        for j in range(4):
            state[f"n{i}{j}"] = np.full(100 + j, i * 10 + j, np.int32)
        state[f"t{i}"] = torch.arange(300, dtype=torch.float32) + i
    stager = Stager()
    staged = stager.stage(state, lazy=True, start=False)
    assert runs == [12]  # in the call: every numpy leaf, in one run
    staged.start()
    staged.wait_ready()
    flat = staged.flat()
    for path, array in zip(flat.paths, flat.arrays, strict=True):
        expected = state[path]
        np.testing.assert_array_equal(array, expected if path[0] == "n" else expected.numpy())
    staged.release()
    stager.close()


@pytest.mark.torch
def test_the_arena_goes_back_to_the_pool_only_after_the_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    stager = Stager()
    hold = Hold(monkeypatch, "w")
    source = torch.arange(1 << 16, dtype=torch.float32)
    staged = stager.stage({"w": source, "n": np.ones(3)}, lazy=True)
    assert staged.snapshot is not None
    hold.wait_reached()
    releasing = threading.Thread(target=staged.release)
    releasing.start()
    releasing.join(0.2)
    assert releasing.is_alive(), "the arena was given back while the copy still ran"
    assert stager.pool.stats().lent_bytes > 0
    hold.release()
    releasing.join(DEADLINE)
    assert stager.pool.stats().lent_bytes == 0
    stager.close()


@pytest.mark.torch
def test_a_stage_left_unstarted_copies_only_once_started_or_waited_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``start=False``: the background copy begins at ``StagedState.start()`` or at the
    first wait for it (the writer's, the fence's, a release), never by itself, so an async
    save can begin it after the save call has returned."""
    import torch

    copied_by: list[str] = []
    original = LazyCopy._copying

    def recording(copy: LazyCopy, paths: list[str]) -> None:
        copied_by.append(threading.current_thread().name)
        original(copy, paths)

    monkeypatch.setattr(LazyCopy, "_copying", recording)
    stager = Stager()
    sources = [torch.arange(1 << 16, dtype=torch.float32) + i for i in range(3)]
    started, waited, fenced = (stager.stage({"w": s}, lazy=True, start=False) for s in sources)
    # the lazy thread runs what it is given in order: once this no-op ran, nothing had been
    stager._lazy_thread().submit(lambda: None).result(DEADLINE)
    assert copied_by == []
    assert not any(s.snapshot is not None and s.snapshot.done() for s in (started, waited))

    started.start()
    started.start()  # once only
    started.wait_ready()
    assert copied_by == ["ckpt-lazy_0"]
    waited.wait_ready()  # the writer's wait starts it
    assert fenced.snapshot is not None
    fenced.snapshot.wait()  # and so does the fence
    assert len(copied_by) == 3
    for staged, source in zip((started, waited, fenced), sources, strict=True):
        staged.wait_ready()
        np.testing.assert_array_equal(staged.tree["w"], source.numpy())
        staged.release()
    stager.close()


@pytest.mark.torch
def test_a_copy_started_while_the_interpreter_exits_still_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An async save starts its copy from the background loop, which a script's last save
    may reach after the main thread ended: a ``ThreadPoolExecutor`` then refuses new work
    (``cannot schedule new futures after interpreter shutdown``), the copy's pool does not."""
    import concurrent.futures.thread

    import torch

    stager = Stager()
    source = torch.arange(1 << 16, dtype=torch.float32)
    staged = stager.stage({"w": source}, lazy=True, start=False)
    monkeypatch.setattr(concurrent.futures.thread, "_shutdown", True)  # as at exit
    staged.start()
    staged.wait_ready()
    np.testing.assert_array_equal(staged.tree["w"], source.numpy())
    staged.release()
    monkeypatch.undo()
    stager.close()


@pytest.mark.torch
def test_the_save_call_leaves_the_slots_and_copy_records_to_the_copying_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The call takes each leaf's counter and the arena's offsets; the leaves' slots and
    copy records are made by the thread that copies, and the flat view the writer reads
    shows the slots (with the bytes save() saw) once the copy is done."""
    import torch

    from ckptstore.stage import stager as stager_module

    made_in: list[str] = []
    original = stager_module._slot

    def slot(*args: Any) -> Any:
        made_in.append(threading.current_thread().name)
        return original(*args)

    monkeypatch.setattr(stager_module, "_slot", slot)
    stager = Stager()
    sources = {f"w{i}": torch.arange(1000, dtype=torch.float32) * i for i in range(5)}
    staged = stager.stage({**sources, "n": np.arange(3)}, lazy=True, start=False)
    assert made_in == [threading.current_thread().name]  # the numpy leaf only: copied now
    flat = staged.flat()
    assert [a.nbytes for a in flat.arrays] == [0] * 5 + [24]  # stand-ins until the copy
    assert staged.nbytes == 5 * 4000 + 24
    staged.start()
    staged.wait_ready()
    assert made_in[1:] == ["ckpt-lazy_0"] * 5
    for path, array in zip(flat.paths, flat.arrays, strict=True):
        expected = sources[path].numpy() if path in sources else np.arange(3)
        np.testing.assert_array_equal(array, expected)
        assert np.shares_memory(array, staged.buffer.view(0, staged.buffer.capacity))
    staged.release()
    stager.close()


@pytest.mark.torch
def test_the_copying_thread_waits_for_copy_records_a_fence_hook_is_still_making(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The optimizer hook's ``holds_any`` can be the first to need the copy records, and
    make them while the copying thread starts: that thread must wait for them, not find
    no batch, call the copy done and let the writer read slots nothing copied into (a
    multi-rank lazy save committed a leaf whose bytes did not match its checksum)."""
    import torch

    from ckptstore.stage import lazy

    entered, finished = threading.Event(), threading.Event()
    maker: list[str] = []

    class Probe(lazy.LazyCopy):
        def _complete(self) -> None:
            super()._complete()
            finished.set()

    def leaf_copy(*args: Any) -> Any:
        if not maker:
            maker.append(threading.current_thread().name)
            entered.set()
            # Made while the copying thread runs: with the fault it completes (with no
            # batch) during this wait; done right, it waits for these records instead.
            finished.wait(1.0)
        return lazy_leaf_copy(*args)

    lazy_leaf_copy = lazy.LeafCopy
    monkeypatch.setattr(lazy, "LazyCopy", Probe)
    monkeypatch.setattr(lazy, "LeafCopy", leaf_copy)
    stager = Stager()
    sources = {f"w{i}": torch.arange(1000, dtype=torch.float32) + i for i in range(4)}
    staged = stager.stage(sources, lazy=True, start=False)
    assert staged.snapshot is not None
    hook = threading.Thread(
        target=staged.snapshot.holds_any, args=(lambda: [],), name="optimizer-hook"
    )
    hook.start()
    assert entered.wait(10)
    staged.start()
    staged.wait_ready()
    hook.join(10)
    assert maker == ["optimizer-hook"]
    flat = staged.flat()
    for path, array in zip(flat.paths, flat.arrays, strict=True):
        np.testing.assert_array_equal(array, sources[path].numpy())
    staged.release()
    stager.close()


@pytest.mark.torch
def test_a_failure_to_make_the_copy_records_fails_the_save_instead_of_hanging(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from ckptstore.stage import lazy

    def broken(*args: Any) -> Any:
        raise MemoryError("no room for the copy records")

    monkeypatch.setattr(lazy, "LeafCopy", broken)
    manager = CheckpointManager(root, snapshot="lazy")
    manager.save(1, {"w": torch.ones(1 << 10)})
    with pytest.raises(MemoryError, match="no room for the copy records"):
        manager.wait_until_finished()
    assert manager.all_steps() == []
    assert manager._stager.pool.stats().lent_bytes == 0
    monkeypatch.undo()
    manager.save(2, {"w": torch.ones(1 << 10)})  # the next save is unharmed
    manager.wait_until_finished()
    assert manager.all_steps() == [2]
    manager.close()


@pytest.mark.torch
def test_a_copy_its_thread_refuses_fails_its_waiters_instead_of_hanging() -> None:
    import torch

    stager = Stager()
    staged = stager.stage({"w": torch.ones(1 << 10)}, lazy=True, start=False)
    stager._lazy_thread().shutdown()
    with pytest.raises(RuntimeError, match="cannot take work"):
        staged.start()
    outcome: list[BaseException] = []

    def wait() -> None:
        try:
            staged.release()  # waits for the copy first
        except BaseException as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    waiter.join(DEADLINE)
    assert not waiter.is_alive(), "the wait for a copy that never started did not return"
    assert len(outcome) == 1
    assert "cannot take work" in str(outcome[0])
    assert stager.pool.stats().lent_bytes == 0
    stager.close()


@pytest.mark.torch
def test_an_async_save_begins_its_lazy_copy_on_the_background_loop(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The save call stages and returns; the copying thread is woken by the background
    loop, so it never runs beside the call (on 2 cores it took the caller's core)."""
    import torch

    starters: list[str] = []
    original = LazyCopy.start

    def recording(copy: LazyCopy) -> None:
        if copy._executor is not None:  # the call that starts it
            starters.append(threading.current_thread().name)
        original(copy)

    monkeypatch.setattr(LazyCopy, "start", recording)
    state = {"w": torch.arange(1 << 16, dtype=torch.float32)}
    with CheckpointManager(root, snapshot="lazy") as mgr:
        for step in range(3):
            mgr.save(step, state)
            mgr.wait_until_finished()
        _assert_bit_exact(mgr.restore(2), state)
    assert starters == ["ckptstore-loop"] * 3


@pytest.mark.torch
def test_a_lazy_stage_holds_what_save_saw() -> None:
    import torch

    stager = Stager()
    source = torch.arange(1 << 16, dtype=torch.float32)
    staged = stager.stage({"w": source}, lazy=True)
    staged.wait_ready()
    source.add_(1)  # after the copy: no effect on the staged bytes
    np.testing.assert_array_equal(staged.tree["w"], np.arange(1 << 16, dtype=np.float32))
    staged.release()
    stager.close()


@pytest.mark.torch
def test_a_lazy_stage_walks_the_state_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The save's half of a lazy stage is one walk of the state, as an eager stage's: the
    flat view the writer reads is built by that walk, and the staged tree (a second walk)
    only when asked for. (It walked three times: find the leaves, rebuild the tree, flatten
    it; on the transformer's 496 tensors that was most of the call's time.)"""
    import torch

    import ckptstore.stage.stager as stager_module

    walks: list[str] = []
    for name in ("flatten", "iter_leaves", "map_leaves"):
        real = getattr(stager_module, name)

        def counted(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            walks.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(stager_module, name, counted)
    stager = Stager()
    source = {"w": torch.arange(64, dtype=torch.float32), "n": np.ones(3), "step": 7}
    staged = stager.stage(source, lazy=True)
    flat = staged.flat()
    assert walks == ["flatten"]
    staged.wait_ready()
    assert flat.paths == ["w", "n"]
    np.testing.assert_array_equal(flat.arrays[0], np.arange(64, dtype=np.float32))
    np.testing.assert_array_equal(staged.tree["n"], np.ones(3))  # the tree, built on demand
    assert walks == ["flatten", "map_leaves"]
    staged.release()
    stager.close()


# ---------------------------------------------------------------------- torch


def _torch_training(norm: str = "layer") -> tuple[Any, Any]:
    import torch

    torch.manual_seed(0)
    layer = torch.nn.LayerNorm(64) if norm == "layer" else torch.nn.BatchNorm1d(64)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), layer, torch.nn.Linear(64, 8))
    model[2].to(torch.bfloat16)  # a bfloat16 layer: kept bit-exact
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train_step(model, opt)
    return model, opt


def _train_step(model: Any, opt: Any) -> None:
    loss = _forward(model).float().square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _forward(model: Any) -> Any:
    import torch

    hidden = model[1](model[0](torch.randn(16, 32)))
    return model[2](hidden.to(torch.bfloat16))


def _state(model: Any, opt: Any) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def _clone(tree: Any) -> Any:
    import torch

    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_clone(v) for v in tree)
    return tree


def _assert_bit_exact(got: Any, expected: Any, path: str = "") -> None:
    import torch

    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor), path
        assert got.dtype == expected.dtype, path
        assert torch.equal(
            got.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)
        ), path
    elif isinstance(expected, dict):
        assert set(got) == set(expected), path
        for key in expected:
            _assert_bit_exact(got[key], expected[key], f"{path}/{key}")
    elif isinstance(expected, list | tuple):
        assert len(got) == len(expected), path
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            _assert_bit_exact(g, e, f"{path}/{i}")
    else:
        assert got == expected, path


def _global_step_hooks() -> int:
    from torch.optim import optimizer as torch_optimizer

    return len(torch_optimizer._global_optimizer_pre_hooks)


@pytest.mark.torch
def test_torch_round_trip_is_bit_exact_and_the_optimizer_step_waits_for_the_copy(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = _torch_training()
    expected = _clone(_state(model, opt))
    biggest = "model/0.weight"  # (64, 32) float32, copied last (smallest first)
    hold = Hold(monkeypatch, biggest)
    with CheckpointManager(root, snapshot="lazy") as mgr:
        mgr.save(1, _state(model, opt))
        hold.wait_reached()
        # The optimizer's step is fenced: it cannot start while the copy is held.
        stepping = threading.Thread(target=_train_step, args=(model, opt))
        stepping.start()
        stepping.join(0.2)
        assert stepping.is_alive(), "the optimizer stepped while its state was being copied"
        hold.release()
        stepping.join(DEADLINE)
        assert not stepping.is_alive()
        mgr.wait_until_finished()
        restored = mgr.restore(1)
    _assert_bit_exact(restored["model"], expected["model"])
    _assert_bit_exact(restored["optim"], expected["optim"])
    # and the model did train on after the save
    assert not np.array_equal(model[0].weight.detach().numpy(), expected["model"]["0.weight"])


def _param(model: Any, opt: Any) -> tuple[str, Any]:
    return "model/0.weight", model[0].weight


def _moment(model: Any, opt: Any) -> tuple[str, Any]:
    return "optim/state/0/exp_avg", opt.state[model[0].weight]["exp_avg"]


def _buffer(model: Any, opt: Any) -> tuple[str, Any]:
    return "model/1.running_mean", model[1].running_mean


@pytest.mark.torch
@pytest.mark.parametrize("which", [_param, _moment, _buffer], ids=["param", "optim", "buffer"])
def test_an_in_place_change_before_the_copy_fails_that_save_naming_the_leaf(
    root: Path, monkeypatch: pytest.MonkeyPatch, which: Any
) -> None:
    import torch

    model, opt = _torch_training("batch")
    path, tensor = which(model, opt)
    hold = Hold(monkeypatch, path)
    with CheckpointManager(root, snapshot="lazy") as mgr:
        mgr.save(1, _state(model, opt))
        hold.wait_reached()
        with torch.no_grad():
            tensor.mul_(2)  # by hand, without the fence: the contract broken
        hold.release()
        with pytest.raises(TornSnapshotError, match=f"'{path}' was modified in place") as err:
            mgr.wait_until_finished()
        assert err.value.path == path
        assert isinstance(err.value, RuntimeError)
        assert mgr.all_steps() == []  # nothing of the torn save is visible
        mgr.wait_until_finished()  # reported once
        mgr.save(2, _state(model, opt))  # the next save is unaffected
        mgr.wait_until_finished()
        assert mgr.all_steps() == [2]
    assert mgr._stager.pool.stats().lent_bytes == 0


@pytest.mark.torch
def test_a_batch_norm_forward_during_the_copy_fails_the_save(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = _torch_training("batch")
    hold = Hold(monkeypatch, "model/0.weight")
    with CheckpointManager(root, snapshot="lazy") as mgr:
        mgr.save(1, _state(model, opt))
        hold.wait_reached()
        # Its running statistics change without a version bump; num_batches_tracked bumps.
        _forward(model)
        hold.release()
        with pytest.raises(TornSnapshotError, match=r"'model/1\.num_batches_tracked'"):
            mgr.wait_until_finished()
        # the documented way: fence before a forward that updates batch statistics
        mgr.save(2, _state(model, opt))
        expected = _clone(model.state_dict())
        mgr.fence()
        _forward(model)
        mgr.wait_until_finished()
        _assert_bit_exact(mgr.restore(2)["model"], expected)


@pytest.mark.torch
def test_the_fence_by_hand_and_as_a_block(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    model, _ = _torch_training()
    expected = _clone(model.state_dict())
    hold = Hold(monkeypatch, "0.weight")
    with CheckpointManager(root, snapshot="lazy") as mgr:
        mgr.save(1, model.state_dict())
        hold.wait_reached()
        fenced = threading.Event()

        def ema() -> None:
            with mgr.fenced(), torch.no_grad():
                fenced.set()
                for p in model.parameters():
                    p.mul_(0.5)

        hand = threading.Thread(target=ema)
        hand.start()
        hand.join(0.2)
        assert not fenced.is_set(), "fenced() entered before the copy was done"
        hold.release()
        hand.join(DEADLINE)
        assert fenced.is_set()
        mgr.wait_until_finished()
        _assert_bit_exact(mgr.restore(1), expected)
        assert mgr.fence() is False  # the copy is done: a no-op


@pytest.mark.torch
def test_the_fence_copies_what_the_background_thread_has_not_started(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fence has nothing else to do: it takes the batches no thread has started and waits
    only for the one the background thread holds."""
    import torch

    # 8 leaves of 1 MiB, one batch each (chunk_bytes 1 MiB); the smallest is copied first
    state = {f"w{i}": torch.full((1 << 18,), float(i)) for i in range(8)}
    expected = _clone(state)
    copied_by: dict[str, str] = {}
    hold = Hold(monkeypatch, "w0")
    original = LazyCopy._copying

    def recording(copy: LazyCopy, paths: list[str]) -> None:
        original(copy, paths)  # the hold: the background thread waits in w0's batch
        for path in paths:
            copied_by[path] = threading.current_thread().name

    monkeypatch.setattr(LazyCopy, "_copying", recording)
    with CheckpointManager(root, snapshot="lazy", stager=Stager(chunk_bytes=1 << 20)) as mgr:
        mgr.save(1, state)
        hold.wait_reached()
        fence = threading.Thread(target=mgr.fence, name="the-fence")
        fence.start()
        deadline = time.monotonic() + DEADLINE
        while len(copied_by) < 7:  # every leaf but the held one
            assert time.monotonic() < deadline, f"the fence copied only {sorted(copied_by)}"
            time.sleep(0.01)
        assert {copied_by[f"w{i}"] for i in range(1, 8)} == {"the-fence"}
        fence.join(0.2)
        assert fence.is_alive(), "the fence returned before the held batch was copied"
        hold.release()
        fence.join(DEADLINE)
        assert not fence.is_alive()
        assert copied_by["w0"] != "the-fence"
        for tensor in state.values():
            tensor.add_(1)  # after the fence: not in the checkpoint
        mgr.wait_until_finished()
        _assert_bit_exact(mgr.restore(1), expected)


@pytest.mark.torch
def test_the_last_host_batches_are_one_piece_each_so_the_threads_finish_together() -> None:
    """Large leaves are copied in pieces of a quarter of ``chunk_bytes``, batched
    ``chunk_bytes`` at a time until two batches' bytes are left, then a piece at a time: a
    fence that joins near the end never waits on a whole leaf the other thread copies."""
    import torch

    chunk = 1 << 20
    # 6 leaves of 1 MiB and one of 32 KiB, copied smallest first
    state = {f"w{i}": torch.full((1 << 18,), float(i)) for i in range(6)}
    state["small"] = torch.arange(1 << 13, dtype=torch.float32)
    expected = _clone(state)
    stager = Stager(chunk_bytes=chunk)
    staged = stager.stage(state, lazy=True, start=False)
    copy = staged.snapshot
    assert isinstance(copy, LazyCopy)
    copy._ready()
    batches = copy._host_batches
    sizes = [batch.nbytes for batch in batches]
    assert sum(sizes) == 6 * chunk + (1 << 15)
    left = sum(sizes)
    for size in sizes:  # a batch takes pieces until it has its bytes: less than a piece over
        assert size < (chunk if left > 2 * chunk else chunk // 4) + chunk // 4, sizes
        left -= size
    assert sizes[-8:] == [chunk // 4] * 8  # the last 2 MiB: eight pieces of 256 KiB
    assert batches[0].leaves[0].path == "small"
    # a leaf's pieces may be in two batches: each batch names the leaves it copies
    assert [leaf.path for leaf in batches[-1].leaves] == ["w5"]
    staged.start()
    copy.result()
    for path, tensor in expected.items():
        assert staged.tree[path].tobytes() == tensor.numpy().tobytes()
    staged.release()


@pytest.mark.torch
def test_the_fence_is_a_no_op_once_the_copy_is_done(root: Path) -> None:
    model, opt = _torch_training()
    with CheckpointManager(root, snapshot="lazy") as mgr:
        mgr.save(1, _state(model, opt))
        mgr.fence()  # waits or not: the copy may be done already
        assert mgr.fence() is False  # after one fence, nothing is left to wait for
        mgr.save(2, _state(model, opt))
        mgr.wait_until_finished()  # the copy is done once the save is
        assert mgr.fence() is False
    with CheckpointManager(root, snapshot="eager") as eager:
        eager.save(3, _state(model, opt))
        assert eager.fence() is False


@pytest.mark.torch
def test_an_optimizer_whose_state_is_not_saved_is_not_fenced(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = _torch_training()
    other, other_opt = _torch_training()
    hold = Hold(monkeypatch, "model/0.weight")
    with CheckpointManager(root, snapshot="lazy") as mgr:
        mgr.save(1, _state(model, opt))
        hold.wait_reached()
        _train_step(other, other_opt)  # would hang here if it were fenced
        hold.release()
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1]


@pytest.mark.torch
def test_a_copy_error_surfaces_as_in_eager_mode(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = _torch_training()

    def failing(copy: LazyCopy, paths: list[str]) -> None:
        if "model/0.weight" in paths:
            raise OSError("the copy broke")

    with CheckpointManager(root, snapshot="lazy") as mgr:
        monkeypatch.setattr(LazyCopy, "_copying", failing)
        mgr.save(1, _state(model, opt))
        _train_step(model, opt)  # the fence does not raise the copy's error
        with pytest.raises(OSError, match="the copy broke") as err:
            mgr.save(2, _state(model, opt))  # the next save raises it, before staging
        assert "(raised by the background save of step 1)" in (err.value.__notes__ or [])
        mgr.wait_until_finished()  # reported once
        assert mgr.all_steps() == []
        monkeypatch.undo()
        mgr.save(3, _state(model, opt))
        mgr.wait_until_finished()
        assert mgr.all_steps() == [3]
        assert mgr._stager.pool.stats().lent_bytes == 0


@pytest.mark.torch
def test_a_finished_snapshot_keeps_no_source_alive(root: Path) -> None:
    import gc
    import weakref

    import torch

    weight = torch.ones(1 << 12)
    gone = weakref.ref(weight)
    with CheckpointManager(root, snapshot="lazy") as mgr:
        mgr.save(1, {"w": weight})
        mgr.wait_until_finished()
        del weight
        gc.collect()
        assert gone() is None  # the manager (its fence included) holds no source
        assert mgr.fence() is False


@pytest.mark.torch
def test_the_optimizer_hook_is_removed_at_close(root: Path) -> None:
    model, opt = _torch_training()
    before = _global_step_hooks()
    mgr = CheckpointManager(root, snapshot="lazy")
    mgr.save(1, _state(model, opt))
    assert _global_step_hooks() == before + 1
    _train_step(model, opt)
    mgr.close()
    assert _global_step_hooks() == before
    assert not mgr._fence.hooked
    eager = CheckpointManager(root / "eager")
    eager.save(1, _state(model, opt))
    assert _global_step_hooks() == before  # eager saves install nothing
    eager.close()


# ---------------------------------------------------------------------- CUDA


def _cuda() -> Any:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine")
    return torch


@pytest.mark.torch
def test_cuda_lazy_round_trip_is_bit_exact(root: Path) -> None:
    torch = _cuda()
    model = torch.nn.Linear(256, 256).cuda()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 256, device="cuda")).sum().backward()
    opt.step()
    expected = _clone(_state(model, opt))
    with CheckpointManager(root, snapshot="lazy") as mgr:
        mgr.save(1, _state(model, opt))
        model(torch.randn(8, 256, device="cuda")).sum().backward()
        opt.step()  # fenced: its kernels run after the side stream's copies
        mgr.wait_until_finished()
        restored = mgr.restore(1)
    _assert_bit_exact(restored["model"], expected["model"])
    _assert_bit_exact(restored["optim"]["state"], expected["optim"]["state"])


@pytest.mark.torch
def test_cuda_change_before_the_fence_fails_the_save(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = _cuda()
    weight = torch.randn(1 << 20, device="cuda")
    hold = Hold(monkeypatch, "w")
    with CheckpointManager(root, snapshot="lazy") as mgr:
        mgr.save(1, {"w": weight})
        hold.wait_reached()
        weight.add_(1)  # issued before the fence: may overtake the copy on the device
        hold.release()
        with pytest.raises(TornSnapshotError, match="'w' was modified in place"):
            mgr.wait_until_finished()
        assert mgr.all_steps() == []


# ---------------------------------------------------------------------- JAX


@pytest.mark.jax
def test_jax_round_trip_is_bit_exact(root: Path) -> None:
    import jax.numpy as jnp

    state = {
        "w": jnp.arange(4096, dtype=jnp.float32).reshape(64, 64),
        "h": jnp.linspace(-3, 3, 1000).astype(jnp.bfloat16),
        "step": jnp.int32(7),
    }
    with CheckpointManager(root, snapshot="lazy") as mgr:
        mgr.save(1, state)
        mgr.wait_until_finished()
        restored = mgr.restore(1)
    for key, array in state.items():
        assert restored[key].dtype == array.dtype
        np.testing.assert_array_equal(
            np.asarray(restored[key]).reshape(-1).view(np.uint8),
            np.asarray(array).reshape(-1).view(np.uint8),
        )


def _donating_step() -> Any:
    import jax

    return jax.jit(lambda w: w * 2 + 1, donate_argnums=0)


@pytest.mark.jax
def test_a_jax_array_donated_before_its_copy_fails_that_save(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import jax.numpy as jnp

    w = jnp.ones((256, 256), dtype=jnp.float32)
    step = _donating_step()
    hold = Hold(monkeypatch, "w")
    with CheckpointManager(root, snapshot="lazy") as mgr:
        mgr.save(1, {"w": w, "b": jnp.zeros(4)})
        hold.wait_reached()
        new_w = step(w)  # donates w: its buffer is gone
        if not w.is_deleted():
            pytest.skip("this JAX backend does not honour donation")
        hold.release()
        with pytest.raises(TornSnapshotError, match=r"'w' was deleted .*donated"):
            mgr.wait_until_finished()
        assert mgr.all_steps() == []
        # the documented way: fence before the donating call
        mgr.save(2, {"w": new_w})
        mgr.fence()
        newer = step(new_w)
        mgr.wait_until_finished()
        np.testing.assert_array_equal(np.asarray(mgr.restore(2)["w"]), np.full((256, 256), 3.0))
        assert float(newer[0, 0]) == 7.0


@pytest.fixture(autouse=True)
def _no_hook_left_behind() -> Iterator[None]:
    """Every manager a test opens is closed by it: no optimizer hook outlives a test."""
    import sys

    before = _global_step_hooks() if "torch" in sys.modules else 0
    yield
    if "torch" in sys.modules:
        assert _global_step_hooks() == before
