"""The incremental-save suite, run against every backend that subclasses it.

A backend's test module subclasses :class:`IncrementalTests` and provides the async
``store`` fixture (a fresh, empty store), as for :class:`~ckptstore.testing.CheckpointTests`.
The tests drive a fine-tuning loop (a frozen base, a trainable adapter and its Adam moments)
through the public API and check what reaches the store, byte by byte: only the changed
leaves are written, every step restores bit-exact whatever subset of steps was deleted, and
references that are not committed objects are refused (docs/format.md, "Incremental saves").
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from typing import Any

import numpy as np
import pytest

from ckptstore.errors import BrokenReferenceError, CorruptCheckpointError
from ckptstore.layout.commit import read_manifest
from ckptstore.layout.keys import attempt_prefix, manifest_key
from ckptstore.layout.lease import LEASE_NAME
from ckptstore.layout.maintenance import copy_step, verify_step
from ckptstore.layout.manifest import Manifest
from ckptstore.layout.references import MARKER_PREFIX, RECORD_NAME, delete_step
from ckptstore.manager.functions import adelete_step, agc, aload, asave
from ckptstore.store.base import PutMode, Store
from ckptstore.store.memory import MemoryStore
from ckptstore.store.wrappers import CountingStore, StoreWrapper

__all__ = ["FineTuning", "IncrementalTests", "KeyCountingStore"]


class KeyCountingStore(CountingStore):
    """A counting store that also keeps the bytes put per key and the whole-object reads
    (``get``) per key."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.put_keys: dict[str, int] = {}
        self.get_keys: Counter[str] = Counter()

    async def _hook(self, op: str, key: str, nbytes: int) -> None:
        await super()._hook(op, key, nbytes)
        if op in ("put", "put_part"):
            self.put_keys[key] = self.put_keys.get(key, 0) + nbytes
        elif op == "get":
            self.get_keys[key] += 1

    def data_bytes(self) -> int:
        """Bytes put to data objects (not manifests, leases, records or markers)."""
        return sum(
            n
            for key, n in self.put_keys.items()
            if key.count("/") >= 2 and not key.endswith((LEASE_NAME, RECORD_NAME, ".json"))
        )


@dataclasses.dataclass
class FineTuning:
    """A numpy stand-in for fine-tuning: frozen base weights (large leaves and small ones
    such as norms), a trainable adapter and the Adam moments of the adapter only."""

    base_large: int = 4
    large_shape: tuple[int, int] = (256, 1024)  # 1 MiB of float32: objects of their own
    base_small: int = 24
    adapter_shape: tuple[int, int] = (64, 32)
    seed: int = 0

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.seed)
        self.state: dict[str, Any] = {
            "base": {
                **{
                    f"w{i}": rng.standard_normal(self.large_shape, np.float32)
                    for i in range(self.base_large)
                },
                **{
                    f"norm{i}": rng.standard_normal(512, np.float32) for i in range(self.base_small)
                },
            },
            "adapter": {
                "a": rng.standard_normal(self.adapter_shape, np.float32),
                "b": np.zeros(self.adapter_shape[::-1], np.float32),
            },
            "optim": {
                "exp_avg": {"a": np.zeros(self.adapter_shape, np.float32)},
                "exp_avg_sq": {"a": np.zeros(self.adapter_shape, np.float32)},
                "step": 0,
            },
        }
        self.rng = rng

    def train_step(self) -> None:
        """Change the adapter and its moments, never the base."""
        grad = self.rng.standard_normal(self.adapter_shape, np.float32)
        optim = self.state["optim"]
        optim["exp_avg"]["a"] = 0.9 * optim["exp_avg"]["a"] + 0.1 * grad
        optim["exp_avg_sq"]["a"] = 0.999 * optim["exp_avg_sq"]["a"] + 0.001 * grad * grad
        self.state["adapter"]["a"] = self.state["adapter"]["a"] - 0.01 * optim["exp_avg"]["a"]
        self.state["adapter"]["b"] = self.state["adapter"]["b"] + 0.01 * grad.T
        optim["step"] += 1

    def changed_bytes(self) -> int:
        """Bytes of the leaves a train step changes."""
        adapter = self.state["adapter"]
        optim = self.state["optim"]
        return sum(
            a.nbytes
            for a in (adapter["a"], adapter["b"], optim["exp_avg"]["a"], optim["exp_avg_sq"]["a"])
        )

    def snapshot(self) -> dict[str, Any]:
        """A deep copy of the state as it is now."""

        def copy(node: Any) -> Any:
            if isinstance(node, dict):
                return {k: copy(v) for k, v in node.items()}
            return node.copy() if isinstance(node, np.ndarray) else node

        return copy(self.state)  # type: ignore[no-any-return]


def _assert_same(actual: Any, expected: Any, where: str = "") -> None:
    if isinstance(expected, dict):
        assert list(actual) == list(expected), where
        for key in expected:
            _assert_same(actual[key], expected[key], f"{where}/{key}")
    elif isinstance(expected, np.ndarray):
        assert actual.dtype == expected.dtype, where
        assert actual.tobytes() == expected.tobytes(), f"{where}: bits differ"
    else:
        assert actual == expected, where


async def _keys(store: Store) -> list[str]:
    return sorted(await store.list_keys(""))


class IncrementalTests:
    """Incremental saves on one backend; subclass and provide a ``store`` fixture."""

    steps = 10

    async def _loop(self, store: Store) -> tuple[FineTuning, dict[int, Any], KeyCountingStore]:
        counting = KeyCountingStore(store)
        run = FineTuning()
        saved: dict[int, Any] = {}
        for step in range(1, self.steps + 1):
            run.train_step()
            before = counting.data_bytes()
            info = await asave(counting, run.state, step=step)
            written = counting.data_bytes() - before
            assert written == info.nbytes
            saved[step] = run.snapshot()
            if step >= 3:
                # steady state: only the changed leaves, padded to the leaf alignment
                assert info.nbytes <= 1.05 * run.changed_bytes() + 4 * 64, (step, info)
                assert info.referenced_bytes > 0
        return run, saved, counting

    async def test_fine_tuning_writes_only_what_changed(self, store: Store) -> None:
        _, saved, _ = await self._loop(store)
        for step, expected in saved.items():
            _assert_same(await aload(store, step), expected, f"step {step}")
            assert (await verify_step(store, step)).ok
        manifest = await read_manifest(store, self.steps)
        assert manifest.references()
        assert manifest.own_bytes + manifest.referenced_bytes == manifest.nbytes

    @pytest.mark.parametrize("deleted", [(1,), (1, 2), (2, 5, 9), (1, 2, 3, 4, 5, 6, 7, 8, 9)])
    async def test_restores_after_any_subset_is_deleted(
        self, store: Store, deleted: tuple[int, ...]
    ) -> None:
        _, saved, _ = await self._loop(store)
        for step in deleted:
            await adelete_step(store, step)
        report = await agc(store, grace=0)
        assert not report.removed  # nothing uncommitted: only deleted steps' leftovers
        for step, expected in saved.items():
            if step not in deleted:
                _assert_same(await aload(store, step), expected, f"step {step}")
        for step in saved:
            if step not in deleted:
                await adelete_step(store, step)
        assert await _keys(store) == []  # what only deleted steps used is gone

    async def test_full_save_references_nothing(self, store: Store) -> None:
        run = FineTuning()
        await asave(store, run.state, step=1)
        run.train_step()
        info = await asave(store, run.state, step=2, full=True)
        assert info.referenced_objects == 0
        assert not (await read_manifest(store, 2)).references()
        await adelete_step(store, 1)
        assert all(key.startswith("2/") for key in await _keys(store))

    async def test_copy_is_self_contained(self, store: Store) -> None:
        _, saved, _ = await self._loop(store)
        async with MemoryStore() as other:
            report = await copy_step(store, other, self.steps)
            assert report.nbytes == (await read_manifest(store, self.steps)).nbytes
            copied = await read_manifest(other, self.steps)
            assert not copied.references()
            _assert_same(await aload(other, self.steps), saved[self.steps])
            assert (await verify_step(other, self.steps)).ok

    async def test_verify_checks_referenced_objects(self, store: Store) -> None:
        await self._loop(store)
        manifest = await read_manifest(store, self.steps)
        victim = manifest.object_key(manifest.references()[0])
        await store.put(victim, b"\0" * manifest.object_lengths[manifest.references()[0]])
        report = await verify_step(store, self.steps)
        assert not report.ok
        assert any(d.name == victim for d in report.damage)
        with pytest.raises(CorruptCheckpointError):
            await aload(store, self.steps)

    async def test_hostile_references_are_refused(self, store: Store) -> None:
        run = FineTuning()
        await asave(store, run.state, step=1)
        run.train_step()
        await asave(store, run.state, step=2)
        good = await read_manifest(store, 2)
        ref = good.references()[0]
        base = await read_manifest(store, 1)
        # an uncommitted attempt holding the same bytes: copy the object there
        stray = f"attempt-000000000001-{'0' * 16}"
        name = good.object_keys[ref].split("/", 1)[1]
        await store.put(f"1/{stray}/{name}", await store.get(good.object_key(ref)))

        def with_ref(step: int, key: str, length: int | None = None) -> Manifest:
            steps = list(good.object_steps or [])
            keys = list(good.object_keys)
            lengths = list(good.object_lengths)
            steps[ref], keys[ref] = step, key
            if length is not None:
                lengths[ref] = length
            return dataclasses.replace(
                good, step=3, object_steps=steps, object_keys=keys, object_lengths=lengths
            )

        cases = {
            "uncommitted attempt": with_ref(1, f"{stray}/{name}"),
            "missing step": with_ref(7, good.object_keys[ref]),
            "not in its record": with_ref(1, f"{base.attempt}/pack-999999"),
        }
        for what, manifest in cases.items():
            await store.put(manifest_key(3), manifest.encode())
            with pytest.raises(BrokenReferenceError):
                await aload(store, 3)
            assert not (await verify_step(store, 3)).ok, what
            await store.delete([manifest_key(3)])
        # outside the root and at its own step are refused by validation itself
        for bad_step, bad_key in (
            (1, f"{base.attempt}/../../x"),
            (1, f"{base.attempt}/deeper/x"),
            (1, f"not-an-attempt/{name}"),
            (3, good.object_keys[ref]),
        ):
            data = with_ref(bad_step, bad_key).encode()
            with pytest.raises(CorruptCheckpointError, match="invalid manifest"):
                Manifest.parse(data, step=3)

    async def test_old_manifests_still_load(self, store: Store) -> None:
        run = FineTuning()
        info = await asave(store, run.state, step=1)
        data = await store.get(manifest_key(1))
        assert data.startswith(b'{"format":"ckptstore","version":2')
        # a version-1 manifest: the same checkpoint without the hash column
        manifest = Manifest.parse(data, step=1)
        old = dataclasses.replace(manifest, leaf_hash=None).encode()
        assert old.startswith(b'{"format":"ckptstore","version":1')
        await store.put(manifest_key(1), old, mode="overwrite")
        _assert_same(await aload(store, 1), run.state)
        run.train_step()
        second = await asave(store, run.state, step=2)  # nothing to compare with: all written
        assert second.referenced_objects == 0
        assert second.nbytes == info.nbytes

    @pytest.mark.parametrize("deleter", ["delete_step", "gc"])
    async def test_delete_racing_a_save_that_references_it(
        self, store: Store, deleter: str
    ) -> None:
        """However a save and the deletion of its base interleave, the save commits with all
        its bytes present (or writes them itself). The deleter is ``delete_step`` or gc
        reclaiming a step whose manifest is gone (as a retention killed before its reclaim,
        or running in another process, leaves it)."""

        async def delete(target: Store) -> list[str]:
            """Delete step 1; the attempts kept because something references them."""
            if deleter == "delete_step":
                return (await delete_step(target, 1)).kept_referenced
            manifest = await read_manifest(store, 1)
            record = attempt_prefix(1, manifest.attempt) + RECORD_NAME
            await store.put(record, await store.get(manifest_key(1)))
            await store.delete([manifest_key(1)])
            return (await agc(target, grace=0)).kept_referenced

        for pause_at in ("refs", "marker"):
            run = FineTuning(seed=len(pause_at))
            keys_before = await _keys(store)
            assert keys_before == []
            await asave(store, run.state, step=1)
            base = attempt_prefix(1, (await read_manifest(store, 1)).attempt)
            run.train_step()
            gate = _Gate(store, pause_at)
            save: asyncio.Future[Any] | None
            if pause_at == "refs":
                # the saver has named step 1 in its lease; the deletion runs to its end
                save = asyncio.ensure_future(asave(gate, run.state, step=2))
                await gate.reached.wait()
                assert await delete(store) == [base]  # the lease keeps it
                gate.go.set()
            else:
                # the deleter has marked step 1's attempt; the save runs to its end
                deleting = asyncio.ensure_future(delete(gate))
                await gate.reached.wait()
                info = await asave(store, run.state, step=2)
                assert info.referenced_objects == 0  # it saw the marker: wrote everything
                gate.go.set()
                assert await deleting == []
                save = None
            if save is not None:
                await save
            _assert_same(await aload(store, 2), run.state)
            assert (await verify_step(store, 2)).ok
            await adelete_step(store, 2)
            assert await _keys(store) == []


class _Gate(StoreWrapper):
    """Pauses right after the first put that lands a lease naming references (``refs``) or
    a reclaim marker (``marker``), until ``go`` is set."""

    def __init__(self, inner: Store, at: str) -> None:
        super().__init__(inner)
        self.at = at
        self.reached = asyncio.Event()
        self.go = asyncio.Event()

    async def _put(self, key: str, data: memoryview, mode: PutMode) -> None:
        await self.inner._put(key, data, mode)
        if self.reached.is_set():
            return
        if self.at == "refs":
            hit = key.endswith(LEASE_NAME) and b'"refs": ["' in bytes(data)
        else:
            hit = f"/{MARKER_PREFIX}" in key
        if hit:
            self.reached.set()
            await self.go.wait()
