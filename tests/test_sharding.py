"""Sharded tensors and resharding, with ranks as threads (``LocalGroup``) on local disk: the
chunk format, verified partial reads, hostile chunk lists, and the save's checks across ranks.
The same on real gloo processes and SeaweedFS: tests/test_sharding_ranks.py; JAX meshes:
tests/test_sharding_jax.py."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptstore
from ckptstore import background
from ckptstore.distributed import LocalGroup, Shard, load, save
from ckptstore.errors import CorruptCheckpointError
from ckptstore.layout.chunks import MAX_SAVE_BLOCKS, MIN_BLOCK_SIZE, block_size_for, check_grid
from ckptstore.layout.keys import manifest_key
from ckptstore.layout.manifest import Manifest
from ckptstore.store.checksum import crc32c
from ckptstore.store.registry import open_store
from ckptstore.store.wrappers import CountingStore

BLOCK = 4 << 10
FULL = np.arange(192 * 96, dtype=np.float32).reshape(192, 96) * 0.5  # 72 KiB

Box = tuple[tuple[int, ...], tuple[int, ...]]


def split(shape: tuple[int, ...], parts: int, dim: int) -> list[Box]:
    """``parts`` boxes of ``shape`` along ``dim``, as torch.chunk splits (uneven at the end)."""
    per = -(-shape[dim] // parts)
    boxes = []
    for i in range(parts):
        low = min(shape[dim], i * per)
        high = min(shape[dim], low + per)
        start = tuple(low if d == dim else 0 for d in range(len(shape)))
        size = tuple(high - low if d == dim else n for d, n in enumerate(shape))
        boxes.append((start, size))
    return boxes


def grid(shape: tuple[int, ...], rows: int, cols: int) -> list[Box]:
    return [
        ((r[0][0], c[0][1]), (r[1][0], c[1][1]))
        for r in split(shape, rows, 0)
        for c in split(shape, cols, 1)
    ]


def cut(full: np.ndarray[Any, Any], box: Box) -> np.ndarray[Any, Any]:
    return full[tuple(slice(s, s + n) for s, n in zip(*box, strict=True))]


def in_threads(world: int, fn: Callable[[int, Any], Any]) -> list[Any]:
    group = LocalGroup(world, timeout=60)
    with ThreadPoolExecutor(world) as pool:
        return list(pool.map(lambda rank: fn(rank, group.member(rank)), range(world)))


def save_boxes(root: str, boxes: list[Box], step: int = 1) -> None:
    """Save FULL as ``w`` from ``len(boxes)`` ranks, rank r holding ``boxes[r]`` of it."""

    def one(rank: int, comm: Any) -> Any:
        box = boxes[rank]
        part = {"w": Shard(cut(FULL, box), offsets=box[0], global_shape=FULL.shape), "step": step}
        return save(root, part, step=step, comm=comm, chunk_block_size=BLOCK)

    in_threads(len(boxes), one)


def load_boxes(
    root: str, boxes: list[Box], step: int = 1
) -> list[tuple[np.ndarray[Any, Any], int]]:
    """Load each box on a rank of its own; return what each read and its bytes read."""

    def one(rank: int, comm: Any) -> tuple[np.ndarray[Any, Any], int]:
        box = boxes[rank]
        counting = CountingStore(open_store(root))
        like = {"w": Shard(np.empty(box[1], np.float32), offsets=box[0], global_shape=FULL.shape)}
        # a collective load (read once, broadcast): each rank still reads its own boxes
        got = load(counting, step, target=like, comm=comm)["w"]
        background.run(counting.close())
        assert isinstance(got, Shard)
        assert got.offsets == box[0]
        return got.tensor, counting.bytes["read"]

    return in_threads(len(boxes), one)


SAVED_AS = {
    "rows": split(FULL.shape, 4, 0),
    "columns": split(FULL.shape, 4, 1),
    "grid": grid(FULL.shape, 2, 2),
}
LOADED_AS: dict[str, Callable[[int], list[Box]]] = {
    "rows": lambda world: split(FULL.shape, world, 0),
    "columns": lambda world: split(FULL.shape, world, 1),
    "grid": lambda world: grid(FULL.shape, 2, world // 2) if world % 2 == 0 else [],
}


@pytest.mark.parametrize("saved_as", sorted(SAVED_AS))
@pytest.mark.parametrize("loaded_as", sorted(LOADED_AS))
def test_4_ranks_save_and_any_world_and_sharding_load_bit_exact(
    tmp_path: Path, saved_as: str, loaded_as: str
) -> None:
    root = str(tmp_path / "ckpt")
    save_boxes(root, SAVED_AS[saved_as])
    manifest = ckptstore.read_manifest(root)
    assert manifest.chunks is not None
    assert len(manifest.chunks.leaf) == 4
    for world in (2, 3, 8):
        boxes = LOADED_AS[loaded_as](world)
        if not boxes:
            continue
        for box, (array, _) in zip(boxes, load_boxes(root, boxes), strict=True):
            assert array.shape == box[1]
            np.testing.assert_array_equal(array, cut(FULL, box))
    # 4 -> 1: one process, the full tensor
    whole = ckptstore.load(root)
    np.testing.assert_array_equal(whole["w"], FULL)
    assert whole["step"] == 1


def test_row_resharding_reads_at_most_1_1x_what_it_needs(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    big = np.random.default_rng(0).standard_normal((1024, 256), dtype=np.float32)  # 1 MiB

    def one(rank: int, comm: Any) -> Any:
        box = split(big.shape, 4, 0)[rank]
        part = {"w": Shard(cut(big, box), offsets=box[0], global_shape=big.shape)}
        return save(root, part, step=1, comm=comm, chunk_block_size=BLOCK)

    in_threads(4, one)
    for world in (3, 5, 8):
        for box in split(big.shape, world, 0):
            counting = CountingStore(open_store(root))
            like = {
                "w": Shard(np.empty(box[1], np.float32), offsets=box[0], global_shape=big.shape)
            }
            got = load(counting, 1, target=like)["w"]
            np.testing.assert_array_equal(got.tensor, cut(big, box))
            needed = math.prod(box[1]) * 4
            assert needed <= counting.bytes["read"] <= 1.1 * needed, (world, box)
            # over-read is at most one partial block at each end of each chunk overlap
            assert counting.bytes["read"] - needed < 2 * 2 * BLOCK


@pytest.mark.parametrize("loaded_as", ["grid 2x2", "columns/4", "grid 4x2"])
def test_a_column_split_of_a_table_saved_by_rows_reads_only_its_bytes(
    tmp_path: Path, loaded_as: str
) -> None:
    # the default Settings: blocks of a quarter row, not 1 MiB, and no merging across the
    # runs a box skips, so a box that takes part of every row reads just that part
    root = str(tmp_path / "ckpt")
    table = np.random.default_rng(1).standard_normal((512, 8192), dtype=np.float32)  # 16 MiB

    def one(rank: int, comm: Any) -> Any:
        box = split(table.shape, 4, 0)[rank]
        return save(
            root,
            {"t": Shard(cut(table, box), offsets=box[0], global_shape=table.shape)},
            step=1,
            comm=comm,
        )

    in_threads(4, one)
    manifest = ckptstore.read_manifest(root)
    assert manifest.chunks is not None
    assert manifest.chunks.block_size == 8192  # a quarter of a 32 KiB row
    kind, _, how = loaded_as.partition(" ")
    boxes = (
        split(table.shape, 4, 1)
        if kind == "columns/4"
        else grid(table.shape, int(how[0]), int(how[2]))
    )
    for box in boxes:
        counting = CountingStore(open_store(root))
        like = {"t": Shard(np.empty(box[1], np.float32), offsets=box[0], global_shape=table.shape)}
        got = load(counting, 1, target=like)["t"]
        background.run(counting.close())
        np.testing.assert_array_equal(got.tensor, cut(table, box))
        assert counting.bytes["read"] == math.prod(box[1]) * 4, box


def test_block_size_is_a_quarter_of_the_shortest_row_within_its_bounds() -> None:
    mib = 1 << 20
    assert block_size_for([((2048, 16384), 4)] * 4, mib) == 16 << 10
    assert block_size_for([((2048, 16384), 4), ((64, 1000), 2)], mib) == MIN_BLOCK_SIZE  # 500 B
    assert block_size_for([((2048, 16384), 4)], 4096) == 4096  # never above the setting
    assert block_size_for([((1 << 20,), 4)], mib) == mib  # 1-D chunks: one run, any block
    assert block_size_for([((100, 8), 4)], mib) == MIN_BLOCK_SIZE
    assert block_size_for([], mib) == mib
    # rows of 64 KiB want 16 KiB blocks, but 64 GiB of chunks would hold 4 Mi of them
    many = [((1 << 18, 1 << 14), 4)] * 4  # 4 x 16 GiB
    block = block_size_for(many, mib)
    assert block == 64 << 10
    assert 4 * (16 << 30) // block <= MAX_SAVE_BLOCKS


def test_an_empty_sharded_leaf_does_not_shrink_the_blocks_of_the_others() -> None:
    from ckptstore.manager.distributed import _block_size, _Leaf

    def leaf(shape: list[int], rows: int) -> _Leaf:
        box = ((0, 0), (rows, shape[1]))
        nbytes = math.prod(shape) * 4
        return _Leaf("t", "float32", shape, nbytes, None, {0: 0}, chunks=[(0, 0, box)])

    table = leaf([8192, 16384], 2048)
    assert _block_size([table], 1 << 20) == 16 << 10
    assert _block_size([table, leaf([0, 16384], 0)], 1 << 20) == 16 << 10


def _chunk_object(root: str, chunk: int) -> tuple[Path, int]:
    manifest = ckptstore.read_manifest(root)
    assert manifest.chunks is not None
    key = manifest.object_key(manifest.chunks.object[chunk])
    return Path(root) / key, manifest.chunks.offset[chunk]


def test_a_corrupted_block_fails_the_loads_that_read_it_and_no_other(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    save_boxes(root, SAVED_AS["rows"])
    manifest = ckptstore.read_manifest(root)
    assert manifest.chunks is not None
    first = manifest.chunks.start.index([0, 0])  # rows [0, 48): 18 KiB, blocks 0-4
    path, offset = _chunk_object(root, first)
    raw = bytearray(path.read_bytes())
    raw[offset + 3 * BLOCK + 100] ^= 0x40  # in block 3: rows 32-42
    path.write_bytes(bytes(raw))

    with pytest.raises(CorruptCheckpointError, match=r"block 3: crc32c mismatch"):
        load_boxes(root, [((30, 0), (10, 96))])
    with pytest.raises(CorruptCheckpointError, match=r"block 3"):
        ckptstore.load(root)
    # a box whose blocks are intact loads: verification is per block, not per chunk
    ((array, _),) = load_boxes(root, [((0, 0), (16, 96))])
    np.testing.assert_array_equal(array, FULL[:16])


def test_replicated_boxes_are_written_once_spread_over_their_holders(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    halves = split(FULL.shape, 2, 0)
    save_boxes(root, [halves[0], halves[0], halves[1], halves[1]])
    manifest = ckptstore.read_manifest(root)
    assert manifest.chunks is not None
    assert sorted(map(tuple, manifest.chunks.start)) == [(0, 0), (96, 0)]
    np.testing.assert_array_equal(ckptstore.load(root)["w"], FULL)


def test_ranks_whose_shards_do_not_tile_the_array_all_get_the_same_error(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    overlapping = [((0, 0), (100, 96)), ((90, 0), (102, 96))]
    with pytest.raises(ValueError, match=r"shards of 'w'.*overlap"):
        save_boxes(root, overlapping)
    gap = [((0, 0), (90, 96)), ((100, 0), (92, 96))]
    with pytest.raises(ValueError, match=r"no chunk covers \[90, 100\) along dimension 0"):
        save_boxes(root, gap)

    def mixed(rank: int, comm: Any) -> Any:
        box = split(FULL.shape, 2, 0)[rank]
        leaf = Shard(cut(FULL, box), offsets=box[0], global_shape=FULL.shape) if rank else FULL
        try:
            save(root, {"w": leaf}, step=1, comm=comm)
        except ValueError as exc:
            return str(exc)
        return "saved"

    errors = in_threads(2, mixed)
    assert errors[0] == errors[1]
    assert "shard of a global array on rank 1" in errors[0]
    assert ckptstore.list_steps(root) == []


def test_a_shard_target_reads_its_box_of_a_leaf_saved_whole(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    ckptstore.save(root, {"w": FULL}, step=3)
    ((array, _),) = load_boxes(root, [((10, 20), (5, 7))], step=3)
    np.testing.assert_array_equal(array, FULL[10:15, 20:27])


def test_shard_arguments_and_targets_are_checked() -> None:
    with pytest.raises(ValueError, match="reaches out of the global shape"):
        Shard(np.ones((2, 2)), offsets=(3, 0), global_shape=(4, 4))
    with pytest.raises(ValueError, match="2 dimensions"):
        Shard(np.ones((2, 2)), offsets=(0,), global_shape=(4, 4))
    with pytest.raises(TypeError, match="ints"):
        Shard(np.ones((2, 2)), offsets=(0.5, 0), global_shape=(4, 4))


def test_a_shard_target_of_another_global_shape_is_refused(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    save_boxes(root, SAVED_AS["rows"])
    like = {"w": Shard(np.empty((4, 96), np.float32), offsets=(0, 0), global_shape=(200, 96))}
    with pytest.raises(ValueError, match=r"target has global shape \[200, 96\], the checkpoint"):
        load(root, 1, target=like)
    like = {"w": Shard(np.empty((8, 96), np.float32), offsets=(190, 0), global_shape=(200, 96))}
    with pytest.raises(ValueError, match="not inside the checkpoint's shape"):
        load(root, 1, target=like)


# --------------------------------------------------------------------------- the format


def _saved_doc(tmp_path: Path) -> tuple[str, dict[str, Any]]:
    root = str(tmp_path / "ckpt")
    save_boxes(root, grid(FULL.shape, 2, 2))
    raw = (Path(root) / manifest_key(1)).read_bytes()
    assert raw.startswith(b'{"format":"ckptstore","version":3,')
    return root, json.loads(raw[raw.index(b'"body":') + 7 : -1])


def _encode(doc: dict[str, Any], version: int = 3) -> bytes:
    body = json.dumps(doc, separators=(",", ":")).encode()
    head = f'{{"format":"ckptstore","version":{version},"crc32c":{crc32c(body)},"body":'
    return head.encode() + body + b"}"


def _set_chunk(field: str, chunk: int, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        doc["chunks"][field][chunk] = value

    return mutate


def _drop_chunk(doc: dict[str, Any]) -> None:
    for field, column in doc["chunks"].items():
        if field != "block_size":
            del column[-1]


def _repeat_chunk(doc: dict[str, Any]) -> None:
    for field, column in doc["chunks"].items():
        if field != "block_size":
            column.append(copy.deepcopy(column[0]))


def _same_bytes_as_chunk_0(doc: dict[str, Any]) -> None:
    doc["chunks"]["object"][1] = doc["chunks"]["object"][0]
    doc["chunks"]["offset"][1] = doc["chunks"]["offset"][0]


def _negative_block_crcs(doc: dict[str, Any]) -> None:
    doc["chunks"]["crc32c"][0] = [-1] * len(doc["chunks"]["crc32c"][0])


HOSTILE: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "overlapping chunk": (_set_chunk("start", 1, [0, 40]), "overlap along dimension 1"),
    "same box twice": (_repeat_chunk, "two chunks cover the box at"),
    "missing chunk": (_drop_chunk, "a gap in the grid"),
    "out of bounds": (_set_chunk("start", 3, [96, 60]), "reaches out of the array's shape"),
    "empty chunk": (_set_chunk("shape", 0, [0, 48]), "is empty or too large"),
    "wrong rank": (_set_chunk("start", 0, [0]), "not a list of 2 ints"),
    "block count": (_set_chunk("crc32c", 0, [1]), "does not hold"),
    "block crc not u32": (_negative_block_crcs, "32-bit"),
    "block size": (lambda doc: doc["chunks"].__setitem__("block_size", 3000), "power of two"),
    "tiny block size": (lambda doc: doc["chunks"].__setitem__("block_size", 512), "power of two"),
    "unknown leaf": (_set_chunk("leaf", 0, 7), "chunks.leaf"),
    "unknown object": (_set_chunk("object", 0, 99), "chunks.object"),
    "negative offset": (_set_chunk("offset", 0, -1), "chunks.offset"),
    "chunks overlap in an object": (_same_bytes_as_chunk_0, "overlap in one object"),
    "chunk past its object": (_set_chunk("offset", 0, 1 << 40), "reaches past the end"),
    "leaf with an object too": (
        lambda doc: doc["leaves"]["object"].__setitem__(0, 0),
        "both an object and chunks",
    ),
    "unknown field": (lambda doc: doc["chunks"].__setitem__("extra", []), "exactly the fields"),
    "columns differ": (lambda doc: doc["chunks"]["offset"].pop(), "differ in length"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_chunk_lists_are_refused_before_any_data_read(tmp_path: Path, case: str) -> None:
    root, doc = _saved_doc(tmp_path)
    mutate, reason = HOSTILE[case]
    mutate(doc)
    (Path(root) / manifest_key(1)).write_bytes(_encode(doc))
    counting = CountingStore(open_store(root))
    with pytest.raises(CorruptCheckpointError, match="invalid manifest") as caught:
        ckptstore.load(counting, 1)
    assert reason in str(caught.value)
    assert counting.bytes["read"] == 0


def test_chunks_in_an_older_version_are_refused_and_older_manifests_still_load(
    tmp_path: Path,
) -> None:
    _, doc = _saved_doc(tmp_path)
    with pytest.raises(CorruptCheckpointError, match="version-2 manifest has no chunks"):
        Manifest.parse(_encode(doc, version=2))
    plain = str(tmp_path / "plain")
    ckptstore.save(plain, {"w": FULL}, step=1)
    raw = (Path(plain) / manifest_key(1)).read_bytes()
    assert raw.startswith(
        (b'{"format":"ckptstore","version":1,', b'{"format":"ckptstore","version":2,')
    )
    np.testing.assert_array_equal(ckptstore.load(plain)["w"], FULL)


def test_grid_check_names_each_problem() -> None:
    shape = (4, 4)
    check_grid(shape, [(0, 0), (0, 2), (2, 0), (2, 2)], [(2, 2)] * 4)
    with pytest.raises(ValueError, match="gap in the grid"):
        check_grid(shape, [(0, 0), (0, 2), (2, 0)], [(2, 2)] * 3)
    with pytest.raises(ValueError, match="overlap"):
        check_grid(shape, [(0, 0), (1, 0)], [(3, 4), (3, 4)])
    with pytest.raises(ValueError, match=r"no chunk covers \[2, 4\) along dimension 1"):
        check_grid(shape, [(0, 0), (2, 0)], [(2, 2), (2, 2)])
    with pytest.raises(ValueError, match="reaches out"):
        check_grid(shape, [(0, 0), (2, 0)], [(2, 4), (3, 4)])
    # an exact tiling that is not a grid is refused, as no framework makes one
    with pytest.raises(ValueError, match="overlap along dimension 1"):
        check_grid(shape, [(0, 0), (2, 0), (2, 2)], [(2, 4), (2, 2), (2, 2)])


def test_verify_finds_a_damaged_chunk_and_cp_copies_a_sharded_step(tmp_path: Path) -> None:
    from ckptstore.layout.maintenance import copy_step, verify_step

    root, copy_root = str(tmp_path / "ckpt"), str(tmp_path / "copy")
    save_boxes(root, grid(FULL.shape, 2, 2))

    async def copy_and_verify() -> tuple[int, int]:
        async with open_store(root) as src, open_store(copy_root) as dst:
            await copy_step(src, dst, 1)
            return len((await verify_step(src, 1)).damage), len((await verify_step(dst, 1)).damage)

    assert background.run(copy_and_verify()) == (0, 0)
    copied = ckptstore.read_manifest(copy_root)
    assert copied.chunks is not None
    np.testing.assert_array_equal(ckptstore.load(copy_root)["w"], FULL)
    ((array, _),) = load_boxes(copy_root, [((50, 10), (100, 70))])
    np.testing.assert_array_equal(array, FULL[50:150, 10:80])

    path, offset = _chunk_object(copy_root, 2)
    raw = bytearray(path.read_bytes())
    raw[offset + 10] ^= 1
    path.write_bytes(bytes(raw))

    async def verify() -> list[tuple[str, str, str]]:
        async with open_store(copy_root) as store:
            return [(d.kind, d.name, d.problem) for d in (await verify_step(store, 1)).damage]

    # the object's crc32c and the crc32c of the block the flipped byte is in
    (obj, block) = background.run(verify())
    assert obj[0] == "object"
    assert "crc32c mismatch" in obj[2]
    assert block[:2] == ("leaf", f"w (chunk at {copied.chunks.start[2]}, block 0)")


async def test_any_box_of_any_grid_reads_exactly_its_elements() -> None:
    """Random grids of chunks in 1 to 3 dimensions, random dtypes and boxes, 4 KiB and 1 MiB
    blocks: what read_boxes returns (100 trials) equals numpy's slice of the global array."""
    import itertools
    import random

    from ckptstore.layout.chunks import Chunks, block_crcs, read_boxes
    from ckptstore.store.memory import MemoryStore

    rng = random.Random(22)

    def intervals(n: int) -> list[tuple[int, int]]:
        cuts = sorted(rng.sample(range(1, n), min(rng.randint(0, 3), n - 1)))
        bounds = [0, *cuts, n]
        return list(itertools.pairwise(bounds))

    for trial in range(100):
        shape = tuple(rng.randint(1, 40) for _ in range(rng.randint(1, 3)))
        dtype = np.dtype(rng.choice(["u1", "i2", "f4", "f8"]))
        full = (np.arange(math.prod(shape)) % 251).astype(dtype).reshape(shape)
        block = rng.choice([4 << 10, 1 << 20])
        store = MemoryStore()
        rows = []
        for i, cell in enumerate(itertools.product(*(intervals(n) for n in shape))):
            data = np.ascontiguousarray(full[tuple(slice(a, b) for a, b in cell)])
            await store.put(f"chunk{i}", data.tobytes())
            rows.append(
                (0, [a for a, _ in cell], [b - a for a, b in cell], i, 0, block_crcs(data, block))
            )
        boxes: list[Box] = []
        for _ in range(rng.randint(1, 3)):
            start = tuple(rng.randint(0, n - 1) for n in shape)
            size = tuple(rng.randint(1, n - s) for s, n in zip(start, shape, strict=True))
            boxes.append((start, size))
        got = await read_boxes(
            store, "chunk{}".format, Chunks.build(block, rows), 0, shape, dtype, boxes, where="t"
        )
        for box, array in zip(boxes, got, strict=True):
            np.testing.assert_array_equal(array, cut(full, box), err_msg=f"trial {trial}")


def test_verify_checks_every_block_against_its_own_crc32c(tmp_path: Path) -> None:
    """A block crc32c that lies (the object's crc32c intact) fails verify as it fails loads."""
    from ckptstore.layout.maintenance import verify_step

    root, doc = _saved_doc(tmp_path)
    doc["chunks"]["crc32c"][1][2] ^= 1
    (Path(root) / manifest_key(1)).write_bytes(_encode(doc))

    async def verify() -> list[tuple[str, str]]:
        async with open_store(root) as store:
            return [(d.kind, d.name) for d in (await verify_step(store, 1)).damage]

    (damage,) = background.run(verify())
    assert damage[0] == "leaf"
    assert damage[1] == f"w (chunk at {doc['chunks']['start'][1]}, block 2)"
    with pytest.raises(CorruptCheckpointError, match="block 2: crc32c mismatch"):
        ckptstore.load(root)


def test_a_whole_leaf_packed_beside_chunks_reads_only_its_bytes(tmp_path: Path) -> None:
    # A rank packs the small leaves it owns with the chunks it writes: loading such a leaf
    # alone must read its bytes, not the whole pack (the pack holds chunks too).
    root = str(tmp_path / "ckpt")
    bias = np.arange(256, dtype=np.float32)  # 1 KiB, every rank holds it
    boxes = split(FULL.shape, 2, 0)

    def one(rank: int, comm: Any) -> Any:
        box = boxes[rank]
        part = {"w": Shard(cut(FULL, box), offsets=box[0], global_shape=FULL.shape), "b": bias}
        return save(root, part, step=1, comm=comm, chunk_block_size=BLOCK)

    in_threads(2, one)
    manifest = ckptstore.read_manifest(root, 1)
    assert manifest.chunks is not None
    packed_with = manifest.leaf_object[manifest.paths.index("b")]
    assert packed_with in manifest.chunks.object  # the case at hand: one object, both kinds
    counting = CountingStore(open_store(root))
    got = ckptstore.load(counting, 1, keys=["b"])
    assert np.array_equal(got["b"], bias)
    assert counting.bytes["read"] == bias.nbytes
