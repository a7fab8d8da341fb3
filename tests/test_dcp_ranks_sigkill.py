"""DCP through ckptstore on real processes (gloo on 127.0.0.1): a rank SIGKILLed from outside
in the middle of ``dcp.save``, as a preemption or the OOM killer would end it.

tests/test_dcp_multirank.py covers a rank that raises and one that exits by its own hand;
here the test process sends the signal, once rank 1 has uploaded objects of its own.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from tests.multirank import TARGETS_AND_WORLDS, Target, assert_all_ok, run_and_sigkill, run_ranks

pytestmark = [pytest.mark.torch, pytest.mark.slow]

WORKER = Path(__file__).with_name("dcp_ranks.py")
VICTIM = 1  # the rank dcp_ranks.FailingPlanner("wait") stops mid-save


@pytest.mark.parametrize(("target", "world"), TARGETS_AND_WORLDS, indirect=["target"])
def test_rank_sigkilled_mid_dcp_save_leaves_no_checkpoint(
    target: Target, world: int, tmp_path: Path
) -> None:
    good, killed = f"{target.base}/1", f"{target.base}/2"
    logs, env = tmp_path / "logs", target.env()
    errors = run_and_sigkill(
        WORKER, world, "sigkill", good, killed, victim=VICTIM, logs=logs, env=env
    )
    # every survivor gets DCP's CheckpointException, or the RuntimeError of DCP's own
    # collective that met the dead peer (gloo: "Connection closed by peer"); ckptstore has no
    # hand in the latter
    for error in errors:
        assert error.startswith(("CheckpointException", "RuntimeError")), error

    assert target.steps() == [1]  # the killed save is not visible
    assert any("/r1-" in key for key in target.keys(killed))  # it really died mid-save
    loaded = assert_all_ok(run_ranks(WORKER, world, "load", good, "1", logs=logs, env=env))
    assert [result["exact"] for result in loaded] == [True] * world
