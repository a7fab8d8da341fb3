"""The main job: a small torch training loop that checkpoints asynchronously, then proves it.

    python -m ckptstore.examples.train                        # to ./checkpoints
    python -m ckptstore.examples.train --url s3://bucket/run  # any ckptstore URL

A ~2.3M-parameter MLP learns a fixed random "teacher" network with Adam on the CPU. Every
``--save-every`` steps the model, the optimizer state and the RNG state are saved through a
:class:`~ckptstore.manager.CheckpointManager`: the loop blocks only while the tensors are
copied into pooled host buffers, and the write and commit overlap the next training steps.
Each save prints how long it blocked and how long its background write took.

If the URL already holds checkpoints of this job, training resumes from the latest one (a
streaming restore: the first step starts before the optimizer's state is read). At the
end the latest checkpoint is restored and checked bit-exact against the live model and
optimizer, then loaded into a fresh model and optimizer, and one more training step on both
must give identical parameters. Any mismatch or error exits non-zero.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from ckptstore.examples.job import job_parser, run_job
from ckptstore.manager import CheckpointManager
from ckptstore.manager.async_save import SaveHandle


def build(width: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, width),
        torch.nn.GELU(),
        torch.nn.Linear(width, width),
        torch.nn.GELU(),
        torch.nn.Linear(width, 256),
    )
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def teacher_batch(step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of one step: deterministic in the step, so a resumed run sees the
    same data as an uninterrupted one."""
    g = torch.Generator().manual_seed(1_000_003 * step + 7)
    x = torch.randn(batch, 256, generator=g)
    t = torch.Generator().manual_seed(42)
    w1, w2 = torch.randn(256, 256, generator=t) / 16, torch.randn(256, 256, generator=t) / 16
    return x, torch.tanh(x @ w1) @ w2


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, batch: int) -> float:
    x, y = teacher_batch(step, batch)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()  # type: ignore[no-untyped-call]
    opt.step()
    return float(loss.detach())


def training_state(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}


def same_bits(a: Any, b: Any, where: str = "") -> list[str]:
    """Paths at which two states differ (structure, dtype, shape or any bit)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if list(a) != list(b):
            return [f"{where}: keys {list(a)[:4]} vs {list(b)[:4]}"]
        return [d for k in a for d in same_bits(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b):
            return [f"{where}: lengths {len(a)} vs {len(b)}"]
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in same_bits(x, y, f"{where}/{i}")
        ]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return [f"{where}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"]
        ab = a.detach().contiguous().view(-1).view(torch.uint8)
        bb = b.detach().contiguous().view(-1).view(torch.uint8)
        return [] if torch.equal(ab, bb) else [f"{where}: values differ"]
    return [] if a == b and type(a) is type(b) else [f"{where}: {a!r} vs {b!r}"]


def main(argv: list[str] | None = None) -> int:
    parser = job_parser("ckptstore.examples.train", __doc__)
    parser.add_argument(
        "--url",
        default="./checkpoints",
        help="where checkpoints go: a directory or any ckptstore URL "
        "(s3://bucket/run?endpoint_url=..., gs://bucket/run, nfs:///mnt/run)",
    )
    parser.add_argument("--steps", type=int, default=100, help="training steps to run")
    parser.add_argument("--save-every", type=int, default=20, help="steps between saves")
    parser.add_argument("--width", type=int, default=1280, help="hidden width (1280: 2.3M params)")
    parser.add_argument("--batch", type=int, default=64, help="examples per training step")
    parser.add_argument("--keep", type=int, default=3, help="checkpoints to keep")
    parser.add_argument("--threads", type=int, default=1, help="torch compute threads")
    args = parser.parse_args(argv)
    return run_job(parser.prog, lambda: train(args))


def train(args: argparse.Namespace) -> int:
    """The job itself; returns 1 if the restored checkpoint does not match."""
    torch.set_num_threads(args.threads)
    model, opt = build(args.width, seed=0)
    params = sum(p.numel() for p in model.parameters())
    mgr = CheckpointManager(args.url, max_to_keep=args.keep, save_interval_steps=args.save_every)
    try:
        start = 0
        latest = mgr.latest_step()
        if latest is not None:
            # stream=True: the call returns once the model is read; Adam's moments are read
            # while the first forward and backward pass run, and the first opt.step() waits
            # for them (docs/lifecycle.md, "Resuming before the restore ends")
            state = mgr.restore(latest, stream=True)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optim"])
            start = int(state["step"]) + 1
            print(f"resuming from step {latest} in {args.url}")
        print(
            f"training a {params / 1e6:.1f}M-parameter MLP with Adam for {args.steps} steps, "
            f"saving every {args.save_every} steps to {args.url}"
        )
        handles: list[SaveHandle] = []
        t_train = time.perf_counter()
        blocked = 0.0
        last = start + args.steps - 1
        for step in range(start, last + 1):
            loss = train_step(model, opt, step, args.batch)
            state = training_state(model, opt, step)
            if mgr.save(step, state, force=step == last, metadata={"loss": loss}):
                handle = mgr.last_handle
                assert handle is not None
                handles.append(handle)
                blocked += handle.timing.blocked
                done = [h.write_seconds for h in handles[:-1] if h.write_seconds is not None]
                prev = f", previous write {done[-1] * 1e3:.0f} ms" if done else ""
                timing = handle.timing
                print(
                    f"step {step:5d}  loss {loss:.5f}  save blocked {timing.blocked * 1e3:6.1f} ms "
                    f"(waited {timing.waited * 1e3:.1f}, copied {timing.nbytes / 1e6:.1f} MB)"
                    f"{prev}",
                    flush=True,
                )
        mgr.wait_until_finished()
        elapsed = time.perf_counter() - t_train
        nbytes = sum(h.timing.nbytes for h in handles)
        writing = sum(h.write_seconds or 0.0 for h in handles)
        print(
            f"{args.steps} steps in {elapsed:.1f} s ({args.steps / elapsed:.1f} steps/s); "
            f"{len(handles)} saves of {nbytes / max(len(handles), 1) / 1e6:.1f} MB blocked "
            f"{blocked * 1e3:.0f} ms in all ({blocked / elapsed:.1%} of the run); background "
            f"writes ran at {nbytes / max(writing, 1e-9) / 1e6:.0f} MB/s"
        )
        print(f"checkpoints kept: {mgr.all_steps()}")

        # Restore the latest checkpoint and check it bit-exact against the live state.
        latest = mgr.latest_step()
        if latest != last:
            print(f"FAIL: latest committed step is {latest}, expected {last}", file=sys.stderr)
            return 1
        t0 = time.perf_counter()
        restored = mgr.restore()
        print(f"restored step {latest} in {(time.perf_counter() - t0) * 1e3:.0f} ms")
        diffs = same_bits(restored, training_state(model, opt, last))
        # Resume check: a fresh model and optimizer loaded from it train on identically.
        fresh_model, fresh_opt = build(args.width, seed=123)
        fresh_model.load_state_dict(restored["model"])
        fresh_opt.load_state_dict(restored["optim"])
        train_step(model, opt, last + 1, args.batch)
        train_step(fresh_model, fresh_opt, last + 1, args.batch)
        diffs += same_bits(fresh_model.state_dict(), model.state_dict(), "after one more step")
        if diffs:
            print("FAIL: restored state differs:\n  " + "\n  ".join(diffs[:10]), file=sys.stderr)
            return 1
        print(f"OK: step {latest} restored bit-exact; training resumes identically from it")
        return 0
    finally:
        mgr.close()


if __name__ == "__main__":
    raise SystemExit(main())
