"""Incremental saves (ckptstore.testing.IncrementalTests) on memory, local, moto and
SeaweedFS stores, plus what only one backend needs: the CLI's view of references."""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptstore
from ckptstore.cli.main import format_bytes, main
from ckptstore.pipeline.root import opened
from ckptstore.store.base import Store
from ckptstore.store.local import LocalStore
from ckptstore.store.memory import MemoryStore
from ckptstore.store.s3 import S3Store
from ckptstore.store.wrappers import CountingStore
from ckptstore.testing.incremental_tests import FineTuning, IncrementalTests, KeyCountingStore
from ckptstore.testing.servers import SeaweedFS
from tests.multirank import EVERY_TARGET, Target
from tests.servers.moto import MotoS3


class TestMemoryIncremental(IncrementalTests):
    @pytest.fixture
    async def store(self) -> AsyncIterator[MemoryStore]:
        async with MemoryStore() as store:
            yield store


class TestLocalIncremental(IncrementalTests):
    @pytest.fixture
    async def store(self, tmp_path: Path) -> AsyncIterator[LocalStore]:
        async with LocalStore(tmp_path / "ckpt") as store:
            yield store


@pytest.mark.s3
class TestMotoIncremental(IncrementalTests):
    @pytest.fixture
    async def store(self, moto_s3: MotoS3) -> AsyncIterator[S3Store]:
        async with S3Store(moto_s3.bucket, "ckpt", **moto_s3.options()) as store:
            yield store


@pytest.mark.s3
class TestSeaweedFSIncremental(IncrementalTests):
    @pytest.fixture
    async def store(self, seaweedfs: SeaweedFS) -> AsyncIterator[S3Store]:
        seaweedfs.create_bucket("incremental")
        async with S3Store(
            "incremental",
            f"t-{uuid.uuid4().hex[:12]}",
            endpoint_url=seaweedfs.s3_endpoint,
            anonymous=True,
        ) as store:
            yield store
            await store.delete(await store.list_keys())


def test_show_reports_own_and_referenced_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = FineTuning()
    ckptstore.save(tmp_path, run.state, step=1)
    run.train_step()
    info = ckptstore.save(tmp_path, run.state, step=2)
    assert main(["show", str(tmp_path), "2", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["own_bytes"] == info.nbytes
    assert shown["referenced_bytes"] == info.referenced_bytes > 0
    referenced = [o for o in shown["objects"] if o["referenced"]]
    assert referenced
    assert all(o["key"].startswith("1/") for o in referenced)
    assert main(["show", str(tmp_path), "2"]) == 0
    assert "referenced" in capsys.readouterr().out


def test_ls_counts_each_stored_object_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = FineTuning()
    for step in (1, 2, 3):
        run.train_step()
        ckptstore.save(tmp_path, run.state, step=step)
    # its base weights stay, referenced by 2 and 3, and so does the rest of its attempt
    ckptstore.delete_step(tmp_path, 1)

    def data_files(*steps: str) -> list[Path]:
        """The data objects under the steps' attempts, as the file system sees them."""
        return [
            f
            for step in steps
            for f in (tmp_path / step).glob("attempt-*/*")
            if f.suffix != ".json"
        ]

    def on_disk(*steps: str) -> int:
        return sum(f.stat().st_size for f in data_files(*steps))

    assert main(["ls", str(tmp_path), "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    rows, total = listing["steps"], listing["total"]
    assert [row["step"] for row in rows] == [2, 3]
    assert total["steps"] == 2
    assert total["nbytes"] == on_disk("1", "2", "3") > 0
    assert total["own_bytes"] == on_disk("2", "3") == sum(row["own_bytes"] for row in rows)
    assert total["retained_bytes"] == on_disk("1") > 0
    assert total["objects"] == len(data_files("1", "2", "3"))
    # summing the rows counts step 1's objects once per step that references them
    assert total["steps_nbytes"] == sum(row["nbytes"] for row in rows) > total["nbytes"]

    assert main(["ls", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["step", "size", "own", "referenced"]
    step2 = rows[0]
    assert lines[1].split()[3:5] == format_bytes(step2["own_bytes"]).split()
    assert lines[1].split()[5:7] == format_bytes(step2["referenced_bytes"]).split()
    assert lines[3].startswith(f"total: {format_bytes(total['nbytes'])} stored in ")
    assert f"{format_bytes(total['retained_bytes'])} kept of deleted steps" in lines[3]
    assert format_bytes(total["steps_nbytes"]) in lines[4]


# ---------------------------------------------------------------------- the manager


def _changed_bytes(
    before: dict[str, tuple[int, bytes]], after: dict[str, tuple[int, bytes]]
) -> tuple[int, int]:
    """Bytes and count of the leaves whose bytes differ between two flat snapshots."""
    changed = [k for k in after if before.get(k) != after[k]]
    return sum(after[k][0] for k in changed), len(changed)


def _flat_bytes(state: Any, path: str = "") -> dict[str, tuple[int, bytes]]:
    """Every array leaf's length and sha256 by path (a digest, not the bytes: the 200 MiB
    variant keeps ten snapshots), computed from the arrays themselves."""
    if isinstance(state, dict):
        out: dict[str, tuple[int, bytes]] = {}
        for key, value in state.items():
            out.update(_flat_bytes(value, f"{path}/{key}"))
        return out
    if isinstance(state, list | tuple):
        out = {}
        for i, value in enumerate(state):
            out.update(_flat_bytes(value, f"{path}/{i}"))
        return out
    if hasattr(state, "detach"):  # a torch tensor
        state = state.detach().contiguous().view(-1).view(torch_uint8()).numpy()
    if isinstance(state, np.ndarray):
        data = np.ascontiguousarray(state).reshape(-1).view(np.uint8)
        return {path: (data.nbytes, hashlib.sha256(data).digest())}
    return {}


def torch_uint8() -> Any:
    import torch

    return torch.uint8


def test_manager_retention_keeps_what_kept_steps_reference(tmp_path: Path) -> None:
    run = FineTuning()
    expected: dict[int, Any] = {}
    with ckptstore.CheckpointManager(
        tmp_path, max_to_keep=2, async_save=False, full_every=4
    ) as manager:
        for step in range(1, 11):
            run.train_step()
            manager.save(step, run.state)
            expected[step] = run.snapshot()
        assert manager.all_steps() == [9, 10]
        for step in (9, 10):
            restored = manager.restore(step)
            assert _flat_bytes(restored) == _flat_bytes(expected[step])
    # saves 1, 5 and 9 were full: 9 and 10 reference nothing older than 9
    manifest = ckptstore.read_manifest(tmp_path, 10)
    assert {a.split("/")[0] for a in manifest.referenced_attempts()} == {"9"}
    left = {p.name for p in tmp_path.iterdir() if p.is_dir()}
    assert left == {"9", "10"}  # what only deleted steps used is gone


def test_retention_reads_each_manifest_once_per_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retention pass reads a manifest once, however many steps it deletes: a deleted
    step's to make its record (or to decide, if the manager has not seen the step; then
    not again), a kept step's after marking (the read the gc rule requires). Only a step the
    manager has not seen and keeps is read twice: to decide, then after marking."""
    run = FineTuning()
    for step in range(1, 6):  # saved before the manager opens: it has not seen them
        run.train_step()
        ckptstore.save(tmp_path, run.state, step=step)
    counting = KeyCountingStore(LocalStore(tmp_path))
    passes: list[dict[str, int]] = []
    with ckptstore.CheckpointManager(counting, max_to_keep=2, async_save=False) as manager:
        retain = manager._retain

        async def observed() -> None:
            before = counting.get_keys.copy()
            await retain()
            reads = counting.get_keys - before
            passes.append({k: n for k, n in reads.items() if k.endswith("/manifest.json")})

        monkeypatch.setattr(manager, "_retain", observed)
        for step in range(6, 10):
            run.train_step()
            manager.save(step, run.state)
        assert manager.all_steps() == [8, 9]
        assert _flat_bytes(manager.restore(9)) == _flat_bytes(run.state)
    first, *later = passes
    assert first == {
        **{f"{step}/manifest.json": 1 for step in (1, 2, 3, 4)},  # to decide: deleted
        "5/manifest.json": 2,  # to decide, then after marking: kept
        "6/manifest.json": 1,  # saved by the manager: after marking
    }
    for step, reads in zip((7, 8, 9), later, strict=True):
        assert reads == {f"{s}/manifest.json": 1 for s in (step - 2, step - 1, step)}, step


def test_manager_without_full_every_keeps_the_base_alive(tmp_path: Path) -> None:
    run = FineTuning()
    with ckptstore.CheckpointManager(tmp_path, max_to_keep=1, async_save=False) as manager:
        for step in range(1, 6):
            run.train_step()
            manager.save(step, run.state)
        assert manager.all_steps() == [5]
        assert _flat_bytes(manager.restore(5)) == _flat_bytes(run.state)
    # step 1's base weights live on, under a committed record, for step 5
    assert (tmp_path / "1").is_dir()
    assert not (tmp_path / "1" / "manifest.json").exists()
    assert list((tmp_path / "1").glob("attempt-*/committed.json"))
    ckptstore.delete_step(tmp_path, 5)
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]


# ---------------------------------------------------------------------- torch fine-tuning


def _torch_fine_tuning(target: Target, base_mib: int) -> None:
    """A frozen base of ``base_mib`` MiB, a trainable low-rank adapter, Adam on the adapter
    only: every save writes only the changed bytes, every step restores bit-exact, and
    restores still work after retention deleted any subset."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    width = 1024
    layers = base_mib  # one 1024x256 float32 = 1 MiB per layer
    base = torch.nn.ModuleList(torch.nn.Linear(width, 256) for _ in range(layers))
    for p in base.parameters():
        p.requires_grad_(False)
    adapter = torch.nn.ParameterDict(
        {"down": torch.nn.Parameter(torch.randn(width, 8) * 0.01),
         "up": torch.nn.Parameter(torch.zeros(8, 256))}
    )  # fmt: skip
    optim = torch.optim.Adam(adapter.parameters(), lr=1e-3)

    def state() -> dict[str, Any]:
        return {
            "base": base.state_dict(),
            "adapter": adapter.state_dict(),
            "optim": optim.state_dict(),
        }

    snapshots: dict[int, dict[str, tuple[int, bytes]]] = {}
    root = target.base
    with (
        opened(root, target.options) as store,  # ours to close: a manager leaves it open
        ckptstore.CheckpointManager(
            counting := KeyCountingStore(store), async_save=False
        ) as manager,
    ):
        previous: dict[str, tuple[int, bytes]] = {}
        for step in range(1, 11):
            x = torch.randn(4, width)
            out = sum(layer(x) for layer in base[:2]) + x @ adapter["down"] @ adapter["up"]
            optim.zero_grad()
            out.square().mean().backward()
            optim.step()
            before = counting.data_bytes()
            manager.save(step, state())
            written = counting.data_bytes() - before
            snapshot = _flat_bytes(state())
            changed, leaves = _changed_bytes(previous, snapshot)
            if step > 2:  # the first incremental save also repacks frozen small leaves
                assert written <= 1.05 * changed + 64 * leaves, (step, written, changed)
            previous = snapshots[step] = snapshot
        for step, expected in snapshots.items():
            assert _flat_bytes(manager.restore(step)) == expected
    deleted: set[int] = set()
    for batch in ((1,), (2, 3, 7), (4, 5, 6, 8, 9)):
        for step in batch:
            ckptstore.delete_step(root, step, **target.options)
        deleted.update(batch)
        for step in sorted(set(snapshots) - deleted):
            loaded = ckptstore.load(root, step, target="torch", **target.options)
            assert _flat_bytes(loaded) == snapshots[step]
    ckptstore.delete_step(root, 10, **target.options)
    assert target.keys(root) == []  # what only deleted steps used is gone


@pytest.mark.torch
def test_torch_fine_tuning_writes_only_changed_bytes(target: Target) -> None:
    """On local disk, moto and SeaweedFS (the ``target`` fixture)."""
    _torch_fine_tuning(target, base_mib=8)


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.parametrize("target", EVERY_TARGET, indirect=True)
def test_torch_fine_tuning_200_mib_base(target: Target) -> None:
    """The acceptance's fine-tuning loop, on every store it names."""
    _torch_fine_tuning(target, base_mib=200)


def test_each_save_parses_one_manifest_however_many_attempts_it_references(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A root whose saves each change another leaf references one more attempt with every
    step, and each save checks every referenced attempt's record before it writes. A record
    whose bytes were parsed before is not parsed again: a save parses its base's manifest
    alone, after ten steps as after two."""
    from ckptstore.layout.manifest import Manifest

    real = Manifest.parse.__func__  # type: ignore[attr-defined]
    parses: list[int] = []

    def counted(cls: type[Manifest], data: bytes, **kwargs: Any) -> Manifest:
        parses.append(kwargs.get("step", -1))
        return real(cls, data, **kwargs)

    state = {f"w{i}": np.full(256, i, np.float32) for i in range(12)}
    per_save: list[list[int]] = []
    monkeypatch.setattr(Manifest, "parse", classmethod(counted))
    for step in range(11):
        state[f"w{step}"] += 1  # one more leaf changed: its newest copy is this step's
        parses.clear()
        ckptstore.save(tmp_path, state, step=step)
        per_save.append(list(parses))
    monkeypatch.undo()
    assert len(ckptstore.read_manifest(tmp_path, 10).referenced_attempts()) >= 9
    assert per_save[0] == []  # nothing to compare with
    for step in range(1, 11):
        assert per_save[step] == [step - 1], (step, per_save[step])  # the base, once
    assert _flat_bytes(ckptstore.load(tmp_path, 10, target="numpy")) == _flat_bytes(state)


def test_plan_reuse_follows_its_rule_whatever_the_order_of_the_paths(tmp_path: Path) -> None:
    """Which leaves reuse the base's bytes: a leaf whose path, hash, dtype and shape equal a
    base leaf's; a base pack is referenced only when every leaf in it is reused (its other
    unchanged leaves are STABLE, written apart from the changed ones). The same answer for
    the base's own order of paths (found by position) as for any other (found by path)."""
    from ckptstore.layout.incremental import CHANGED, STABLE, plan_reuse, unchanged_before

    small = {f"s{i}": np.full(1024, i, np.float32) for i in range(6)}  # one pack
    large = {f"l{i}": np.full(1 << 19, i, np.float32) for i in range(2)}  # an object each
    ckptstore.save(tmp_path, {**small, **large}, step=0)
    base = ckptstore.read_manifest(tmp_path, 0)
    assert base.leaf_hash is not None
    n = len(base.paths)
    pack = base.leaf_object[base.paths.index("s0")]
    packed = [j for j in range(n) if base.leaf_object[j] == pack]
    assert len(packed) == 6
    assert len(base.object_keys) == 3

    def reuse(order: list[int], hashes: dict[int, str | None], shapes: dict[int, Any]) -> Any:
        paths = [base.paths[j] for j in order]
        got = plan_reuse(
            base,
            paths,
            [base.dtypes[j] for j in order],
            [shapes.get(j, base.shapes[j]) for j in order],
            [hashes.get(j, base.leaf_hash[j]) for j in order],  # type: ignore[index]
        )
        # back in the base's order, to compare the orders' answers
        source = {order[i]: got.leaf_source[i] for i in range(n)}
        groups = {order[i]: got.groups[i] for i in range(n)}
        return source, groups, got.objects

    for order in (list(range(n)), list(reversed(range(n)))):
        source, groups, objects = reuse(order, {}, {})
        assert source == {j: j for j in range(n)}
        assert objects == [0, 1, 2]
        # a shape given as a tuple is the same shape
        assert reuse(order, {}, {j: tuple(base.shapes[j]) for j in range(n)})[0] == source

        changed = packed[2]
        for hashes, shapes in (
            ({changed: "0" * 32}, {}),
            ({changed: None}, {}),
            ({}, {changed: [512, 2]}),
        ):
            source, groups, objects = reuse(order, hashes, shapes)
            assert objects == sorted(set(range(3)) - {pack})
            for j in range(n):
                if j == changed:
                    assert (source[j], groups[j]) == (-1, CHANGED)
                elif j in packed:  # unchanged, in a pack that is written again
                    assert (source[j], groups[j]) == (-1, STABLE)
                else:
                    assert source[j] == j
    # a path the base lacks reuses nothing; so does a base leaf of another dtype
    got = plan_reuse(base, ["new", *base.paths[1:]], base.dtypes, base.shapes, base.leaf_hash)
    assert got.leaf_source[0] == -1
    assert got.groups[0] == CHANGED
    got = plan_reuse(base, base.paths, ["float64", *base.dtypes[1:]], base.shapes, base.leaf_hash)
    assert got.leaf_source[0] == -1
    # nothing of a first save was reused from an earlier step
    assert unchanged_before(base, base.paths) == [False] * n
    assert unchanged_before(base, ["new", *reversed(base.paths)]) == [False] * (n + 1)


class _HeadKeys(CountingStore):
    """Counts requests, and keeps the keys of its ``head`` requests."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.heads: list[str] = []

    async def _hook(self, op: str, key: str, nbytes: int) -> None:
        await super()._hook(op, key, nbytes)
        if op == "head":
            self.heads.append(key)


async def test_a_save_finds_its_base_without_a_head_per_step_the_root_keeps(
    tmp_path: Path,
) -> None:
    """An incremental save looks for its base among the root's steps: the newest committed
    one is asked for first, so a root that keeps 40 steps costs a save a manifest ``head``
    for it, not 40 (a thousand steps kept on an object store were a thousand requests a
    save). Step directories without a manifest above it (attempts left by a crash) are
    skipped in a few batches of requests, and the base found is still the newest committed
    step."""
    from ckptstore.layout.commit import base_step, latest_step
    from ckptstore.layout.keys import MANIFEST_NAME, new_attempt_id

    state = {"frozen": np.ones(1024, np.float32), "trained": np.zeros(1024, np.float32)}
    async with LocalStore(tmp_path) as store:
        for step in range(40):
            state["trained"] += 1
            await ckptstore.asave(store, state, step=step)
        counting = _HeadKeys(store)
        state["trained"] += 1
        await ckptstore.asave(counting, state, step=40)
        asked = {int(key.split("/")[0]) for key in counting.heads if key.endswith(MANIFEST_NAME)}
        referenced = (await ckptstore.aread_manifest(store, 40)).referenced_attempts()
        assert referenced
        # the new step's own (committed already?), its base's, and those of the steps whose
        # objects it references (their records are checked): no other step's
        assert asked == {40, 39} | {int(prefix.split("/")[0]) for prefix in referenced}, asked
        assert len(asked) <= 4

        # seven steps begun and never committed, above the newest committed one
        for step in range(41, 48):
            await store.put(f"{step}/{new_attempt_id()}/objects/0", b"x")
        counting = _HeadKeys(store)
        assert await base_step(counting, 48) == 40
        assert await latest_step(counting) == 40
        # windows of 1, 2, 4 and then 8 directories: four round trips each, not eight
        assert len(counting.heads) == 2 * (1 + 2 + 4 + 8), counting.heads
        assert await base_step(counting, 40) == 39  # a step is not its own base
        state["trained"] += 1
        await ckptstore.asave(store, state, step=48)
        assert _flat_bytes(await ckptstore.aload(store, 48, target="numpy")) == _flat_bytes(state)


async def test_a_record_whose_bytes_change_after_a_check_is_checked_again(tmp_path: Path) -> None:
    """The object tables of records already checked are found by the digest of the bytes
    read, which are read every time: a record damaged after a save checked it refuses the
    next reference to it."""
    from ckptstore.errors import BrokenReferenceError
    from ckptstore.layout.references import check_references

    # 2 MiB each: objects of their own, above the pack threshold
    state = {"frozen": np.ones(1 << 19, np.float32), "trained": np.zeros(1 << 19, np.float32)}
    async with LocalStore(tmp_path) as store:
        await ckptstore.asave(store, state, step=0)
        state["trained"] += 1
        await ckptstore.asave(store, state, step=1)
        manifest = await ckptstore.aread_manifest(store, 1)
        assert manifest.referenced_attempts()  # "frozen" is step 0's object
        await check_references(store, manifest)  # the record is valid: its table is held
        record = tmp_path / "0" / "manifest.json"
        body = record.read_bytes()
        record.write_bytes(body[:-16])  # truncated
        with pytest.raises(BrokenReferenceError, match=r"record of 0/.* is invalid"):
            await check_references(store, manifest)
        record.write_bytes(body)  # the bytes held before: accepted again
        await check_references(store, manifest)


async def test_record_tables_hold_at_most_their_tables_and_objects(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ckptstore.errors import CorruptCheckpointError
    from ckptstore.layout.keys import manifest_key
    from ckptstore.layout.manifest import Manifest
    from ckptstore.layout.references import RecordTables

    parsed: list[int] = []
    real = Manifest.parse_shared.__func__  # type: ignore[attr-defined]

    def counted(cls: type[Manifest], data: bytes, **kwargs: Any) -> Manifest:
        parsed.append(kwargs["step"])
        return real(cls, data, **kwargs)

    records: dict[int, bytes] = {}
    async with MemoryStore() as store:
        for step in range(3):  # 1, 2 and 3 objects of their own (above the pack threshold)
            state = {f"w{i}": np.full(1 << 19, step, np.float32) for i in range(step + 1)}
            await ckptstore.asave(store, state, step=step, full=True)
            records[step] = await store.get(manifest_key(step))
    monkeypatch.setattr(Manifest, "parse_shared", classmethod(counted))

    def table(tables: RecordTables, step: int) -> dict[str, tuple[int, int]]:
        attempt, own = tables.table(records[step], step, 1 << 20, "test")
        assert attempt == Manifest.parse(records[step], step=step).attempt
        return own

    by_entries = RecordTables(entries=2)
    assert [len(table(by_entries, s)) for s in (0, 1, 0, 2)] == [1, 2, 1, 3]
    assert parsed == [0, 1, 2]  # the second look at step 0 was held
    assert len(by_entries) == 2
    table(by_entries, 1)  # the least recently used went: parsed again
    assert parsed == [0, 1, 2, 1]
    parsed.clear()
    by_objects = RecordTables(objects=4)
    for step in (0, 1, 2, 0, 2):
        table(by_objects, step)
    # 1 + 2 + 3 > 4: step 2's table dropped the two before it; 3 + 1 then fit
    assert parsed == [0, 1, 2, 0]
    assert len(by_objects) == 2
    # 1 + 3 + 2 > 4: step 0's went, the least recently used, and then step 2's too
    table(by_objects, 1)
    table(by_objects, 0)
    assert parsed == [0, 1, 2, 0, 1, 0]
    assert len(by_objects) == 2
    with pytest.raises(CorruptCheckpointError):
        by_objects.table(records[0][:-8], 0, 1 << 20, "test")
    assert len(by_objects) == 2  # a failed parse is never held
