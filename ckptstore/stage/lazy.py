"""The background copy of a lazy snapshot, and the checks that keep it from being torn.

An eager save copies the state in the ``save()`` call. But the parameters and the optimizer
state of a training loop do not change during the forward and backward passes; they change at
the optimizer step. A lazy snapshot exploits that (as DataStates-LLM does): ``save()`` lays the
arena out, records each source's mutation counter and returns; one background thread copies
the leaves into the arena while the loop computes; before the state is changed, a *fence*
(:meth:`LazyCopy.wait`) waits for whatever of the copy is left. The bytes, the layout and the
commit are the eager ones: the writer waits for the copy (:meth:`LazyCopy.result`) and then
runs the one save pipeline.

A snapshot is never written torn. The contract is that nothing changes the state between
``save()`` and the fence. Each leaf's counter (torch's ``Tensor._version``, which every
in-place op bumps; for JAX, whose arrays are immutable, whether the array was deleted, as
donation to a jitted function does) is checked after its copy and, for every leaf, again when
the whole copy is done: a leaf that changed fails the whole save with
:class:`~ckptstore.errors.TornSnapshotError` naming it, and the error surfaces like any
background error (the next save, ``wait_until_finished``). The second check flags a change
made after the leaf's own copy too: harmless for that leaf, but a break of the contract that
says other leaves may have changed unseen (below). A leaf is never re-copied: a later value
next to the others' earlier ones would itself be a torn snapshot.

What the counters cannot see: torch bumps a counter when an in-place op *finishes*, so an op
still running when the copy's last check reads the counter escapes it; a write through
``tensor.data`` bumps no counter; and batch norm's forward (in training mode) updates its
running mean and variance inside its kernel without bumping theirs. It does bump its
``num_batches_tracked``, so a batch-norm forward during the copy of a ``state_dict()`` fails
the save at the final check: with batch norm in training mode, fence before the forward.
The check is the safety net for the contract; the fence is the guarantee.

Leaves on a CUDA device are copied by :class:`~ckptstore.stage.stager.DeviceCopies`: the
background thread issues their copies on a side stream that first waits for what the caller
had queued at ``save()``; the fence makes the caller's stream wait for the copies (no host
wait); their counters are checked at the fence or once the copies have landed, whichever comes
first, since from then on nothing the caller issues can overtake them.

Leaves are copied smallest first: small tensors (biases, norms, counters) are then copied
within moments of the call, and a batch of them goes in one call (``run_many``).

The fence helps. A thread that waits at the fence has nothing else to do, so it takes the
host batches no one has started, beside the background thread, and waits only for the
batches already under way. When the copy takes longer than the forward and backward it
overlaps, what is left is then copied by two threads instead of one (on a 2-core machine,
with a 456 MiB transformer state in the async benchmark's loop: 114 ms lost per save before,
79 ms with the fence helping, medians of 5 alternating rounds; commit 39a0044). Host leaves
are taken in pieces, the last batches a piece each, so the two threads finish together: with
batches of whole leaves, the 1 GiB state's fence (16 leaves of 64 MiB) waited 87-121 ms, and
84-89 ms in pieces (24 saves each, 4 alternating rounds). The writer's
wait (:meth:`LazyCopy.result`) does not help: it runs while the loop computes, and a second
copying thread would take the loop's core.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from numpy.typing import NDArray

from ckptstore.errors import TornSnapshotError
from ckptstore.stage.stager import ArrayKind, CopyTask, DeviceCopies, _run_batch, _show

__all__ = ["LazyCopy", "LeafCopy"]


# Not frozen: a frozen dataclass's __init__ sets each field through object.__setattr__, about
# 1 us a leaf of the save call (nothing mutates a leaf's copy).
@dataclass(slots=True)
class LeafCopy:
    """One leaf of a lazy snapshot.

    Attributes:
        path: its path in the state.
        leaf: the source array (held until the copy is done).
        kind: its framework.
        version: its mutation counter at ``save()``.
        dst: its slot in the arena.
        device: the device copies that copy it, or ``None`` for a host leaf.
        chunk_bytes: what :meth:`tasks` splits a large host leaf by (the copy itself takes
            host leaves in smaller pieces, :func:`_host_batches`).
    """

    path: str
    leaf: Any
    kind: ArrayKind
    version: int
    dst: NDArray[Any]
    device: DeviceCopies | None
    chunk_bytes: int

    @property
    def nbytes(self) -> int:
        return int(self.dst.nbytes)

    @property
    def on_device(self) -> bool:
        """Its copies are device copies (checked at the fence or once they landed)."""
        return self.device is not None

    def tasks(self) -> list[CopyTask]:
        """The copies that move it into its slot (built in the background thread)."""
        if self.device is not None:
            return self.device.copies(self.leaf, self.dst)
        return self.kind.copies(self.leaf, self.dst, self.chunk_bytes)

    def lost(self) -> TornSnapshotError | None:
        """The error to fail the save with if the source changed since ``save()``."""
        reason = self.kind.lost(self.leaf, self.version)
        return None if reason is None else TornSnapshotError(_show(self.path), reason)


class LazyCopy:
    """The background copy of one lazy snapshot.

    Args:
        leaves: what to copy (in any order; copied smallest first), or a function that
            makes that list: it is called once, by the first thread that needs it (the
            copying thread, a fence, the writer's wait), so the ``save()`` call does not
            build a record per leaf.
        devices: the accelerator copies among them, one per framework that has some.
        chunk_bytes: host copies are run in batches of about this many bytes.
        executor: whose thread copies, from :meth:`start`.
    """

    def __init__(
        self,
        leaves: list[LeafCopy] | Callable[[], list[LeafCopy]],
        devices: list[DeviceCopies],
        chunk_bytes: int,
        executor: ThreadPoolExecutor,
    ) -> None:
        self._executor: ThreadPoolExecutor | None = executor
        self._make: Callable[[], list[LeafCopy]] | None = (
            leaves if callable(leaves) else lambda: leaves
        )
        self._made = threading.Lock()
        self._devices = devices
        self._chunk_bytes = chunk_bytes
        self._issued = threading.Event()
        self._lock = threading.Lock()
        self._leaves: list[LeafCopy] = []
        self._device_checked = False
        self._error: BaseException | None = None
        self._storages: set[int] | None = None
        # Device leaves are issued by the background thread alone (on its side stream); host
        # batches go to whichever thread takes them first (the background one, or a fence).
        self._device_batches: list[list[LeafCopy]] = []
        self._host_batches: list[_Batch] = []
        self._next = 0  # the next host batch to take
        self._in_flight = 0  # host batches taken and not yet finished
        self._runner_done = False  # the background thread has nothing more to take

    def _ready(self) -> None:
        """Make the leaves' records and batches, once, in the first thread that needs them;
        if that fails, the copy fails with its error (and copies nothing)."""
        if self._make is None:  # set to None only once the batches are made
            return
        with self._made:
            make = self._make
            if make is None:
                return
            try:
                leaves = sorted(make(), key=lambda leaf: leaf.nbytes)
            except BaseException as exc:
                self._fail(exc)
                leaves = []
            chunk_bytes = self._chunk_bytes
            self._device_batches = _batches(
                [leaf for leaf in leaves if leaf.on_device], chunk_bytes
            )
            self._host_batches = _host_batches(
                [leaf for leaf in leaves if not leaf.on_device], chunk_bytes
            )
            self._device_checked = not any(leaf.on_device for leaf in leaves)
            self._leaves = leaves
            # last: a thread that sees None without the lock must find the batches made,
            # or the copying thread could finish with none while a fence still makes them
            self._make = None

    def start(self) -> None:
        """Begin copying on the executor's thread (once; later calls do nothing).

        The stage leaves this to whoever runs the save next (an async save does it first
        thing on the background loop, :mod:`ckptstore.manager.async_save`), so the
        copying thread never runs beside the ``save()`` call: on 2 cores a thread woken in
        the call took the caller's core, and about one call in three took 8 ms instead of 4.
        The fence and the writer's wait start it too, so a copy no one started is never
        waited for.
        """
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is None:
            return
        try:
            executor.submit(self._run)
        except BaseException as exc:  # a closed executor: the copy fails, no one waits forever
            self._fail(exc)
            self._issued.set()
            raise

    # ------------------------------------------------------------------ the copying thread

    def _copying(self, paths: list[str]) -> None:
        """Called before each batch of copies, with the batch's leaf paths (a seam where
        tests hold the copy to mutate a leaf deterministically before it is copied)."""

    def _run(self) -> None:
        try:
            self._ready()
            for leaves in self._device_batches:
                self._copy(_Batch(leaves, [copy for leaf in leaves for _, copy in leaf.tasks()]))
            for device in self._devices:
                device.issued()
            self._help()
        except BaseException as exc:
            self._fail(exc)
        finally:
            with self._lock:
                self._runner_done = True
                last = self._in_flight == 0
            if last:
                self._complete()

    def _help(self) -> None:
        """Copy host batches no thread has taken, until none is left (or one failed)."""
        while True:
            with self._lock:
                if self._error is not None or self._next >= len(self._host_batches):
                    return  # after a failure nothing more is started
                batch = self._host_batches[self._next]
                self._next += 1
                self._in_flight += 1
            try:
                self._copy(batch)
            except BaseException as exc:
                self._fail(exc)
            finally:
                with self._lock:
                    self._in_flight -= 1
                    last = self._runner_done and self._in_flight == 0
                if last:
                    self._complete()

    def _complete(self) -> None:
        """Every host batch is copied (or the copy failed): the final check, then done.
        Run once, by the thread that finished last."""
        try:
            if self._error is None:
                _check([leaf for leaf in self._leaves if not leaf.on_device])
        except BaseException as exc:
            self._fail(exc)
        finally:
            self._issued.set()

    def _copy(self, batch: _Batch) -> None:
        self._copying([leaf.path for leaf in batch.leaves])
        host = [leaf for leaf in batch.leaves if not leaf.on_device]
        _check(host)  # a deleted array fails clearly here rather than obscurely in numpy
        try:
            _run_batch(batch.copies)
        except Exception as exc:
            _check(host, exc)
            raise
        _check(host)

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = error

    def _check_devices(self) -> None:
        """Check device leaves' counters, once: at the first moment nothing the caller issues
        later can overtake their copies (the fence ordered its stream, or they landed)."""
        with self._lock:
            if self._device_checked:
                return
            self._device_checked = True
        for leaf in self._leaves:
            if leaf.on_device and (error := leaf.lost()) is not None:
                self._fail(error)
                return

    # ------------------------------------------------------------------ the caller's side

    def done(self) -> bool:
        """Whether every copy has been issued (host copies: done) and checked."""
        return self._issued.is_set() and (self._device_checked or self._error is not None)

    def wait(self) -> bool:
        """The fence: return once nothing the caller does next can change what this copy
        reads. Host copies are waited for; device copies are ordered before the caller's
        later work on its streams. Never raises the copy's error (the save raises it).

        Returns:
            Whether there was any copy left to wait for.
        """
        if self.done():
            return False
        self.start()
        self._ready()
        self._help()  # the caller would only wait: it copies what no thread has started
        self._issued.wait()
        if self._error is None:
            for device in self._devices:
                device.order()
            self._check_devices()
        return True

    def result(self) -> None:
        """Block until the copy has landed in host memory (the writer's wait).

        Raises:
            TornSnapshotError: a source changed (or was deleted) before its copy.
            Exception: what a copy raised.
        """
        self.start()
        self._issued.wait()
        if self._error is None:
            for device in self._devices:
                device.wait()
            self._check_devices()
        # Checked and landed: let the sources and the arena's views go, so a fence that
        # still holds this copy keeps neither the training state nor an old arena alive.
        self._leaves, self._host_batches, self._device_batches = [], [], []
        self._make = None
        if self._error is not None:
            raise self._error

    # ------------------------------------------------------------------ fence hooks

    def holds_any(self, storages: Callable[[], list[int]]) -> bool:
        """Whether any source of this copy shares memory with ``storages()`` (the data
        pointers of an optimizer's tensors); computed while the copy is pending."""
        self._ready()
        with self._lock:
            if self._storages is None:
                self._storages = {
                    ptr for leaf in self._leaves if (ptr := _storage(leaf.leaf)) is not None
                }
            mine = self._storages
        return any(ptr in mine for ptr in storages())


@dataclass(slots=True)
class _Batch:
    """Copies one thread runs in one go, and the leaves they copy (some of a leaf's pieces
    may be in other batches): checked before and after the copies."""

    leaves: list[LeafCopy]
    copies: list[Callable[[], None]]
    nbytes: int = 0


#: Host leaves are copied in pieces of ``chunk_bytes`` divided by this, so the last batches,
#: one piece each, are small: two threads (the copying one, a fence's) finish together.
#: With batches of whole leaves, a 1 GiB state of 64 MiB leaves ended with one thread
#: copying the last leaf (about 11 ms here) while the fence, beside it, had nothing to take.
PIECES = 4


def _host_batches(leaves: list[LeafCopy], chunk_bytes: int) -> list[_Batch]:
    """The copies of ``leaves``, in order, in pieces of ``chunk_bytes // PIECES``, batched
    about ``chunk_bytes`` at a time, but a piece at a time once no more than two batches'
    bytes are left."""
    piece = max(1, chunk_bytes // PIECES)
    tasks = [
        (leaf, n, copy)
        for leaf in leaves
        for n, copy in leaf.kind.copies(leaf.leaf, leaf.dst, piece)
    ]
    left = sum(n for _, n, _ in tasks)
    out: list[_Batch] = []
    i = 0
    while i < len(tasks):
        goal = chunk_bytes if left > 2 * chunk_bytes else piece
        batch = _Batch([], [])
        taken = 0
        while i < len(tasks) and taken < goal:
            leaf, n, copy = tasks[i]
            i += 1
            if not batch.leaves or batch.leaves[-1] is not leaf:
                batch.leaves.append(leaf)
            batch.copies.append(copy)
            taken += n
        left -= taken
        batch.nbytes = taken
        out.append(batch)
    return out


def _batches(leaves: list[LeafCopy], chunk_bytes: int) -> list[list[LeafCopy]]:
    """``leaves`` in order, in batches of about ``chunk_bytes`` (a leaf is never split)."""
    out: list[list[LeafCopy]] = []
    batch: list[LeafCopy] = []
    nbytes = 0
    for leaf in leaves:
        batch.append(leaf)
        nbytes += leaf.nbytes
        if nbytes >= chunk_bytes:
            out.append(batch)
            batch, nbytes = [], 0
    if batch:
        out.append(batch)
    return out


def _check(leaves: list[LeafCopy], cause: BaseException | None = None) -> None:
    """Raise the error of the first of ``leaves`` that changed since ``save()``."""
    for leaf in leaves:
        if (error := leaf.lost()) is not None:
            raise error from cause


def _storage(leaf: Any) -> int | None:
    """The address of a torch tensor's storage (``None`` for other leaves)."""
    storage = getattr(leaf, "untyped_storage", None)
    return int(storage().data_ptr()) if storage is not None else None
