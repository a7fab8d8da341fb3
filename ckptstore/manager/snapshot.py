"""The fence of a manager's lazy snapshots: who waits for a background copy, and when.

With ``CheckpointManager(..., snapshot="lazy")`` a save returns before the state is copied
(:mod:`ckptstore.stage.lazy`), so something must keep the training loop from changing the
state while its copy runs. That is the fence, :meth:`LazyFence.wait`, reached three ways:

* **automatically, before an optimizer step.** While a manager is open it holds one torch
  optimizer step pre-hook (``torch.optim.optimizer.register_optimizer_step_pre_hook``: torch
  calls it before the step of every optimizer, so no optimizer has to be registered by hand).
  The hook fences only an optimizer whose parameters or state share memory with a tensor of a
  copy still pending, that is an optimizer whose state is being saved, which is how
  ``{"model": model.state_dict(), "optim": opt.state_dict()}`` is found: a state dict holds
  the parameters' memory and the optimizer's own state tensors, not the optimizer. Another
  optimizer (a GAN's discriminator while the generator is saved) never waits. The hook is
  installed at the first lazy save of torch tensors and removed by ``close()``. When no copy
  is pending it returns at once.
* **explicitly**, ``mgr.fence()``, for loops that change the state by hand (an EMA of the
  weights, a learning-rate buffer, a JAX step that donates its input), and
* ``with mgr.fenced(): ...``, the same as a block.

The fence never raises a copy's error: that belongs to the save and surfaces as any
background error does (the next ``save``, ``wait_until_finished``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ckptstore.pipeline.save import LazyCopy, StagedState

__all__ = ["LazyFence"]


class LazyFence:
    """The lazy snapshots of one manager still copying, and the hook that fences them."""

    def __init__(self) -> None:
        self._pending: list[LazyCopy] = []
        self._hook: Any = None  # torch's RemovableHandle, while installed
        # id(optimizer) -> whether it holds a tensor of the pending copy it was asked about
        self._holds: dict[int, tuple[LazyCopy, bool]] = {}

    def track(self, staged: StagedState) -> None:
        """Fence ``staged``'s background copy from now on (called in the saving thread)."""
        if staged.snapshot is None:
            return
        self._pending = [copy for copy in self._pending if not copy.done()]
        self._pending.append(staged.snapshot)
        if self._hook is None and "torch" in sys.modules:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            self._hook = register_optimizer_step_pre_hook(self._before_step)

    def wait(self) -> bool:
        """Wait for whatever of the pending copies is left.

        Returns:
            Whether there was a copy to wait for (``False``: a no-op).
        """
        pending, self._pending = self._pending, []
        waited = False
        for copy in pending:
            waited = copy.wait() or waited
        return waited

    @contextmanager
    def fenced(self) -> Iterator[None]:
        """A block that may change the state: entered once the pending copies are done."""
        self.wait()
        yield

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        pending = [copy for copy in self._pending if not copy.done()]
        if not pending:
            self._pending = []
            self._holds.clear()
            return
        for copy in pending:
            known = self._holds.get(id(optimizer))
            if known is None or known[0] is not copy:
                known = (copy, copy.holds_any(lambda: _optimizer_storages(optimizer)))
                self._holds[id(optimizer)] = known
            if known[1]:
                copy.wait()

    @property
    def hooked(self) -> bool:
        """Whether the optimizer step hook is installed."""
        return self._hook is not None

    def close(self) -> None:
        """Remove the optimizer hook (the manager waits for its saves itself)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._holds.clear()


def _optimizer_storages(optimizer: Any) -> list[int]:
    """Storage addresses of an optimizer's parameters and of the tensors of its state."""
    import torch

    ptrs = [
        int(p.untyped_storage().data_ptr())
        for group in optimizer.param_groups
        for p in group["params"]
    ]
    for per_param in optimizer.state.values():
        values = per_param.values() if isinstance(per_param, dict) else ()
        ptrs += [int(v.untyped_storage().data_ptr()) for v in values if isinstance(v, torch.Tensor)]
    return ptrs
