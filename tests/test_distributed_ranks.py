"""ckptstore.distributed on real processes: gloo over 127.0.0.1, 4 ranks save, 2 load.

Each test starts N copies of tests/native_ranks.py; see tests/multirank.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from tests.multirank import Target, assert_all_ok, run_ranks

pytestmark = pytest.mark.torch

WORKER = Path(__file__).with_name("native_ranks.py")
SHARD_BYTES = 1 << 20  # native_ranks.SHARD float32


def test_save_on_4_ranks_commits_once_and_2_ranks_load_only_their_shards(
    target: Target, tmp_path: Path
) -> None:
    logs, env = tmp_path / "logs", target.env()
    saved = assert_all_ok(run_ranks(WORKER, 4, "save", target.base, "7", logs=logs, env=env))
    assert len({result["attempt"] for result in saved}) == 1  # every rank reports one commit
    keys = target.keys(target.base)
    assert "7/manifest.json" in keys
    written = [key.split("/") for key in keys if key != "7/manifest.json"]
    assert {name.split("-")[0] for _, _, name in written} == {"r0", "r1", "r2", "r3"}
    assert {attempt for _, attempt, _ in written} == {saved[0]["attempt"]}
    assert target.steps() == [7]

    loaded = assert_all_ok(run_ranks(WORKER, 2, "load", target.base, "7", "4", logs=logs, env=env))
    for result in loaded:
        assert result["exact"] is True
        assert result["shards"] == 2
        # two shards, the 8 KiB replicated weight (packed with small leaves, so the read may
        # take in some bytes around it), never another rank's shard
        assert 2 * SHARD_BYTES <= result["bytes_read"] < 2 * SHARD_BYTES + 64 * 1024


def test_failing_or_dying_rank_leaves_no_checkpoint_and_previous_loads(
    target: Target, tmp_path: Path
) -> None:
    logs, env = tmp_path / "logs", target.env()
    rank0, rank1 = run_ranks(WORKER, 2, "failures", target.base, logs=logs, env=env)
    assert rank0.returncode == 0, rank0.log[-4000:]
    assert rank0.results[-1]["raise"].startswith("CkptStoreError")
    assert "rank 1" in rank0.results[-1]["raise"]
    assert rank0.results[-1]["die"] != "succeeded"  # the survivor fails, it does not hang
    assert rank1.returncode == 17, rank1.log[-4000:]  # it really died mid-save
    assert rank1.results[-1]["raise"].startswith("StoreError")

    assert target.steps() == [1]  # neither failed save is visible
    keys = target.keys(target.base)
    assert not [k for k in keys if k.startswith("2/")]  # the failed save cleaned up
    assert any(k.startswith("3/") and "/r1-" in k for k in keys)  # rank 1 had stored data

    loaded = assert_all_ok(run_ranks(WORKER, 2, "load", target.base, "1", "2", logs=logs, env=env))
    assert all(result["exact"] for result in loaded)
