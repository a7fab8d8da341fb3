"""Stagers: numpy, torch and JAX arrays copied bit-exact into pooled host buffers."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from ckptstore.layout.tree import UnsupportedLeafError
from ckptstore.stage import BufferPool, Stager, rebuild_state
from ckptstore.stage.stager import collection_paused
from ckptstore.store.buffers import PAGE
from tests.children import python_path


def bits(array: Any) -> bytes:
    """The raw bytes of an array of any framework, for bit-exact comparison."""
    if type(array).__module__.startswith("torch"):
        import torch

        t = array.detach().cpu().contiguous()
        return bytes(t.view(-1).view(torch.uint8).numpy())
    return np.ascontiguousarray(np.asarray(array)).tobytes()


# -- pool ---------------------------------------------------------------------------------


def test_pool_reuses_a_released_arena() -> None:
    pool = BufferPool()
    first = pool.acquire(10_000)
    assert first.capacity >= 10_000
    assert first.data.ctypes.data % PAGE == 0
    address = first.data.ctypes.data
    first.release()
    first.release()  # idempotent
    second = pool.acquire(9_000)
    assert second.data.ctypes.data == address
    stats = pool.stats()
    assert (stats.allocations, stats.reuses, stats.lent_bytes) == (1, 1, second.capacity)


def test_pool_does_not_lend_an_arena_much_larger_than_asked() -> None:
    pool = BufferPool(slack=0.5)
    big = pool.acquire(1 << 20)
    big.release()
    small = pool.acquire(1000)
    assert small.capacity < 1 << 20
    # the big arena was dropped rather than kept beside the new one
    assert pool.stats().allocations == 2
    assert pool.stats().idle_bytes == 0


def test_pool_allocates_pinned_arenas_with_the_callers_allocator() -> None:
    # The pool lives in store/ and knows no framework: page-locked memory comes from the
    # allocator the caller passes (the stager passes torch's).
    calls: list[int] = []

    def pin(capacity: int) -> tuple[np.ndarray, Any]:
        calls.append(capacity)
        owner = np.empty(capacity, np.uint8)
        return owner, owner

    pool = BufferPool()
    pinned = pool.acquire(5000, pin=pin)
    assert pinned.pinned
    assert calls == [pinned.capacity]
    pinned.release()
    pageable = pool.acquire(5000)  # a pageable request never gets the pinned arena
    assert not pageable.pinned
    assert pageable is not pinned
    assert pool.acquire(5000, pin=pin) is pinned  # a pinned one does, without allocating
    assert len(calls) == 1


def test_pool_view_rejects_ranges_outside_the_arena() -> None:
    buf = BufferPool().acquire(4096)
    with pytest.raises(ValueError, match="outside"):
        buf.view(4000, 200)


@pytest.mark.parametrize("native", [True, False], ids=["native", "no-native-module"])
def test_copy_into_copies_each_source_writes_nothing_else_and_refuses_bad_input(
    monkeypatch: Any, native: bool
) -> None:
    """The staging bulk copy: arrays by their buffers (and, compiled, by their addresses)
    land at their offsets, the bytes between them stay as they were, and a refused call
    writes nothing."""
    from ckptstore.store import buffers

    if native and not buffers.NATIVE_COPY:
        pytest.skip("the compiled module (ckptstore.store._gather) is not built here")
    monkeypatch.setattr(buffers, "NATIVE_COPY", native)
    rng = np.random.default_rng(11)
    arrays = [
        rng.integers(0, 255, size=1, dtype=np.uint8),
        np.zeros((0, 3), np.float32),
        rng.standard_normal((32, 16)).astype(np.float64),  # 4,096 B
        np.array(2.5, np.float32),
        rng.standard_normal(333).astype(ml_dtypes.bfloat16),  # exports no buffer
    ]
    offsets = [0, 1, 64, 4160, 4168]
    lengths = [a.nbytes for a in arrays]
    sources: list[Any] = [*arrays[:4], arrays[4].ctypes.data if native else arrays[4]]
    out = np.full(4834, 7, np.uint8)
    if native:
        buffers.copy_into(out, sources, offsets, lengths)
        for array, offset in zip(arrays, offsets, strict=True):
            assert out[offset : offset + array.nbytes].tobytes() == array.tobytes()
        assert out[1:64].tobytes() == b"\x07" * 63  # nothing but the sources is written
        assert out[4164:4168].tobytes() == b"\x07" * 4
    else:
        with pytest.raises(TypeError, match="copy 4: a ndarray is neither an address"):
            buffers.copy_into(out, sources, offsets, lengths)
        buffers.copy_into(out, sources[:4], offsets[:4], lengths[:4])
        for array, offset in zip(arrays[:4], offsets[:4], strict=True):
            assert out[offset : offset + array.nbytes].tobytes() == array.tobytes()
        assert out[1:64].tobytes() == b"\x07" * 63
        assert out[4164:].tobytes() == b"\x07" * (4834 - 4164)

    before = out.copy()
    with pytest.raises(ValueError, match="outside the 4834-byte buffer"):
        buffers.copy_into(out, sources[:4], [0, 1, 64, 4831], lengths[:4])
    with pytest.raises(ValueError, match="outside"):
        buffers.copy_into(out, sources[:1], [-1], [1])
    with pytest.raises(ValueError, match="4 sources, 3 offsets and 4 lengths"):
        buffers.copy_into(out, sources[:4], offsets[:3], lengths[:4])
    with pytest.raises(ValueError, match="copy 2: the source is 4096 bytes, not 4095"):
        buffers.copy_into(out, sources[:4], offsets[:4], [1, 0, 4095, 4])
    with pytest.raises(TypeError, match="copy 1: a ndarray"):  # strided
        buffers.copy_into(out, [arrays[0], arrays[2][:, ::2]], [0, 64], [1, 2048])
    with pytest.raises(TypeError, match="copy 0: a str"):
        buffers.copy_into(out, ["abc"], [0], [3])
    if native:
        with pytest.raises(ValueError, match="a null address"):
            buffers.copy_into(out, [0], [0], [1])
    assert out.tobytes() == before.tobytes()  # a refused call copies nothing


# -- numpy --------------------------------------------------------------------------------


def numpy_state() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    strided = rng.standard_normal((64, 48)).astype(np.float32)[::2, 1::3]
    return {
        "w": rng.standard_normal((256, 128)).astype(np.float32),
        "strided": strided,
        "bf16": rng.standard_normal(1000).astype(ml_dtypes.bfloat16),
        "f8": rng.standard_normal(77).astype(ml_dtypes.float8_e4m3fn),
        "mask": rng.random(33) > 0.5,
        "z": (rng.standard_normal(10) + 1j * rng.standard_normal(10)).astype(np.complex64),
        "scalar": np.float64(3.25),
        "empty": np.zeros((0, 5), np.int32),
        "meta": {"lr": 0.1, "name": "run", "tags": ("a", 1), "none": None},
    }


def test_numpy_state_staged_into_one_arena_bit_exact() -> None:
    state = numpy_state()
    stager = Stager(chunk_bytes=4096)
    staged = stager.stage(state)
    assert staged.buffer is not None
    lo = staged.buffer.data.ctypes.data
    hi = lo + staged.buffer.capacity
    for key in ("w", "strided", "bf16", "f8", "mask", "z", "scalar", "empty"):
        out = staged.tree[key]
        assert isinstance(out, np.ndarray)
        assert out.flags.c_contiguous
        assert out.dtype == np.asarray(state[key]).dtype
        assert out.shape == np.asarray(state[key]).shape
        assert bits(out) == bits(state[key]), key
        if out.nbytes:
            assert lo <= out.ctypes.data < hi  # lives in the pooled arena, not the source
    assert staged.tree["meta"] == state["meta"]
    assert staged.attrs["scalar"] == {"framework": "numpy", "scalar": True}
    assert staged.nbytes == sum(np.asarray(state[k]).nbytes for k in state if k != "meta")


def test_mutating_a_numpy_source_after_staging_does_not_change_the_copy() -> None:
    state = {"w": np.arange(1 << 16, dtype=np.float32)}
    staged = Stager().stage(state)
    before = bits(staged.tree["w"])
    state["w"] += 1
    assert bits(staged.tree["w"]) == before


def test_copy_false_lets_host_arrays_through_without_a_buffer() -> None:
    state = {"w": np.arange(100, dtype=np.int64)}
    staged = Stager().stage(state, copy=False)
    assert staged.buffer is None
    assert np.shares_memory(staged.tree["w"], state["w"])


@pytest.mark.jax
@pytest.mark.torch
def test_copy_false_copies_only_the_leaves_outside_host_memory() -> None:
    """A JAX array has no host view, so a copy=False stage copies it and lets the numpy
    array and the CPU tensor beside it through, all in one flat view."""
    import jax.numpy as jnp
    import torch

    state = {
        "np": np.arange(1000, dtype=np.float32),
        "torch": torch.arange(300, dtype=torch.int16),
        "jax": jnp.arange(77, dtype=jnp.float32) * 0.5,
        "step": 9,
    }
    stager = Stager()
    staged = stager.stage(state, copy=False)
    assert staged.buffer is not None  # the JAX array's slot
    flat = staged.flat()
    arrays = dict(zip(flat.paths, flat.arrays, strict=True))
    assert np.shares_memory(arrays["np"], state["np"])
    assert np.shares_memory(arrays["torch"], state["torch"].numpy())
    lo = staged.buffer.data.ctypes.data
    assert lo <= arrays["jax"].ctypes.data < lo + staged.buffer.capacity
    assert bits(arrays["jax"]) == bits(state["jax"])
    assert staged.nbytes == 4000 + 600 + 308
    back = rebuild_state(staged.tree, staged.attrs)
    assert bits(back["torch"]) == bits(state["torch"])
    assert back["step"] == 9
    staged.release()
    stager.close()


def test_steady_state_saves_reuse_the_arena() -> None:
    state = numpy_state()
    stager = Stager()
    for _ in range(4):
        staged = stager.stage(state)
        staged.release()
    stats = stager.pool.stats()
    assert (stats.allocations, stats.reuses) == (1, 3)


def test_parallel_chunked_copy_matches_source() -> None:
    rng = np.random.default_rng(1)
    state = {f"t{i}": rng.standard_normal(300_000).astype(np.float32) for i in range(6)}
    stager = Stager(threads=2, chunk_bytes=64 << 10)
    staged = stager.stage(state)
    for key, value in state.items():
        assert bits(staged.tree[key]) == bits(value)
    stager.close()


def test_object_arrays_are_refused_with_the_path() -> None:
    with pytest.raises(TypeError, match=r"a/0"):
        Stager().stage({"a": [np.array([object()])]})


def test_rebuild_as_saved_returns_numpy_scalars_and_arrays() -> None:
    staged = Stager().stage(numpy_state())
    out = rebuild_state(staged.tree, staged.attrs)
    assert isinstance(out["scalar"], np.float64)
    assert out["scalar"] == 3.25
    assert bits(out["bf16"]) == bits(numpy_state()["bf16"])


# -- torch --------------------------------------------------------------------------------


@pytest.mark.torch
def test_torch_dtypes_and_layouts_staged_bit_exact() -> None:
    import torch

    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 48, generator=g)
    state = {
        "f32": torch.randn(300, 200, generator=g),
        "bf16": torch.randn(1000, generator=g).to(torch.bfloat16),
        "f16": torch.randn(17, generator=g).to(torch.float16),
        "f8": torch.randn(99, generator=g).to(torch.float8_e4m3fn),
        "f8b": torch.randn(99, generator=g).to(torch.float8_e5m2),
        "bool": torch.rand(31, generator=g) > 0.5,
        "c64": torch.randn(12, dtype=torch.complex64, generator=g),
        "i64": torch.arange(-5, 5),
        "transposed": base.t(),
        "strided": base[::3, 1::2],
        "expanded": torch.randn(1, 8, generator=g).expand(5, 8),
        "scalar": torch.tensor(7.5),
        "param": torch.nn.Parameter(torch.randn(4, 4, generator=g)),
        "grad_leaf": torch.randn(3, generator=g).requires_grad_(),
    }
    staged = Stager(chunk_bytes=8192).stage(state)
    for key, tensor in state.items():
        out = staged.tree[key]
        assert isinstance(out, np.ndarray), key
        assert out.shape == tuple(tensor.shape), key
        assert bits(out) == bits(tensor), key
    assert staged.tree["bf16"].dtype == np.dtype(ml_dtypes.bfloat16)
    assert staged.tree["f8"].dtype == np.dtype(ml_dtypes.float8_e4m3fn)
    assert staged.attrs["param"] == {
        "framework": "torch",
        "dtype": "float32",
        "device": "cpu",
        "requires_grad": True,
        "parameter": True,
    }
    assert staged.attrs["bf16"]["requires_grad"] is False
    assert staged.attrs["grad_leaf"]["requires_grad"] is True
    # the stager takes tensors apart once per class, dtype, device, grad flag and layout:
    # a plain tensor that requires grad is not taken for the parameter beside it
    assert "parameter" not in staged.attrs["grad_leaf"]

    back = rebuild_state(staged.tree, staged.attrs)
    for key, tensor in state.items():
        assert isinstance(back[key], torch.Tensor), key
        assert back[key].dtype == tensor.dtype, key
        assert bits(back[key]) == bits(tensor), key
    assert isinstance(back["param"], torch.nn.Parameter)
    assert back["grad_leaf"].requires_grad
    assert not back["f32"].requires_grad


@pytest.mark.torch
def test_torch_mutation_after_staging_does_not_change_the_copy() -> None:
    import torch

    w = torch.randn(1 << 18)
    staged = Stager(chunk_bytes=1 << 16).stage({"w": w})
    before = bits(staged.tree["w"])
    with torch.no_grad():
        w.mul_(2).add_(1)
    del w
    assert bits(staged.tree["w"]) == before


@pytest.mark.torch
def test_torch_unsupported_tensors_are_refused() -> None:
    import torch

    with pytest.raises(TypeError, match="sparse"):
        Stager().stage({"s": torch.eye(3).to_sparse()})
    with pytest.raises(TypeError, match="meta"):
        Stager().stage({"m": torch.empty(3, device="meta")})


@pytest.mark.torch
def test_torch_restore_into_numpy_and_torch_target() -> None:
    import torch

    state = {"w": torch.randn(5, 3).to(torch.bfloat16), "b": torch.arange(4)}
    staged = Stager().stage(state)
    as_numpy = rebuild_state(staged.tree, staged.attrs, "numpy")
    assert isinstance(as_numpy["w"], np.ndarray)
    assert as_numpy["w"].dtype == np.dtype(ml_dtypes.bfloat16)
    target = {"w": torch.zeros(5, 3, dtype=torch.float32), "b": torch.zeros(4, dtype=torch.int64)}
    into = rebuild_state(staged.tree, staged.attrs, target)
    assert into["w"].dtype == torch.float32  # the target's dtype
    assert torch.equal(into["w"], state["w"].float())
    with pytest.raises(ValueError, match="shape"):
        rebuild_state(staged.tree, staged.attrs, {"w": torch.zeros(3, 5)})


@pytest.mark.torch
def test_cuda_staging_uses_pinned_memory_and_an_event() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine; the pinned, non_blocking path needs one")
    src = torch.randn(1 << 20, device="cuda")
    staged = Stager().stage({"w": src})
    assert staged.buffer is not None
    assert staged.buffer.pinned
    assert staged.fences
    staged.wait_ready()
    assert bits(staged.tree["w"]) == bits(src)
    assert staged.attrs["w"]["device"].startswith("cuda")


@pytest.mark.torch
def test_cuda_copies_follow_the_callers_stream_from_every_staging_thread() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        # Large enough that a host state this size is shared with the helper thread; CUDA
        # copies weigh no host bytes, so the calling thread queues them all, on ``side``.
        state = {f"w{i}": torch.full((8 << 20,), float(i), device="cuda") for i in range(4)}
        expected = {k: bits(v) for k, v in state.items()}
        staged = Stager(threads=2).stage(state)
        for value in state.values():  # queued on the same stream after the copies
            value.add_(100.0)
    staged.wait_ready()
    for key in state:
        assert bits(staged.tree[key]) == expected[key], key


def test_copies_that_weigh_no_host_bytes_run_on_the_calling_thread() -> None:
    import threading

    from ckptstore.stage.stager import _Copying

    ran: list[tuple[int, int]] = []

    def task(i: int) -> tuple[int, Any]:
        return 0, lambda: ran.append((i, threading.get_ident()))

    def no_helpers(count: int) -> Any:
        raise AssertionError(f"{count} helper threads asked for copies a device engine makes")

    copying = _Copying([task(i) for i in range(500)], threads=4, chunk_bytes=1)
    copying.start(no_helpers)
    copying.finish()
    assert sorted(i for i, _ in ran) == list(range(500))
    assert {ident for _, ident in ran} == {threading.get_ident()}


@pytest.mark.torch
def test_cuda_copies_are_queued_in_one_foreach_call_per_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The batching of CUDA copies, on CPU tensors with the CUDA calls recorded (the copies
    themselves run on a lent GPU machine: the two tests above)."""
    import contextlib

    import torch

    from ckptstore.stage.stager import _run_batch
    from ckptstore.stage.torch import _CudaCopy

    entered: list[str] = []
    foreach: list[tuple[int, bool]] = []
    held: list[tuple[int, str]] = []

    @contextlib.contextmanager
    def stream(name: str) -> Iterator[None]:
        entered.append(name)
        yield

    real = torch._foreach_copy_

    def foreach_copy(dsts: list[Any], srcs: list[Any], non_blocking: bool = False) -> None:
        foreach.append((len(dsts), non_blocking))
        real(dsts, srcs, non_blocking=non_blocking)

    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch, "_foreach_copy_", foreach_copy)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: held.append((t.data_ptr(), s)))
    srcs = [torch.arange(n, dtype=torch.float32) * (n + 1) for n in (3, 5, 7, 2, 4)]
    srcs[4] = torch.arange(12, dtype=torch.float32).view(3, 4).t()  # strided: copy_ lays it out
    dsts = [torch.zeros(s.shape) for s in srcs]
    # the caller's stream ("main", eager saves) and a lazy snapshot's side stream ("side")
    where = [("main", False), ("side", True), ("main", False), ("side", True), ("main", False)]
    copies = zip(where, dsts, srcs, strict=True)
    _run_batch([_CudaCopy(name, dst, src, hold) for (name, hold), dst, src in copies])
    for dst, src in zip(dsts, srcs, strict=True):
        assert torch.equal(dst, src)
    assert entered == ["main", "side"]
    assert foreach == [(3, True), (2, True)]
    assert held == [(srcs[1].data_ptr(), "side"), (srcs[3].data_ptr(), "side")]


# -- JAX ----------------------------------------------------------------------------------


@pytest.mark.jax
def test_jax_arrays_staged_bit_exact_and_rebuilt() -> None:
    import jax
    import jax.numpy as jnp

    key = jax.random.PRNGKey(0)
    state = {
        "w": jax.random.normal(key, (128, 64)),
        "bf16": jax.random.normal(key, (333,)).astype(jnp.bfloat16),
        "i": jnp.arange(10, dtype=jnp.int32),
        "mask": jnp.arange(9) % 2 == 0,
        "nested": [jnp.ones((2, 2)), {"s": jnp.float32(2.0)}],
    }
    staged = Stager().stage(state)
    assert staged.tree["bf16"].dtype == np.dtype(ml_dtypes.bfloat16)
    assert bits(staged.tree["w"]) == bits(state["w"])
    assert bits(staged.tree["bf16"]) == bits(state["bf16"])
    assert staged.attrs["w"]["framework"] == "jax"
    back = rebuild_state(staged.tree, staged.attrs)
    assert isinstance(back["w"], jax.Array)
    assert bits(back["bf16"]) == bits(state["bf16"])
    assert bits(back["nested"][1]["s"]) == bits(state["nested"][1]["s"])


@pytest.mark.jax
def test_jax_staging_starts_every_host_copy_before_gathering(monkeypatch: Any) -> None:
    import jax
    import jax.numpy as jnp

    from ckptstore.stage import jax as stage_jax

    events: list[str] = []
    real_copy = stage_jax._copy_shard

    def spy_copy(dst: Any, index: Any, data: Any) -> None:
        events.append("gather")
        real_copy(dst, index, data)

    leaves = [jnp.full((100,), i, dtype=jnp.float32) for i in range(4)]
    impl = type(leaves[0])  # the concrete class behind the jax.Array ABC
    original = impl.copy_to_host_async

    def spy_start(self: jax.Array) -> None:
        events.append("start")
        original(self)

    monkeypatch.setattr(stage_jax, "_copy_shard", spy_copy)
    monkeypatch.setattr(impl, "copy_to_host_async", spy_start)
    staged = Stager().stage(leaves)
    assert events == ["start"] * 4 + ["gather"] * 4
    assert [float(x[0]) for x in staged.tree] == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.jax
def test_sharded_jax_arrays_on_one_host_gathered(tmp_path: Path) -> None:
    """Runs in a subprocess: the CPU device count is fixed when JAX starts."""
    pytest.importorskip("jax")
    script = textwrap.dedent(
        """
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        from ckptstore.stage import Stager, rebuild_state
        assert len(jax.devices()) == 4, jax.devices()
        mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))
        full = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
        cases = {
            "rows": NamedSharding(mesh, P("a", None)),         # replicated over b
            "grid": NamedSharding(mesh, P("a", "b")),
            "replicated": NamedSharding(mesh, P()),
        }
        state = {k: jax.device_put(full, s) for k, s in cases.items()}
        state["bf16"] = jax.device_put(full.astype(jnp.bfloat16), cases["grid"])
        staged = Stager().stage(state)
        for k in cases:
            assert np.array_equal(staged.tree[k], full), k
        assert staged.tree["bf16"].tobytes() == full.astype(jnp.bfloat16).tobytes()
        assert staged.attrs["grid"]["devices"] == 4
        target = {
            k: jax.ShapeDtypeStruct((8, 6), jnp.float32, sharding=s) for k, s in cases.items()
        }
        back = rebuild_state({k: staged.tree[k] for k in cases}, staged.attrs, target)
        for k, s in cases.items():
            assert back[k].sharding == s, k
            assert np.array_equal(np.asarray(back[k]), full), k
        print("OK")
        """
    )
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": python_path(),
    }
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith("OK")


@pytest.mark.jax
@pytest.mark.torch
def test_restore_torch_state_as_jax_and_jax_state_as_torch() -> None:
    import jax
    import jax.numpy as jnp
    import torch

    saved_torch = Stager().stage({"w": torch.randn(4, 4).to(torch.bfloat16)})
    as_jax = rebuild_state(saved_torch.tree, saved_torch.attrs, "jax")
    assert isinstance(as_jax["w"], jax.Array)
    assert as_jax["w"].dtype == jnp.bfloat16
    assert bits(as_jax["w"]) == bits(saved_torch.tree["w"])
    saved_jax = Stager().stage({"w": jnp.arange(6, dtype=jnp.float32)})
    as_torch = rebuild_state(saved_jax.tree, saved_jax.attrs, {"w": torch.empty(6)})
    assert isinstance(as_torch["w"], torch.Tensor)
    assert as_torch["w"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_importing_ckptstore_imports_neither_torch_nor_jax() -> None:
    code = (
        "import sys, ckptstore, ckptstore.stage, numpy as np\n"
        "ckptstore.stage.Stager().stage({'a': np.ones(3)})\n"
        "print(sorted(m for m in ('torch', 'jax') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": python_path()},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == "[]"


def test_large_leaves_start_on_a_page_so_local_stores_write_them_direct() -> None:
    from ckptstore.config import default_settings
    from ckptstore.stage.stager import PAGE_ALIGN_MIN

    leaf_alignment = default_settings().layout.leaf_alignment

    state = {
        "tiny": np.arange(3, dtype=np.int8),
        "big": np.ones(PAGE_ALIGN_MIN + 1, np.uint8),
        "odd": np.arange(5, dtype=np.int16),
        "big2": np.zeros((300, 301), np.float32),
    }
    staged = Stager().stage(state)
    for key in ("big", "big2"):
        assert staged.tree[key].ctypes.data % PAGE == 0, key
        assert bits(staged.tree[key]) == bits(state[key])
    for key in ("tiny", "odd"):
        assert staged.tree[key].ctypes.data % leaf_alignment == 0, key
        assert bits(staged.tree[key]) == bits(state[key])


# -- how the copies run ---------------------------------------------------------------------


def _patch_copies(monkeypatch: Any, bulk: bool, wrap: Any) -> None:
    """Have ``wrap(real, dst_nbytes, sources, run)`` run each host copy: the bulk copy of
    small arrays (``bulk``) or a numpy kind's copy of one piece."""
    from ckptstore.stage import numpy as numpy_kind
    from ckptstore.stage import stager as stager_module

    if bulk:
        real_bulk = stager_module._bulk_copy

        def bulk_copy(arena: Any, run: Any) -> None:
            wrap(lambda: real_bulk(arena, run), run.nbytes, run.leaves)

        monkeypatch.setattr(stager_module, "_bulk_copy", bulk_copy)
    else:
        real_copy = numpy_kind._copy

        def copy(dst: Any, src: Any) -> None:
            wrap(lambda: real_copy(dst, src), dst.nbytes, [src])

        monkeypatch.setattr(numpy_kind, "_copy", copy)


@pytest.mark.parametrize("bulk", [True, False], ids=["small-in-bulk", "large-in-pieces"])
def test_copies_are_shared_by_the_helper_and_the_calling_thread(
    monkeypatch: Any, bulk: bool
) -> None:
    import threading

    copied_by: dict[int, int] = {}
    caller = threading.get_ident()
    caller_copied = threading.Event()

    def counting(run: Any, nbytes: int, sources: Any) -> None:
        ident = threading.get_ident()
        if ident == caller:
            caller_copied.set()
        else:
            # Hold the helper until the caller has taken copies of its own, so the test does
            # not depend on how fast the helper is; if the caller never does, the wait times
            # out and the assertions below fail.
            caller_copied.wait(timeout=10)
        copied_by[ident] = copied_by.get(ident, 0) + nbytes
        run()

    _patch_copies(monkeypatch, bulk, counting)
    rng = np.random.default_rng(2)
    size = 1 << 14 if bulk else 1 << 18  # 64 KiB, bulk; 1 MiB (BULK_MAX), in pieces
    state = {f"t{i}": rng.standard_normal(size).astype(np.float32) for i in range(32)}
    stager = Stager(threads=2, chunk_bytes=64 << 10)
    staged = stager.stage(state)
    for key, value in state.items():
        assert bits(staged.tree[key]) == bits(value)
    assert caller in copied_by, copied_by
    assert len(copied_by) == 2, copied_by
    assert sum(copied_by.values()) == sum(v.nbytes for v in state.values())
    stager.close()


@pytest.mark.parametrize("native", [True, False], ids=["native", "no-native-module"])
def test_small_host_arrays_are_copied_in_bulk_around_the_other_leaves(
    monkeypatch: Any, native: bool
) -> None:
    """Small contiguous arrays go in a few bulk calls, not one copy each, and a bulk call
    writes nothing but its arrays' bytes: leaves copied otherwise (strided here, and copied
    first: the largest copies go first) lie between them and keep their values."""
    from ckptstore.stage import stager as stager_module
    from ckptstore.store import buffers

    if native and not buffers.NATIVE_COPY:
        pytest.skip("the compiled module (ckptstore.store._gather) is not built here")
    monkeypatch.setattr(stager_module, "NATIVE_COPY", native)
    monkeypatch.setattr(buffers, "NATIVE_COPY", native)
    calls: list[int] = []

    def counting(run: Any, nbytes: int, sources: Any) -> None:
        calls.append(len(sources))
        run()

    _patch_copies(monkeypatch, True, counting)
    rng = np.random.default_rng(5)
    state: dict[str, Any] = {}
    for i in range(300):
        state[f"a{i:03}"] = rng.integers(0, 255, size=rng.integers(1, 300), dtype=np.uint8)
        if i % 100 == 50:  # larger than all the runs together, so copied before them
            state[f"a{i:03}s"] = rng.standard_normal((1024, 64)).astype(np.float32)[:, ::2]
    state["bf16"] = np.arange(7, dtype=ml_dtypes.bfloat16)
    state["zero-d"] = np.array(3.5)
    state["empty"] = np.zeros((0, 3), np.int16)
    state["big"] = rng.standard_normal(1 << 18).astype(np.float32)  # BULK_MAX: in pieces
    stager = Stager(threads=1, chunk_bytes=1 << 20)
    staged = stager.stage(state)
    for key, value in state.items():
        assert bits(staged.tree[key]) == bits(value), key
        assert staged.tree[key].dtype == value.dtype
        assert staged.tree[key].shape == value.shape
    # All but the three strided and the large one; bfloat16 exports no buffer, so goes by
    # its address, which only the compiled call takes.
    assert sum(calls) == len(state) - (4 if native else 5)
    assert len(calls) == 1, calls  # one run of under 1 MiB (chunk_bytes), across them all
    staged.release()
    stager.close()


@pytest.mark.parametrize("native", [True, False], ids=["native", "no-native-module"])
def test_torch_host_copies_go_in_batches_not_one_call_per_tensor(
    monkeypatch: Any, native: bool
) -> None:
    """Large tensors' pieces, and small tensors where the compiled bulk copy is missing, are
    copied by torch a batch to a call; small ones otherwise in a few bulk calls, by address."""
    torch = pytest.importorskip("torch")
    from ckptstore.stage import stager as stager_module

    if not stager_module.NATIVE_COPY and native:
        pytest.skip("the compiled module (ckptstore.store._gather) is not built here")
    monkeypatch.setattr(stager_module, "NATIVE_COPY", native)
    calls: list[int] = []
    real = torch._foreach_copy_

    def counting(dsts: Any, srcs: Any) -> None:
        calls.append(len(dsts))
        real(dsts, srcs)

    monkeypatch.setattr(torch, "_foreach_copy_", counting)
    bulk: list[int] = []

    def in_bulk(run: Any, nbytes: int, sources: Any) -> None:
        bulk.append(len(sources))
        run()

    _patch_copies(monkeypatch, True, in_bulk)
    state = {f"w{i}": torch.full((64, 65), float(i)) for i in range(100)}  # 16,640 B
    state.update({f"big{i}": torch.full((512, 513), float(i)) for i in range(4)})  # > 1 MiB
    state["strided"] = torch.arange(60.0).reshape(6, 10).t()
    staged = Stager(threads=2, chunk_bytes=64 << 10).stage(state)
    for key, value in state.items():
        assert bits(staged.tree[key]) == bits(value)
    chunks = 4 * 17 + 1  # 1,050,624 B a large tensor in 64 KiB chunks, and the strided one
    if native:
        assert sum(bulk) == 100  # the small tensors, ...
        assert len(bulk) == 25, bulk  # ... four to a call (64 KiB)
    else:
        assert not bulk
        chunks += 100  # the small ones too, one chunk each
    assert sum(calls) == chunks  # every chunk copied once...
    assert len(calls) <= chunks // 3, calls  # ...in a few calls, not one per copy


@pytest.mark.torch
def test_small_torch_tensors_copied_by_address_bit_exact() -> None:
    """A bulk copy by address takes only tensors whose bytes are their values, C-contiguous
    in host memory: a conjugate or negative view, a strided or expanded tensor is copied by
    torch, which resolves it; a contiguous slice is read from its storage offset."""
    import torch

    from ckptstore.stage import stager as stager_module

    if not stager_module.NATIVE_COPY:
        pytest.skip("the compiled module (ckptstore.store._gather) is not built here")
    g = torch.Generator().manual_seed(3)
    base = torch.randn(4096, generator=g)
    state = {
        "slice": base[1000:1999],
        "bf16": torch.randn(333, generator=g).to(torch.bfloat16),
        "bool": torch.rand(77, generator=g) > 0.5,
        "conj": torch.randn(9, dtype=torch.complex64, generator=g).conj(),
        "neg": torch._neg_view(torch.randn(11, generator=g)),
        "strided": base[::7],
        "expanded": torch.randn(1, 6, generator=g).expand(3, 6),
        "scalar": torch.tensor(-2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
        "param": torch.nn.Parameter(torch.randn(5, 5, generator=g)),
    }
    kind = next(k for k in stager_module.array_kinds() if k.name == "torch")
    by_address = {key for key, value in state.items() if kind.host_address(value) is not None}
    assert by_address == {"slice", "bf16", "bool", "scalar", "empty", "param"}
    staged = Stager(chunk_bytes=1 << 20).stage(state)
    for key, value in state.items():
        expected = value.detach().resolve_conj().resolve_neg()
        assert bits(staged.tree[key]) == bits(expected), key
        assert staged.tree[key].shape == tuple(value.shape), key
    staged.release()


@pytest.mark.parametrize("bulk", [True, False], ids=["small-in-bulk", "large-in-pieces"])
def test_a_failing_copy_fails_the_stage_and_returns_the_arena(monkeypatch: Any, bulk: bool) -> None:
    def failing(run: Any, nbytes: int, sources: Any) -> None:
        if any(src.size and src.reshape(-1)[0] == 7 for src in sources):
            raise MemoryError("copy failed")
        run()

    _patch_copies(monkeypatch, bulk, failing)
    size = 1 << 15 if bulk else 1 << 18
    state = {f"t{i}": np.full(size, float(i), np.float32) for i in range(16)}
    stager = Stager(threads=2, chunk_bytes=16 << 10)
    with pytest.raises(MemoryError, match="copy failed"):
        stager.stage(state)
    stats = stager.pool.stats()
    assert stats.idle_bytes > 0
    assert stats.lent_bytes == 0
    monkeypatch.undo()
    staged = stager.stage(state)  # the arena comes back and is reused
    assert bits(staged.tree["t7"]) == bits(state["t7"])
    assert stager.pool.stats().reuses == 1


def test_an_unstorable_leaf_fails_the_stage_and_returns_the_arena() -> None:
    from ckptstore.layout.tree import UnsupportedLeafError

    stager = Stager(threads=2, chunk_bytes=16 << 10)
    state = {"w": np.ones(1 << 16, np.float32), "bad": object()}
    with pytest.raises(UnsupportedLeafError, match="bad"):
        stager.stage(state)
    assert stager.pool.stats().lent_bytes == 0


def test_the_flat_view_is_built_while_staging_and_reused() -> None:
    state = {"w": np.arange(10, dtype=np.int32), "step": 3}
    staged = Stager().stage(state)
    flat = staged.flat()
    assert flat is staged.flat()
    assert flat.paths == ["w"]
    assert bits(flat.arrays[0]) == bits(state["w"])


class _Watched(Mapping[str, Any]):
    """A mapping that records whether the garbage collector ran while the walker read it."""

    def __init__(self, items: dict[str, Any], seen: list[bool]) -> None:
        self._items, self._seen = items, seen

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        self._seen.append(gc.isenabled())
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


@pytest.mark.parametrize("lazy", [False, True])
def test_staging_pauses_the_garbage_collector_and_restores_it(lazy: bool) -> None:
    seen: list[bool] = []
    state = {"a": _Watched({"x": np.arange(4.0)}, seen)}
    stager = Stager()
    assert gc.isenabled()
    stager.stage(state, lazy=lazy).wait_ready()
    assert seen  # the walker read it (more than once, for its keys and its values)
    assert not any(seen)
    assert gc.isenabled()
    seen.clear()
    with pytest.raises(UnsupportedLeafError):  # a failed stage turns it back on too
        stager.stage({"a": _Watched({"x": object()}, seen)}, lazy=lazy)
    assert seen
    assert not any(seen)
    assert gc.isenabled()
    gc.disable()  # an application that runs without it keeps it off
    try:
        stager.stage(state, lazy=lazy).wait_ready()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_concurrent_stages_share_one_pause() -> None:
    outer, inner = collection_paused(), collection_paused()
    outer.__enter__()
    inner.__enter__()
    assert not gc.isenabled()
    outer.__exit__(None, None, None)  # the first to finish leaves it paused for the other
    assert not gc.isenabled()
    inner.__exit__(None, None, None)
    assert gc.isenabled()
