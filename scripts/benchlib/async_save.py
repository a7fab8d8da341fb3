"""async: what an asynchronous save costs a training loop, against memcpy, DCP and Orbax.

A torch CPU training loop (``torch.set_num_threads(1)``: one core computes, the other is left
to checkpointing, as a GPU job leaves its host CPUs mostly free) runs ``(saves + 1) x every``
steps of a small MLP and saves a large state every ``every`` steps to local disk. Each system
runs the very same loop in a fresh child process, one run of each system per round, rounds
alternating the systems; figures are medians over the rounds of:

* **lost per save**: the loop's time beyond its own undisturbed pace, ``sum(step times) -
  steps x pace``, less the same figure of the loop without saves run in the same round,
  divided by the saves. The pace is the median of the steps in the last quarter of every
  interval between saves, after the background write has finished (each line prints how
  many steps after its save a system's write was seen done, where the system tells); a
  median over all steps would count the steps a long write slows as the pace: for the 1 GiB
  state, whose writes run through two thirds of each interval, that understated ckptstore's
  loss by ~20 ms a save. It includes the blocking call, any wait for the previous save, and
  the slowdown the background write causes on the training steps (memory bandwidth, GIL,
  CPU). Measured within each run so that the load of a shared machine, which drifts between
  runs, cancels; the plain difference of loop wall times is printed beside it. A system
  whose writes outlast three quarters of the interval (DCP on the 1 GiB state) has its loss
  understated, so the comparison with it errs in its favour.
* **blocking call**: median time the training thread spent inside the save call.
* **where the loss lies** (in each system's line): the time beyond the pace of the save's
  own step (an eager save's copy), of each of the three steps after it (a lazy snapshot's
  fence is in the first) and of the rest of the interval (the background write), per save,
  medians over rounds; the loop without saves has its own, its save step changing one
  element of every tensor.
* **peak extra memory**: the child's peak RSS minus its RSS once the state and model exist,
  over a warm-up save and the timed saves, as a multiple of the state size.

Every child starts after an ``os.sync()``, so no system's writes are slowed by the kernel
flushing what the previous child left dirty (in a run without it, ckptstore's transformer
saves lost 40 ms in the first round and 49 and 47 ms in the two that followed DCP and Orbax).
Every child runs with glibc's malloc thresholds fixed (``MALLOC_MMAP_THRESHOLD_=32 MiB``,
``MALLOC_TRIM_THRESHOLD_=1 GiB``). With the defaults the training step's temporaries went
back to the kernel and were faulted in again: 1,700-4,500 page faults a step, a number that
differed 2x from one child to the next and moved the median step between 18.5 and 23 ms, so
the loop without saves was often the slowest one and no per-save figure was steadier than
+-60 ms. With them fixed, under 20 faults a step, the median step sits at 15.5-17 ms in every
child and the memcpy system loses what its copy takes. The figure is the same for every
system; the lines below print each one's page faults per step.

Systems: ``none`` (no saves), ``memcpy`` (one single-threaded ``copy_`` of every tensor into
buffers allocated and touched before timing, nothing written), ``bare`` (the same copy, then a
separate process, ``bare_writer.py``, hashes and durably writes the same number of bytes from
its own memory: crc32c, ``O_DIRECT``, fsync, rename and directory fsync per object, one object
per tensor of 1 MiB or more and one for the rest, one object at a time; a writer that shares
no Python, GIL, allocator or event loop with the loop, so what it loses beyond memcpy is what
writing the bytes costs the machine, not a design's overhead; it is not a floor (it does
nothing to be gentle, and in the run at 155d8f0 ckptstore lost less than it on the 1 GiB
state); its writer's
memory is not in its peak), ``ckptstore``
(``CheckpointManager.save``, async, one save in flight, ``max_to_keep=2``, local disk with
fsync), ``ckptstore-lazy`` (the same with ``snapshot="lazy"``: the call returns before the
copy, which runs on a background thread while the next step's forward and backward run, and
the loop calls ``mgr.fence()`` before every ``opt.step()``: the saved tensors are not the
optimizer's here, so the automatic fence would never wait, and a real loop, whose optimizer
changes what it saves, would), ``dcp`` (``torch.distributed.checkpoint.async_save`` with its
default stager and ``FileSystemWriter``, waiting on the previous save's future before the
next, as its tutorial does), ``orbax`` (``AsyncCheckpointer(PyTreeCheckpointHandler)`` over
the tensors as numpy views, if orbax-checkpoint is installed).

Before every save, on every system and in the loop without saves at the same steps, one
element of every tensor of the state changes, as training changes all of it between two
saves: ckptstore's saves are incremental by default and would otherwise write nothing after
the first (the section published at 39a0044 measured that, wrongly).

Workloads (:mod:`benchlib.workloads`, the same every suite uses, as torch tensors): ``1GiB``:
16 float32 tensors of 64 MiB; ``transformer``: the transformer-like state with Adam's two
moments and step counters, 456 MiB in 496 tensors.
"""

from __future__ import annotations

import json
import os
import resource
import select
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchlib import Context, Result, Suite, torch_tensors, workloads
from benchlib.workloads import as_torch

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent.parent
SYSTEMS = ["none", "memcpy", "bare", "ckptstore", "ckptstore-lazy", "dcp", "orbax"]
#: ckptstore's systems: eager and lazy snapshots.
OURS = ("ckptstore", "ckptstore-lazy")
#: The bare system writes each tensor of at least this size as its own object, the rest as one.
BARE_OBJECT_MIN = 1 << 20
#: The environment variable that gives the ``tiered`` system (run by the tiers suite, not by
#: this one) its persistent tier's URL.
TIERED_URL = "CKPTSTORE_BENCH_TIERED_URL"
#: Where a child's model, batch and state live: ``cpu`` (this suite) or ``cuda`` (the
#: ``async-gpu`` suite, :mod:`benchlib.async_gpu`); the parent sets it for every child.
DEVICE_ENV = "CKPTSTORE_BENCH_DEVICE"
#: Changes to ckptstore's background work that the ``async-breakdown`` suite
#: (:mod:`benchlib.async_breakdown`) makes in a child, comma-separated: ``nocrc`` (crc32c
#: returns at once), ``keepall`` (no retention), ``memory`` (the manager saves to
#: ``memory://``: no file is written). Measurement only: a checkpoint saved so is not valid.
PATCH_ENV = "CKPTSTORE_BENCH_PATCH"
#: glibc malloc settings of every child (see the module docstring).
MALLOC_SETTINGS = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


# ------------------------------------------------------------------ child process


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _state(workload: str, quick: bool) -> dict[str, Any]:
    """The named workload of :mod:`benchlib.workloads`, as torch tensors."""
    make = {"1GiB": workloads.big, "transformer": workloads.transformer}[workload]
    return as_torch(make(quick))


def _to_device(tree: Any, device: str) -> Any:
    import torch

    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, dict):
        return {k: _to_device(v, device) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_to_device(v, device) for v in tree)
    return tree


def _numpy_tree(tree: Any) -> Any:
    import torch

    if isinstance(tree, torch.Tensor):
        return tree.numpy()
    if isinstance(tree, dict):
        return {str(k): _numpy_tree(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return [_numpy_tree(v) for v in tree]
    return tree


class _Saver:
    """One system's save call and final wait."""

    def __init__(self, system: str, state: dict[str, Any], workdir: Path) -> None:
        self.system, self.state, self.workdir = system, state, workdir
        self.pending: Any = None
        self.cuda = False
        if system in ("memcpy", "bare"):
            import torch

            # A CUDA tensor's copy goes to pinned host memory, as every GPU stager's does; one
            # stream synchronization after the last copy ends the memcpy.
            self.pairs = [
                (torch.empty(t.shape, dtype=t.dtype, pin_memory=True), t)
                if t.is_cuda
                else (torch.empty_like(t), t)
                for t in torch_tensors(state)
            ]
            self.cuda = any(t.is_cuda for _, t in self.pairs)
        if system == "bare":
            sizes = [dst.numel() * dst.element_size() for dst, _ in self.pairs]
            small = sum(n for n in sizes if n < BARE_OBJECT_MIN)
            objects = [n for n in sizes if n >= BARE_OBJECT_MIN] + ([small] if small else [])
            self.writer = subprocess.Popen(
                [sys.executable, str(HERE.parent / "bare_writer.py"), str(workdir / "bare")]
                + [str(n) for n in objects],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
        elif system == "writer-probe":  # the async-breakdown suite's (benchlib.writer_probe)
            from benchlib.writer_probe import ProbeSaver

            self.probe = ProbeSaver(torch_tensors(state), workdir)
        elif system in OURS:
            from ckptstore.manager import CheckpointManager

            snapshot = "lazy" if system == "ckptstore-lazy" else "eager"
            patch = set(filter(None, os.environ.get(PATCH_ENV, "").split(",")))
            if "nocrc" in patch:
                import ckptstore.store.checksum as checksum

                checksum._crc32c.crc32c = lambda data, crc=0: crc
            url = f"memory://bench-{os.getpid()}" if "memory" in patch else workdir / "ckpt"
            keep = None if "keepall" in patch else 2
            self.mgr = CheckpointManager(url, max_to_keep=keep, snapshot=snapshot)
        elif system == "tiered":  # the same saves, each then copied to a persistent tier
            from ckptstore.manager import CheckpointManager

            self.mgr = CheckpointManager(
                os.environ[TIERED_URL], local=workdir / "ckpt", local_max_to_keep=2, max_to_keep=2
            )
        elif system == "orbax":
            import orbax.checkpoint as ocp

            self.ocp = ocp
            self.ckptr = ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler())
            self.np_state = _numpy_tree(state)

    def _bare_ack(self) -> None:
        if self.pending is not None:
            assert self.writer.stdout is not None
            if self.writer.stdout.read(1) != b"k":
                raise RuntimeError(f"bare writer exited with {self.writer.wait()}")
            self.pending = None

    def save(self, step: int) -> None:
        if self.system in ("memcpy", "bare"):
            if self.system == "bare":
                self._bare_ack()  # one save in flight, as for the others
            for dst, src in self.pairs:
                dst.copy_(src, non_blocking=self.cuda)
            if self.cuda:
                import torch

                torch.cuda.current_stream().synchronize()
            if self.system == "bare":
                assert self.writer.stdin is not None
                self.writer.stdin.write(b"s")
                self.writer.stdin.flush()
                self.pending = step
        elif self.system in (*OURS, "tiered"):
            self.mgr.save(step, self.state, force=True)
        elif self.system == "writer-probe":
            self.probe.save()
        elif self.system == "dcp":
            import torch.distributed.checkpoint as dcp

            if self.pending is not None:
                self.pending.result()
            old = self.workdir / f"dcp-{step - 2}"
            self.pending = dcp.async_save(
                self.state, checkpoint_id=str(self.workdir / f"dcp-{step}"), no_dist=True
            )
            shutil.rmtree(old, ignore_errors=True)
        elif self.system == "orbax":
            self.ckptr.wait_until_finished()
            shutil.rmtree(self.workdir / f"orbax-{step - 2}", ignore_errors=True)
            self.ckptr.save(
                self.workdir / f"orbax-{step}", args=self.ocp.args.PyTreeSave(self.np_state)
            )

    def done(self) -> bool | None:
        """Whether the last save's background work is finished; None if it does not tell."""
        if self.system == "memcpy":
            return True
        if self.system == "bare":
            stdout = self.writer.stdout
            if self.pending is not None and select.select([stdout], [], [], 0)[0]:  # type: ignore[type-var]
                self._bare_ack()
            return self.pending is None
        if self.system == "writer-probe":
            return self.probe.done()
        if self.system in (*OURS, "tiered"):
            handle = self.mgr.last_handle
            return handle is None or handle.done()
        if self.system == "dcp":
            return self.pending is None or bool(self.pending.done())
        return None

    def before_step(self) -> None:
        """Before the optimizer step: a lazy snapshot's fence (see the module docstring)."""
        if self.system == "ckptstore-lazy":
            self.mgr.fence()

    def wait(self) -> None:
        if self.system == "bare":
            self._bare_ack()
        elif self.system == "writer-probe":
            self.probe.ack()
        elif self.system in (*OURS, "tiered"):
            self.mgr.wait_until_finished()
        elif self.system == "dcp" and self.pending is not None:
            self.pending.result()
        elif self.system == "orbax":
            self.ckptr.wait_until_finished()

    def close(self) -> None:
        if self.system == "writer-probe":
            self.probe.close()
        elif self.system == "bare":
            assert self.writer.stdin is not None
            self.writer.stdin.close()
            self.writer.wait()
        elif self.system in (*OURS, "tiered"):
            self.mgr.close()
        elif self.system == "orbax":
            self.ckptr.close()


def child(
    system: str, workload: str, workdir: Path, every: int, saves: int, quick: bool
) -> dict[str, Any]:
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    device = os.environ.get(DEVICE_ENV, "cpu")
    cuda = device == "cuda"
    state = _to_device(_state(workload, quick), device)
    state_bytes = sum(t.numel() * t.element_size() for t in torch_tensors(state))
    # On a GPU the step is a GPU's: wide enough that the device, not Python, sets its pace
    # (about 2.5 TFLOP a step in float32), and synchronized at its end as a loop that reads
    # its loss does.
    width = 256 if quick else (4096 if cuda else 768)
    batch = 128 if not cuda else (1024 if quick else 8192)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width),
        torch.nn.GELU(),
        torch.nn.Linear(width, width),
        torch.nn.GELU(),
        torch.nn.Linear(width, width),
    ).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(batch, width, device=device)

    saver: _Saver | None = None

    def train_step() -> None:
        loss = model(x).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if saver is not None:
            saver.before_step()
        opt.step()
        if cuda:
            torch.cuda.synchronize()

    for _ in range(3):
        train_step()
    baseline_rss = _rss()
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    saver = _Saver(system, state, workdir) if system != "none" else None
    if saver is not None:  # warm-up save: buffers, imports, first-touch page faults
        saver.save(0)
        saver.wait()
    blocked: list[float] = []
    steps: list[float] = []
    done_after: list[int] = []  # per save, steps until its background write was seen done
    pending: int | None = None
    cpu0 = time.process_time()
    main_cpu0 = time.thread_time()
    t0 = time.perf_counter()
    tensors = [t.view(-1) for t in torch_tensors(state)]
    for step in range(1, (saves + 1) * every + 1):
        s0 = time.perf_counter()
        train_step()
        saving = step % every == 0 and step <= saves * every
        if saving:
            # Training changes every tensor between two saves; so does this, one element
            # each, on every system (none included, so its cost cancels). Without it the
            # state never changed and ckptstore's incremental saves (the default) wrote
            # nothing after the first one.
            for t in tensors:
                t[:1].add_(1)
        if saver is not None and saving:
            b0 = time.perf_counter()
            saver.save(step)
            blocked.append(time.perf_counter() - b0)
            if pending is not None:  # the previous write outlasted its interval
                done_after.append(every)
            pending = step
        steps.append(time.perf_counter() - s0)
        if pending is not None and saver is not None:
            done = saver.done()
            if done is None:  # the system does not tell
                pending = None
            elif done:
                done_after.append(step - pending)
                pending = None
    loop = time.perf_counter() - t0
    main_cpu = time.thread_time() - main_cpu0
    # The undisturbed pace: steps in the last quarter of each interval (step k sits at
    # position k % every; the save is at position 0).
    late = [t for k, t in enumerate(steps, start=1) if k % every >= every * 3 // 4]
    pace = statistics.median(late)
    # Where the excess lies: per position in the interval after a timed save (0: the save's
    # own step), the steps' time beyond the pace, summed over the saves.
    after = [0.0] * every
    for k, t in enumerate(steps, start=1):
        if every <= k < (saves + 1) * every:
            after[k % every] += t - pace
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
    t1 = time.perf_counter()
    if saver is not None:
        saver.wait()
        saver.close()
    tail = time.perf_counter() - t1
    cpu = time.process_time() - cpu0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "loop": loop,
        "excess": sum(steps) - len(steps) * pace,
        # per save: the save's step, each of the three after it, and the rest of the interval
        "after_save": [x / saves for x in after[:4]] + [sum(after[4:]) / saves],
        "done_after": done_after,
        "every": every,
        "tail": tail,
        "blocked": blocked,
        "cpu": cpu,
        "main_cpu": main_cpu,
        "peak_extra": max(0, peak - baseline_rss),
        "state_bytes": state_bytes,
        "faults_per_step": faults / len(steps),
        "median_step": statistics.median(steps),
    }


# ------------------------------------------------------------------ parent


def _available(system: str, device: str = "cpu") -> bool:
    if system == "bare" and device != "cpu":  # the yardstick of CPU-only machines; a GPU
        return False  # machine's goals are stated against one memcpy
    if system == "orbax":
        if device != "cpu":  # a JAX library: a torch CUDA state reaches it only through a
            return False  # device-to-host copy outside its save
        try:
            import orbax.checkpoint  # noqa: F401
        except ImportError:
            return False
    return True


def _run_child(
    system: str,
    workload: str,
    workdir: Path,
    every: int,
    saves: int,
    quick: bool,
    env: dict[str, str] | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    scratch = workdir / f"{system}-{workload}"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    # Every child starts on an idle disk: what an earlier child left in the page cache (the
    # systems that write without fsync, and the removal of its files) is flushed now, not
    # in the background of the next child's saves.
    os.sync()
    env = {
        **os.environ,
        # the caller's path kept behind ours (a lent machine's extra wheels lie there)
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(ROOT), str(HERE.parent.parent), os.environ.get("PYTHONPATH")) if p
        ),
        **MALLOC_SETTINGS,
        DEVICE_ENV: device,
        **(env or {}),
    }
    args = [
        sys.executable,
        str(HERE),
        system,
        workload,
        str(scratch),
        str(every),
        str(saves),
        str(int(quick)),
    ]
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=1800)
    shutil.rmtree(scratch, ignore_errors=True)
    if out.returncode != 0:
        raise RuntimeError(f"{system}/{workload} child failed:\n{out.stdout}\n{out.stderr}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def lost_per_save(
    runs: list[dict[str, Any]], without: list[dict[str, Any]], saves: int
) -> list[float]:
    """Per round, the time a system's loop lost per save: its steps' excess over their own
    pace, less that of the loop without saves in the same round (see the module docstring)."""
    return [(r["excess"] - base["excess"]) / saves for r, base in zip(runs, without, strict=True)]


def _after_save(runs: list[dict[str, Any]]) -> str:
    """Where a system's loop lost its time, medians over rounds: the save's own step (an
    eager save's copy), each of the next three (a lazy snapshot's fence is in the first), and
    the rest of the interval (the background write), each beyond the loop's pace; the loop
    without saves changes one element of every tensor in its save's step too."""
    ms = [statistics.median(r["after_save"][i] for r in runs) * 1e3 for i in range(5)]
    return (
        f"steps beyond the pace: the save's {ms[0]:.0f} ms, the next three {ms[1]:.0f}, "
        f"{ms[2]:.0f} and {ms[3]:.0f} ms, the rest of the interval {ms[4]:.0f} ms"
    )


def _done_range(runs: list[dict[str, Any]]) -> str:
    seen = [n for r in runs for n in r["done_after"]]
    if not seen:
        return "(not told)"
    within = [n for n in seen if n < runs[0]["every"]]
    parts = [f"{min(within)}-{max(within)} steps after its save"] if within else []
    if len(within) < len(seen):
        parts.append(f"{len(seen) - len(within)} of {len(seen)} writes not before the next save")
    return ", ".join(parts)


#: Goals per ckptstore system (issue 19): lost per save and blocking call as multiples of one
#: memcpy of the state, and lost as a multiple of each peer's.
GOALS = {
    "ckptstore": {"lost": 1.0, "blocking": 1.25, "peer": 0.5},
    "ckptstore-lazy": {"lost": 0.5, "blocking": 0.1, "peer": 0.25},
}


def _our_ratios(
    system: str,
    lost: dict[str, list[float]],
    runs: dict[str, list[dict[str, Any]]],
    nbytes: int,
    memcpy: float,
    memcpy_block: float,
    bare: float,
) -> list[str]:
    """One ckptstore system's figures against memcpy, the bare writer and the peers."""
    if system not in lost:
        return []
    goal = GOALS[system]
    ours = statistics.median(lost[system])
    ours_block = statistics.median(statistics.median(r["blocked"]) for r in runs[system])
    ours_peak = statistics.median(r["peak_extra"] / nbytes for r in runs[system])
    # A lost time at or below zero is the loop's noise outweighing the saves: no ratio
    # against it means anything.
    against_memcpy = (
        f"{ours / memcpy:.2f}x"
        if memcpy > 0
        else f"n/a (memcpy's lost time, {memcpy * 1e3:.0f} ms, is within the loop's noise)"
    )
    ratio = [
        f"{system} lost/memcpy lost {against_memcpy}, lost/one memcpy (the memcpy "
        f"system's blocking call) {ours / memcpy_block:.2f}x (goal <= {goal['lost']})",
        f"blocking/memcpy {ours_block / memcpy_block:.2f}x (goal <= {goal['blocking']})",
        f"peak extra memory {ours_peak:.2f}x the state (goal <= 1.15)",
    ]
    if bare > 0:
        ratio.append(f"{system} lost/bare lost {ours / bare:.2f}x")
    for peer in ("dcp", "orbax"):
        if peer in lost:
            theirs = statistics.median(lost[peer])
            ratio.append(f"{system} lost/{peer} lost {ours / theirs:.2f}x (goal <= {goal['peer']})")
    return ratio


def run(ctx: Context) -> list[Result]:
    every, saves = (4, 2) if ctx.quick else (60, 6)
    return measure(ctx, "async", "cpu", every, saves)


def measure(ctx: Context, suite: str, device: str, every: int, saves: int) -> list[Result]:
    """The loop of every system on both workloads, ``ctx.repeat`` rounds, on ``device``: the
    ``async`` suite on the CPU, ``async-gpu`` on a CUDA device."""
    systems = [s for s in SYSTEMS if _available(s, device)]
    target = "local" if device == "cpu" else f"local, {device} state"
    rows: list[Result] = []
    lines = []
    for workload in ctx.chosen(("1GiB", "transformer")):
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
        for _ in range(ctx.repeat):
            for system in systems:
                runs[system].append(
                    _run_child(
                        system, workload, ctx.workdir, every, saves, ctx.quick, device=device
                    )
                )
                print(f"  {workload} {system}: {runs[system][-1]}", flush=True)
        nbytes = runs["none"][0]["state_bytes"]
        lost: dict[str, list[float]] = {}
        for system in systems:
            if system == "none":
                continue
            lost[system] = lost_per_save(runs[system], runs["none"], saves)
            wall = [
                (r["loop"] - base["loop"]) / saves
                for r, base in zip(runs[system], runs["none"], strict=True)
            ]
            blocked = [statistics.median(r["blocked"]) for r in runs[system]]
            cpu = statistics.median(
                r["cpu"] - b["cpu"] for r, b in zip(runs[system], runs["none"], strict=True)
            )
            peak = [r["peak_extra"] / nbytes for r in runs[system]]
            rows.append(
                Result(
                    suite,
                    workload,
                    target,
                    system,
                    "lost per save",
                    nbytes,
                    statistics.median(lost[system]),
                    lost[system],
                    cpu / saves,
                )
            )
            rows.append(
                Result(
                    suite,
                    workload,
                    target,
                    system,
                    "blocking call",
                    nbytes,
                    statistics.median(blocked),
                    blocked,
                    0.0,
                    notes=f"peak extra {statistics.median(peak):.2f}x state",
                )
            )
            lines.append(
                f"- {workload} {system}: lost {statistics.median(lost[system]) * 1e3:.0f} ms/save, "
                f"blocking {statistics.median(blocked) * 1e3:.0f} ms, peak extra memory "
                f"{statistics.median(peak):.2f}x the state, tail wait "
                f"{statistics.median(r['tail'] for r in runs[system]) * 1e3:.0f} ms, "
                f"loop wall-time difference {statistics.median(wall) * 1e3:.0f} ms/save, "
                f"median step {statistics.median(r['median_step'] for r in runs[system]) * 1e3:.1f}"
                f" ms, {statistics.median(r['faults_per_step'] for r in runs[system]):.0f} page "
                f"faults a step, write seen done {_done_range(runs[system])}, "
                f"{_after_save(runs[system])}"
            )
        memcpy = statistics.median(lost["memcpy"])
        memcpy_block = statistics.median(statistics.median(r["blocked"]) for r in runs["memcpy"])
        bare = statistics.median(lost["bare"]) if "bare" in lost else 0.0
        ratio = []
        if "bare" in lost:
            ratio.append(
                f"bare writer lost/one memcpy {bare / memcpy_block:.2f}x"
                if bare > 0
                else f"bare writer lost {bare * 1e3:.0f} ms"
            )
        for system in OURS:
            ratio += _our_ratios(system, lost, runs, nbytes, memcpy, memcpy_block, bare)
        lines.append(f"- **{workload}**: " + "; ".join(ratio))
    ctx.options["summary"] = (
        f"Loop: {(saves + 1) * every} steps, a save every {every} steps ({saves} timed saves after "
        "one untimed warm-up save); median over rounds.\n\n" + "\n".join(lines)
    )
    return rows


SUITE = Suite(
    name="async",
    title="Async save: time a training loop loses per save",
    run=run,
    description=__doc__.split("\n\n", 1)[1].strip(),
)


if __name__ == "__main__":
    system, workload, workdir, every, saves, quick = sys.argv[1:7]
    result = child(system, workload, Path(workdir), int(every), int(saves), quick == "1")
    print(json.dumps(result))
