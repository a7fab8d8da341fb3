"""Unit tests of the layout pieces that need no store: tree, dtypes, plan, manifest codec."""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import ckptstore
from ckptstore.config import Settings
from ckptstore.errors import CorruptCheckpointError, StoreError
from ckptstore.layout.commit import read_manifest
from ckptstore.layout.dtypes import dtype_from_name, dtype_name
from ckptstore.layout.keys import manifest_key
from ckptstore.layout.manifest import Manifest, SharedManifests
from ckptstore.layout.plan import PackPlan
from ckptstore.layout.tree import (
    MAX_DEPTH,
    UnsupportedLeafError,
    flatten,
    select_paths,
    tree_paths,
    unflatten,
)
from ckptstore.store.base import Capabilities, Store
from ckptstore.store.buffers import PAGE, BufferPool
from ckptstore.store.checksum import crc32c
from ckptstore.store.wrappers import CountingStore, Fault, FaultStore, StoreWrapper, transient_error
from ckptstore.testing import assert_same_state


class Opaque:
    pass


@pytest.mark.parametrize(
    ("state", "path", "reason"),
    [
        ({"a": {"b": np.array([object()], dtype=object)}}, "a/b", "dtype object"),
        ({"a": [1, Opaque()]}, "a/1", "Opaque"),
        ({"s": {1, 2}}, "s", "set"),
        ({"u": np.array(["x"])}, "u", "dtype <U1"),
        ({"t": np.array(["2020-01-01"], dtype="M8[D]")}, "t", "datetime64"),
        ({"k": {(1, 2): 3}}, "k", "tuple; keys are str or int"),
        ({"k": {1: 0, "1": 0}}, "k", "share one path"),
        ({"b": b"raw"}, "b", "bytes"),
    ],
)
def test_unsupported_leaves_name_their_path(state: object, path: str, reason: str) -> None:
    with pytest.raises(UnsupportedLeafError, match=reason) as info:
        flatten(state)
    assert info.value.path == path


def test_too_deep_is_refused() -> None:
    state: object = np.zeros(1)
    for _ in range(MAX_DEPTH + 2):
        state = [state]
    with pytest.raises(UnsupportedLeafError, match="deeper"):
        flatten(state)


def _chain(depth: int, leaf: object) -> object:
    """``leaf`` under ``depth`` one-key dicts."""
    tree = leaf
    for _ in range(depth):
        tree = {"d": ["k"], "c": [tree]}
    return tree


def test_tree_paths_takes_the_depth_limit_at_a_leaf_as_at_any_node() -> None:
    """A leaf index right under a dict is placed without a trip through the walk's stack:
    the depth limit, a bad index and an index used twice still refuse it, as before."""
    assert tree_paths(_chain(MAX_DEPTH, 0), 1)[0] == ["/".join(["k"] * MAX_DEPTH)]
    with pytest.raises(ValueError, match="deeper than"):
        tree_paths(_chain(MAX_DEPTH + 1, 0), 1)
    with pytest.raises(ValueError, match=r"tree leaf 'a' names array 2 of 2"):
        tree_paths({"d": ["a", "b"], "c": [2, 0]}, 2)
    with pytest.raises(ValueError, match=r"tree names array 0 twice \('b'\)"):
        tree_paths({"d": ["a", "b"], "c": [0, 0]}, 2)
    with pytest.raises(ValueError, match=r"tree names array 0 twice \('x/0'\)"):
        tree_paths({"d": ["a", "x"], "c": [0, {"l": [0]}]}, 2)
    # a dict of array leaves alone is checked in bulk: an index another node placed, or one
    # it repeats, is still refused by name
    with pytest.raises(ValueError, match=r"tree names array 0 twice \('x/y'\)"):
        tree_paths({"d": ["a", "x"], "c": [0, {"d": ["y", "z"], "c": [0, 1]}]}, 2)
    with pytest.raises(ValueError, match=r"tree names array 1 twice \('x/z'\)"):
        tree_paths({"d": ["a", "x"], "c": [0, {"d": ["y", "z"], "c": [1, 1]}]}, 2)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (["a", 1.5], r"tree dict at 'x' has a float key"),
        (["a", True], r"tree dict at 'x' has a bool key"),
        (["a", None], r"tree dict at 'x' has a NoneType key"),
        ([1, "1"], r"tree dict at 'x' repeats key '1'"),
        (["a/b", "a~1b", "a/b"], r"tree dict at 'x' repeats key 'a~1b'"),
    ],
)
def test_tree_paths_refuse_a_dict_with_bad_or_repeated_keys(keys: list[Any], message: str) -> None:
    """A dict's keys are str or int, and no two spell one path segment (escaped)."""
    tree = {"d": ["x"], "c": [{"d": keys, "c": list(range(len(keys)))}]}
    with pytest.raises(ValueError, match=message):
        tree_paths(tree, len(keys))


def test_tree_paths_escape_and_join_keys_at_every_depth() -> None:
    tree = {"d": ["a/b", 7], "c": [{"d": ["~c", 0], "c": [0, {"l": [1]}]}, 2]}
    assert tree_paths(tree, 3)[0] == ["a~1b/~0c", "a~1b/0/0", "7"]


def test_paths_escape_separators() -> None:
    flat = flatten({"a/b": {"~c": np.zeros(1)}, 7: [np.ones(1)], "top": np.zeros(2)})
    assert flat.paths == ["a~1b/~0c", "7/0", "top"]
    assert flatten(np.zeros(3)).paths == [""]


def test_a_container_of_plain_arrays_is_flattened_in_bulk_as_leaf_by_leaf() -> None:
    """A dict or list whose children are all plain numpy arrays is added in one step, not
    leaf by leaf: the same indices, paths, attrs and tree as the walk gives leaf by leaf (a
    container of one array, or of arrays and other values, still goes that way), and an
    array of a dtype no checkpoint holds is still named by its path."""
    a, b, c, d = (np.full(2, i, np.float32) for i in range(4))
    e = np.arange(3, dtype=np.int8)
    m = np.zeros(2).view(np.memmap)  # a subclass: leaf by leaf, as an array
    state = {"mlp": {"w/1": a, "b": b}, "one": [c], "mixed": [d, 3, m], "ints": (e, e)}
    flat = flatten(state)
    assert flat.paths == ["mlp/w~11", "mlp/b", "one/0", "mixed/0", "mixed/2", "ints/0", "ints/1"]
    assert [x is y for x, y in zip(flat.arrays, [a, b, c, d, m, e, e], strict=True)] == [
        True, True, True, True, False, True, True
    ]  # fmt: skip
    assert flat.attrs == [None] * 7
    assert flat.tree == {
        "d": ["mlp", "one", "mixed", "ints"],
        "c": [
            {"d": ["w/1", "b"], "c": [0, 1]},
            {"l": [2]},
            {"l": [3, {"v": 3}, 4]},
            {"t": [5, 6]},
        ],
    }
    assert_same_state(unflatten(flat.tree, flat.arrays), state)
    with pytest.raises(UnsupportedLeafError, match=r"'layer/q'.*dtype object"):
        flatten({"layer": {"k": a, "q": np.array([None, 1]), "v": b}})


def test_unflatten_with_selection_prunes() -> None:
    state = {"m": {"w": np.zeros(2), "b": np.ones(2)}, "l": [np.zeros(1), 5], "x": 1}
    flat = flatten(state)
    out = unflatten(flat.tree, flat.arrays, selected=lambda p: p in {"m/w", "l/1"})
    assert_same_state(out, {"m": {"w": np.zeros(2)}, "l": [None, 5]})


def test_unflatten_with_selection_drops_empty_containers_it_did_not_select() -> None:
    """An empty container (an optax ``EmptyState``, an empty dict of hyper-parameters) came
    back from every selection, so ``load(url, keys=["model"])`` returned other top-level keys
    too; it is kept only under a selected path, like a plain value."""
    state = {"m": {"w": np.zeros(2)}, "opt": ((), {"lr": {}}), "e": [], "keep": {"x": {}}}
    flat = flatten(state)
    only_m = unflatten(flat.tree, flat.arrays, selected=select_paths(["m"]))
    assert_same_state(only_m, {"m": {"w": np.zeros(2)}})
    with_keep = unflatten(flat.tree, flat.arrays, selected=select_paths(["m", "keep"]))
    assert_same_state(with_keep, {"m": {"w": np.zeros(2)}, "keep": {"x": {}}})


def test_convert_hook_supplies_arrays_and_attrs() -> None:
    def convert(leaf: object, path: str) -> tuple[np.ndarray, dict[str, object]] | None:
        if isinstance(leaf, Opaque):
            return np.arange(3), {"framework": "opaque", "path": path}
        return None

    flat = flatten({"a": Opaque(), "b": np.zeros(1)}, convert=convert)
    assert flat.paths == ["a", "b"]
    assert flat.attrs == [{"framework": "opaque", "path": "a"}, None]


def test_typed_values_and_ordered_dicts_round_trip_through_the_tree() -> None:
    torch = pytest.importorskip("torch")
    from collections import OrderedDict

    state = {
        "sd": OrderedDict([("z", np.ones(2)), ("a", OrderedDict([(1, "x")]))]),
        "dtypes": [torch.bfloat16, torch.float8_e5m2, torch.complex64],
        "device": (torch.device("cuda", 3), torch.device("cpu")),
        "plain": {"o": 1, "x": ["torch.dtype", "int8"]},  # user keys shaped like the nodes
    }
    flat = flatten(state)
    assert flat.tree["c"][0]["o"] == 1
    assert "o" not in flat.tree["c"][3]
    assert flat.tree["c"][1]["l"][0] == {"x": ["torch.dtype", "bfloat16"]}
    assert flat.tree["c"][2]["t"][0] == {"x": ["torch.device", "cuda:3"]}
    leaf_paths, value_paths = tree_paths(flat.tree, len(flat.arrays))
    assert leaf_paths == ["sd/z"]
    assert "dtypes/0" in value_paths
    assert "device/1" in value_paths
    out = unflatten(flat.tree, flat.arrays)
    assert type(out["sd"]) is OrderedDict
    assert type(out["sd"]["a"]) is OrderedDict
    assert list(out["sd"]) == ["z", "a"]
    assert out["dtypes"] == state["dtypes"]
    assert out["device"] == state["device"]
    assert type(out["plain"]) is dict
    assert out["plain"] == state["plain"]
    with pytest.raises(ValueError, match="needs format version 4"):
        tree_paths(flat.tree, len(flat.arrays), version_4=False)
    selected = unflatten(flat.tree, flat.arrays, selected=select_paths(["dtypes/1"]))
    assert selected == {"dtypes": [None, torch.float8_e5m2, None]}


def _empty_manifest(step: int, metadata: Any = None, tree: Any = None) -> Manifest:
    """A manifest of no arrays, with ``tree`` (an empty dict's if not given)."""
    return Manifest(
        step=step,
        attempt="attempt-000000000001-0000000000000001",
        created=0.0,
        metadata=metadata,
        tree=flatten({}).tree if tree is None else tree,
        object_keys=[],
        object_lengths=[],
        object_crcs=[],
        paths=[],
        dtypes=[],
        shapes=[],
        leaf_object=[],
        leaf_offset=[],
        leaf_length=[],
        leaf_crc=[],
        attrs=[],
    )


def test_a_manifest_is_version_4_only_when_its_tree_needs_it() -> None:
    """The version is found by a search of the tree's JSON: a user's keys and strings that
    spell the new fields do not count, an ordered dict or a typed value does."""
    from collections import OrderedDict

    def version(state: Any) -> int:
        flat = flatten(state)
        manifest = _empty_manifest(1, {"o": 1, "x": '{"x":'}, flat.tree)
        data = manifest.encode()
        assert Manifest.parse(data, step=1).tree == flat.tree
        return int(data[len(b'{"format":"ckptstore","version":') :].split(b",")[0])

    shaped = {"o": 1, "x": {"x": '{"x": "o":', "o": ['"o":', '{"x":']}, '"o":': 2}
    assert version(shaped) == 1
    assert version({"a": OrderedDict(b=1)}) == 4
    assert version(OrderedDict()) == 4
    torch = pytest.importorskip("torch")
    assert version({"a": [torch.int8]}) == 4


def test_a_manifest_is_parsed_and_validated_with_the_cyclic_collector_paused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A parse makes objects by the leaf; in a training process's large heap, the full
    collections they set off doubled some parses. The collector is back on after a parse,
    and after a refused one."""
    import gc

    from ckptstore.layout import manifest as manifest_module

    if not gc.isenabled():
        pytest.skip("the cyclic collector is off in this process")
    during: list[bool] = []
    loads, validate = manifest_module._loads, Manifest._validate.__func__  # type: ignore[attr-defined]

    def watched_loads(body: bytes) -> Any:
        during.append(gc.isenabled())
        return loads(body)

    def watched_validate(cls: type[Manifest], doc: Any, step: Any, version: int) -> Manifest:
        during.append(gc.isenabled())
        return validate(cls, doc, step, version)  # type: ignore[no-any-return]

    monkeypatch.setattr(manifest_module, "_loads", watched_loads)
    monkeypatch.setattr(Manifest, "_validate", classmethod(watched_validate))
    data = _empty_manifest(3, {"n": 1}).encode()
    assert Manifest.parse(data, step=3).metadata == {"n": 1}
    assert during == [False, False]
    assert gc.isenabled()
    with pytest.raises(CorruptCheckpointError, match="read as step 4"):
        Manifest.parse(data, step=4)
    assert during == [False, False, False, False]
    assert gc.isenabled()


def test_shared_manifests_spare_the_parse_of_the_same_bytes_only() -> None:
    held = SharedManifests(entries=2, max_bytes=1 << 20)
    data = _empty_manifest(3, {"n": 1}).encode()
    first = held.parse(data, 3, 1 << 20, "m")
    assert first.metadata == {"n": 1}
    assert held.parse(bytes(bytearray(data)), 3, 1 << 20, "m") is first  # equal bytes
    # other bytes are parsed (and validated) anew: a changed manifest is never served
    other = _empty_manifest(3, {"n": 2}).encode()
    assert held.parse(other, 3, 1 << 20, "m").metadata == {"n": 2}
    flipped = data.replace(b'"n":1', b'"n":7')
    with pytest.raises(CorruptCheckpointError, match="crc32c mismatch"):
        held.parse(flipped, 3, 1 << 20, "m")
    # nor are bytes held for one step served for another, or to a reader of a smaller cap
    with pytest.raises(CorruptCheckpointError, match="read as step 4"):
        held.parse(data, 4, 1 << 20, "m")
    with pytest.raises(CorruptCheckpointError, match="over the"):
        held.parse(data, 3, len(data) - 1, "m")
    assert len(held) == 2


def test_shared_manifests_drop_the_least_recently_used_and_keep_to_their_bytes() -> None:
    held = SharedManifests(entries=2, max_bytes=1 << 20)
    a, b, c = (_empty_manifest(step).encode() for step in (1, 2, 3))
    ma, mb = held.parse(a, 1, 1 << 20, "a"), held.parse(b, 2, 1 << 20, "b")
    assert held.parse(a, 1, 1 << 20, "a") is ma  # a is now the most recently used
    held.parse(c, 3, 1 << 20, "c")
    assert held.parse(a, 1, 1 << 20, "a") is ma
    assert held.parse(b, 2, 1 << 20, "b") is not mb  # b was dropped, so parsed again
    big = _empty_manifest(9, "x" * 5000).encode()
    small = SharedManifests(entries=8, max_bytes=len(big) - 1)
    assert small.parse(big, 9, 1 << 20, "big") is not small.parse(big, 9, 1 << 20, "big")
    assert len(small) == 0  # over the bytes alone: parsed, never held
    two = SharedManifests(entries=8, max_bytes=len(b) + len(c))
    for step, data in ((1, a), (2, b), (3, c)):
        two.parse(data, step, 1 << 20, "m")
    assert len(two) == 2  # the third went over the bytes: the oldest was dropped


def test_dtype_names_round_trip_and_keep_byte_order() -> None:
    for dt in [np.dtype(">f4"), np.dtype("<i2"), np.dtype("?"), np.dtype(ml_dtypes.bfloat16)]:
        name = dtype_name(dt)
        assert name is not None
        assert dtype_from_name(name) == dt
    assert dtype_name(np.dtype(">f4")) == ">f4"
    assert dtype_name(np.dtype(ml_dtypes.float8_e5m2)) == "float8_e5m2"
    assert dtype_name(np.dtype("O")) is None
    assert dtype_from_name("O") is None
    assert dtype_from_name("<V2") is None


def test_plan_packs_small_aligns_and_isolates_large() -> None:
    lengths = [10, 0, 5 << 20, 100, 3, 4096]
    plan = PackPlan.build(lengths, pack_threshold=1 << 20, pack_size=8 << 20, alignment=64)
    assert plan.leaf_object[1] == -1
    large = plan.objects[plan.leaf_object[2]]
    assert not large.packed
    assert large.size == 5 << 20
    assert large.leaves == (2,)
    packs = [o for o in plan.objects if o.packed]
    assert len(packs) == 1
    assert all(plan.leaf_offset[i] % 64 == 0 for i in (0, 3, 4, 5))
    spans = sorted((plan.leaf_offset[i], plan.leaf_offset[i] + lengths[i]) for i in (0, 3, 4, 5))
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))


def test_plan_never_exceeds_pack_size_or_store_limits() -> None:
    plan = PackPlan.build([3000] * 100, pack_threshold=4096, pack_size=10_000, alignment=64)
    assert all(o.size <= 10_000 for o in plan.objects)
    assert len(plan.objects) == math.ceil(100 / 3)
    caps = Capabilities(atomic_create=True, multipart=True, max_part_size=1000, max_parts=10)
    settings = Settings(pack_size=1 << 20, pack_threshold=1 << 20)
    plan = PackPlan.for_store([5000, 9000], settings, caps)
    assert all(o.size <= 10_000 for o in plan.objects)
    with pytest.raises(ValueError, match="'too-big'"):
        PackPlan.for_store([10_001], settings, caps, paths=["too-big"])


def _walked_plan(
    lengths: list[int],
    *,
    pack_threshold: int,
    pack_size: int,
    alignment: int,
    max_object_size: int,
    groups: list[int] | None,
) -> tuple[list[tuple[str, int, tuple[int, ...]]], list[int], list[int]] | str:
    """The plan as the module describes it, leaf by leaf: in state order (by group, stable),
    a large leaf is an object of its own when met; a small one goes into the open pack at the
    next aligned offset, unless it would pass ``pack_size`` (or its group differs), which
    closes the pack first. Objects are numbered as they are made."""
    objects: list[tuple[str, int, tuple[int, ...]]] = []
    where = [-1] * len(lengths)
    offset_of = [0] * len(lengths)
    members: list[int] = []
    fill = 0
    group: int | None = None

    def close() -> None:
        nonlocal members, fill
        if members:
            for leaf in members:
                where[leaf] = len(objects)
            objects.append((f"pack-{len(objects):06d}", fill, tuple(members)))
            members, fill = [], 0

    order = (
        range(len(lengths))
        if groups is None
        else sorted(range(len(lengths)), key=groups.__getitem__)
    )
    for leaf in order:
        length = lengths[leaf]
        if not length:
            continue
        if groups is not None and groups[leaf] != group:
            close()
            group = groups[leaf]
        if length >= min(pack_threshold, pack_size):
            if length > max_object_size:
                return f"#{leaf} "
            where[leaf] = len(objects)
            objects.append((f"leaf-{len(objects):06d}", length, (leaf,)))
            continue
        offset = -(-fill // alignment) * alignment
        if members and offset + length > pack_size:
            close()
            offset = 0
        offset_of[leaf] = offset
        members.append(leaf)
        fill = offset + length
    close()
    return objects, where, offset_of


def test_plan_is_the_walk_of_the_leaves_the_module_describes() -> None:
    """``PackPlan.build`` finds its packs by search rather than leaf by leaf; on random
    states of every kind of leaf, with and without groups, its plan is the walk's."""
    rng = np.random.default_rng(31)
    sizes = [0, 1, 3, 64, 100, 500, 1000, 4096, 5000, 9000, 20_000]
    for _ in range(3000):
        count = int(rng.integers(0, 40))
        lengths = [int(n) for n in rng.choice(sizes, count)]
        groups = [int(g) for g in rng.integers(0, 4, count)] if rng.random() < 0.5 else None
        options: dict[str, Any] = {
            "pack_threshold": int(rng.choice([1000, 5000, 10_000, 50_000])),
            "pack_size": int(rng.choice([100, 4096, 10_000, 30_000])),
            "alignment": int(rng.choice([1, 8, 64])),
            "max_object_size": int(rng.choice([5000, 20_000, 1 << 62])),
        }
        expected = _walked_plan(lengths, groups=groups, **options)
        if isinstance(expected, str):
            with pytest.raises(ValueError, match=f"leaf {expected}"):
                PackPlan.build(lengths, groups=groups, **options)
            continue
        plan = PackPlan.build(lengths, groups=groups, **options)
        objects, where, offsets = expected
        assert [(o.name, o.size, o.leaves) for o in plan.objects] == objects
        assert [o.packed for o in plan.objects] == [n.startswith("pack") for n, _, _ in objects]
        assert plan.leaf_object == where
        assert plan.leaf_offset == offsets
        assert plan.leaf_length == lengths


def test_plan_fill_gathers_noncontiguous_and_zeroes_padding() -> None:
    arrays = [np.arange(10, dtype=np.int32)[::2], np.array(7, dtype=">i8"), np.ones((2, 3))]
    plan = PackPlan.build(
        [a.nbytes for a in arrays], pack_threshold=1 << 20, pack_size=1 << 20, alignment=64
    )
    (pack,) = plan.objects
    buf = np.full(pack.size, 0xAB, np.uint8)
    plan.fill(0, arrays, buf)
    for leaf, array in enumerate(arrays):
        start = plan.leaf_offset[leaf]
        assert buf[start : start + array.nbytes].tobytes() == np.ascontiguousarray(array).tobytes()
    assert not buf[20:64].any()  # the gap after the first leaf is zeroed


def _region_plan(
    lengths: list[int], offsets: list[int], groups: list[int] | None = None
) -> PackPlan:
    def rest(kept: list[int]) -> PackPlan:
        return PackPlan.build(kept, pack_threshold=1 << 20, pack_size=8 << 20, alignment=64)

    return PackPlan.in_region(
        lengths, offsets, object_size=4 * PAGE, gap=PAGE, rest=rest, groups=groups
    )


def test_plan_in_region_cuts_runs_of_leaves_as_they_lie() -> None:
    P = PAGE
    lengths = [100, 200, P, 0, 5 * P, 64, P, 300, 50, 7]
    offsets = [0, 128, P, 2 * P, 2 * P, 7 * P, 7 * P + 64, 20 * P, 22 * P, -1]
    plan = _region_plan(lengths, offsets)
    by_leaf = {i: plan.objects[plan.leaf_object[i]] for i in range(len(lengths)) if lengths[i]}
    # 0, 1, 2 lie one after another: one object cut from the region at 0
    assert by_leaf[0] is by_leaf[1] is by_leaf[2]
    assert by_leaf[0].start == 0
    assert by_leaf[0].size == 2 * P
    assert [plan.leaf_offset[i] for i in (0, 1, 2)] == [0, 128, P]
    assert plan.leaf_object[3] == -1  # empty: no object
    # a leaf of object_size or more goes alone, as a leaf object
    assert by_leaf[4].leaves == (4,)
    assert not by_leaf[4].packed
    # 5 and 6 follow it: a run of their own, offsets taken from the run's start
    assert by_leaf[5] is by_leaf[6]
    assert by_leaf[5].start == 7 * P
    assert plan.leaf_offset[6] == 64
    # more than a page of padding cuts a run
    assert by_leaf[7] is not by_leaf[8]
    # a leaf outside the region keeps the object the packed plan gives it
    assert by_leaf[9].start is None
    assert by_leaf[9].packed
    assert plan.leaf_offset[9] == 0
    assert [o.name for o in plan.objects] == [
        f"{'pack' if o.packed else 'leaf'}-{n:06d}" for n, o in enumerate(plan.objects)
    ]


def test_plan_in_region_cuts_full_runs_before_a_leaf_on_a_page() -> None:
    P = PAGE
    lengths = [P, P, P, P, 64, 64, P, 3 * P, 64]
    offsets = [0, P, 2 * P, 3 * P, 4 * P + 64, 4 * P + 192, 5 * P, 6 * P, 9 * P]
    plan = _region_plan(lengths, offsets)
    objects = [plan.objects[plan.leaf_object[leaf]] for leaf in range(len(lengths))]
    # leaf 4 would take the run of 0-3 past 4 pages, and it does not start on a page: the
    # run is cut before 3, the last of its leaves that does
    assert objects[0].leaves == (0, 1, 2)
    assert objects[3].leaves == (3, 4, 5, 6)
    assert objects[3].start == 3 * P
    # 7 starts on a page and would take that run past 4 pages: cut before it
    assert objects[7].leaves == (7, 8)
    assert all(o.size <= 4 * P for o in plan.objects)
    assert all(o.start is not None and o.start % P == 0 for o in plan.objects)
    # where no leaf starts on a page, the run is cut at twice object_size
    small = [64] * 1000
    plan = _region_plan(small, [32 + 64 * i for i in range(1000)])
    assert [o.size for o in plan.objects] == [8 * P, 64_000 - 8 * P]
    # groups (unchanged and changed leaves of an incremental save) never share a run
    plan = _region_plan([100, 100, 100], [0, 128, 256], groups=[0, 1, 1])
    assert plan.leaf_object[0] != plan.leaf_object[1] == plan.leaf_object[2]


def _count_pack_builds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    builds: list[int] = []
    for name in ("fill", "fill_digests"):
        original = getattr(PackPlan, name)
        monkeypatch.setattr(
            PackPlan, name, lambda *a, _f=original, **k: builds.append(1) or _f(*a, **k)
        )
    return builds


def _padding(root: Path, manifest: Manifest, index: int) -> np.ndarray:
    """The bytes of object ``index`` that no leaf of ``manifest`` holds."""
    body = (root / manifest.object_key(index)).read_bytes()
    assert len(body) == manifest.object_lengths[index]
    assert crc32c(body) == manifest.object_crcs[index]
    padding = np.frombuffer(body, np.uint8).copy()
    for leaf in range(len(manifest.paths)):
        if manifest.leaf_object[leaf] == index:
            at = manifest.leaf_offset[leaf]
            padding[at : at + manifest.leaf_length[leaf]] = 0
    return padding


@pytest.mark.parametrize("snapshot", ["eager", "lazy"])
def test_a_managers_local_save_writes_its_arena_in_place_with_zeroed_padding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, snapshot: str
) -> None:
    """A staged save to a local directory cuts its objects from the staging arena: no pack is
    built (no copy, no pooled pack buffer), leaves of every size share an object, the
    padding an earlier use of the arena left is zeroed, and the steps read back whole."""
    rng = np.random.default_rng(7)
    sizes = [10, 300_000, 17, 70_000, 5, 2_000_000, 33, 1, 600_000, 3]
    state = {f"w{i}": rng.standard_normal(n).astype(np.float32) for i, n in enumerate(sizes)}
    builds = _count_pack_builds(monkeypatch)
    with ckptstore.CheckpointManager(
        tmp_path, snapshot=snapshot, max_to_keep=None, incremental=False
    ) as mgr:
        pool = mgr._stager.pool
        acquire = pool.acquire

        def dirty(nbytes: int, **kwargs: Any) -> Any:
            buffer = acquire(nbytes, **kwargs)
            buffer.data[:] = 0xFF  # what an earlier save of another layout left
            return buffer

        monkeypatch.setattr(pool, "acquire", dirty)
        for step in range(2):
            state["w8"][:] = rng.standard_normal(600_000)
            mgr.save(step, state)
            mgr.fence()
        mgr.wait_until_finished()
    assert builds == []
    for step in range(2):
        manifest = ckptstore.read_manifest(tmp_path, step)
        assert len(manifest.object_keys) == 1  # 12 MB of ten leaves, one run of the arena
        assert not _padding(tmp_path, manifest, 0).any()
    out = ckptstore.load(tmp_path, step=1)
    for key, value in state.items():
        np.testing.assert_array_equal(out[key], value)


def test_an_incremental_roots_full_saves_keep_large_leaves_apart_and_the_rest_go_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With incremental saves, the first save (and every full one) gives each large leaf an
    object of its own, so that the next saves reuse the frozen ones object by object; a save
    with a base writes what changed in place, optimizer state in objects of its own (a
    streaming restore reads the rest first)."""
    rng = np.random.default_rng(3)
    state = {
        "frozen": {f"f{i}": rng.standard_normal(400_000).astype(np.float32) for i in range(3)},
        "bias": rng.standard_normal(100).astype(np.float32),  # small: packed at first
        "adapter": {f"a{i}": rng.standard_normal(300_000).astype(np.float32) for i in range(3)},
        "optim": {f"m{i}": rng.standard_normal(300_000).astype(np.float32) for i in range(3)},
    }
    builds = _count_pack_builds(monkeypatch)
    with ckptstore.CheckpointManager(tmp_path, max_to_keep=None, async_save=False) as mgr:
        mgr.save(0, state)
        first = len(builds)
        for step in (1, 2):
            for group in ("adapter", "optim"):
                for value in state[group].values():
                    value += 1
            mgr.save(step, state)
    assert first >= 1  # the first save packed its small leaves
    assert len(builds) == first  # the later ones built nothing
    zero = ckptstore.read_manifest(tmp_path, 0)
    frozen = {
        zero.object_key(zero.leaf_object[i]) for i, p in enumerate(zero.paths) if "frozen" in p
    }
    assert len(frozen) == 3
    for step in (1, 2):
        manifest = ckptstore.read_manifest(tmp_path, step)
        by_path = dict(zip(manifest.paths, manifest.leaf_object, strict=True))
        # the frozen leaves are step 0's objects, reused whole
        assert {manifest.object_key(by_path[f"frozen/f{i}"]) for i in range(3)} == frozen
        # what changed is two objects of this step: the adapter's run and the optimizer's
        own = {by_path[p] for p in by_path if p.startswith(("adapter", "optim"))}
        assert all(manifest.object_step(o) == step for o in own)
        assert len(own) == 2
        for index in own:
            members = [p for p, o in by_path.items() if o == index]
            assert len({p.startswith("optim") for p in members}) == 1
            assert not _padding(tmp_path, manifest, index).any()
    out = ckptstore.load(tmp_path, step=2)
    for group in ("frozen", "adapter", "optim"):
        for key, value in state[group].items():
            np.testing.assert_array_equal(out[group][key], value)
    np.testing.assert_array_equal(out["bias"], state["bias"])


def test_a_staged_save_to_an_object_store_keeps_the_packed_plan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An object store is not a store of files: its staged saves pack small leaves into pooled
    buffers and give larger ones objects of their own, as before."""
    fills = _count_pack_builds(monkeypatch)
    state = {"a": np.arange(10, dtype=np.float32), "b": np.ones(300_000, np.float32)}
    with ckptstore.CheckpointManager("memory://in-region-off") as mgr:
        mgr.save(0, state)
        mgr.wait_until_finished()
        manifest = ckptstore.read_manifest("memory://in-region-off", 0)
    assert fills == [1]
    assert [key.rsplit("/", 1)[1] for key in manifest.object_keys] == ["leaf-000000", "pack-000001"]


def test_buffer_pool_reuses_and_frees_the_oldest_idle_arena_over_its_cap() -> None:
    page = PAGE
    pool = BufferPool(max_idle_bytes=2 * page)
    a = pool.acquire(page)
    a.release()
    assert pool.acquire(page - 100) is a  # reused, within the slack
    b = pool.acquire(page)
    c = pool.acquire(page)
    for buf in (a, b, c):
        buf.release()
    stats = pool.stats()
    assert (stats.idle_bytes, stats.lent_bytes) == (2 * page, 0)  # a (the oldest) was freed
    assert {pool.acquire(page), pool.acquire(page)} == {b, c}
    assert pool.stats().allocations == 3


def test_one_buffer_pool_class_under_every_name() -> None:
    import ckptstore.layout as layout
    import ckptstore.stage as stage
    import ckptstore.store.transfer as transfer

    assert stage.BufferPool is BufferPool
    assert not hasattr(layout, "BufferPool")
    assert not hasattr(transfer, "BufferPool")


async def test_stager_attrs_round_trip_through_restore_hook() -> None:
    from ckptstore.layout.commit import write_checkpoint
    from ckptstore.manager.functions import load_state
    from ckptstore.store.memory import MemoryStore

    class Tensor:  # stands in for a framework tensor
        def __init__(self, data: np.ndarray, grad: bool) -> None:
            self.data, self.grad = data, grad

    def convert(leaf: object, path: str) -> tuple[np.ndarray, dict[str, object]] | None:
        if isinstance(leaf, Tensor):
            return leaf.data, {"framework": "fake", "requires_grad": leaf.grad}
        return None

    state = {"w": Tensor(np.arange(6.0).reshape(2, 3), True), "n": np.ones(2), "k": 1}
    store = MemoryStore()
    await write_checkpoint(store, flatten(state, convert=convert), step=3)
    seen: list[tuple[str, object]] = []

    def restore(array: np.ndarray, path: str, attrs: dict[str, object] | None) -> object:
        seen.append((path, attrs))
        return Tensor(array, bool(attrs["requires_grad"])) if attrs else array

    out = await load_state(store, restore=restore)
    assert isinstance(out["w"], Tensor)
    assert out["w"].grad is True
    assert_same_state(out["w"].data, np.arange(6.0).reshape(2, 3))
    assert_same_state(out["n"], np.ones(2))
    assert out["k"] == 1
    assert seen == [("w", {"framework": "fake", "requires_grad": True}), ("n", None)]


async def test_packs_are_built_one_at_a_time_and_uploaded_as_they_are_built(
    monkeypatch: pytest.MonkeyPatch, fresh_hash_pool: None
) -> None:
    """Building a pack in Python holds the GIL for most of its time, so concurrent builds all
    finished together and the first upload waited for nearly all of them."""
    import threading

    monkeypatch.setenv("CKPTSTORE_HASH_THREADS", "2")  # one at a time even with two

    from ckptstore.layout.commit import write_checkpoint
    from ckptstore.store.memory import MemoryStore

    lock = threading.Lock()
    building = {"now": 0, "most": 0, "done": 0}
    done_at_first_put: list[int] = []

    def counted(real: Any) -> Any:
        def fill(self: PackPlan, index: int, arrays: list[np.ndarray], out: np.ndarray) -> Any:
            with lock:
                building["now"] += 1
                building["most"] = max(building["most"], building["now"])
            try:
                return real(self, index, arrays, out)
            finally:
                with lock:
                    building["now"] -= 1
                    building["done"] += 1

        return fill

    class Recording(MemoryStore):
        async def _put(self, key: str, data: memoryview, mode: str) -> None:  # type: ignore[override]
            if "/pack-" in key and not done_at_first_put:
                done_at_first_put.append(building["done"])
            await super()._put(key, data, mode)  # type: ignore[arg-type]

    # a save with no base builds with fill_digests (the hashes in the same pass)
    monkeypatch.setattr(PackPlan, "fill", counted(PackPlan.fill))
    monkeypatch.setattr(PackPlan, "fill_digests", counted(PackPlan.fill_digests))
    state = {f"t{i:03d}": np.full(1024, i, np.float32) for i in range(400)}
    store = Recording(settings=Settings(pack_size=64 << 10))
    info = await write_checkpoint(store, flatten(state), step=0)
    assert info.objects == 25  # 400 leaves of 4 KiB in packs of 64 KiB
    assert building["most"] == 1
    assert done_at_first_put[0] < 5
    out = await ckptstore.aload(store)
    assert_same_state(out, state)


def test_large_leaves_load_into_page_aligned_arrays(tmp_path: Path) -> None:
    """So a local store reads them with O_DIRECT straight into place, no bounce copy."""
    state = {"big": np.arange(1 << 19, dtype=np.float32), "small": np.arange(10)}
    ckptstore.save(tmp_path, state, step=0)
    out = ckptstore.load(tmp_path)
    assert out["big"].ctypes.data % 4096 == 0
    np.testing.assert_array_equal(out["big"], state["big"])
    np.testing.assert_array_equal(out["small"], state["small"])


def test_leaves_of_a_pack_read_whole_view_their_own_bytes(tmp_path: Path) -> None:
    """A pack read whole gives each leaf a view of its bytes in the buffer read; runs of
    leaves of one dtype and shape at even offsets are made as the rows of one strided array
    (layout/restore.py). Runs of 2-d leaves with padding between them, runs cut by a 0-d
    leaf or another dtype, and lone leaves all come back bit-exact, writable, C-contiguous
    and sharing no byte with another leaf."""
    rng = np.random.default_rng(5)
    state = {
        "rows": [rng.standard_normal((3, 5)).astype(np.float32) for _ in range(30)],
        "vectors": [np.arange(i, i + 8, dtype=np.int64) for i in range(20)],
        "mixed": [np.full(4, i, np.float32) if i % 3 else np.array(i, np.int16) for i in range(12)],
        "bf16": [np.full(8, i, ml_dtypes.bfloat16) for i in range(5)],
        "cube": rng.standard_normal((2, 3, 4)),
        "cubes": [rng.standard_normal((2, 3, 4)).astype(np.float16) for _ in range(4)],
    }
    ckptstore.save(tmp_path, state, step=1)
    manifest = Manifest.parse((tmp_path / "1" / "manifest.json").read_bytes())
    assert len(manifest.object_keys) == 1  # one pack, read whole
    out = ckptstore.load(tmp_path)
    assert_same_state(out, state)
    arrays = [a for a in flatten(out).arrays if a.ndim]
    assert len(arrays) == 30 + 20 + 8 + 5 + 1 + 4
    for array in arrays:
        assert array.flags.writeable
        assert array.flags.c_contiguous
    for a, b in itertools.combinations(arrays, 2):
        assert not np.shares_memory(a, b)


@pytest.mark.parametrize(
    "offsets",
    [[0, 16, 32, 48], [0, 16, 48, 64], [64, 48, 32, 16], [0, 32, 16, 48], [8, 8, 40, 72]],
    ids=["even", "uneven", "descending", "out of order", "a repeated offset"],
)
def test_leaf_views_follow_each_leafs_own_offset(offsets: list[int]) -> None:
    """However a manifest orders its leaves' offsets, each view starts at its own."""
    from ckptstore.layout.restore import _leaf_views

    buf = np.arange(128, dtype=np.uint8)
    views = _leaf_views(buf, [0, 1, 2, 3], offsets, [[2, 2]] * 4, ["<f4"] * 4)
    for leaf, offset in enumerate(offsets):
        expected = buf[offset : offset + 16].view(np.float32).reshape(2, 2)
        np.testing.assert_array_equal(views[leaf].view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("size", [0, 1, 4095, 4096 * 3 + 7])
def test_crc32c_matches_the_reference_across_chunks(
    size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    import google_crc32c

    from ckptstore.store import checksum

    monkeypatch.setattr(checksum, "CHUNK", 4096)  # several chunks stitched together
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    expected = google_crc32c.value(data.tobytes())
    assert checksum.crc32c(data) == expected
    assert checksum.crc32c(data.tobytes()) == expected
    assert checksum.crc32c(data.view(np.int8)) == expected


@pytest.fixture
def fresh_hash_pool() -> Iterator[None]:
    from ckptstore.store import checksum

    checksum._forget_pool()
    yield
    checksum._forget_pool()


async def test_background_hashing_stays_on_the_bounded_hash_pool(
    monkeypatch: pytest.MonkeyPatch, fresh_hash_pool: None
) -> None:
    """asyncio's default executor has cpus + 4 threads: a save handing it many large leaves
    hashed on every core at once, the training thread's included."""
    import threading
    import time

    from ckptstore.layout.commit import write_checkpoint
    from ckptstore.store import checksum
    from ckptstore.store.memory import MemoryStore

    lock = threading.Lock()
    running = {"now": 0, "most": 0}
    threads: set[str] = set()

    def slow(real: Callable[..., object]) -> Callable[..., object]:
        def hashing(*args: object) -> object:
            with lock:
                running["now"] += 1
                running["most"] = max(running["most"], running["now"])
                threads.add(threading.current_thread().name)
            time.sleep(0.01)  # long enough for a larger pool to overlap
            try:
                return real(*args)
            finally:
                with lock:
                    running["now"] -= 1

        return hashing

    # the writes' checksums, and the incremental pass that hashes and checksums together
    monkeypatch.setattr(checksum, "crc32c", slow(checksum.crc32c))
    monkeypatch.setattr(checksum, "digests", slow(checksum.digests))
    monkeypatch.setenv("CKPTSTORE_HASH_THREADS", "2")
    state = {f"w{i}": np.full(1 << 19, i, np.float32) for i in range(12)}  # 2 MiB leaves
    for incremental in (True, False):
        store = MemoryStore(settings=Settings().replace(incremental=incremental))
        threads.clear()
        running["most"] = 0
        await write_checkpoint(store, flatten(state), step=0)
        assert threads
        assert all(name.startswith("ckptstore-hash") for name in threads)
        # the pass takes its turns one at a time; the writes' checksums fill the pool
        assert running["most"] == (1 if incremental else 2)


async def test_the_hashing_pass_gives_the_writes_their_checksums(
    monkeypatch: pytest.MonkeyPatch, fresh_hash_pool: None
) -> None:
    """An incremental save with no base hashes its leaves in turns beside the writes, and the
    turn that hashes a leaf stored alone finds its crc32c too: the write sends that one and
    no leaf is read a second time for its checksum."""
    import threading

    from ckptstore.layout import commit, incremental
    from ckptstore.layout.commit import write_checkpoint
    from ckptstore.store import checksum
    from ckptstore.store.memory import MemoryStore

    order: list[tuple[str, Any]] = []
    lock = threading.Lock()
    real_digests, real_crc = incremental.leaf_digests, checksum.crc32c

    def digests(arrays: list[np.ndarray], with_crc: list[bool]) -> Any:
        with lock:
            order.append(("turn", list(with_crc)))
        return real_digests(arrays, with_crc)

    crc_calls: list[int] = []

    def crc(data: object, value: int = 0) -> int:
        size = len(memoryview(data).cast("B"))  # type: ignore[arg-type]
        if size >= 1 << 20:
            crc_calls.append(size)
        return real_crc(data, value)

    monkeypatch.setattr(commit, "leaf_digests", digests)
    monkeypatch.setattr(checksum, "crc32c", crc)
    monkeypatch.setattr(commit, "HASH_TURN_BYTES", 4 << 20)
    monkeypatch.setattr(commit, "FIRST_TURN_BYTES", 4 << 20)
    monkeypatch.setenv("CKPTSTORE_HASH_THREADS", "1")
    store = MemoryStore()
    real_put = store.put

    async def put(key: str, data: Any, *, mode: Any = "overwrite", crc32c: Any = None) -> None:
        with lock:
            order.append(("put", (key, crc32c)))
        await real_put(key, data, mode=mode, crc32c=crc32c)

    monkeypatch.setattr(store, "put", put)
    state = {f"w{i:02}": np.full(1 << 20, i, np.float32) for i in range(16)}  # 4 MiB leaves
    state["small"] = np.arange(100, dtype=np.int64)  # packed: its pack hashes itself
    info = await write_checkpoint(store, flatten(state), step=0)
    turns = [i for i, (kind, _) in enumerate(order) if kind == "turn"]
    puts = [i for i, (kind, _) in enumerate(order) if kind == "put"]
    assert [order[i][1] for i in turns[:16]] == [[True]] * 16  # one turn per 4 MiB leaf
    if checksum.native_hashes():
        assert len(turns) == 16  # the small leaf's pack build hashed it
    else:
        assert len(turns) == 17  # a turn of its own, held until the packs were built
        assert order[turns[-1]][1] == [False]  # the small leaf is hashed only
    sent = {order[i][1][0] for i in puts if order[i][1][1] is not None}
    assert crc_calls == []  # and nothing read a big leaf again for its checksum
    got = await ckptstore.aload(store, 0, target="numpy")  # every checksum checked
    assert_same_state(got, state)
    manifest = await ckptstore.aread_manifest(store, 0)
    assert manifest.attempt == info.attempt
    assert manifest.leaf_hash == incremental.leaf_hashes([state[p] for p in manifest.paths])
    # each object's write sent a crc32c: a big leaf's the one its turn found, the pack its own
    assert sent == {f"0/{key}" for key in manifest.object_keys}
    assert len(sent) == 17
    data = [i for i in puts if order[i][1][0] in sent]
    assert data[0] < turns[-1]  # the writes began before the hashes ended


async def test_leaves_the_base_reused_are_hashed_without_their_checksum(
    monkeypatch: pytest.MonkeyPatch, fresh_hash_pool: None
) -> None:
    """A leaf the base step reused from an earlier one is likely frozen: the hashing pass does
    not compute its crc32c, and if it did change after all, its write hashes it itself."""
    from ckptstore.layout import commit, incremental
    from ckptstore.layout.commit import write_checkpoint
    from ckptstore.store.memory import MemoryStore

    asked: list[list[bool]] = []
    real_digests = incremental.leaf_digests

    def digests(arrays: list[np.ndarray], with_crc: list[bool]) -> Any:
        asked.append(list(with_crc))
        return real_digests(arrays, with_crc)

    monkeypatch.setattr(commit, "leaf_digests", digests)
    monkeypatch.setattr(commit, "FIRST_TURN_BYTES", 1)  # the first turn: one leaf
    store = MemoryStore()
    state = {
        "a": np.zeros(1 << 10, np.float32),  # 4 KiB, below the first turn's end
        "frozen": np.ones(1 << 19, np.float32),  # 2 MiB
        "trained": np.zeros(1 << 19, np.float32),
    }
    for step in range(3):
        state["trained"] += 1
        await write_checkpoint(store, flatten(state), step=step)
    paths = sorted(state)
    assert paths == ["a", "frozen", "trained"]
    # step 0: no base; step 1: the base wrote both; step 2: the base reused "frozen"
    assert asked[-2:] == [[False], [False, True]]
    assert asked[-4:-2] == [[False], [True, True]]
    state["frozen"] += 1  # changed after all: written, its crc32c found by its write
    await write_checkpoint(store, flatten(state), step=3)
    assert asked[-2:] == [[False], [False, True]]
    assert_same_state(await ckptstore.aload(store, 3, target="numpy"), state)
    assert_same_state(
        await ckptstore.aload(store, 2, target="numpy"),
        {**state, "frozen": np.ones(1 << 19, np.float32)},
    )


async def test_a_save_with_nothing_to_compare_with_builds_its_packs_before_any_hashing_turn(
    monkeypatch: pytest.MonkeyPatch, fresh_hash_pool: None, tmp_path: Path
) -> None:
    """On a root with nothing committed the hashes are for the manifest alone: the hashing
    pass holds all its turns from the start, so the first job of the hashing thread is a
    pack's build, not a turn hashing leaves no write waits for. With a base, the pass runs
    first, beside the base's read (the plan compares with its hashes)."""
    from ckptstore.layout import commit
    from ckptstore.layout.commit import write_checkpoint
    from ckptstore.store.local import LocalStore

    jobs: list[str] = []
    real = commit.in_hash_thread

    async def recorded(fn: Any, *args: Any) -> Any:
        jobs.append(getattr(fn, "__name__", repr(fn)))
        return await real(fn, *args)

    monkeypatch.setattr(commit, "in_hash_thread", recorded)
    # a local root: its listing runs on a thread, so a pass already started would run
    # meanwhile (a memory store's listing never lets it)
    state = {f"w{i:04d}": np.full(1024, i, np.float32) for i in range(3000)}  # 4 KiB each
    async with LocalStore(tmp_path) as store:
        await write_checkpoint(store, flatten(state), step=0)
        assert jobs, "nothing ran on the hashing thread"
        assert jobs[0] == "build", jobs[:3]
        jobs.clear()
        state["w0000"] += 1
        await write_checkpoint(store, flatten(state), step=1)
        assert jobs[0] == "leaf_digests", jobs[:3]
        assert_same_state(await ckptstore.aload(store, 1, target="numpy"), state)


async def test_a_cancelled_save_waits_for_its_hashing_thread(
    monkeypatch: pytest.MonkeyPatch, fresh_hash_pool: None
) -> None:
    """The hashing thread reads the caller's arrays and cannot be stopped: a save cancelled
    while it waits for the hashes returns only once the thread is done with them."""
    import asyncio
    import threading

    from ckptstore.layout import commit
    from ckptstore.layout.commit import write_checkpoint
    from ckptstore.store.memory import MemoryStore

    started, release, finished = threading.Event(), threading.Event(), threading.Event()

    def held(arrays: list[np.ndarray], with_crc: list[bool]) -> Any:
        started.set()
        release.wait(30)
        finished.set()
        return [None] * len(arrays), [None] * len(arrays)

    store = MemoryStore()
    state = {"w": np.ones(1024, np.float32)}
    await write_checkpoint(store, flatten(state), step=0)  # a base: the save awaits its hashes
    monkeypatch.setattr(commit, "leaf_digests", held)
    save = asyncio.ensure_future(write_checkpoint(store, flatten(state), step=1))
    deadline = asyncio.get_running_loop().time() + 30
    while not started.is_set():
        assert asyncio.get_running_loop().time() < deadline, "the hashing never started"
        await asyncio.sleep(0.01)
    save.cancel()
    await asyncio.sleep(0.05)
    assert not save.done()  # still waiting for the thread that reads the arrays
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await save
    assert finished.is_set()
    assert await ckptstore.alist_steps(store) == [0]  # step 1 never committed


def test_hash_threads_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from ckptstore.store.checksum import hash_threads

    monkeypatch.delenv("CKPTSTORE_HASH_THREADS", raising=False)
    assert hash_threads() == max(1, min(4, len(os.sched_getaffinity(0)) // 2))
    monkeypatch.setenv("CKPTSTORE_HASH_THREADS", "3")
    assert hash_threads() == 3
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("CKPTSTORE_HASH_THREADS", bad)
        with pytest.raises(ValueError, match="CKPTSTORE_HASH_THREADS"):
            hash_threads()


def test_a_forked_child_hashes_on_its_own_pool(fresh_hash_pool: None) -> None:
    import asyncio
    import os
    import signal

    from ckptstore.store.checksum import acrc32c, crc32c

    data = np.arange(1 << 20, dtype=np.uint32)  # 4 MiB: hashed on the pool
    expected = crc32c(data)
    assert asyncio.run(acrc32c(data)) == expected  # the parent's pool now has a thread
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child reports through its exit status)
        signal.alarm(20)  # the parent's pool threads do not exist here: a hang fails
        try:
            os._exit(0 if asyncio.run(acrc32c(data)) == expected else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_pack_groups_never_share_a_pack() -> None:
    """An incremental save's unchanged leaves and changed leaves go to separate packs, so a
    pack of unchanged ones can be reused whole by the next save."""
    groups = [i % 2 for i in range(40)]  # interleaved in state order
    plan = PackPlan.build(
        [1000] * 40, pack_threshold=4096, pack_size=8192, alignment=64, groups=groups
    )
    for obj in plan.objects:
        assert len({groups[leaf] for leaf in obj.leaves}) == 1, obj
    first = [groups[obj.leaves[0]] for obj in plan.objects]
    assert first == sorted(first)  # lower groups first
    # within a group, state order and aligned offsets as always
    for obj in plan.objects:
        assert list(obj.leaves) == sorted(obj.leaves)
        assert all(plan.leaf_offset[leaf] % 64 == 0 for leaf in obj.leaves)


#: Attempt ids of three saves, as new_attempt_id draws them.
A0, A1, A2 = (f"attempt-{t:012x}-{t:016x}" for t in (1, 2, 3))


def test_a_manifest_draft_places_plans_references_and_hashes() -> None:
    """The one builder of manifests: leaves declared, a plan's objects added with the
    writer's checksums, a reused leaf pointed flat at its base's object, hashes recorded;
    what it builds encodes and validates."""
    from ckptstore.layout.session import ManifestDraft

    base_draft = ManifestDraft.of_leaves(3, A1, ["a"], ["<f4"], [[4]], [16])
    # the base's own object lives at step 2: its reference is named there, not at step 3
    base_draft.add_objects([f"{A0}/pack-0"], [64], [11], step=2)
    base_draft.place(0, 0, 32, 7)
    base_draft.set_hashes([(0, "0" * 32)])
    base = Manifest.parse(base_draft.build(tree={"d": ["a"], "c": [0]}).encode(), step=3)

    lengths = [16, 0, 100]
    draft = ManifestDraft.of_leaves(
        5,
        A2,
        ["a", "empty", "c"],
        ["<f4", "<f4", "|u1"],
        [[4], [0], [100]],
        lengths,
        [None, None, {"mode": 420}],
    )
    plan = PackPlan.build([0, 0, 100], pack_threshold=1 << 20, pack_size=8 << 20, alignment=64)
    draft.add_plan(plan, [99], [0, 0, 5], name_prefix="r1-")
    draft.reference(base, [(0, 0), (1, -1)])
    draft.set_hashes([(2, "f" * 32)])
    built = draft.build(tree={"d": ["a", "empty", "c"], "c": [0, 1, 2]}, metadata={"m": 1})

    assert built.object_keys == [f"{A2}/r1-{plan.objects[0].name}", f"{A0}/pack-0"]
    assert built.object_steps == [5, 2]
    assert built.references() == [1]
    assert (built.leaf_object, built.leaf_offset, built.leaf_crc) == (
        [1, -1, 0],
        [32, 0, 0],
        [7, 0, 5],
    )
    assert built.leaf_hash == [None, None, "f" * 32]
    parsed = Manifest.parse(built.encode(), step=5)
    assert parsed.object_key(1) == f"2/{A0}/pack-0"
    assert parsed.attrs == [None, None, {"mode": 420}]
    assert parsed.metadata == {"m": 1}


def test_a_manifest_draft_of_a_manifest_keeps_its_leaves_with_new_objects() -> None:
    """A copy's draft: the source's leaves as they are, placed in the copy's own objects
    (added in the source's order), or in one the destination already holds."""
    from ckptstore.layout.session import ManifestDraft

    draft = ManifestDraft.of_leaves(4, A1, ["a", "b"], ["<f4", "|u1"], [[4], [3]], [16, 3])
    draft.add_objects([f"{A1}/pack-0", f"{A1}/big"], [80, 3], [11, 12])
    draft.place(0, 0, 64, 7)
    draft.place(1, 1, 0, 12)
    draft.set_hashes([(0, "a" * 32), (1, "b" * 32)])
    source = Manifest.parse(
        draft.build(tree={"d": ["a", "b"], "c": [0, 1]}, metadata={"m": 2}, created=5.0).encode(),
        step=4,
    )
    copy = ManifestDraft.of_manifest(source, A2)
    copy.add_objects([f"{A2}/pack-0"], [80], [11])
    copy.add_objects([f"{A0}/big"], [3], [12], step=2)  # held at the destination
    built = Manifest.parse(
        copy.build(tree=source.tree, metadata=source.metadata, created=source.created).encode(),
        step=4,
    )
    assert (built.attempt, built.object_keys, built.object_steps) == (
        A2,
        [f"{A2}/pack-0", f"{A0}/big"],
        [4, 2],
    )
    for column in ("paths", "dtypes", "shapes", "leaf_object", "leaf_offset", "leaf_length"):
        assert getattr(built, column) == getattr(source, column), column
    assert (built.leaf_crc, built.leaf_hash) == (source.leaf_crc, source.leaf_hash)
    assert (built.tree, built.metadata, built.created) == (source.tree, {"m": 2}, 5.0)


def test_a_manifest_draft_needs_one_entry_per_leaf() -> None:
    from ckptstore.layout.session import ManifestDraft

    with pytest.raises(ValueError, match="one entry per leaf"):
        ManifestDraft.of_leaves(1, A1, ["a", "b"], ["<f4"], [[1], [1]], [4, 4])


async def test_a_copy_over_the_destinations_manifest_cap_copies_nothing() -> None:
    from ckptstore.layout.maintenance import copy_step
    from ckptstore.store.memory import MemoryStore

    src = MemoryStore("copy-cap-src")
    await ckptstore.asave(src, {f"w{i}": np.full(3, i) for i in range(200)}, step=1)
    dst = MemoryStore("copy-cap-dst", settings=Settings(manifest_max_bytes=4096))
    with pytest.raises(ValueError, match=r"over Settings\.manifest_max_bytes"):
        await copy_step(src, dst, 1)
    assert await dst.list_keys() == []  # refused before any byte was copied


#: 40 leaves of 1.2 MiB: one object each, so a copy reads them in batches of several.
MANY_OBJECTS = {f"w{i}": np.full(150_000, i, dtype=np.float64) for i in range(40)}


class _Batches(StoreWrapper):
    """Records the sizes of the objects each read_objects_crc32c call asks for."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.batches: list[list[int]] = []

    async def read_objects_crc32c(self, requests: Any) -> list[int]:
        self.batches.append([len(memoryview(out)) for _, out in requests])
        return await super().read_objects_crc32c(requests)


@pytest.mark.parametrize("room", [64, 5])
async def test_a_copy_reads_small_objects_in_batches_of_bytes_and_room(room: int) -> None:
    from ckptstore.layout.maintenance import COPY_BATCH_BYTES, copy_step, verify_step
    from ckptstore.store.memory import MemoryStore

    src = _Batches(MemoryStore(f"batches-src-{room}"))
    await ckptstore.asave(src, MANY_OBJECTS, step=1)
    dst = MemoryStore(f"batches-dst-{room}", settings=Settings(max_concurrency=room))
    report = await copy_step(src, dst, 1)
    assert report.objects == 40
    assert (await verify_step(dst, 1)).ok
    sizes = [n for batch in src.batches for n in batch]
    assert sorted(sizes) == sorted((await read_manifest(src, 1)).object_lengths)
    for batch, after in zip(src.batches, src.batches[1:], strict=False):
        # each batch as full as the bytes and the destination's concurrency allow
        assert sum(batch) <= COPY_BATCH_BYTES
        assert len(batch) <= room
        assert sum(batch) + after[0] > COPY_BATCH_BYTES or len(batch) == room
    assert len(src.batches) < 40 // 2


async def test_a_failed_write_of_a_copy_starts_no_other_and_commits_nothing() -> None:
    from ckptstore.layout.maintenance import copy_step
    from ckptstore.store.memory import MemoryStore

    src = MemoryStore("failed-write-src")
    await ckptstore.asave(src, MANY_OBJECTS, step=1)
    inner = MemoryStore("failed-write-dst", settings=Settings(max_concurrency=4))
    counting = CountingStore(inner)
    fault = Fault(frozenset({"put"}), error=transient_error, key="leaf-", after=6, times=1)
    with pytest.raises(StoreError, match="injected fault in put"):
        await copy_step(src, FaultStore(counting, [fault]), 1)
    # the seventh write failed; at most the writes of its batch had started beside it
    assert counting.requests["put"] - 1 <= 6 + 4  # the lease's put, then the data
    assert await ckptstore.alist_steps(inner) == []
    assert [k for k in await inner.list_keys() if "leaf-" in k] == []


async def test_a_copy_cancelled_while_reading_keeps_the_buffers_the_read_may_fill_out_of_the_pool(
    tmp_path: Path,
) -> None:
    """A local read runs on in its thread after the copy is cancelled: the buffers it fills
    must never go back to the pool, where the next user would see them change."""
    import asyncio
    import threading

    from ckptstore.layout.maintenance import copy_step
    from ckptstore.store.buffers import host_buffers
    from ckptstore.store.local import LocalStore
    from ckptstore.store.memory import MemoryStore

    src = LocalStore(tmp_path)
    await ckptstore.asave(src, MANY_OBJECTS, step=1)
    entered, go_on = threading.Event(), threading.Event()
    filled: list[int] = []
    read = src._read_objects_crc32c

    def held_read(requests: list[tuple[str, memoryview]]) -> list[int]:
        filled.extend(np.frombuffer(view, np.uint8).ctypes.data for _, view in requests)
        entered.set()
        go_on.wait(30)
        return read(requests)

    src._read_objects_crc32c = held_read  # type: ignore[method-assign]
    lent = host_buffers.stats().lent_bytes
    dst = MemoryStore("cancelled-copy-dst")
    copy = asyncio.ensure_future(copy_step(src, dst, 1))
    assert await asyncio.to_thread(entered.wait, 30)
    copy.cancel()
    go_on.set()
    with pytest.raises(asyncio.CancelledError):
        await copy
    await src.settle()
    assert host_buffers.stats().lent_bytes == lent
    pooled = {b.data.ctypes.data for b in host_buffers._idle}
    assert filled
    assert pooled.isdisjoint(filled)
    assert await ckptstore.alist_steps(dst) == []
    await src.close()


def test_missing_keys_and_select_paths_are_one_rule() -> None:
    from ckptstore.pipeline.restore import missing_keys, select_paths

    known = sorted(["model/w", "model/b", "opt/m/w", "step"])
    assert missing_keys(known, ["model", "model/w", "", "opt/m", "step"]) == []
    assert missing_keys(known, ["mod", "model/w/x", "steps", "opt/m/"]) == [
        "mod",
        "model/w/x",
        "steps",
        "opt/m/",
    ]
    assert missing_keys([], [""]) == [""]  # an empty step holds nothing to name
    accept = select_paths(["model", "step"])
    assert [p for p in known if accept(p)] == ["model/b", "model/w", "step"]
    assert all(select_paths([""])(p) for p in known)


def test_a_numpy_target_of_another_shape_is_refused_by_leaf(tmp_path: Path) -> None:
    """Plain numpy leaves restored as they are skip the rebuild per leaf, unless a target
    asks for them: its shapes are still checked, leaf by leaf."""
    ckptstore.save(tmp_path, {"a": np.arange(4, dtype=np.float32), "b": np.ones(2)}, step=1)
    with pytest.raises(ValueError, match=r"leaf 'a': the restore target has shape \(3,\)"):
        ckptstore.load(tmp_path, target={"a": np.zeros(3, np.float32), "b": np.zeros(2)})
    out = ckptstore.load(tmp_path, target={"a": np.zeros(4, np.float32), "b": np.zeros(2)})
    np.testing.assert_array_equal(out["a"], np.arange(4, dtype=np.float32))


def test_a_restore_reads_with_a_manifest_it_is_given(tmp_path: Path) -> None:
    from ckptstore import background
    from ckptstore.pipeline.restore import read, request
    from ckptstore.pipeline.steps import read_manifest
    from ckptstore.store import open_store

    ckptstore.save(tmp_path, {"a": np.arange(4), "b": 2}, step=3)
    store = open_store(str(tmp_path))
    try:
        manifest = background.run(read_manifest(store, 3))
        selection = background.run(read(store, 3, request(), manifest=manifest))
        assert selection.manifest is manifest
        np.testing.assert_array_equal(selection.arrays[0], np.arange(4))
        with pytest.raises(ValueError, match="step 3's, not step 4's"):
            background.run(read(store, 4, request(), manifest=manifest))
    finally:
        background.run(store.close())


async def test_a_cancelled_save_never_lends_out_a_pack_buffer_its_build_still_fills(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pack is built in a hashing thread that cancelling the save does not stop: its
    pooled buffer is discarded, not handed to the next user while the build writes on."""
    import asyncio
    import threading

    from ckptstore.store.buffers import host_buffers

    started, go, done = threading.Event(), threading.Event(), threading.Event()

    def slowed(fill: Any) -> Any:
        def slow_fill(self: PackPlan, index: int, arrays: Any, out: Any) -> Any:
            started.set()
            go.wait(30)
            try:
                return fill(self, index, arrays, out)
            finally:
                done.set()

        return slow_fill

    # a first save builds with fill_digests (its hashes in the same pass)
    monkeypatch.setattr(PackPlan, "fill", slowed(PackPlan.fill))
    monkeypatch.setattr(PackPlan, "fill_digests", slowed(PackPlan.fill_digests))
    state = {f"w{i}": np.full(1024, 7, np.float32) for i in range(64)}  # one pack
    host_buffers.clear()
    saving = asyncio.ensure_future(ckptstore.asave(str(tmp_path), state, step=1))
    assert await asyncio.to_thread(started.wait, 30)
    saving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await saving
    nxt = host_buffers.acquire(Settings().layout.pack_size)
    try:
        nxt.data[:] = 0
        go.set()
        assert await asyncio.to_thread(done.wait, 30)
        assert not nxt.data.any(), "a cancelled build wrote into a buffer lent to someone else"
    finally:
        nxt.release()


@pytest.mark.parametrize(
    "value",
    [
        math.nan,
        math.inf,
        -math.inf,
        -0.0,
        1e-05,
        2**70,  # an int over 64 bits
        2**64,  # the first int orjson would read back as a float
        -(2**63) - 1,  # below int64: the same
        "h\u00e9llo \u4e16\u754c",  # not ASCII
        "lone \ud800 surrogate",
        None,
    ],
    ids=repr,
)
def test_a_manifest_keeps_every_plain_value_and_key_exactly(value: Any, tmp_path: Path) -> None:
    """The manifest's body is written by two encoders (a fast one for what it spells as the
    json module does, the json module for the rest: NaN and infinities, ints over 64 bits,
    lone surrogates); whichever writes it, every value, key, attr and the metadata read back
    as they were."""
    key = value if isinstance(value, str) else "k"
    state = {"plain": value, key: np.arange(3, dtype=np.float32), "list": [value, 1]}
    metadata = {"m": value, "nested": [value]}
    ckptstore.save(tmp_path, state, step=1, metadata=metadata)

    assert_same_state(ckptstore.load(tmp_path, 1), state)
    manifest = ckptstore.read_manifest(tmp_path, 1)
    assert_same_state(manifest.metadata, metadata)
    assert key in manifest.paths


def test_manifest_bodies_go_to_json_only_where_orjson_would_read_an_int_as_a_float() -> None:
    """A body goes to json, which is slower, only where it may hold an integer literal
    outside 64 bits. A run of 20 decimal digits inside a 128-bit hex digest is no such
    literal: 20,000-leaf manifests, which nearly always hold one, are read by orjson.
    Whichever reads it, every body reads as json reads it: exactly, int or float."""
    from ckptstore.layout import manifest as m

    digest = "1862424802015684979860ad8c4ba0f9"  # 20 digits after the opening quote
    assert not m._wide_int(json.dumps({"xxh3": [digest, "ab" + digest[:30]]}).encode())
    assert not m._wide_int(b"[0.12345678901234567890123, 1e+12345678901234567890, 2]")
    wide = [str(2**64), str(-(2**63) - 1), "123456789012345678901.5"]
    for literal in wide:
        for shape in ("{0}", "[{0}]", "[1,{0}]", '{{"k":{0}}}', "[ {0}]", "[\n\t\r{0}]"):
            assert m._wide_int(shape.format(literal).encode()), shape.format(literal)

    rng = np.random.default_rng(31)
    alphabet = list("0123456789abcdef-.e:, ")
    for _ in range(3000):
        parts: list[Any] = []
        for _ in range(int(rng.integers(1, 6))):
            pick = int(rng.integers(0, 4))
            if pick == 0:
                parts.append("".join(rng.choice(alphabet, int(rng.integers(0, 40)))))
            elif pick == 1:
                parts.append(int(rng.integers(-9, 10)) * 10 ** int(rng.integers(0, 25)) - 1)
            elif pick == 2:
                parts.append(float(rng.normal()) * 10.0 ** int(rng.integers(-30, 30)))
            else:
                parts.append({"h": "".join(rng.choice(list("0123456789"), 24))})
        body = json.dumps(parts).encode()
        read = m._loads(body)
        assert read == json.loads(body)
        assert [type(x) for x in read] == [type(x) for x in json.loads(body)], body


def test_a_manifest_body_joined_from_its_pieces_is_one_document_under_its_crc(
    tmp_path: Path,
) -> None:
    """The body is written in pieces (each part by the fast encoder where it is exact, by the
    json module where it is not: here the tree, which holds a NaN) and joined once with the
    envelope, whose crc32c is taken over the pieces: it is one JSON document, its parts in
    the order json writes them, under the crc of its bytes, and no NaN became null."""
    state = {
        "w": np.ones(2, np.float32),
        "\u043a\u043b\u044e\u0447": {"b": np.arange(3)},
        # long lists of plain scalars are checked in one pass; a NaN at their end is not
        # missed (orjson would write it as null), nor a nested one
        "lr": [*range(2000), math.nan],
        "flags": [True, None, "\u00e9", 2.5, [1, [math.inf]]],
        "step": 7,
    }
    ckptstore.save(tmp_path, state, step=1, metadata={"note": "\u00fc", "x": [1.5, -0.0]})
    data = (tmp_path / manifest_key(1)).read_bytes()
    envelope = re.match(rb'\{"format":"ckptstore","version":\d+,"crc32c":(\d+),"body":', data)
    assert envelope is not None
    assert data.endswith(b"}")
    body = data[envelope.end() : -1]
    assert int(envelope[1]) == crc32c(body)
    doc = json.loads(body)
    assert list(doc) == ["step", "attempt", "created", "metadata", "tree", "objects", "leaves"]
    assert b"NaN" in body
    assert b"Infinity" in body
    assert_same_state(ckptstore.load(tmp_path, 1), state)
    loaded = ckptstore.load(tmp_path, 1)
    assert math.isnan(loaded["lr"][-1])
    assert loaded["flags"][4][1] == [math.inf]


async def test_leaf_digests_turns_are_bounded_in_leaves_and_bytes(
    monkeypatch: pytest.MonkeyPatch, fresh_hash_pool: None
) -> None:
    """A turn of many small leaves holds the pack builds queued behind it on the hashing
    thread: turns end at HASH_TURN_LEAVES leaves, or at their bytes, whichever comes first."""
    from ckptstore.layout import commit
    from ckptstore.layout.incremental import leaf_hashes

    monkeypatch.setattr(commit, "HASH_TURN_LEAVES", 100)
    monkeypatch.setattr(commit, "FIRST_TURN_BYTES", 8000)
    monkeypatch.setattr(commit, "HASH_TURN_BYTES", 1 << 20)
    arrays = [np.full(100, i, np.float32) for i in range(250)]  # 400 bytes each
    arrays.insert(120, np.zeros(1 << 18, np.float32))  # 1 MiB: a turn ends with it
    digests = commit.LeafDigests(arrays, crc_from=1 << 20, lengths=[a.nbytes for a in arrays])
    assert digests._turns == [(0, 20), (20, 120), (120, 121), (121, 221), (221, 251)]
    assert await digests.hashes == leaf_hashes(arrays)
    with pytest.raises(ValueError, match="one length per array"):
        commit.LeafDigests(arrays, crc_from=1 << 20, lengths=[1, 2])


async def test_leaf_digests_turns_match_a_walk_over_the_leaves(
    monkeypatch: pytest.MonkeyPatch, fresh_hash_pool: None
) -> None:
    """The turns and which leaves are hashed for their crc32c are found in bulk: the same
    as a walk over the leaves that ends a turn at the leaf bringing its bytes to the goal,
    at HASH_TURN_LEAVES leaves, or at the last leaf (empty leaves, and a leaf alone over the
    goal, included)."""
    from ckptstore.layout import commit
    from ckptstore.layout.incremental import leaf_hashes

    monkeypatch.setattr(commit, "HASH_TURN_LEAVES", 7)
    monkeypatch.setattr(commit, "FIRST_TURN_BYTES", 50)
    monkeypatch.setattr(commit, "HASH_TURN_BYTES", 120)
    rng = np.random.default_rng(5)
    for count in (0, 1, 2, 9, 40, 300):
        sizes = [int(x) for x in rng.choice([0, 1, 8, 30, 64, 119, 120, 500], count)]
        turns, start, size, goal = [], 0, 0, 50
        for end, nbytes in enumerate(sizes, start=1):
            size += nbytes
            if size >= goal or end - start >= 7 or end == len(sizes):
                turns.append((start, end))
                start, size, goal = end, 0, 120
        arrays = [np.zeros(n, np.uint8) for n in sizes]
        for below in (None, 100):
            digests = commit.LeafDigests(arrays, crc_from=64, crc_below=below, lengths=sizes)
            assert digests._turns == turns
            assert digests._turn_of == [t for t, (a, b) in enumerate(turns) for _ in range(a, b)]
            limit = below if below is not None else math.inf
            assert digests._with_crc == [64 <= n < limit for n in sizes]
            assert await digests.hashes == leaf_hashes(arrays)


async def test_held_turns_wait_for_resume_and_take_the_hashes_given(
    monkeypatch: pytest.MonkeyPatch, fresh_hash_pool: None
) -> None:
    """defer() holds the turns that no write waits for (a save with no base); resume() lets
    them run, taking the hashes the pack builds found; a leaf hashed for its crc32c is not
    held, and a leaf's crc() never waits for a held turn."""
    import asyncio

    from ckptstore.layout import commit
    from ckptstore.layout.incremental import leaf_hashes

    asked: list[int] = []
    real = commit.leaf_digests

    def counted(arrays: list[np.ndarray], with_crc: list[bool]) -> Any:
        asked.append(len(arrays))
        return real(arrays, with_crc)

    monkeypatch.setattr(commit, "leaf_digests", counted)
    monkeypatch.setattr(commit, "HASH_TURN_LEAVES", 10)
    monkeypatch.setattr(commit, "FIRST_TURN_BYTES", 1 << 30)
    small = [np.full(8, i, np.int64) for i in range(30)]
    big = np.arange(1 << 15, dtype=np.int64)  # 256 KiB: its turn finds its crc32c
    arrays = [*small[:10], big, *small[10:]]
    digests = commit.LeafDigests(arrays, crc_from=1 << 18)
    digests.defer()
    assert digests.deferred
    assert await asyncio.wait_for(digests.crc(3), 1) is None  # not hashed for it: at once
    assert await asyncio.wait_for(digests.crc(10), 10) == checksum_of(big)
    await asyncio.sleep(0.05)
    assert not digests.hashes.done()
    ran = len(asked)
    known: list[str | None] = [None] * len(arrays)
    expected = leaf_hashes(arrays)
    for leaf in range(11, 31):  # found by "pack builds": not read again
        known[leaf] = expected[leaf]
    digests.resume(known)
    assert await digests.hashes == expected
    assert asked[:ran] == [10]  # the big leaf's turn, held by nothing
    assert asked[ran:] == [10]  # the first turn, none of it known; the others all known

    abandoned = commit.LeafDigests(small, crc_from=1 << 18)
    abandoned.defer()
    await asyncio.sleep(0.05)
    before = len(asked)
    abandoned.abandon()
    await abandoned.hashes  # ends without hashing the held turns
    assert len(asked) - before <= 1


def checksum_of(array: np.ndarray) -> int:
    return crc32c(array.tobytes())


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_the_stager_records_each_leafs_offset_in_its_arena_as_the_addresses_give_it(
    lazy: bool,
) -> None:
    """``FlatState.region_at`` (recorded at layout) is what reading every array's address
    gives, leaves outside the arena ``-1``; a state with a plain value and sizes on both
    sides of a page."""
    import torch

    from ckptstore.stage import Stager

    state = {
        "a": torch.arange(10, dtype=torch.float32),
        "b": torch.zeros(3 * PAGE, dtype=torch.uint8),
        "c": [torch.ones(5, dtype=torch.float64), 7],
        "d": torch.arange(PAGE + 3, dtype=torch.int16),
    }
    stager = Stager()
    staged = stager.stage(state, lazy=lazy)
    try:
        if staged.snapshot is not None:
            staged.snapshot.result()
        flat = staged.flat()
        recorded = flat.region_offsets()
        assert recorded is not None
        assert flat.region_at is recorded
        flat.region_at = None
        assert flat.region_offsets() == recorded
        assert sorted(recorded) == recorded  # laid out in leaf order
        assert len(set(recorded)) == len(recorded) == len(flat.arrays)
    finally:
        staged.release()
