"""Training runs for tests/test_tree_adapters.py, each in a process of its own.

Each reports only the steps it trained itself, so a resumed run shows where it started.

``python tests/tree_adapters.py hf|accelerate|orbax OPTIONS_JSON``: trains a tiny GPT-2
built from a config (no download) on CPU through the Hugging Face Trainer or Accelerate, or
a JAX random walk through Orbax's CheckpointManager, with the ckptstore adapter uploading
its checkpoints, optionally resuming from a store URL first, and prints one JSON line: the
loss of every step it trained, by step.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch

VOCAB, LENGTH = 64, 16


def after_save(opts: dict[str, Any], step: int) -> None:
    """``kill_after_save``: SIGKILL this process right after the save of that step was
    accepted (queued, not yet durable), as a crash or an OOM kill would."""
    if step == opts.get("kill_after_save"):
        os.kill(os.getpid(), signal.SIGKILL)


def tiny_gpt2() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=LENGTH,
        n_embd=16,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)  # dropout on: resuming must restore the RNG too


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, count: int = 64) -> None:
        generator = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, VOCAB, (count, LENGTH), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def run_hf(opts: dict[str, Any]) -> dict[int, float]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from ckptstore.integrations.transformers import StoreCallback, resume_from_store

    store = opts["store_options"]
    args = TrainingArguments(
        output_dir=opts["output_dir"],
        max_steps=opts["max_steps"],
        save_strategy="steps",
        save_steps=opts["save_steps"],
        # the Trainer deletes old checkpoints while they may be queued
        save_total_limit=opts.get("save_total_limit", 1),
        logging_steps=1,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        report_to="none",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trained: list[int] = []

    class Trained(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            trained.append(state.global_step)

    class StopAt(TrainerCallback):  # a job stopped early (preempted), same schedule
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == opts.get("stop_at"):
                control.should_training_stop = True

    class Killed(TrainerCallback):  # after StoreCallback.on_save: the upload is queued
        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            after_save(opts, state.global_step)

    class Notice(TrainerCallback):  # the scheduler's SIGTERM, during step ``preempt_at``
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step + 1 == opts.get("preempt_at"):
                os.kill(os.getpid(), signal.SIGTERM)

    native = opts.get("native_resume", False)
    resume_step = opts.get("resume_step", native)  # an int: that step (rollback= allowed)
    rollback = opts.get("rollback", False)
    callback = StoreCallback(
        opts["upload_to"],
        resume=resume_step,
        rollback=rollback,
        preemption=opts.get("preemption", False),
        **store,
    )
    callbacks = [callback, Trained(), StopAt(), Killed(), Notice()]
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(), callbacks=callbacks)
    resume: Any = None
    if native:  # the Trainer's own resume, from what the callback put in output_dir
        resume = True if opts.get("expect_checkpoint") else callback.last_checkpoint
    elif opts.get("resume_from"):
        resume = resume_from_store(
            opts["resume_from"], opts["output_dir"], step=opts.get("step"), **store
        )
        assert resume is not None
    trainer.train(resume_from_checkpoint=resume)
    # The log history also holds the restored steps' entries; report the steps run here.
    return {
        e["step"]: e["loss"]
        for e in trainer.state.log_history
        if "loss" in e and e["step"] in trained
    }


def run_accelerate(opts: dict[str, Any]) -> dict[int, float]:
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    from ckptstore.integrations.accelerate import StoreStates, mirror_states

    native = opts.get("native", False)
    config = None
    if native:  # Accelerate's own save_state()/load_state(), mirrored to the store
        config = ProjectConfiguration(
            project_dir=opts["local_dir"],
            automatic_checkpoint_naming=True,
            total_limit=opts.get("total_limit", 1),
        )
    accelerator = Accelerator(cpu=True, project_config=config)
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    if native:
        mirror = mirror_states(
            accelerator,
            opts["url"],
            preemption=opts.get("preemption", False),
            **opts["store_options"],
        )
        start = 0
        if opts.get("rollback"):
            accelerator.load_state(step=opts["step"], rollback=True)
            start = accelerator.step
        elif opts.get("resume"):
            accelerator.load_state()
            start = accelerator.step  # the training step the state was saved at
        # Accelerate's own calls only: accelerator.step counts the steps, saved with the state
        save = lambda step: accelerator.save_state()  # noqa: E731
        losses = _train(accelerator, model, optimizer, opts, start, save)
        if not opts.get("no_close"):  # else closed at exit
            mirror.close()
        return losses
    states = StoreStates(accelerator, opts["url"], opts["local_dir"], **opts["store_options"])
    start = 0
    if opts.get("resume"):
        start = states.load_state(opts.get("step"), rollback=opts.get("rollback", False)) or 0
    losses = _train(accelerator, model, optimizer, opts, start, states.save_state)
    states.close()
    return losses


def _train(
    accelerator: Any, model: Any, optimizer: Any, opts: dict[str, Any], start: int, save: Any
) -> dict[int, float]:
    """Steps ``start + 1`` to ``max_steps``, calling ``save(step)`` at the ``save_at`` ones."""
    data = Tokens()
    losses: dict[int, float] = {}
    model.train()
    for step in range(start + 1, opts["max_steps"] + 1):
        batch = data.ids[(step * 4) % len(data) : (step * 4) % len(data) + 4]
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.step = step
        losses[step] = loss.item()
        if step == opts.get("preempt_at"):
            os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's notice
        # Accelerate's trigger, every step: True on every process once one had notice
        stop = bool(opts.get("preemption")) and accelerator.check_trigger()
        if stop or step in opts.get("save_at", []):
            save(step)
            after_save(opts, step)
    return losses


def run_orbax(opts: dict[str, Any]) -> dict[int, float]:
    """A JAX loop with Orbax's own CheckpointManager calls after ``mirror_manager``: a
    random walk of the weights, its key in the state, so a resume must restore both."""
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    from ckptstore.integrations.orbax import mirror_manager

    preemption = opts.get("preemption", False)
    options = ocp.CheckpointManagerOptions(max_to_keep=3, step_prefix="ckpt")
    losses: dict[int, float] = {}
    manager = ocp.CheckpointManager(opts["local_dir"], options=options)
    with contextlib.nullcontext() if opts.get("no_close") else manager:  # else closed at exit
        mirror_manager(manager, opts["url"], preemption=preemption, **opts["store_options"])
        state = {
            "w": jnp.zeros((4, 4), jnp.float32),
            "key": jax.random.key_data(jax.random.PRNGKey(0)),
            "step": jnp.asarray(0),
        }
        restore = ocp.args.StandardRestore(state)
        if opts.get("rollback"):
            state = manager.restore(opts["step"], args=restore, rollback=True)
        elif opts.get("resume") and (newest := manager.latest_step()) is not None:
            state = manager.restore(newest, args=restore)
        for step in range(int(state["step"]) + 1, opts["max_steps"] + 1):
            key, sub = jax.random.split(jax.random.wrap_key_data(state["key"]))
            w = state["w"] * 0.9 + jax.random.normal(sub, (4, 4))
            state = {"w": w, "key": jax.random.key_data(key), "step": jnp.asarray(step)}
            losses[step] = float(jnp.sum(w * w))
            if step == opts.get("preempt_at"):
                os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's notice
            # Orbax's own idiom: reached_preemption() is True once the mirror had notice
            if step in opts.get("save_at", []) or manager.reached_preemption(step):
                manager.save(step, args=ocp.args.StandardSave(state))
                after_save(opts, step)
        if not opts.get("no_close"):
            manager.wait_until_finished()
    return losses


def run_manager(opts: dict[str, Any]) -> dict[int, float]:
    """ckptstore's own CheckpointManager: a random walk saved every ``save_every`` steps
    (``save()`` is called every step and keeps to the interval, or saves on a notice)."""
    import numpy as np

    from ckptstore import CheckpointManager

    mgr = CheckpointManager(
        opts["url"],
        max_to_keep=3,
        save_interval_steps=opts.get("save_every", 2),
        preemption=opts.get("preemption", False),
        **opts["store_options"],
    )
    state: dict[str, Any] = {"w": np.zeros(64, np.float32), "step": np.int64(0)}
    if opts.get("rollback"):
        state = mgr.restore(opts["step"], rollback=True)
    elif opts.get("resume") and (newest := mgr.latest_step()) is not None:
        state = mgr.restore(newest)
    losses: dict[int, float] = {}
    for step in range(int(state["step"]) + 1, opts["max_steps"] + 1):
        noise = np.random.default_rng(step).standard_normal(64).astype(np.float32)
        state = {"w": state["w"] * np.float32(0.9) + noise, "step": np.int64(step)}
        losses[step] = float((state["w"] * state["w"]).sum())
        if step == opts.get("preempt_at"):
            os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's notice
        mgr.save(step, state)
        after_save(opts, step)
    if not opts.get("no_close"):  # else closed at exit
        mgr.close()
    return losses


def run_ranks(opts: dict[str, Any]) -> dict[int, Any]:
    """The multi-rank ``ckptstore.distributed.CheckpointManager`` on 2 gloo processes: each
    rank walks its own shard of the weights (its noise seeded by step and rank) and saves it
    every 2 steps; a step's losses are both ranks'. This process launches the ranks (each is
    this script again, ``ranks-worker``, started by ``tests/multirank.py``), and ends as they
    do: SIGKILLed if one was, else with rank 0's status, printing rank 1's then rank 0's
    output."""
    import tempfile

    from tests.multirank import run_ranks as launch

    with tempfile.TemporaryDirectory() as logs:
        outcomes = launch(Path(__file__), 2, "ranks-worker", json.dumps(opts), logs=Path(logs))
    if any(outcome.returncode == -signal.SIGKILL for outcome in outcomes):
        os.kill(os.getpid(), signal.SIGKILL)
    if any(outcome.returncode != 0 for outcome in outcomes):
        for outcome in reversed(outcomes):
            sys.stderr.write(outcome.log)
        sys.stderr.flush()
        code = outcomes[0].returncode
        os._exit(code if code > 0 else 1)
    losses = [
        json.loads(next(x for x in o.log.splitlines() if x.startswith("LOSSES ")).split(" ", 1)[1])
        for o in outcomes
    ]
    return {int(step): [losses[0][step], losses[1][step]] for step in losses[0]}


def run_ranks_worker(opts: dict[str, Any]) -> dict[int, float]:
    """One rank of :func:`run_ranks`."""
    from datetime import timedelta

    import numpy as np
    import torch.distributed as dist

    import ckptstore.distributed

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    mgr = ckptstore.distributed.CheckpointManager(
        opts["url"],
        max_to_keep=3,
        save_interval_steps=2,
        timeout=60,
        preemption=opts.get("preemption", False),
        **opts["store_options"],
    )
    shard = f"shard{rank}"
    state: dict[str, Any] = {"w": {shard: np.zeros(32, np.float32)}, "step": np.int64(0)}
    like = {"w": {shard: np.zeros(32, np.float32)}, "step": np.int64(0)}
    if opts.get("rollback"):
        state = mgr.restore(opts["step"], target=like, rollback=True)
    elif opts.get("resume") and mgr.latest_step() is not None:
        state = mgr.restore(target=like)
    losses: dict[int, float] = {}
    for step in range(int(state["step"]) + 1, opts["max_steps"] + 1):
        noise = np.random.default_rng([step, rank]).standard_normal(32).astype(np.float32)
        w = state["w"][shard] * np.float32(0.9) + noise
        state = {"w": {shard: w}, "step": np.int64(step)}
        losses[step] = float((w * w).sum())
        if step == opts.get("preempt_at") and rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # one rank's notice: every rank must stop
        mgr.save(step, state)
        after_save(opts, step)
    if not opts.get("no_close"):  # else closed at exit
        mgr.close()
        dist.destroy_process_group()
    return losses


def run_dcp(opts: dict[str, Any]) -> dict[int, float]:
    """``torch.distributed.checkpoint``'s own calls with ckptstore's Writer and Reader: the
    model and Adam state through DCP's ``get_state_dict``/``set_state_dict``, saved with
    ``dcp.async_save`` to ``<root>/<step>``, resumed from the root's newest step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import ckptstore
    import ckptstore.dcp
    from ckptstore.manager.preemption import Preempted, watch

    notices = watch(opts.get("preemption", False), None)  # DCP has no manager: the loop's
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    root = opts["url"]

    def load(step: int) -> int:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state, "step": 0}
        dcp.load(state, storage_reader=ckptstore.dcp.Reader(f"{root}/{step}"))
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
        return int(state["step"])

    start = 0
    if opts.get("rollback"):
        ckptstore.rollback(root, opts["step"])
        start = load(opts["step"])
    elif opts.get("resume") and (steps := ckptstore.list_steps(root)):
        start = load(steps[-1])
    losses: dict[int, float] = {}
    pending: Any = None
    for step in range(start + 1, opts["max_steps"] + 1):
        data = torch.Generator().manual_seed(step)
        x = torch.randn(16, 8, generator=data)
        loss = ((model(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses[step] = loss.item()
        if step == opts.get("preempt_at"):
            os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's notice
        notice = None if notices is None else notices.notice()
        if notice is not None or step in opts.get("save_at", []):
            if pending is not None:
                pending.result()  # one save at a time, as DCP's docs do
            model_state, optimizer_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optimizer": optimizer_state, "step": step}
            pending = dcp.async_save(state, storage_writer=ckptstore.dcp.Writer(f"{root}/{step}"))
            after_save(opts, step)
        if notice is not None:
            pending.result()  # durable
            raise Preempted(step, notice, root)
    if pending is not None and not opts.get("no_close"):  # else DCP's executor, at exit
        pending.result()
    return losses


def run_lightning(opts: dict[str, Any]) -> dict[int, float]:
    """Lightning's own ``Trainer.fit`` with ``StoreCheckpointIO`` and a ``ModelCheckpoint``
    saving ``step=N.ckpt`` every 2 steps and ``last.ckpt`` into the store URL ``url``.
    Each step's batch comes from its global step, so a resume mid-epoch trains the same
    batches; a resume is ``fit(ckpt_path=last_checkpoint(url))``, a roll-back
    ``StoreCheckpointIO(rollback=True)`` and ``fit(ckpt_path=<url>/step=N.ckpt)``."""
    import logging
    import warnings

    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ckptstore.lightning import SaveOnPreemption, StoreCheckpointIO, last_checkpoint

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")
    losses: dict[int, float] = {}

    class Steps(torch.utils.data.Dataset[torch.Tensor]):
        def __len__(self) -> int:
            return 1000

        def __getitem__(self, index: int) -> torch.Tensor:
            return torch.zeros(1)

    class Fit(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(
                torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
            )

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            step = self.global_step + 1
            x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
            loss = ((self.net(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
            losses[step] = loss.item()
            if step == opts.get("preempt_at"):
                os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's notice
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    class Killing(StoreCheckpointIO):
        def save_checkpoint(self, checkpoint: Any, path: Any, storage_options: Any = None) -> None:
            super().save_checkpoint(checkpoint, path, storage_options)
            if not str(path).split("?")[0].rstrip("/").split("/")[-1].startswith("last"):
                after_save(opts, checkpoint["global_step"])

    url = opts["url"]
    every = ModelCheckpoint(
        dirpath=url, filename="{step}", every_n_train_steps=2, save_top_k=-1, save_last=True
    )
    io = Killing(rollback=bool(opts.get("rollback")), **opts["store_options"])
    trainer = Trainer(
        max_steps=opts["max_steps"],
        accelerator="cpu",
        plugins=[io],
        callbacks=[every, SaveOnPreemption()] if opts.get("preemption") else [every],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    if opts.get("rollback"):
        ckpt_path = f"{url}/step={opts['step']}.ckpt"
    elif opts.get("resume"):
        ckpt_path = last_checkpoint(url, **opts["store_options"])
    else:
        ckpt_path = None
    loader = torch.utils.data.DataLoader(Steps(), batch_size=1)
    trainer.fit(Fit(), loader, ckpt_path=ckpt_path)
    return losses


if __name__ == "__main__":
    torch.set_num_threads(1)
    which, raw = sys.argv[1], sys.argv[2]
    options = json.loads(Path(raw).read_text() if raw.endswith(".json") else raw)
    runs = {
        "hf": run_hf,
        "accelerate": run_accelerate,
        "orbax": run_orbax,
        "manager": run_manager,
        "dcp": run_dcp,
        "lightning": run_lightning,
        "ranks": run_ranks,
        "ranks-worker": run_ranks_worker,
    }
    print("LOSSES " + json.dumps(runs[which](options)))
