"""The :class:`~ckptstore.manager.distributed.Collectives` of a ``jax.distributed`` job.

A JAX multi-process job (``jax.distributed.initialize`` on every process) has no process
group for Python objects on CPU: JAX's collectives run inside compiled computations, on
arrays. What it does have on every backend is the coordination service that
``jax.distributed`` starts on process 0: a key-value store with blocking reads, atomic
increments and recursive deletes, reached through ``jax._src.distributed.global_state.client``
(a ``DistributedRuntimeClient``). :class:`JaxCollectives` builds the collectives of a
multi-rank save and load on it, so a JAX job needs no torch:

* Every call draws the next sequence number of its name in this process (every process
  calls the same collectives in the same order, so the numbers agree, also across the
  objects a face makes per call) and works under ``ckptstore/<name>/<number>/``: a call's
  keys are unique, and a late reader of one call can never see the next call's values.
* A member posts its object under its rank, as JSON (:mod:`ckptstore.manager.messages`:
  whoever can reach the coordination service can write there, so nothing read from it is
  unpickled); the members that need it wait for it
  with blocking gets bounded by ``timeout`` per call (in a ``gather`` the others wait for an empty
  sign of every member's arrival, so all of them notice a member that never comes). A
  member that never posts (it died, or it stopped calling) makes the others raise
  :class:`TimeoutError` naming the rank and the call, never hang: the coordination
  service does not tell the other processes that one was SIGKILLed, it only stops hearing
  from it.
* Once a member has read all it needs, it adds one to the call's counter; the member whose
  increment completes the count deletes the call's directory. Every value has been read by
  then, and the store holds the keys of the calls in progress only, however long the job.

:meth:`JaxCollectives.exchange` (array bytes for the read-once broadcast of a load, where
they do not go through shared memory between processes of one host) goes through the same
store, as raw bytes in pieces of ``piece_bytes``. It works (the tests load
bit-exact with it), but every byte travels to process 0's coordination service and back over
its gRPC channel and waits in process 0's memory until read: process 0 carries all of the
traffic, where reads from the store spread over every process's own link, and a large
replicated state would sit in its memory at once. So a load with ``JaxCollectives`` does not
broadcast unless asked (``broadcast=True``; its ``broadcast_by_default`` is ``False``), and
every process reads what it needs from the store itself. Its speed has not been measured.
"""

from __future__ import annotations

import itertools
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptstore.manager import messages
from ckptstore.manager.distributed import Message

__all__ = ["JaxCollectives", "jax_group_running"]

#: the next call's number, by name: a process-wide sequence, so that a face which makes a
#: new object for every save keeps drawing numbers no earlier call of the name has used
_SEQUENCES: dict[str, itertools.count[int]] = {}


def _client() -> Any:
    """The ``jax.distributed`` client, or ``None`` if the runtime is not initialised."""
    from jax._src.distributed import global_state

    return global_state.client


def jax_group_running() -> bool:
    """Whether ``jax.distributed`` is initialised in this process, without importing JAX
    for it (nothing can have initialised it before ``jax`` is imported)."""
    if "jax" not in sys.modules:
        return False
    return _client() is not None


@dataclass(frozen=True, slots=True)
class _Call:
    """One collective call: its key directory, its name in errors, and when it times out
    (``time.monotonic()``)."""

    directory: str
    what: str
    deadline: float


class JaxCollectives:
    """:class:`~ckptstore.manager.distributed.Collectives` over the processes of a
    ``jax.distributed`` job, through its coordination service's key-value store.

    Every process of the job constructs one with the same ``name`` and makes the same
    calls in the same order. Two objects with different names (the training's and a
    multi-rank ``CheckpointManager``'s, say) never see each other's values. Calls of one
    name are numbered process-wide in the order they start, so one name must never be used
    by two threads at once: a multi-rank ``CheckpointManager`` runs its collectives on a
    thread of its own, so give it a name of its own
    (``comm=JaxCollectives("manager")``), not the ``"default"`` that
    ``ckptstore.distributed.save`` and ``load`` use.

    Args:
        name: the namespace of this object's keys in the coordination service.
        timeout: seconds a member waits for another member's value before it raises
            :class:`TimeoutError` naming that member; how long the survivors of a process
            that dies mid-save wait at most.
        piece_bytes: the largest value :meth:`exchange` puts in the store at once.

    Raises:
        RuntimeError: ``jax.distributed`` is not initialised.
    """

    #: a load through these collectives reads from the store on every process unless
    #: ``broadcast=True`` is passed: see the module docstring.
    broadcast_by_default = False

    def __init__(
        self, name: str = "default", *, timeout: float = 300.0, piece_bytes: int = 16 << 20
    ) -> None:
        client = _client() if jax_group_running() else None
        if client is None:
            raise RuntimeError(
                "JaxCollectives needs jax.distributed initialised "
                "(jax.distributed.initialize) on every process"
            )
        if "/" in name or not name:
            raise ValueError(f"a JaxCollectives name is one non-empty key segment, got {name!r}")
        if timeout <= 0 or piece_bytes <= 0:
            raise ValueError("timeout and piece_bytes must be positive")
        import jax

        self._client = client
        #: this process's rank and the number of processes (of the whole job)
        self.rank: int = jax.process_index()
        self.world: int = jax.process_count()
        self._name = name
        self._timeout = timeout
        self._piece = piece_bytes
        self._sequence = _SEQUENCES.setdefault(name, itertools.count(1))

    # ------------------------------------------------------------------ the collectives

    def all_gather(self, obj: Any) -> list[Any]:
        call = self._begin("all_gather")
        self._post(call, str(self.rank), messages.encode(obj))
        out = [self._load(call, rank) for rank in range(self.world)]
        self._done(call)
        return out

    def gather(self, obj: Any, root: int) -> list[Any] | None:
        call = self._begin("gather")
        self._post(call, str(self.rank), messages.encode(obj))
        self._post(call, f"here-{self.rank}", b"")
        if self.rank == root:
            out = [self._load(call, rank) for rank in range(self.world)]
        else:
            # Wait for every member's (empty) sign of arrival: a member that never comes
            # then fails every member here, as a dead process fails a gloo gather everywhere,
            # not only on the root while the others wait for what the root says next.
            for rank in range(self.world):
                self._get(call, f"here-{rank}", rank)
            out = None
        self._done(call)
        return out

    def broadcast(self, obj: Any, root: int) -> Any:
        call = self._begin("broadcast")
        if self.rank == root:
            self._post(call, str(root), messages.encode(obj))
        out = self._load(call, root)
        self._done(call)
        return out

    def exchange(self, sends: list[Message], receives: list[Message]) -> None:
        # Every send is posted before any receive waits, so no order of the members'
        # transfers can deadlock; a buffer is cut into pieces so no single value is large.
        call = self._begin("exchange")
        for peer, tag, buffer in sends:
            data = np.ascontiguousarray(buffer).reshape(-1).view(np.uint8).data
            for at in range(0, max(1, len(data)), self._piece):
                piece = bytes(data[at : at + self._piece])
                self._post(call, f"{self.rank}-{peer}-{tag}-{at}", piece)
        for peer, tag, buffer in receives:
            out = buffer.reshape(-1).view(np.uint8)
            for at in range(0, max(1, out.size), self._piece):
                piece = self._get(call, f"{peer}-{self.rank}-{tag}-{at}", peer)
                out[at : at + len(piece)] = np.frombuffer(piece, np.uint8)
        self._done(call)

    # ------------------------------------------------------------------ keys

    def _begin(self, what: str) -> _Call:
        number = next(self._sequence)
        return _Call(
            f"ckptstore/{self._name}/{number}",
            f"{what} #{number}",
            time.monotonic() + self._timeout,
        )

    def _post(self, call: _Call, key: str, data: bytes) -> None:
        self._client.key_value_set_bytes(f"{call.directory}/v/{key}", data)

    def _load(self, call: _Call, rank: int) -> Any:
        # JSON, never a pickle: anyone who reaches the coordination service can write here
        return messages.decode(self._get(call, str(rank), rank))

    def _get(self, call: _Call, key: str, rank: int) -> bytes:
        # one deadline for the whole call, however many values it waits for
        left_ms = max(1, int((call.deadline - time.monotonic()) * 1000))
        try:
            data: bytes = self._client.blocking_key_value_get_bytes(
                f"{call.directory}/v/{key}", left_ms
            )
        except Exception as exc:
            if "DEADLINE_EXCEEDED" not in str(exc):
                raise
            raise TimeoutError(
                f"process {rank} of the jax.distributed job did not reach {call.what} of "
                f"ckptstore's collectives {self._name!r} within {self._timeout:g} s; it most "
                "likely died or stopped calling the collectives the other processes call"
            ) from exc
        return data

    def _done(self, call: _Call) -> None:
        # The member whose increment completes the count is the last one to have read what
        # it needed: every value of the call is read, so the call's keys can go.
        if self._client.key_value_increment(f"{call.directory}/done", 1) == self.world:
            self._client.key_value_delete(call.directory)
