"""The save-floor suite's yardsticks do the work they stand for (benchlib/save_floor.py).

Its minimal save is the lower bound a reader holds ckptstore's save against: one that skipped
a checksum, a fsync or a pack would make that bound look lower than it is.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import orjson
import pytest

from ckptstore.store.checksum import crc32c

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from benchlib import Context, save_floor  # noqa: E402

pytestmark = pytest.mark.skipif(
    not hasattr(os, "O_DIRECT"), reason="the suite writes its packs with O_DIRECT (Linux)"
)


@pytest.fixture(autouse=True)
def _direct_io(tmp_path: Path) -> None:
    try:
        fd = os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError as exc:  # tmpfs and some FUSE mounts refuse O_DIRECT
        pytest.skip(f"{tmp_path} refuses O_DIRECT: {exc}")
    os.close(fd)
    os.unlink(tmp_path / "probe")


def _state(count: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {f"w{i:05d}": rng.standard_normal(1024, dtype=np.float32) for i in range(count)}


def test_the_minimal_save_writes_every_leaf_checksummed_and_removes_its_lease(
    tmp_path: Path,
) -> None:
    state = _state(3000)  # two packs of 8 MiB: more than one write in flight
    floor = save_floor.Floor(state)
    try:
        floor.save(str(tmp_path))
    finally:
        floor.close()
    (attempt,) = (tmp_path / "1").glob("attempt-*")
    assert not (attempt / "lease.json").exists()  # taken, then removed after the commit
    manifest = orjson.loads((tmp_path / "1" / "manifest.json").read_bytes())
    assert manifest == orjson.loads(floor.manifest)
    assert manifest["paths"] == list(state)
    packs = {name: (attempt / name).read_bytes() for name in manifest["objects"]}
    assert len(packs) == 2
    for name, crc in zip(manifest["objects"], manifest["object_crc32c"], strict=True):
        assert crc32c(packs[name]) == crc
    objects = {leaf: obj.name for obj in floor.plan.objects for leaf in obj.leaves}
    for leaf, array in enumerate(state.values()):
        offset, length = manifest["offsets"][leaf], manifest["lengths"][leaf]
        body = packs[objects[leaf]][offset : offset + length]
        assert body == array.tobytes()
        assert manifest["crc32c"][leaf] == crc32c(array.tobytes())
        assert len(manifest["xxh3"][leaf]) == 32
    assert set(floor.phases) == {"walk", "lease+first write", "last pack durable", "committed"}


def test_the_suite_reports_each_yardstick_against_the_ceiling_and_their_sum(
    tmp_path: Path,
) -> None:
    ctx = Context(repeat=1, workdir=tmp_path, quick=True)
    rows = save_floor.run(ctx)
    assert [row.system for row in rows] == list(save_floor.CASES.values())
    assert all(row.seconds > 0 and len(row.runs) == 1 for row in rows)
    summary = ctx.options["summary"]
    assert "pack writes + lease + manifest put" in summary
    assert "minimal save, median ms from its start: walk " in summary
    assert json.dumps([row.as_dict() for row in rows])  # the report writes them as JSON
    assert not any(tmp_path.iterdir())  # every directory it wrote is gone
