"""Streaming restore: return once the part a training loop needs first is in place, and read
the rest in the background.

After a failure every accelerator idles until the restore ends, yet the first forward and
backward pass need only the model's weights; the optimizer's moments (two thirds of an Adam
state) are needed only at the first optimizer step. A restore asked with ``stream=`` (on
``ckptstore.load``, both managers' ``restore`` and ``ckptstore.distributed.load``) therefore
reads in two parts:

* **first**, before the call returns: every selected leaf but the optimizer's state (a leaf
  whose path has a segment starting with ``optim`` or equal to ``opt``, ``opt_state`` or
  ``opt_states``: ``optim/state/0/exp_avg``, ``optimizer_states/0/...``, ``opt_state/mu/...``),
  with ``stream=True``; or, with ``stream=["model", "step"]``, exactly the leaves under the
  keys given (each must name something in the step, as a key does). Scalars (0-d leaves) and a
  target's shards are always read first: they are small, and a numpy scalar cannot be filled
  in place.
* **later**, on a thread of this module: the rest, read and verified exactly as the first part
  is, straight into the arrays the call already returned.

What the caller holds for a leaf of the later part, and what makes it safe to use:

* a **torch tensor** or a **numpy array**: the very array the rest is read into (a CPU tensor
  shares the host array's memory; a tensor on a device, or of another dtype than the
  checkpoint's, is copied into once its bytes are verified, on a side CUDA stream for a device
  tensor). Its values are undefined until the fence, which comes
* **automatically before a torch optimizer step**: while a streamed restore is pending this
  module holds one optimizer step pre-hook
  (``torch.optim.optimizer.register_optimizer_step_pre_hook``, called before the step of every
  optimizer), which waits for every pending restore: an ``optimizer.load_state_dict`` of the
  restored state keeps the restored tensors themselves (same dtype and device), so the step
  sees their final values;
* **explicitly** with :func:`fence` (``ckptstore.fence()``, or a manager's ``fence()``), and
  before any save through ckptstore's own calls (``ckptstore.save``, the managers,
  ``ckptstore.distributed.save``, the Lightning plug-in: :func:`ckptstore.pipeline.save.stage`
  stages a state only after the pending restores are complete), so an unfilled tensor is
  never written to a checkpoint. A DCP save is not fenced: DCP reads the state itself.
* a **JAX array**: JAX arrays are immutable, so the state holds a :class:`Pending`
  placeholder at its place (its ``shape``, ``dtype`` and ``path``), and
  ``state = ckptstore.fence(state)`` returns the state with every placeholder replaced by its
  array: JAX's fence, called before the step that needs the optimizer's state. A placeholder
  passed to a JAX function is refused by JAX (it is not an array), never read as zeros.

A failure of the later part (a corrupt byte, a lost server, the restore deadline) is raised at
the fence (by the optimizer step, ``fence()`` or the next save), once, with a note naming the
restore; the float arrays the later part was filling are set to NaN first, and a placeholder
raises it again whenever it is asked for its value, so a caller that catches the error and
goes on cannot train on silently wrong values.

Converting the later part's tensors to another dtype or device before the fence (an
``optimizer.load_state_dict`` into parameters of another dtype or device than the restored
tensors', a ``.to()`` of them) copies values that are not there yet: restore them where they
are used (a ``target`` state of the model's own tensors, or ``target="torch"`` on the device
the saved tensors came from).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np

from ckptstore import background
from ckptstore.errors import CkptStoreError
from ckptstore.layout.tree import is_optimizer_path
from ckptstore.store.transport import store_logger

__all__ = [
    "Pending",
    "Reader",
    "Streamed",
    "fence",
    "is_optimizer_path",
    "pending",
    "wait_all",
]

_log = store_logger("ckptstore.restore")


class Pending:
    """The place of a JAX leaf of a streaming restore's later part, until :func:`fence`.

    Attributes:
        path: the leaf's path in the checkpoint.
        shape: its shape.
        dtype: its dtype (numpy's).
    """

    __slots__ = ("_build", "_host", "_stream", "_value", "dtype", "path", "shape")

    def __init__(
        self,
        stream: Streamed,
        path: str,
        host: np.ndarray[Any, Any],
        build: Callable[[np.ndarray[Any, Any]], Any],
    ) -> None:
        self._stream, self.path = stream, path
        self.shape, self.dtype = tuple(host.shape), host.dtype
        self._host: np.ndarray[Any, Any] | None = host
        self._build: Callable[[np.ndarray[Any, Any]], Any] | None = build
        self._value: Any = None

    def _finish(self) -> None:
        """Build the array from the verified host bytes (on the restore's thread)."""
        assert self._host is not None
        assert self._build is not None
        self._value = self._build(self._host)
        self._host = self._build = None

    def value(self) -> Any:
        """The leaf's array, once the later part is read (waits for it).

        Raises:
            the later part's error, every time it is asked.
        """
        self._stream.wait(raise_once=False)
        return self._value

    def __repr__(self) -> str:
        return (
            f"Pending({self.path!r}, shape={self.shape}, dtype={self.dtype}: read in the "
            "background by a streaming restore; state = ckptstore.fence(state) gives the array)"
        )


#: What reads the later part: ``read(leaves, into)`` fills ``into`` (host arrays by leaf
#: index) and verifies every byte.
Reader = Callable[[list[int], dict[int, np.ndarray[Any, Any]]], Coroutine[Any, Any, None]]


class Streamed:
    """The later part of one streaming restore: its reads on a thread, and its fence.

    Built by :func:`ckptstore.pipeline.restore.rebuild` for a selection with a later part;
    :meth:`hold` is called for each of the later part's leaves while the state is built,
    :meth:`start` once it is built.

    Args:
        where: the store URL, for messages.
        step: the step restored.
        paths: the paths of the manifest's leaves, by index.
    """

    def __init__(self, where: str, step: int, paths: list[str]) -> None:
        self.where, self.step, self._paths = where, step, paths
        #: later leaf -> the host array it is read into (emptied once the reads end)
        self.leaves: dict[int, np.ndarray[Any, Any]] = {}
        self._copies: list[tuple[Any, np.ndarray[Any, Any]]] = []  # (result, host) to copy
        self._placeholders: list[Pending] = []
        self._results: list[Any] = []  # every array handed out for the later part
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._reported = False
        self.seconds: float | None = None

    # ----------------------------------------------------------------- while building

    def hold(
        self,
        index: int,
        host: np.ndarray[Any, Any],
        build: Callable[[np.ndarray[Any, Any]], Any],
        *,
        immutable: bool,
    ) -> Any:
        """What the state holds for later leaf ``index`` until its bytes are read.

        Args:
            host: the host array its bytes will be read into.
            build: the face's rebuild of a host array into the caller's array.
            immutable: the result is a JAX array: a :class:`Pending` stands in for it.
        """
        self.leaves[index] = host
        if immutable:
            placeholder = Pending(self, self._paths[index], host, build)
            self._placeholders.append(placeholder)
            return placeholder
        result = build(host)
        if not _shares(result, host):
            if not _fillable(result):
                placeholder = Pending(self, self._paths[index], host, build)
                self._placeholders.append(placeholder)
                return placeholder
            self._copies.append((result, host))
        self._results.append(result)
        return result

    # ----------------------------------------------------------------- the reads

    def start(self, read: Reader, *, close: Callable[[], Coroutine[Any, Any, None]] | None) -> None:
        """Read the later part on a thread of its own, then register it for the fence.

        Args:
            read: reads the later leaves into their host arrays and verifies them.
            close: closes the store afterwards (a store the face opened for this restore).
        """
        _register(self)
        thread = threading.Thread(
            target=self._run, args=(read, close), name=f"ckptstore-restore-{self.step}", daemon=True
        )
        thread.start()

    def _run(self, read: Reader, close: Callable[[], Coroutine[Any, Any, None]] | None) -> None:
        began = time.monotonic()
        count, nbytes = len(self.leaves), sum(int(a.nbytes) for a in self.leaves.values())
        try:
            background.run(read(sorted(self.leaves), self.leaves))
            for result, host in self._copies:
                _copy_into(result, host)
            for placeholder in self._placeholders:
                placeholder._finish()
        except BaseException as exc:  # raised at the fence
            exc.add_note(
                f"(in the background part of a streaming restore of step {self.step} from "
                f"{self.where}: {len(self.leaves)} leaves such as "
                f"{self._paths[min(self.leaves)]!r} were not restored)"
            )
            self._error = exc
            for result in self._results:
                _poison(result)
        finally:
            if close is not None:
                try:
                    background.run(close())
                except Exception as exc:  # the restore's outcome stands
                    _log.warning("closing the store of %s after a restore: %r", self.where, exc)
            self.seconds = time.monotonic() - began
            # the host arrays of copied leaves are garbage now; the others are the caller's
            self.leaves, self._copies, self._results = {}, [], []
            self._done.set()
        if self._error is None and _log.isEnabledFor(logging.INFO):
            _log.info(
                "restored the background part of step %d from %s: %d leaves, %.1f MiB read "
                "and verified in %.2f s",
                self.step,
                self.where,
                count,
                nbytes / 2**20,
                self.seconds,
            )

    # ----------------------------------------------------------------- the fence

    def done(self) -> bool:
        """Whether the later part has finished (read, or failed)."""
        return self._done.is_set()

    def wait(self, *, raise_once: bool = True) -> bool:
        """Wait for the later part (in slices, so Ctrl-C is acted on).

        Returns:
            Whether there was anything left to wait for.

        Raises:
            the later part's error: the first time only, unless ``raise_once`` is false.
        """
        waited = not self._done.is_set()
        while not self._done.wait(0.1):
            pass
        if self._error is not None and (not raise_once or not self._reported):
            self._reported = True
            raise self._error
        return waited

    @property
    def error(self) -> BaseException | None:
        """The later part's error, once it has failed."""
        return self._error

    def fill(self, state: Any) -> Any:
        """``state`` with this restore's :class:`Pending` placeholders replaced (waits)."""
        self.wait(raise_once=False)
        return _replace(state) if self._placeholders else state


def _shares(result: Any, host: np.ndarray[Any, Any]) -> bool:
    """Whether ``result`` is ``host``'s memory itself (so reading into ``host`` fills it)."""
    address, nbytes = host.__array_interface__["data"][0], host.nbytes
    if isinstance(result, np.ndarray):
        return bool(result.__array_interface__["data"][0] == address and result.nbytes == nbytes)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(result, torch.Tensor):
        return bool(
            result.device.type == "cpu"
            and result.is_contiguous()
            and result.data_ptr() == address
            and result.numel() * result.element_size() == nbytes
        )
    return False


def _fillable(result: Any) -> bool:
    """Whether ``result`` can take the verified bytes by a copy into it."""
    if isinstance(result, np.ndarray):
        return bool(result.flags.writeable)
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(result, torch.Tensor)


def _copy_into(result: Any, host: np.ndarray[Any, Any]) -> None:
    """Copy the verified ``host`` array into ``result`` (converting dtype, to its device)."""
    if isinstance(result, np.ndarray):
        np.copyto(result, host, casting="unsafe")
        return
    import torch

    from ckptstore.stage.torch import tensor_from_numpy

    source = tensor_from_numpy(host)
    with torch.no_grad():
        if result.device.type == "cuda":
            side = torch.cuda.Stream(result.device)  # type: ignore[no-untyped-call]
            with torch.cuda.stream(side):
                result.copy_(source, non_blocking=False)
            side.synchronize()
        else:
            result.copy_(source)


def _poison(result: Any) -> None:
    """Set a float array of a failed later part to NaN, so it cannot pass for trained values."""
    try:
        if isinstance(result, np.ndarray):
            if np.issubdtype(result.dtype, np.floating) and result.flags.writeable:
                result[...] = math.nan
            return
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(result, torch.Tensor) and result.is_floating_point():
            with torch.no_grad():
                result.fill_(math.nan)
    except Exception:  # the error raised at the fence is what matters
        pass


def _replace(node: Any) -> Any:
    """``node`` with every :class:`Pending` in it replaced by its value; containers without
    one are returned as themselves."""
    if isinstance(node, Pending):
        return node.value()
    if isinstance(node, dict):
        values = {key: _replace(value) for key, value in node.items()}
        if all(values[key] is node[key] for key in node):
            return node
        out = node.copy()
        out.update(values)
        return out
    if isinstance(node, list):
        items = [_replace(value) for value in node]
        return node if all(a is b for a, b in zip(items, node, strict=True)) else items
    if isinstance(node, tuple):
        items = [_replace(value) for value in node]
        if all(a is b for a, b in zip(items, node, strict=True)):
            return node
        return type(node)(*items) if hasattr(node, "_fields") else type(node)(items)
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        changes = {
            f.name: _replace(getattr(node, f.name))
            for f in dataclasses.fields(node)
            if f.init and hasattr(node, f.name)
        }
        if all(value is getattr(node, name) for name, value in changes.items()):
            return node
        return dataclasses.replace(node, **changes)
    jax = sys.modules.get("jax")
    if jax is not None:  # a registered pytree node (an optax state, a flax struct)
        leaves, treedef = jax.tree_util.tree_flatten(node, is_leaf=lambda x: isinstance(x, Pending))
        if any(isinstance(leaf, Pending) for leaf in leaves):
            return jax.tree_util.tree_unflatten(treedef, [_replace(leaf) for leaf in leaves])
    return node


# --------------------------------------------------------------------- the process's fence

_lock = threading.Lock()
_pending: list[Streamed] = []
_hook: Any = None  # torch's RemovableHandle while a restore is pending


def _register(stream: Streamed) -> None:
    global _hook
    with _lock:
        _pending.append(stream)
        if _hook is None and "torch" in sys.modules:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            _hook = register_optimizer_step_pre_hook(_before_step)


def pending() -> list[Streamed]:
    """The streamed restores of this process whose later part is not yet fenced."""
    with _lock:
        return list(_pending)


def wait_all() -> bool:
    """Wait for every pending streamed restore; raise the first failure not yet raised.

    Returns:
        Whether there was anything to wait for.
    """
    global _hook
    waited = False
    first: BaseException | None = None
    if background.on_loop():  # its reads need this thread: a synchronous face waits first
        busy = [s for s in pending() if not s.done()]
        if busy:
            raise CkptStoreError(
                f"a save on ckptstore's background loop while a streaming restore of step "
                f"{busy[0].step} from {busy[0].where} is still reading; call "
                "ckptstore.fence() before the save"
            )
    for stream in pending():
        try:
            waited = stream.wait() or waited
        except BaseException as exc:
            first = first or exc
    with _lock:
        _pending[:] = [s for s in _pending if not s.done()]
        if not _pending and _hook is not None:
            _hook.remove()
            _hook = None
    if first is not None:
        raise first
    return waited


def fence(state: Any = None) -> Any:
    """Wait until every streamed restore of this process is complete.

    Called before the training step that needs the later part (a torch optimizer step does
    it by itself). With a ``state``, returns it with every :class:`Pending` placeholder (a
    JAX leaf of a later part) replaced by its array: ``state = ckptstore.fence(state)``.
    Returns ``None`` without one.

    Raises:
        the error of a later part that failed, once (see the module docstring).
    """
    wait_all()
    return None if state is None else _replace(state)


def _before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    wait_all()
