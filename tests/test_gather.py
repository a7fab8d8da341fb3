"""The compiled pack kernel (ckptstore/store/_gather.c) against the Python loop it replaces:
the same bytes and crc32c for every layout, the same refusals, and built where it should be."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import google_crc32c
import ml_dtypes
import numpy as np
import pytest

import ckptstore
from ckptstore.store import buffers, checksum

X86_LINUX = sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")
needs_native = pytest.mark.skipif(
    not checksum.NATIVE, reason="the compiled module is not built here (or not on this CPU)"
)


@pytest.fixture(params=["native", "python"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "native" and not checksum.NATIVE:
        pytest.skip("the compiled module is not built here (or not on this CPU)")
    monkeypatch.setattr(checksum, "NATIVE", request.param == "native")
    return request.param


def reference(data: bytes) -> int:
    return int(google_crc32c.value(data))


def layout(
    rng: np.random.Generator, count: int, alignment: int = 64
) -> tuple[list[np.ndarray], list[int], list[int], int]:
    """Leaves of many kinds (sizes around the kernel's two three-stream steps, strided ones, a
    byte-swapped one, ml_dtypes, 0-d, empty) at aligned offsets."""
    sizes = [0, 1, 7, 8, 9, 767, 768, 769, 1535, 2304, 4096, 5000, 3 * 8192 - 1, 3 * 8192]
    sizes += [3 * 8192 + 769, 6 * 8192 + 3 * 256 + 9, 200_001]
    arrays: list[np.ndarray] = []
    for i in range(count):
        kind = i % 6
        n = int(rng.choice(sizes))
        if kind == 0:
            arrays.append(rng.integers(0, 256, n, dtype=np.uint8))
        elif kind == 1:  # strided: no C-contiguous buffer
            arrays.append(rng.standard_normal(max(n // 8, 1) * 2)[::2])
        elif kind == 2:
            arrays.append(rng.standard_normal(max(n // 2, 1)).astype(ml_dtypes.bfloat16))
        elif kind == 3:
            arrays.append(np.array(rng.integers(-9, 9), dtype=">i8"))  # 0-d, big-endian
        elif kind == 4:  # a C-contiguous view inside a larger array, at an odd address
            base = rng.integers(0, 256, n + 5, dtype=np.uint8)
            arrays.append(base[3 : 3 + n])
        else:
            arrays.append(rng.standard_normal((3, max(n // 24, 1))).astype(np.float32).T)
    offsets, position = [], 0
    for array in arrays:
        position += int(rng.integers(0, 3)) * alignment  # some gaps wider than the alignment
        position = (position + alignment - 1) // alignment * alignment
        offsets.append(position)
        position += array.nbytes
    return arrays, offsets, [a.nbytes for a in arrays], position


@pytest.mark.parametrize("seed", range(6))
def test_gather_copies_every_leaf_zeroes_the_gaps_and_finds_each_crc(path: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    arrays, offsets, lengths, size = layout(rng, 60)
    order = list(range(len(arrays)))
    out = np.full(size, 0xAB, np.uint8)
    crcs = checksum.gather_crc32c(out, arrays, order, offsets, lengths)
    expected = bytearray(size)
    for array, offset in zip(arrays, offsets, strict=True):
        expected[offset : offset + array.nbytes] = np.ascontiguousarray(array).tobytes()
    assert out.tobytes() == bytes(expected)  # leaves in place, every gap zeroed
    assert crcs == [reference(np.ascontiguousarray(a).tobytes()) for a in arrays]


def test_gather_takes_a_pack_of_some_leaves_in_their_offset_order(path: str) -> None:
    rng = np.random.default_rng(7)
    arrays = [rng.integers(0, 256, 100, dtype=np.uint8) for _ in range(5)]
    offsets = [0, 500, 0, 128, 9999]  # leaves 0, 3, 1 form this pack; 2 and 4 are elsewhere
    lengths = [100] * 5
    out = np.full(600, 0xCD, np.uint8)
    crcs = checksum.gather_crc32c(out, arrays, (0, 3, 1), offsets, lengths)
    assert crcs == [reference(arrays[i].tobytes()) for i in (0, 3, 1)]
    assert out[0:100].tobytes() == arrays[0].tobytes()
    assert out[128:228].tobytes() == arrays[3].tobytes()
    assert out[500:600].tobytes() == arrays[1].tobytes()
    assert not out[100:128].any()
    assert not out[228:500].any()


def test_gather_refuses_a_leaf_outside_the_buffer_or_of_another_size(path: str) -> None:
    arrays = [np.ones(100, np.uint8), np.ones(100, np.uint8)]
    out = np.zeros(150, np.uint8)
    with pytest.raises(ValueError, match="150-byte buffer"):
        checksum.gather_crc32c(out, arrays, [0, 1], [0, 100], [100, 100])
    with pytest.raises(ValueError, match="100 bytes"):
        checksum.gather_crc32c(out, arrays, [0], [0], [90])


@pytest.mark.parametrize("seed", range(4))
def test_first_mismatch_finds_the_first_bad_leaf_and_its_crc(path: str, seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    arrays, offsets, lengths, size = layout(rng, 40)
    buf = np.zeros(size, np.uint8)
    recorded = checksum.gather_crc32c(buf, arrays, list(range(40)), offsets, lengths)
    order = list(range(40))
    assert checksum.first_mismatch(buf, order, offsets, lengths, recorded) is None
    damaged = [i for i in order if lengths[i] > 0][len(order) // 3 :]
    first, later = damaged[0], damaged[-1]
    for leaf in (later, first):
        buf[offsets[leaf] + lengths[leaf] // 2] ^= 0x10
    found = checksum.first_mismatch(buf, order, offsets, lengths, recorded)
    start = offsets[first]
    assert found == (first, reference(buf[start : start + lengths[first]].tobytes()))
    with pytest.raises(ValueError, match="outside"):
        checksum.first_mismatch(buf[:-1], [order[-1]], offsets, [lengths[-1] + 1] * 40, recorded)


@pytest.mark.skipif(not X86_LINUX, reason="the kernel's crc32c is built for x86-64 Linux")
def test_the_kernel_is_built_and_used_on_x86_64_linux() -> None:
    """An install that silently failed to build it would fall back to the slower Python loop
    (the README's install builds it: a C compiler is part of the set-up)."""
    if os.environ.get("CKPTSTORE_NATIVE") == "0":
        pytest.skip("turned off in this run's environment")
    from ckptstore.store import _gather

    assert _gather.hardware_crc32c == 1
    assert checksum.NATIVE
    assert buffers.NATIVE_COPY


def test_the_native_switch_refuses_a_value_it_does_not_know() -> None:
    env = {**os.environ, "CKPTSTORE_NATIVE": "yes"}
    done = subprocess.run(
        [sys.executable, "-c", "import ckptstore"], env=env, capture_output=True, text=True
    )
    assert done.returncode != 0
    assert "CKPTSTORE_NATIVE: expected 0 or 1, got 'yes'" in done.stderr


@needs_native
def test_a_checkpoint_is_the_same_with_and_without_the_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Saved by one path, loaded (and verified) by the other: the same manifest checksums."""
    rng = np.random.default_rng(3)
    state = {f"l{i}": rng.standard_normal(int(rng.integers(1, 3000))) for i in range(300)}
    state["strided"] = np.arange(100.0)[::3]
    for native, other in ((True, False), (False, True)):
        root = tmp_path / f"native-{native}"
        monkeypatch.setattr(checksum, "NATIVE", native)
        ckptstore.save(root, state, step=0)
        monkeypatch.setattr(checksum, "NATIVE", other)
        loaded = ckptstore.load(root)
        for key, value in state.items():
            np.testing.assert_array_equal(loaded[key], value)
    one = ckptstore.read_manifest(tmp_path / "native-True")
    two = ckptstore.read_manifest(tmp_path / "native-False")
    assert one.leaf_crc == two.leaf_crc
    assert one.object_crcs == two.object_crcs


@pytest.mark.parametrize("seed", range(4))
def test_gather_digests_finds_each_leafs_xxh3_as_xxhash_does(path: str, seed: int) -> None:
    """The pack build of a save with no base hashes each leaf in the same pass (the compiled
    kernel calls the xxhash package's own XXH3_128bits): the same bytes and crc32c as
    gather_crc32c, and the digests xxhash gives the leaves themselves."""
    import xxhash

    rng = np.random.default_rng(200 + seed)
    arrays, offsets, lengths, size = layout(rng, 60)
    order = [i for i in range(len(arrays)) if lengths[i]]  # a plan packs no empty leaf
    out, again = np.full(size, 0xAB, np.uint8), np.full(size, 0xAB, np.uint8)
    crcs, hashes = checksum.gather_digests(out, arrays, order, offsets, lengths)
    assert crcs == checksum.gather_crc32c(again, arrays, order, offsets, lengths)
    assert out.tobytes() == again.tobytes()
    assert hashes == [
        xxhash.xxh3_128_hexdigest(np.ascontiguousarray(arrays[i]).tobytes()) for i in order
    ]


@needs_native
def test_the_kernel_hashes_with_xxhash_where_its_function_is_found(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found in the installed xxhash (and checked against it), the kernel hashes; where the
    function cannot be found, gather_digests still gives the digests, from Python."""
    import xxhash

    assert checksum.native_hashes()
    monkeypatch.setattr(checksum, "_xxh3_bound", None)

    def missing() -> bool:
        raise AssertionError("must not be called twice")

    real = checksum._bind_xxh3
    monkeypatch.setattr(checksum, "_bind_xxh3", lambda: False)
    assert not checksum.native_hashes()
    monkeypatch.setattr(checksum, "_bind_xxh3", missing)
    assert not checksum.native_hashes()  # decided once
    arrays = [np.arange(i + 1, dtype=np.float32) for i in range(50)]
    offsets = [sum(64 * ((a.nbytes + 63) // 64) for a in arrays[:i]) for i in range(50)]
    lengths = [a.nbytes for a in arrays]
    out = np.empty(offsets[-1] + lengths[-1], np.uint8)
    _, hashes = checksum.gather_digests(out, arrays, range(50), offsets, lengths)
    assert hashes == [xxhash.xxh3_128_hexdigest(a.tobytes()) for a in arrays]
    monkeypatch.setattr(checksum, "_xxh3_bound", None)
    assert real()
