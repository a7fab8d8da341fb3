"""DCP through ckptstore with several real processes on gloo over 127.0.0.1.

Each test starts N copies of tests/dcp_ranks.py (one per rank), which meet through
tests/multirank.py's ``join_group``, and reads the ``RESULT`` line each prints. The state
holds a row-sharded DTensor, so saving on 4 ranks and loading on 2 makes DCP reshard.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from tests.multirank import TARGETS_AND_WORLDS, Target, assert_all_ok, run_ranks

pytestmark = pytest.mark.torch

WORKER = Path(__file__).with_name("dcp_ranks.py")
WEIGHT_BYTES = 1024 * 256 * 4  # dcp_ranks.ROWS x COLS float32
FAILING_RANK = 1  # the rank dcp_ranks.FailingPlanner fails and kills


def test_save_on_4_ranks_load_on_2_reshards_bit_exact(target: Target, tmp_path: Path) -> None:
    url = f"{target.base}/7"  # step 7 of the root
    logs, env = tmp_path / "logs", target.env()
    saved = assert_all_ok(run_ranks(WORKER, 4, "save", url, "7", logs=logs, env=env))
    assert saved == [{"saved": True}] * 4
    keys = target.keys(target.base)
    # every rank wrote its own objects under one attempt of step 7; one manifest
    assert "7/manifest.json" in keys
    data = [key.split("/") for key in keys if key != "7/manifest.json"]
    assert {rank_object.split("-")[0] for _, _, rank_object in data} == {"r0", "r1", "r2", "r3"}
    assert len({attempt for _, attempt, _ in data}) == 1
    assert target.steps() == [7]

    loaded = assert_all_ok(run_ranks(WORKER, 2, "load", url, "7", logs=logs, env=env))
    for result in loaded:
        assert result["exact"] is True
        # each of 2 ranks reads its half of the sharded weight plus small replicated items,
        # never the other half
        assert WEIGHT_BYTES // 2 <= result["bytes_read"] < WEIGHT_BYTES // 2 + 64 * 1024


@pytest.mark.parametrize(("target", "world"), TARGETS_AND_WORLDS, indirect=["target"])
def test_a_second_save_of_an_unchanged_state_references_the_first(
    target: Target, world: int, tmp_path: Path
) -> None:
    first, second = f"{target.base}/1", f"{target.base}/2"
    outcomes = run_ranks(
        WORKER, world, "incremental", first, second, logs=tmp_path / "logs", env=target.env()
    )
    for result in assert_all_ok(outcomes):
        assert result["exact"] is True
        # every rank's shard of the weight is referenced; what is written again is the
        # small pack holding the "step" value, which torch.save serialises anew each time
        assert result["referenced"] >= WEIGHT_BYTES, result
        assert result["own"] < 64 * 1024, result
    assert target.steps() == [1, 2]


@pytest.mark.parametrize(("target", "world"), TARGETS_AND_WORLDS, indirect=["target"])
def test_failing_or_dying_rank_leaves_no_checkpoint_and_previous_loads(
    target: Target, world: int, tmp_path: Path
) -> None:
    good, failed, died = (f"{target.base}/{step}" for step in (1, 2, 3))
    logs, env = tmp_path / "logs", target.env()
    outcomes = run_ranks(WORKER, world, "failures", good, failed, died, logs=logs, env=env)
    for rank, outcome in enumerate(outcomes):
        if rank == FAILING_RANK:
            assert outcome.returncode == 17, outcome.log[-4000:]  # it really died mid-save
            assert outcome.results[-1] == {"raise": "CheckpointException"}
            continue
        # every survivor, coordinator or not, learns of both failures and does not hang
        assert outcome.returncode == 0, f"rank {rank}:\n{outcome.log[-4000:]}"
        assert outcome.results[-1]["raise"] == "CheckpointException", f"rank {rank}"
        assert outcome.results[-1]["die"] != "succeeded", f"rank {rank}"

    assert target.steps() == [1]  # neither failed save is visible
    # rank 1 had uploaded objects of its own before it died: a real mid-save death
    assert any("/r1-" in key for key in target.keys(died))

    loaded = assert_all_ok(run_ranks(WORKER, world, "load", good, "1", logs=logs, env=env))
    assert [result["exact"] for result in loaded] == [True] * world


@pytest.mark.parametrize(("target", "world"), TARGETS_AND_WORLDS, indirect=["target"])
def test_async_save_thread_and_process_executors(
    target: Target, world: int, tmp_path: Path
) -> None:
    thread_url, process_url = f"{target.base}/10", f"{target.base}/20"
    outcomes = run_ranks(
        WORKER, world, "async", thread_url, process_url, logs=tmp_path / "logs", env=target.env()
    )
    assert assert_all_ok(outcomes) == [{"exact": [True, True]}] * world
    assert target.steps() == [10, 20]
