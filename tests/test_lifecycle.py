"""A training job's whole life, on every face that saves (issue 29): each scenario is a real
training script in a child process (``tests/tree_adapters.py``), using the face's own calls:
ckptstore's ``CheckpointManager`` (and the multi-rank one, on 2 gloo processes), the Hugging
Face Trainer with ``StoreCallback``, Accelerate's ``save_state``/``load_state`` after
``mirror_states``, Orbax's ``CheckpointManager`` after ``mirror_manager``,
``torch.distributed.checkpoint``'s ``async_save``/``load`` with ckptstore's
``Writer``/``Reader`` (its roll-back is ``ckptstore.rollback``), and Lightning's
``Trainer.fit`` with ``StoreCheckpointIO`` (each checkpoint a root of its own under the
dirpath: the face's steps are their global steps).

Every job trains steps 1-8 and saves at 2, 4, 6 and 8. An uninterrupted run gives each
step's loss; every scenario then checks that what it trains after an exit, a kill, a
preemption, a restart or a roll-back has exactly those losses (bit for bit: the state,
optimizer and RNG came back whole), that the root ends with the newest step saved, and
that this step's weights are, bit for bit (their leaves' crc32c), the uninterrupted run's.

ckptstore's own manager runs by default; the library faces, a few seconds of import
each per run, under ``--full``.
"""

from __future__ import annotations

import shutil
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import ckptstore
from tests.test_tree_adapters import _child, run, run_refused

SAVES = [2, 4, 6, 8]


@dataclass(frozen=True)
class Face:
    """How one face's job is told what to do, and which store step a training step is."""

    name: str
    #: the job's options for: root, local dir, last step, resume, roll back to (a training
    #: step), close at the end
    options: Callable[[str, Path, int, bool, int | None, bool], dict[str, Any]]
    #: the store step a save at a training step commits
    store_step: Callable[[int], int] = lambda step: step
    #: the steps the job's URL holds committed, ascending
    committed: Callable[[str], list[int]] = ckptstore.list_steps
    #: which save each committed step is (a step saved again is another one)
    saves: Callable[[str], dict[int, str]] = lambda url: {
        step: ckptstore.read_manifest(url, step).attempt for step in ckptstore.list_steps(url)
    }
    #: which of a committed step's leaves hold the weights (compared by their crc32c with
    #: the uninterrupted run's); ``None``: the face's losses are computed from the saved
    #: state itself (Orbax's random walk), so they already compare it
    weight_leaves: Callable[[str], bool] | None = lambda path: True

    def weights(self, url: str, step: int) -> dict[str, int]:
        """The crc32c of each weight leaf of a committed store step."""
        assert self.weight_leaves is not None
        manifest = ckptstore.read_manifest(url, step)
        return {
            path: crc
            for path, crc in zip(manifest.paths, manifest.leaf_crc, strict=True)
            if self.weight_leaves(path)
        }


def _manager(
    url: str, local: Path, last: int, resume: bool, back: int | None, close: bool
) -> dict[str, Any]:
    opts: dict[str, Any] = {"url": url, "store_options": {}, "max_steps": last}
    opts.update(resume=resume, no_close=not close)
    if back is not None:
        opts.update(rollback=True, step=back)
    return opts


def _hf(
    url: str, local: Path, last: int, resume: bool, back: int | None, close: bool
) -> dict[str, Any]:
    opts: dict[str, Any] = {
        "upload_to": url,
        "store_options": {},
        "output_dir": str(local),
        "max_steps": 8,
        "stop_at": last,
        "save_steps": 2,
        "save_total_limit": 3,
    }
    if resume or back is not None:  # StoreCallback(resume=...) and resume_from_checkpoint
        opts.update(native_resume=True, resume_step=True if back is None else back)
        opts.update(rollback=back is not None, expect_checkpoint=back is not None)
    return opts


def _accelerate(
    url: str, local: Path, last: int, resume: bool, back: int | None, close: bool
) -> dict[str, Any]:
    opts: dict[str, Any] = {
        "url": url,
        "store_options": {},
        "local_dir": str(local),
        "max_steps": last,
        "save_at": SAVES,
        "native": True,
        "total_limit": 3,
        "resume": resume,
        "no_close": not close,
    }
    if back is not None:
        opts.update(rollback=True, step=ACCELERATE.store_step(back))
    return opts


def _orbax(
    url: str, local: Path, last: int, resume: bool, back: int | None, close: bool
) -> dict[str, Any]:
    opts: dict[str, Any] = {"url": url, "store_options": {}, "local_dir": str(local)}
    opts.update(max_steps=last, save_at=SAVES, resume=resume, no_close=not close)
    if back is not None:
        opts.update(rollback=True, step=back)
    return opts


def _dcp(
    url: str, local: Path, last: int, resume: bool, back: int | None, close: bool
) -> dict[str, Any]:
    opts = _orbax(url, local, last, resume, back, close)  # the same options; no local dir
    del opts["local_dir"]
    return opts


def _lightning(
    url: str, local: Path, last: int, resume: bool, back: int | None, close: bool
) -> dict[str, Any]:
    opts: dict[str, Any] = {"url": url, "store_options": {}, "max_steps": last}
    opts.update(resume=resume)  # fit ends by itself: nothing to leave unclosed
    if back is not None:
        opts.update(rollback=True, step=back)
    return opts


def _lightning_steps(url: str) -> list[int]:
    """Each Lightning checkpoint is a root of its own under the dirpath: their global steps."""
    from ckptstore.lightning import checkpoints

    return sorted(set(checkpoints(url).values()))


def _lightning_saves(url: str) -> dict[int, str]:
    from ckptstore.lightning import checkpoints

    return {
        step: f"{name}/{ckptstore.read_manifest(f'{url}/{name}', 0).attempt}"
        for name, step in checkpoints(url).items()
        if not name.startswith("last")
    }


class LightningFace(Face):
    def weights(self, url: str, step: int) -> dict[str, int]:
        """The weight leaves of the checkpoint of that global step (not last.ckpt)."""
        from ckptstore.lightning import checkpoints

        name = next(n for n, s in checkpoints(url).items() if s == step and "last" not in n)
        return super().weights(f"{url}/{name}", 0)  # a root of its own: its step 0


MANAGER = Face("manager", _manager)
#: the multi-rank manager on 2 gloo processes (a launcher in the child)
RANKS = Face("ranks", _manager)
HF = Face("hf", _hf, weight_leaves=lambda path: path.endswith("model.safetensors"))
#: automatic checkpoint naming numbers the saves 0, 1, 2...: the save at step 2 is step 0
ACCELERATE = Face(
    "accelerate",
    _accelerate,
    store_step=lambda step: step // 2 - 1,
    weight_leaves=lambda path: path.endswith("model.safetensors"),
)
ORBAX = Face("orbax", _orbax, weight_leaves=None)
DCP = Face("dcp", _dcp, weight_leaves=lambda path: path.startswith("model."))
LIGHTNING = LightningFace(
    "lightning",
    _lightning,
    committed=_lightning_steps,
    saves=_lightning_saves,
    weight_leaves=lambda path: path.startswith("state_dict/"),
)

FACES = [
    pytest.param(MANAGER, id="manager"),
    pytest.param(RANKS, id="ranks", marks=[pytest.mark.slow, pytest.mark.torch]),
    pytest.param(HF, id="hf", marks=[pytest.mark.slow, pytest.mark.torch]),
    pytest.param(ACCELERATE, id="accelerate", marks=[pytest.mark.slow, pytest.mark.torch]),
    pytest.param(ORBAX, id="orbax", marks=[pytest.mark.slow, pytest.mark.jax]),
    pytest.param(DCP, id="dcp", marks=[pytest.mark.slow, pytest.mark.torch]),
    pytest.param(LIGHTNING, id="lightning", marks=[pytest.mark.slow, pytest.mark.torch]),
]


class Job:
    """One face's job in one test: its root, and runs of it on named nodes."""

    def __init__(self, face: Face, tmp_path: Path) -> None:
        self.face = face
        self.tmp = tmp_path
        self.url = str(tmp_path / "root")

    def node(self, name: str) -> Path:
        return self.tmp / f"node-{name}"

    def options(
        self,
        node: str,
        last: int = 8,
        *,
        resume: bool = False,
        back: int | None = None,
        close: bool = True,
    ) -> dict[str, Any]:
        return self.face.options(self.url, self.node(node), last, resume, back, close)

    def run(self, node: str, last: int = 8, **how: Any) -> dict[int, float]:
        return run(self.face.name, self.options(node, last, **how))

    def committed(self) -> list[int]:
        return self.face.committed(self.url)

    def steps(self, *training_steps: int) -> list[int]:
        return [self.face.store_step(s) for s in training_steps]


_WHOLE: dict[str, dict[int, float]] = {}
#: the uninterrupted run's weights at its last step, by face
_WHOLE_WEIGHTS: dict[str, dict[str, int]] = {}


def uninterrupted(face: Face, tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """Every step's loss in an uninterrupted run of the face's job (once per session)."""
    if face.name not in _WHOLE:
        job = Job(face, tmp_path_factory.mktemp(f"whole-{face.name}"))
        losses = job.run("a")
        assert sorted(losses) == list(range(1, 9))
        assert job.committed()[-1] == job.steps(8)[0]
        _WHOLE[face.name] = losses
        if face.weight_leaves is not None:
            _WHOLE_WEIGHTS[face.name] = face.weights(job.url, job.committed()[-1])
            assert _WHOLE_WEIGHTS[face.name], "no weight leaf found"
    return _WHOLE[face.name]


def assert_newest_is_the_uninterrupted_runs(job: Job) -> None:
    """The job's step 8, loaded, holds bit for bit the weights the uninterrupted run saved at
    step 8 (its losses after the event compared the state it trained with; this, the state
    it left)."""
    if job.face.weight_leaves is not None:  # the newest step is step 8's save
        newest = job.committed()[-1]
        assert job.face.weights(job.url, newest) == _WHOLE_WEIGHTS[job.face.name]


def _skip_missing(face: Face) -> None:
    needs = {
        "hf": "transformers",
        "accelerate": "accelerate",
        "orbax": "orbax.checkpoint",
        "lightning": "lightning",
    }
    if face.name in needs:
        pytest.importorskip(needs[face.name])


@pytest.mark.parametrize("face", FACES)
def test_exit_without_close_commits_every_save(face: Face, tmp_path: Path) -> None:
    _skip_missing(face)
    job = Job(face, tmp_path)
    done = _child(face.name, job.options("a", close=False))
    assert done.returncode == 0, done.stderr[-3000:]
    for noise in ("Task was destroyed", "was never awaited", "ckptstore: closing"):
        assert noise not in done.stderr
    assert job.committed()[-1] == job.steps(8)[0]  # the last save too
    shutil.rmtree(job.node("a"), ignore_errors=True)  # a new node finds it whole
    # resumed from step 8 (the Trainer, resumed at its last step, runs one more)
    assert all(step > 8 for step in job.run("b", 8, resume=True))


@pytest.mark.parametrize("face", FACES)
def test_sigkill_then_restart_on_the_same_node_and_on_an_empty_one(
    face: Face, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    _skip_missing(face)
    whole = uninterrupted(face, tmp_path_factory)
    job = Job(face, tmp_path)
    killed = _child(face.name, {**job.options("a"), "kill_after_save": 6})
    assert killed.returncode == -signal.SIGKILL
    # uploads run in the background: the kill may have come before any of them committed,
    # and the steps that did are whole (a save prefix, each loadable)
    committed = job.committed()
    assert committed == job.steps(*SAVES)[: len(committed)], committed
    again = job.run("a", 7, resume=True)  # the same node, the same script
    # it resumed from a save (its own local copy, or the store's), and trained on exactly
    start = min(again) - 1
    assert start in (0, 2, 4, 6), sorted(again)
    assert again == {s: whole[s] for s in range(start + 1, 8)}
    # step 7 was trained and never saved; Lightning saves last.ckpt as fit ends
    newest = 7 if face is LIGHTNING else 6
    assert job.committed()[-1] == job.steps(newest)[0]
    moved = job.run("empty", 8, resume=True)  # another node: nothing local
    assert moved == {s: whole[s] for s in range(newest + 1, 9)}
    assert job.committed()[-1] == job.steps(8)[0]
    assert_newest_is_the_uninterrupted_runs(job)


@pytest.mark.parametrize("face", FACES)
def test_rerun_in_the_same_root_is_refused_before_it_writes(face: Face, tmp_path: Path) -> None:
    _skip_missing(face)
    job = Job(face, tmp_path)
    job.run("a", 4)
    before = job.committed()
    error = run_refused(face.name, job.options("b", 8))  # from scratch, not resuming
    first = job.steps(2)[0]
    assert f"step {first}" in error
    assert f"the newest step of this root is {job.steps(4)[0]}" in error, error
    assert "rollback" in error  # and how to resume or roll back
    assert job.committed() == before


@pytest.mark.parametrize("face", FACES)
def test_roll_back_two_saves_and_train_them_again(
    face: Face, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    _skip_missing(face)
    whole = uninterrupted(face, tmp_path_factory)
    job = Job(face, tmp_path)
    job.run("a")
    replaced = {s: job.face.saves(job.url)[s] for s in job.steps(6, 8)}
    again = job.run("a", 8, back=4)
    assert again == {s: whole[s] for s in range(5, 9)}
    assert job.committed()[-3:] == job.steps(4, 6, 8)
    saves = job.face.saves(job.url)
    for step, save in replaced.items():  # saved again, not the set-aside copies
        assert saves[step] != save
    # a new node rolls back to it once more: its copy downloaded, 6 and 8 set aside again
    assert job.run("empty", 8, back=4) == {s: whole[s] for s in range(5, 9)}
    assert_newest_is_the_uninterrupted_runs(job)


@pytest.mark.parametrize("face", FACES)
def test_sigterm_saves_that_step_and_a_restart_trains_on(
    face: Face, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """SIGTERM during step 5, with each face's preemption option: the managers' and
    Orbax's ``preemption=True`` (the next save call), the Trainer callback's (it saves that
    step and stops), Accelerate's trigger, Lightning's own SIGTERM handling with
    ``SaveOnPreemption``, and DCP's loop watching the signal itself."""
    _skip_missing(face)
    whole = uninterrupted(face, tmp_path_factory)
    job = Job(face, tmp_path)
    stopped = _child(face.name, {**job.options("a"), "preemption": True, "preempt_at": 5})
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    committed = job.committed()
    # steps 2 and 4 on the interval, then step 5 off it, on notice
    assert committed[:2] == job.steps(2, 4)
    assert len(committed) == 3
    assert committed[2] > committed[1]
    assert job.run("b", 8, resume=True) == {s: whole[s] for s in range(6, 9)}
    assert_newest_is_the_uninterrupted_runs(job)
