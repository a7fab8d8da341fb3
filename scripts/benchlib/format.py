"""format: whole checkpoints saved and loaded: ckptstore vs torch.save, DCP, Orbax and raw I/O.

The three workloads of :mod:`benchlib.workloads`, the same every suite uses: 1 GiB as 16
arrays of 64 MiB; 20,000 arrays of 4 KiB (80 MiB); and the transformer-like state with its
Adam state (456 MiB in 496 arrays, 370 of them under 1 MiB). Each is saved to and loaded
from two targets:

* local directory: ckptstore (``ckptstore.save``/``load``, durable: every file and directory
  fsynced before the manifest), ckptstore's async save (a ``CheckpointManager``'s ``save``
  then ``wait_until_finished``, timed from the call to the commit), ``torch.save`` of the
  same tensors (zero-copy ``torch.from_numpy`` views) followed by an fsync of the file, DCP's
  ``FileSystemWriter``
  with its defaults (``torch.distributed.checkpoint.save(..., no_dist=True)``, one process,
  ``sync_files=True``), Orbax on JAX (below), and the ceiling: the same bytes as one
  pre-serialized buffer written with ``write`` and ``fsync``d. Loads read cold: every file of
  every system, Orbax's included, is dropped from the page cache (fsync, then
  ``POSIX_FADV_DONTNEED``) before each run; DCP loads into a preallocated state (its only
  mode), the ceiling reads the blob into a preallocated buffer; ckptstore, ``torch.load`` and
  Orbax allocate new arrays. A second read ceiling reads the very files ckptstore wrote,
  ``Settings.max_concurrency`` (16) files at a time from a thread pool, each into a new
  buffer (as a plain ``read`` makes it, and as ckptstore makes its arrays), with no checksum:
  what ckptstore's restore is held against (issue 19: at least 0.9x its throughput).
* memory: ckptstore on ``memory://`` against ``torch.save`` into a ``BytesIO`` and a memcpy of
  the bytes into a reused buffer (the ceiling). Orbax is measured on the local directory only.

Orbax: orbax-checkpoint's standard API with its defaults (OCDBT over TensorStore),
``StandardCheckpointer().save(path, tree)`` then ``wait_until_finished()``, each run to a fresh
directory, and ``restore(path, abstract_tree)`` with ``jax.ShapeDtypeStruct`` leaves (the CPU
device's sharding), the documented restore: it allocates new ``jax.Array``s, which are
immutable, so there is no restoring into preallocated arrays. The tree holds the same arrays as
``jax.Array``s on the CPU device, made once, untimed, with ``jax.device_put`` of the numpy
arrays; other leaves stay Python values. Durability is Orbax's default, checked with strace
(orbax-checkpoint 0.12.8, tensorstore 0.1.86): TensorStore fsyncs every file it writes (the
array data, the OCDBT manifests, ``_sharding``) and their directories, but the small files
Orbax writes from Python (``_METADATA``, ``_CHECKPOINT_METADATA``,
``array_metadatas/process_0``, ``commit_success.txt``) are not fsynced, nor is the parent
directory after the temporary directory is renamed into place, so after a power loss the array
data is on disk but the checkpoint may be missing or lack its metadata. No fsyncs were added:
the difference from ckptstore's "every file and directory" is a few small files and one
directory. Orbax's cost grows with the number of leaves (here about 1 to 1.5 ms per leaf to
save and 1.5 to 2 ms to restore, nearly a minute per save and restore of 20,000 leaves), so its
runs on the 20,000-leaf workload take about half of this suite's time.

Systems run interleaved after one untimed warm-up each; each figure is the median of the
runs. "objects" counts the files (objects) one save wrote, the manifest included (for Orbax,
its metadata and commit files too). What ckptstore and Orbax load is compared with what was
saved, untimed (Orbax's from its last timed restore).
"""

from __future__ import annotations

import gc
import io
import itertools
import math
import os
import shutil
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

import ckptstore
from benchlib import Context, Result, Suite, Timing, evict, interleave, leaves_of
from benchlib.workloads import WORKLOADS, as_torch, map_leaves
from ckptstore.store.checksum import as_uint8

CKPT = "ckptstore"
CKPT_ASYNC = "ckptstore async (to commit)"
THREADED_READ = "threaded read of ckptstore's files"
TORCH = "torch.save (+fsync)"
TORCH_MEM = "torch.save (BytesIO)"
DCP = "DCP FileSystemWriter"
ORBAX = "Orbax StandardCheckpointer"
CEILING = "write+fsync ceiling"
MEMCPY = "memcpy ceiling"


def _arrays(state: Any) -> list[np.ndarray]:
    return leaves_of(state, np.ndarray)


def _empty_like(state: Any) -> Any:
    import torch

    return map_leaves(state, torch.Tensor, torch.empty_like)


# ---------------------------------------------------------------------------- raw I/O


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_fsync(path: Path, blob: np.ndarray) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(blob)
        done = 0
        while done < len(view):
            done += os.write(fd, view[done : done + (64 << 20)])
        os.fsync(fd)
    finally:
        os.close(fd)
    _fsync_path(path.parent)


def _read_file(path: Path, out: np.ndarray) -> None:
    with open(path, "rb", buffering=0) as f:
        view = memoryview(out)
        done = 0
        while done < len(view):
            n = f.readinto(view[done:])
            if not n:
                raise OSError(f"{path} is short")
            done += n


def _threaded_read(paths: list[Path], sizes: list[int], threads: int) -> None:
    """Read each file into a new buffer, ``threads`` files at a time: a plain reader of the
    files ckptstore wrote (no checksums, no arrays rebuilt), the ceiling for its restore.
    Its buffers are new each time, as a plain ``read`` makes them and as ckptstore's restore
    makes its arrays."""

    def read(path: Path, size: int) -> None:
        _read_file(path, np.empty(size, np.uint8))

    with ThreadPoolExecutor(threads) as pool:
        for done in pool.map(read, paths, sizes):
            del done


def _files(directory: Path) -> list[Path]:
    return [Path(d) / n for d, _s, names in os.walk(directory) for n in names]


# ---------------------------------------------------------------------------- Orbax


def _orbax_missing() -> str | None:
    """Why Orbax on JAX cannot be measured here, or None if it can."""
    try:
        import jax  # noqa: F401
        import orbax.checkpoint  # noqa: F401
    except ImportError as e:
        return f"{e} (pip install jax orbax-checkpoint)"
    return None


class _Orbax:
    """Orbax's standard checkpointer over the workload as ``jax.Array``s on the CPU device."""

    def __init__(self, state: dict[str, Any], path: Path) -> None:
        import jax
        import orbax.checkpoint as ocp

        cpu = jax.devices("cpu")[0]
        self.path = path.resolve()
        self.tree = jax.tree.map(
            lambda x: jax.device_put(x, cpu) if isinstance(x, np.ndarray) else x, state
        )
        jax.block_until_ready(self.tree)
        self.abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, self.tree)
        self.ckptr = ocp.StandardCheckpointer()
        #: The last load's result, checked after the timed runs: on 20,000 leaves one more
        #: restore only to check it would cost about half a minute.
        self.restored: Any = None

    def save(self) -> None:
        self.ckptr.save(self.path, self.tree)
        self.ckptr.wait_until_finished()

    def load(self) -> None:
        import jax

        self.restored = None  # freed inside the timed run, as other systems' results are
        self.restored = jax.block_until_ready(self.ckptr.restore(self.path, self.abstract))

    def close(self) -> None:
        self.restored = None
        self.ckptr.close()


# ---------------------------------------------------------------------------- the suite


def _timed(
    cases: dict[str, Callable[[], Any]], repeat: int, setup: Callable[[str], Any]
) -> dict[str, Timing]:
    for name, case in cases.items():  # untimed warm-up
        setup(name)
        case()
    return interleave(cases, repeat, setup=setup)


def _local(ctx: Context, state: dict[str, Any], blob: np.ndarray, orbax: bool) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp

    base = ctx.workdir / "local"
    dirs = {
        CKPT: base / "ckpt",
        CKPT_ASYNC: base / "ckpt-async",
        TORCH: base / "torch",
        DCP: base / "dcp",
        CEILING: base / "raw",
    }
    tstate = as_torch(state)
    jax_saves: dict[str, Callable[[], Any]] = {}
    jax_loads: dict[str, Callable[[], Any]] = {}
    peer = None
    if orbax:
        dirs[ORBAX] = base / "orbax"
        peer = _Orbax(state, dirs[ORBAX] / "state")  # Orbax makes "state" itself, by rename
        jax_saves[ORBAX], jax_loads[ORBAX] = peer.save, peer.load

    def clear(name: str) -> None:
        shutil.rmtree(dirs[name], ignore_errors=True)
        dirs[name].mkdir(parents=True)
        os.sync()  # earlier runs' writeback stays out of the timed run

    def torch_save() -> None:
        torch.save(tstate, dirs[TORCH] / "state.pt")
        _fsync_path(dirs[TORCH] / "state.pt")
        _fsync_path(dirs[TORCH])

    def dcp_save() -> None:
        dcp.save(tstate, storage_writer=dcp.FileSystemWriter(dirs[DCP]), no_dist=True)

    def async_save() -> None:
        # the manager's async save, timed from the call to the commit: what the plain save
        # is held against (issue 19: within 1.1x of it)
        manager = ckptstore.CheckpointManager(dirs[CKPT_ASYNC])
        manager.save(1, state)
        manager.wait_until_finished()
        manager.close()

    saves = _timed(
        {
            CKPT: lambda: ckptstore.save(dirs[CKPT], state, step=1),
            CKPT_ASYNC: async_save,
            TORCH: torch_save,
            DCP: dcp_save,
            **jax_saves,
            CEILING: lambda: _write_fsync(dirs[CEILING] / "blob", blob),
        },
        ctx.repeat,
        clear,
    )
    objects = {name: len(_files(d)) for name, d in dirs.items()}

    target = _empty_like(tstate)

    ckpt_files = sorted(_files(dirs[CKPT]))
    ckpt_sizes = [p.stat().st_size for p in ckpt_files]
    read_threads = ckptstore.Settings().transport.max_concurrency

    def uncache(name: str) -> None:
        evict(_files(dirs[CKPT if name == THREADED_READ else name]))
        gc.collect()

    def ckpt_load() -> None:
        ckptstore.load(dirs[CKPT])

    def torch_load() -> None:
        torch.load(dirs[TORCH] / "state.pt", weights_only=True)

    def dcp_load() -> None:
        dcp.load(target, storage_reader=dcp.FileSystemReader(dirs[DCP]), no_dist=True)

    loads = _timed(
        {
            CKPT: ckpt_load,
            TORCH: torch_load,
            DCP: dcp_load,
            **jax_loads,
            CEILING: lambda: _read_file(dirs[CEILING] / "blob", blob),  # same bytes back
            THREADED_READ: lambda: _threaded_read(ckpt_files, ckpt_sizes, read_threads),
        },
        ctx.repeat,
        uncache,
    )
    _check_same(ckptstore.load(dirs[CKPT]), state, CKPT)
    if peer is not None:
        _check_same(peer.restored, state, ORBAX)
        peer.close()
    for name in dirs:
        shutil.rmtree(dirs[name], ignore_errors=True)
    return {"save": saves, "load": loads, "objects": objects}


def _memory(ctx: Context, state: dict[str, Any], blob: np.ndarray, tag: str) -> dict[str, Any]:
    import torch

    url = f"memory://bench-format-{tag}"
    tstate = as_torch(state)
    out = np.empty_like(blob)
    buffers: dict[str, io.BytesIO] = {}
    steps = itertools.count(1)

    def clear(name: str) -> None:
        if name in (CKPT, ""):
            for step in ckptstore.list_steps(url):
                ckptstore.delete_step(url, step)
        if name in (TORCH_MEM, ""):
            buffers.clear()
        gc.collect()

    def torch_save() -> None:
        buffers["torch"] = io.BytesIO()
        torch.save(tstate, buffers["torch"])

    saves = _timed(
        {
            CKPT: lambda: ckptstore.save(url, state, step=next(steps)),
            TORCH_MEM: torch_save,
            MEMCPY: lambda: np.copyto(out, blob),
        },
        ctx.repeat,
        clear,
    )
    info = ckptstore.read_manifest(url)
    objects = {CKPT: len(info.object_keys) + 1, TORCH_MEM: 1, MEMCPY: 1}
    torch_save()

    def torch_load() -> None:
        buffers["torch"].seek(0)
        torch.load(buffers["torch"], weights_only=True)

    loads = _timed(
        {
            CKPT: lambda: ckptstore.load(url),
            TORCH_MEM: torch_load,
            MEMCPY: lambda: np.copyto(out, blob),
        },
        ctx.repeat,
        lambda name: gc.collect(),
    )
    _check_same(ckptstore.load(url), state, CKPT)
    clear("")
    return {"save": saves, "load": loads, "objects": objects}


def _same(actual: Any, expected: Any) -> bool:
    """Whether ``actual`` holds ``expected``'s values: arrays (numpy or JAX) byte for byte with
    the same dtype and shape, other leaves equal, dicts by key (Orbax sorts them)."""
    if isinstance(expected, np.ndarray):
        a = np.asarray(actual)
        return (
            a.dtype == expected.dtype
            and a.shape == expected.shape
            and a.tobytes() == expected.tobytes()
        )
    if isinstance(expected, dict):
        return (
            isinstance(actual, dict)
            and actual.keys() == expected.keys()
            and all(_same(actual[k], v) for k, v in expected.items())
        )
    if isinstance(expected, list | tuple):
        return (
            isinstance(actual, list | tuple)
            and len(actual) == len(expected)
            and all(_same(a, e) for a, e in zip(actual, expected, strict=True))
        )
    return bool(actual == expected)


def _check_same(actual: Any, expected: Any, system: str) -> None:
    if not _same(actual, expected):
        raise AssertionError(f"{system} loaded something other than what it saved")


def run(ctx: Context) -> list[Result]:
    warnings.simplefilter("ignore")  # DCP warns about no_dist and single-process use
    rows: list[Result] = []
    summary: list[str] = []
    load_before = os.getloadavg()[0]
    orbax_missing = _orbax_missing()
    if orbax_missing:
        print(f"-- Orbax skipped: {orbax_missing}", flush=True)
    for workload, make in WORKLOADS.items():
        state = make(ctx.quick)
        arrays = _arrays(state)
        nbytes = sum(a.nbytes for a in arrays)
        blob = np.concatenate([as_uint8(a) for a in arrays])
        print(f"-- {workload}: {len(arrays)} arrays, {nbytes / (1 << 20):.0f} MiB", flush=True)
        for target, measured in (
            ("local dir", _local(ctx, state, blob, orbax=orbax_missing is None)),
            ("memory", _memory(ctx, state, blob, str(len(rows)))),
        ):
            for op in ("save", "load"):
                for system, t in measured[op].items():
                    rows.append(
                        Result(
                            "format",
                            workload,
                            target,
                            system,
                            op,
                            nbytes,
                            t.median,
                            t.runs,
                            t.cpu_median,
                            objects=measured["objects"].get(system) if op == "save" else None,
                        )
                    )
            summary.append(_summarise(workload, target, nbytes, measured))
        del state, arrays, blob
        gc.collect()
    load = (
        f"Machine load average (1 min) at the start and end of the suite: {load_before:.1f} "
        f"and {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; the machine was shared "
        "with other jobs, so compare systems within a row group, not across runs."
    )
    if orbax_missing:
        load += f" Orbax was not measured: {orbax_missing}."
    ctx.options["summary"] = "\n".join(summary) + "\n\n" + _acceptance(rows) + "\n\n" + load
    return rows


def _summarise(workload: str, target: str, nbytes: int, m: dict[str, Any]) -> str:
    saves, loads = m["save"], m["load"]
    ours_s, ours_l = saves[CKPT].median, loads[CKPT].median
    parts = []
    for system in {**saves, **loads}:
        if system == CKPT:
            continue
        ops = [
            f"{op} {timings[system].median / ours:.2f}x"
            for op, timings, ours in (("save", saves, ours_s), ("load", loads, ours_l))
            if system in timings
        ]
        parts.append(f"{system}: " + ", ".join(ops))
    return (
        f"- **{workload}, {target}**: ckptstore save {ours_s:.3f} s, load {ours_l:.3f} s, "
        f"{m['objects'][CKPT]} objects. Time of each other system / ckptstore's "
        f"(above 1: ckptstore is faster): " + "; ".join(parts) + "."
    )


def _acceptance(rows: list[Result]) -> str:
    def find(workload: str, target: str, system: str, op: str) -> Result:
        return next(
            r
            for r in rows
            if r.workload == workload and r.target == target and r.system == system and r.op == op
        )

    lines = ["Acceptance checks (issue 3), from the medians above:"]
    small = [r for r in rows if r.workload.startswith("20,000") and r.op == "save"]
    if small:
        r = next(r for r in small if r.system == CKPT and r.target == "local dir")
        bound = math.ceil(r.nbytes / (8 << 20)) + 2
        ok = r.objects is not None and r.objects <= bound
        lines.append(
            f"- 20,000 x 4 KiB wrote {r.objects} objects (bound ceil(bytes / 8 MiB) + 2 = "
            f"{bound}): {'PASS' if ok else 'FAIL'}"
        )
    big = "1 GiB as 16 x 64 MiB"
    if any(r.workload == big for r in rows):
        ours = find(big, "local dir", CKPT, "save")
        ceiling = find(big, "local dir", CEILING, "save")
        dcp = find(big, "local dir", DCP, "save")
        share = ceiling.seconds / ours.seconds
        lines.append(
            f"- local 1 GiB save at {share:.0%} of the write+fsync ceiling's throughput "
            f"(target >= 85%): {'PASS' if share >= 0.85 else 'FAIL'}"
        )
        lines.append(
            f"- local 1 GiB save {dcp.seconds / ours.seconds:.2f}x faster than DCP "
            f"FileSystemWriter: {'PASS' if dcp.seconds > ours.seconds else 'FAIL'}"
        )
    lines += ["", "Acceptance checks (issue 19, local disk), from the medians above:"]
    for workload in (big, "transformer + Adam (~400 MiB)"):
        if not any(r.workload == workload for r in rows):
            continue
        ours = find(workload, "local dir", CKPT, "save").seconds
        checks = [
            ("write+fsync ceiling", find(workload, "local dir", CEILING, "save").seconds, 1.05),
            ("DCP FileSystemWriter", find(workload, "local dir", DCP, "save").seconds, 1.0),
            ("async save to commit", find(workload, "local dir", CKPT_ASYNC, "save").seconds, 1.1),
        ]
        for name, theirs, goal in checks:
            lines.append(
                f"- {workload}: ckptstore.save time / {name} {ours / theirs:.2f}x "
                f"(goal <= {goal}x): {'PASS' if ours <= goal * theirs else 'FAIL'}"
            )
        load = find(workload, "local dir", CKPT, "load").seconds
        plain = find(workload, "local dir", THREADED_READ, "load").seconds
        lines.append(
            f"- {workload}: restore throughput / a threaded read of the same files "
            f"{plain / load:.2f}x (goal >= 0.9x): {'PASS' if plain >= 0.9 * load else 'FAIL'}"
        )
    lines += ["", "Acceptance checks (issue 31, local disk), from the medians above:"]
    for workload in dict.fromkeys(r.workload for r in rows):
        ours = find(workload, "local dir", CKPT, "save").seconds
        for name, system, goal in (
            ("write+fsync ceiling", CEILING, 1.05),
            ("DCP FileSystemWriter", DCP, 1.0),
        ):
            theirs = find(workload, "local dir", system, "save").seconds
            lines.append(
                f"- {workload}: ckptstore.save time / {name} {ours / theirs:.2f}x "
                f"(goal <= {goal}x): {'PASS' if ours <= goal * theirs else 'FAIL'}"
            )
    small = next((r.workload for r in rows if r.workload.startswith("20,000")), None)
    if small is not None:
        load = find(small, "local dir", CKPT, "load").seconds
        plain = find(small, "local dir", THREADED_READ, "load").seconds
        lines.append(
            f"- {small}: restore time / a threaded read of the same files {load / plain:.2f}x "
            f"(goal <= 2x, about {(load - plain) / 20_000 * 1e6:.1f} us per leaf beyond it): "
            f"{'PASS' if load <= 2 * plain else 'FAIL'}"
        )
    return "\n".join(lines)


SUITE = Suite(
    name="format",
    title="Checkpoint format: save and load vs torch.save, DCP, Orbax and raw I/O",
    run=run,
    description=__doc__.split("\n\n", 1)[1].strip(),
)
