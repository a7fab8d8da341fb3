"""ckptstore.dcp.Writer/Reader under torch.distributed.checkpoint, in one process.

Multi-process runs (resharding, failing and dying ranks, the process executor) are in
tests/test_dcp_multirank.py.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner  # noqa: E402
from torch.distributed.checkpoint.metadata import StorageMeta  # noqa: E402
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: E402

import ckptstore  # noqa: E402
import ckptstore.dcp  # noqa: E402
from ckptstore import background  # noqa: E402
from ckptstore.errors import (  # noqa: E402
    CommitConflictError,
    CorruptCheckpointError,
    NotFoundError,
)
from ckptstore.layout.commit import commit_manifest, read_manifest  # noqa: E402
from ckptstore.layout.keys import new_attempt_id  # noqa: E402
from ckptstore.store.registry import open_store  # noqa: E402
from ckptstore.store.wrappers import CountingStore  # noqa: E402
from tests.children import python_path  # noqa: E402

pytestmark = [
    pytest.mark.torch,
    # DCP warns on every call made without an initialised process group.
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]


def sample_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(600_000, generator=g),  # 2.4 MB: its own object at a 1 MiB threshold
        "f32": torch.randn(64, 32, generator=g),
        "bf16": torch.randn(100, generator=g).to(torch.bfloat16),
        "f8": torch.randn(33, generator=g).to(torch.float8_e4m3fn),
        "f16_nan": torch.tensor([float("nan"), -0.0, float("inf")], dtype=torch.float16),
        "c64": torch.randn(5, dtype=torch.complex64, generator=g),
        "i64": torch.arange(-5, 5),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "transposed": torch.arange(12.0).reshape(3, 4).t(),  # not contiguous
        "small": {f"t{i}": torch.full((8,), float(i)) for i in range(300)},
        "step": 42,
        "name": "run-1",
    }


def zeros_like_state(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out[key] = zeros_like_state(value)
        elif isinstance(value, torch.Tensor):
            out[key] = torch.zeros(value.shape, dtype=value.dtype)
        else:
            out[key] = None
    return out


def assert_bit_exact(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, dict):
            assert_bit_exact(actual[key], value)
        elif isinstance(value, torch.Tensor):
            got = actual[key]
            assert got.dtype == value.dtype, key
            assert got.shape == value.shape, key
            # compare raw bytes: NaN payloads, -0.0 and float8 all count
            assert got.contiguous().reshape(-1).view(torch.uint8).tolist() == (
                value.contiguous().reshape(-1).view(torch.uint8).tolist()
            ), key
        else:
            assert actual[key] == value, key


@pytest.fixture(params=["local", "memory"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "ckpt")
    return f"memory://dcp-{uuid.uuid4().hex}/ckpt"


def test_save_then_load_is_bit_exact_and_packs_small_tensors(url: str) -> None:
    state = sample_state()
    dcp.save(state, storage_writer=ckptstore.dcp.Writer(url, pack_threshold=1 << 20))

    # a URL not ending in a step number is a root holding the checkpoint as step 0
    store = open_store(url)
    keys = background.run(store.list_keys())
    manifest = background.run(read_manifest(store, 0))
    data_keys = [k for k in keys if k != "0/manifest.json"]
    # 300 small tensors and the rest share one pack; the 2.4 MB tensor has its own object
    assert len(data_keys) == 2
    assert all(k.startswith(f"0/{manifest.attempt}/") for k in data_keys)
    assert len(manifest.paths) == len(state) - 1 + 300
    assert {"small.t7/0", "f32/0,0", "step"} <= set(manifest.paths)  # DCP name/chunk offsets

    loaded = zeros_like_state(state)
    dcp.load(loaded, storage_reader=ckptstore.dcp.Reader(url))
    assert_bit_exact(loaded, state)


def test_the_writer_packs_by_the_settings_every_face_uses(tmp_path: Path) -> None:
    """Without pack_threshold and pack_size the writer packs as Settings says (1 MiB, 8 MiB;
    it defaulted to 8 and 64 MiB of its own): a 2 MiB tensor gets an object of its own, and
    the store's Settings apply."""
    state = {"big": torch.randn(512 * 1024), **{f"s{i}": torch.randn(64) for i in range(20)}}

    def objects_of_big(root: str, **settings: Any) -> int:
        store = open_store(root, **settings)
        try:
            dcp.save(state, storage_writer=ckptstore.dcp.Writer(store))
        finally:
            background.run(store.close())
        manifest = ckptstore.read_manifest(root, 0)
        big = manifest.paths.index("big/0")
        return sum(obj == manifest.leaf_object[big] for obj in manifest.leaf_object)

    assert objects_of_big(str(tmp_path / "default")) == 1  # alone: 2 MiB >= 1 MiB
    assert objects_of_big(str(tmp_path / "4MiB"), pack_threshold=4 << 20) == 21  # packed
    with pytest.raises(ValueError, match="pack_threshold must be >= 0 and pack_size > 0, got -1"):
        ckptstore.dcp.Writer(str(tmp_path / "bad"), pack_threshold=-1)


def test_step_urls_are_steps_of_a_ckptstore_root(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    for step in (100, 200):
        dcp.save(
            {"w": torch.full((3,), float(step))},
            storage_writer=ckptstore.dcp.Writer(f"{root}/{step}"),
        )
    assert ckptstore.list_steps(root) == [100, 200]  # the native API sees DCP checkpoints
    manifest = ckptstore.read_manifest(root, 200)  # versioned JSON, validated; no pickle
    assert manifest.metadata["format"] == "ckptstore.dcp/1"
    assert manifest.metadata["dcp"]["state_dict_metadata"]["w"]["dtype"] == "float32"
    assert not list((tmp_path / "run").glob("**/.metadata"))
    loaded = {"w": torch.zeros(3)}
    dcp.load(loaded, storage_reader=ckptstore.dcp.Reader(root, step=100))
    assert torch.equal(loaded["w"], torch.full((3,), 100.0))


def test_partial_load_reads_only_the_requested_items(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    state = {f"layer{i}": torch.randn(256 * 1024) for i in range(8)}  # 1 MiB each
    dcp.save(state, storage_writer=ckptstore.dcp.Writer(url, pack_threshold=1 << 30))
    counting = CountingStore(open_store(url))
    wanted = {"layer3": torch.zeros(256 * 1024)}
    dcp.load(wanted, storage_reader=ckptstore.dcp.Reader(counting))
    assert torch.equal(wanted["layer3"], state["layer3"])
    # one packed object holds all 8 MiB; only layer3's MiB is read (plus nothing else)
    assert counting.bytes["read"] == 1 << 20


def _frozen_and_trained(seed: int) -> dict[str, Any]:
    """A fine-tuning state: a frozen 4 MiB backbone and a trained head, both large enough
    for objects of their own, and small tensors packed together."""
    g = torch.Generator().manual_seed(0)
    return {
        "backbone": torch.randn(1 << 20, generator=g),
        "head": torch.full((300_000,), float(seed)),
        "norms": {f"n{i}": torch.ones(16) for i in range(40)},
        "step": seed,
    }


def test_a_save_writes_only_the_items_that_changed_since_the_last_step(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    first = _frozen_and_trained(1)
    dcp.save(first, storage_writer=ckptstore.dcp.Writer(f"{root}/1"))
    counting = CountingStore(open_store(root))
    second = _frozen_and_trained(2)
    dcp.save(second, storage_writer=ckptstore.dcp.Writer(counting, step=2))
    background.run(counting.close())

    manifest = ckptstore.read_manifest(root, 2)
    backbone = manifest.paths.index("backbone/0")
    obj = manifest.leaf_object[backbone]
    assert manifest.object_step(obj) == 1  # referenced where step 1 wrote it
    assert manifest.leaf_hash is not None
    assert all(h is not None for h in manifest.leaf_hash)
    # the 4 MiB backbone is not written again; the head (1.2 MB), the small pack and the
    # manifest are
    assert counting.bytes["put"] < 2 << 20, counting.bytes
    assert manifest.referenced_bytes >= 4 << 20

    for step, state in ((1, first), (2, second)):
        loaded = zeros_like_state(state)
        dcp.load(loaded, storage_reader=ckptstore.dcp.Reader(root, step=step))
        assert_bit_exact(loaded, state)
    # step 1 deleted: the objects step 2 references stay, and it loads intact
    ckptstore.delete_step(root, 1)
    loaded = zeros_like_state(second)
    dcp.load(loaded, storage_reader=ckptstore.dcp.Reader(root, step=2))
    assert_bit_exact(loaded, second)


def test_incremental_false_and_a_native_base_write_everything(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    state = _frozen_and_trained(1)
    dcp.save(state, storage_writer=ckptstore.dcp.Writer(f"{root}/1"))
    dcp.save(state, storage_writer=ckptstore.dcp.Writer(f"{root}/2", incremental=False))
    assert ckptstore.read_manifest(root, 2).references() == []
    # a native step is no base for a DCP save (nor is a DCP step's tree a native one's)
    ckptstore.save(root, {"w": torch.ones(4)}, step=3)
    dcp.save(state, storage_writer=ckptstore.dcp.Writer(f"{root}/4"))
    assert ckptstore.read_manifest(root, 4).references() == []
    dcp.save(state, storage_writer=ckptstore.dcp.Writer(f"{root}/5"))
    assert ckptstore.read_manifest(root, 5).references() != []
    # off by the setting every face reads, on the store the writer is given
    store = open_store(root, incremental=False)
    dcp.save(state, storage_writer=ckptstore.dcp.Writer(store, step=6))
    background.run(store.close())
    assert ckptstore.read_manifest(root, 6).references() == []


def test_second_save_to_a_committed_url_is_refused(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    dcp.save({"w": torch.ones(2)}, storage_writer=ckptstore.dcp.Writer(url))
    with pytest.raises(CheckpointException, match=r"AlreadyExistsError: .* already holds a"):
        dcp.save({"w": torch.zeros(2)}, storage_writer=ckptstore.dcp.Writer(url))
    loaded = {"w": torch.zeros(2)}
    dcp.load(loaded, storage_reader=ckptstore.dcp.Reader(url))
    assert torch.equal(loaded["w"], torch.ones(2))


def test_commit_is_idempotent_for_its_attempt_and_conflicts_for_another(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    dcp.save({"w": torch.ones(2)}, storage_writer=ckptstore.dcp.Writer(url))
    store = open_store(url)
    manifest = background.run(read_manifest(store, 0))
    background.run(commit_manifest(store, manifest))  # a retry after a lost response succeeds
    other = dataclasses.replace(manifest, attempt=new_attempt_id())
    with pytest.raises(CommitConflictError, match=r"committed by attempt \S+ first"):
        background.run(commit_manifest(store, other))


class BrokenPlanner(DefaultSavePlanner):
    def resolve_data(self, write_item: Any) -> Any:
        if write_item.index.fqn == "b":
            raise RuntimeError("staging failed")
        return super().resolve_data(write_item)


def test_failed_save_leaves_no_visible_checkpoint(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    with pytest.raises(CheckpointException, match="staging failed"):
        dcp.save(
            {"a": torch.ones(4), "b": torch.ones(4)},
            storage_writer=ckptstore.dcp.Writer(url),
            planner=BrokenPlanner(),
        )
    assert not (tmp_path / "ckpt" / "0" / "manifest.json").exists()
    with pytest.raises(CheckpointException, match="no committed checkpoint"):
        dcp.load({"a": torch.zeros(4)}, storage_reader=ckptstore.dcp.Reader(url))


def test_reader_on_missing_checkpoint_raises_not_found(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError):
        ckptstore.dcp.Reader(str(tmp_path / "nothing")).read_metadata()


def test_corrupt_data_fails_crc_check(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    dcp.save({"w": torch.arange(1000.0)}, storage_writer=ckptstore.dcp.Writer(url))
    manifest = ckptstore.read_manifest(url, 0)
    data_file = tmp_path / "ckpt" / manifest.object_key(0)
    raw = bytearray(data_file.read_bytes())
    raw[100] ^= 0x01
    data_file.write_bytes(bytes(raw))
    with pytest.raises(CheckpointException, match=r"CorruptCheckpointError: .*crc32c"):
        dcp.load({"w": torch.zeros(1000)}, storage_reader=ckptstore.dcp.Reader(url))


@pytest.mark.parametrize("change", [-4, 4096])
def test_object_of_another_size_is_refused_before_any_read(tmp_path: Path, change: int) -> None:
    """The manifest's sizes are claims; the reader checks the real ones before allocating."""
    url = str(tmp_path / "ckpt")
    dcp.save({"w": torch.arange(1000.0)}, storage_writer=ckptstore.dcp.Writer(url))
    manifest = ckptstore.read_manifest(url, 0)
    data_file = tmp_path / "ckpt" / manifest.object_key(0)
    raw = data_file.read_bytes()
    data_file.write_bytes(raw[:change] if change < 0 else raw + bytes(change))
    counting = CountingStore(open_store(url))
    message = f"is {len(raw) + change} bytes, but the manifest says {len(raw)}"
    with pytest.raises(CheckpointException, match=f"CorruptCheckpointError: .*{message}"):
        dcp.load({"w": torch.zeros(1000)}, storage_reader=ckptstore.dcp.Reader(counting))
    assert counting.requests["read"] == 0


def _tamper_dcp(metadata: dict[str, Any], how: str) -> None:
    entry = metadata["dcp"]["state_dict_metadata"]["w"]
    if how == "dtype":
        entry["dtype"] = "object"
    elif how == "chunk":
        entry["chunks"][0]["sizes"] = [7]
    elif how == "format":
        metadata["format"] = "something-else"


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("bitflip", "crc32c mismatch"),
        ("dtype", "dtype 'object'"),
        ("chunk", "metadata says"),
        ("format", "not a DCP checkpoint"),
    ],
)
def test_tampered_manifest_is_rejected_before_any_data_read(
    tmp_path: Path, how: str, message: str
) -> None:
    url = str(tmp_path / "ckpt")
    dcp.save({"w": torch.arange(10.0)}, storage_writer=ckptstore.dcp.Writer(url))
    path = tmp_path / "ckpt" / "0" / "manifest.json"
    if how == "bitflip":
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0x20
        path.write_bytes(bytes(raw))
    else:  # a well-formed manifest (valid envelope crc) whose DCP part is wrong
        manifest = ckptstore.read_manifest(url, 0)
        metadata = dict(manifest.metadata)
        _tamper_dcp(metadata, how)
        path.write_bytes(dataclasses.replace(manifest, metadata=metadata).encode())
    counting = CountingStore(open_store(url))
    with pytest.raises(CorruptCheckpointError, match=message):
        ckptstore.dcp.Reader(counting).read_metadata()
    assert counting.requests["read"] == 0


def test_writer_pickles_without_its_store_and_reopens(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    writer = ckptstore.dcp.Writer(url, pack_threshold=123)
    assert writer._target.handle.store is not None  # opened
    clone = pickle.loads(pickle.dumps(writer))
    assert clone._target.handle._store is None
    assert clone.url == writer.url
    assert clone.pack_threshold == 123
    dcp.save({"w": torch.ones(3)}, storage_writer=clone)
    reader = pickle.loads(pickle.dumps(ckptstore.dcp.Reader(url)))
    loaded = {"w": torch.zeros(3)}
    dcp.load(loaded, storage_reader=reader)
    assert torch.equal(loaded["w"], torch.ones(3))


def test_checkpoint_id_selects_the_url(tmp_path: Path) -> None:
    writer = ckptstore.dcp.Writer(str(tmp_path / "unused"))
    for step in (1, 2):
        dcp.save(
            {"w": torch.full((2,), float(step))},
            checkpoint_id=str(tmp_path / f"step{step}"),
            storage_writer=writer,
        )
    assert not (tmp_path / "unused").exists()
    reader = ckptstore.dcp.Reader(str(tmp_path / "unused"))
    loaded = {"w": torch.zeros(2)}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "step2"), storage_reader=reader)
    assert torch.equal(loaded["w"], torch.full((2,), 2.0))
    assert ckptstore.dcp.Writer.validate_checkpoint_id("s3://bucket/x")
    assert not ckptstore.dcp.Reader.validate_checkpoint_id("nosuchscheme://x")


def test_checkpoint_metadata_carries_the_writers_storage_meta(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    writer = ckptstore.dcp.Writer(str(tmp_path / "unused"))
    saved: dict[int, tuple[str, str]] = {}  # step -> (url, save id of that save)
    for step in (1, 2):
        url = f"{root}/{step}"
        returned = dcp.save({"w": torch.ones(2)}, checkpoint_id=url, storage_writer=writer)
        assert writer.storage_meta() == StorageMeta(checkpoint_id=url, save_id=writer.save_id)
        assert returned.storage_meta == writer.storage_meta()
        saved[step] = (url, writer.save_id)
    assert saved[1][1] != saved[2][1]  # every save has its own id

    for step, (url, save_id) in saved.items():
        # stored as JSON in the manifest, and handed back to DCP by the reader with its load id
        stored = ckptstore.read_manifest(root, step).metadata["dcp"]["storage_meta"]
        assert stored == {"checkpoint_id": url, "save_id": save_id, "modules": []}
        reader = ckptstore.dcp.Reader(url)
        meta = reader.read_metadata().storage_meta
        assert meta == StorageMeta(checkpoint_id=url, save_id=save_id, load_id=reader.load_id)


def test_async_save_thread_executor(url: str) -> None:
    state = sample_state()
    future = dcp.async_save(state, storage_writer=ckptstore.dcp.Writer(url))
    future.result(timeout=120)
    loaded = zeros_like_state(state)
    dcp.load(loaded, storage_reader=ckptstore.dcp.Reader(url))
    assert_bit_exact(loaded, state)


def test_async_save_with_async_stager(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    state = sample_state()
    stager = DefaultStager(
        StagingOptions(
            use_pinned_memory=False,
            use_shared_memory=False,
            use_async_staging=True,
            use_non_blocking_copy=False,
        )
    )
    try:
        response = dcp.async_save(
            state, storage_writer=ckptstore.dcp.Writer(url), async_stager=stager
        )
        response.staging_completion.result(timeout=60)
        state["f32"].fill_(-1.0)  # after staging, training may modify the state
        response.upload_completion.result(timeout=120)
    finally:
        stager.close()
    loaded = zeros_like_state(state)
    dcp.load(loaded, storage_reader=ckptstore.dcp.Reader(url))
    assert_bit_exact(loaded, sample_state())  # the staged copy, not the modified state


@pytest.fixture(
    params=[
        pytest.param("moto", marks=pytest.mark.s3),
        pytest.param("seaweedfs", marks=pytest.mark.s3),
    ]
)
def s3_root(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    """A fresh S3 root and the store options that reach it."""
    prefix = f"dcp-{uuid.uuid4().hex[:8]}"
    if request.param == "moto":
        moto = request.getfixturevalue("moto_s3")
        return f"s3://{moto.bucket}/{prefix}", moto.options()
    server = request.getfixturevalue("seaweedfs")
    server.create_bucket("ckptstore-dcp")
    return f"s3://ckptstore-dcp/{prefix}", {"endpoint_url": server.s3_endpoint, "anonymous": True}


def test_save_load_and_async_save_on_s3(s3_root: tuple[str, dict[str, Any]]) -> None:
    root, options = s3_root
    state = sample_state()
    dcp.save(
        state, storage_writer=ckptstore.dcp.Writer(f"{root}/1", pack_threshold=1 << 20, **options)
    )
    dcp.async_save(state, storage_writer=ckptstore.dcp.Writer(f"{root}/2", **options)).result(
        timeout=120
    )
    for step in (1, 2):
        loaded = zeros_like_state(state)
        dcp.load(loaded, storage_reader=ckptstore.dcp.Reader(f"{root}/{step}", **options))
        assert_bit_exact(loaded, state)

    async def steps() -> list[int]:
        async with open_store(root, **options) as store:
            return await ckptstore.alist_steps(store)

    assert background.run(steps()) == [1, 2]


def every_stored_dtype() -> list[Any]:
    from ckptstore.stage.torch import dtype_table

    return list(dtype_table())


def random_tensor(dtype: Any, numel: int, seed: int) -> Any:
    """``numel`` elements of ``dtype`` with random bytes (NaN payloads and all), or random
    bools."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=g).to(torch.bool)
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype)


#: torch warns whenever a complex32 tensor is made; the warning is about its operators.
COMPLEX32_IS_EXPERIMENTAL = "ignore:ComplexHalf support is experimental:UserWarning"


@pytest.mark.filterwarnings(COMPLEX32_IS_EXPERIMENTAL)
@pytest.mark.parametrize("dtype", every_stored_dtype(), ids=str)
def test_every_dtype_the_manager_stores_round_trips_bit_exact(dtype: Any, tmp_path: Path) -> None:
    # One dtype table for every face: what CheckpointManager stores, DCP stores too
    # (complex32, float8_e8m0fnu, bfloat16, each float8...), packed and as an object of its own.
    state = {"small": random_tensor(dtype, 24, 1), "large": random_tensor(dtype, 4096, 2)}
    url = str(tmp_path / "ckpt")
    dcp.save(state, storage_writer=ckptstore.dcp.Writer(url, pack_threshold=1024))
    manifest = background.run(read_manifest(open_store(url), 0))
    assert len(manifest.object_keys) == 2  # the small chunk packed, the large one alone
    loaded = zeros_like_state(state)
    dcp.load(loaded, storage_reader=ckptstore.dcp.Reader(url))
    assert_bit_exact(loaded, state)

    with ckptstore.CheckpointManager(tmp_path / "manager") as mgr:
        mgr.save(0, state)
        mgr.wait_until_finished()
        assert_bit_exact(mgr.restore(0), state)


def test_packs_use_the_leaf_alignment_setting_and_pooled_buffers(tmp_path: Path) -> None:
    from ckptstore.store.buffers import host_buffers

    state = {f"t{i}": torch.full((3,), float(i)) for i in range(20)}  # 12 bytes each
    url = str(tmp_path / "ckpt")
    dcp.save(state, storage_writer=ckptstore.dcp.Writer(url, leaf_alignment=256))
    manifest = background.run(read_manifest(open_store(url), 0))
    tensors = [i for i, path in enumerate(manifest.paths) if path.startswith("t")]
    assert len({manifest.leaf_object[i] for i in tensors}) == 1  # one pack
    assert sorted(manifest.leaf_offset[i] for i in tensors) == [256 * i for i in range(20)]

    # a second save builds its pack in the buffer the first gave back
    before = host_buffers.stats()
    dcp.save(state, storage_writer=ckptstore.dcp.Writer(str(tmp_path / "again")))
    after = host_buffers.stats()
    assert after.reuses > before.reuses
    assert after.lent_bytes == before.lent_bytes == 0


@pytest.mark.s3
def test_a_checkpoint_written_through_a_url_with_a_secret_never_stores_it(moto_s3: Any) -> None:
    marker = f"MARKER{uuid.uuid4().hex}"
    url = (
        f"s3://{moto_s3.bucket}/run?endpoint_url={moto_s3.endpoint}&region={moto_s3.region}"
        f"&access_key_id=AKIDVISIBLE&secret_access_key={marker}"
    )
    state = {"w": torch.arange(100.0), "step": 3}
    dcp.save(state, storage_writer=ckptstore.dcp.Writer(url))
    client = moto_s3.client()
    keys = [item["Key"] for item in client.list_objects_v2(Bucket=moto_s3.bucket)["Contents"]]
    assert any(key.endswith("manifest.json") for key in keys), keys
    for key in keys:  # nothing the bucket holds carries the secret, the manifest included
        body = client.get_object(Bucket=moto_s3.bucket, Key=key)["Body"].read()
        assert marker.encode() not in body, key
    loaded = {"w": torch.zeros(100), "step": 0}
    dcp.load(loaded, storage_reader=ckptstore.dcp.Reader(url))
    assert torch.equal(loaded["w"], state["w"])
    assert loaded["step"] == 3


@pytest.mark.s3
def test_a_step_in_a_url_with_a_query_is_that_step_of_the_root(moto_s3: Any) -> None:
    query = f"endpoint_url={moto_s3.endpoint}&region={moto_s3.region}"
    dcp.save(
        {"w": torch.arange(5.0)},
        storage_writer=ckptstore.dcp.Writer(f"s3://{moto_s3.bucket}/run/3?{query}"),
    )
    assert ckptstore.list_steps(f"s3://{moto_s3.bucket}/run?{query}") == [3]
    client = moto_s3.client()
    keys = [item["Key"] for item in client.list_objects_v2(Bucket=moto_s3.bucket)["Contents"]]
    assert "run/3/manifest.json" in keys, keys


_LOAD_A_MISSING_STEP = """
import sys, warnings
import torch, torch.distributed.checkpoint as dcp
import ckptstore.dcp
warnings.filterwarnings("ignore", "torch.distributed is disabled")
try:
    dcp.load({"w": torch.zeros(3)}, storage_reader=ckptstore.dcp.Reader(sys.argv[1]))
except BaseException as exc:  # DCP's CheckpointException is a BaseException
    print("refused:", "holds no committed checkpoint" in str(exc))
"""


@pytest.mark.s3
def test_a_load_of_a_step_never_committed_closes_its_client(moto_s3: Any) -> None:
    url = f"s3://{moto_s3.bucket}/run/7?endpoint_url={moto_s3.endpoint}&region={moto_s3.region}"
    out = subprocess.run(
        [sys.executable, "-X", "dev", "-c", _LOAD_A_MISSING_STEP, url],
        env={**os.environ, "PYTHONPATH": python_path()},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.stdout.strip() == "refused: True", out.stdout + out.stderr
    assert "Unclosed" not in out.stderr, out.stderr
