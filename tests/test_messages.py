"""The ranks' messages as JSON (ckptstore.manager.messages), issue 30: what JaxCollectives
reads from the coordination service is never unpickled.

Every message a multi-rank save, a failing save, a sharded save and a read-once load send
is taken off a real run on threads (``LocalGroup`` wrapped so that every object goes
through the codec, as it does through ``JaxCollectives``) and must come back equal; forged
documents are refused with a ``MessageError`` naming what is wrong. tests/test_jax_ranks.py
runs ``JaxCollectives`` itself on real ``jax.distributed`` processes.
"""

from __future__ import annotations

import dataclasses
import pickle
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptstore
import ckptstore.distributed as cd
from ckptstore.manager import messages
from ckptstore.manager.distributed import _Failure, _Part
from ckptstore.manager.messages import MessageError


@dataclasses.dataclass
class Wire:
    """A member of a LocalGroup whose every object travels as a message, and is kept."""

    inner: cd.Collectives
    seen: list[Any]

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def world(self) -> int:
        return self.inner.world

    def _send(self, obj: Any) -> bytes:
        self.seen.append(obj)
        return messages.encode(obj)

    def all_gather(self, obj: Any) -> list[Any]:
        return [messages.decode(x) for x in self.inner.all_gather(self._send(obj))]

    def gather(self, obj: Any, root: int) -> list[Any] | None:
        out = self.inner.gather(self._send(obj), root)
        return None if out is None else [messages.decode(x) for x in out]

    def broadcast(self, obj: Any, root: int) -> Any:
        return messages.decode(self.inner.broadcast(self._send(obj), root))

    def exchange(self, sends: list[Any], receives: list[Any]) -> None:
        self.inner.exchange(sends, receives)  # raw array bytes, not objects


def run_wired(world: int, fn: Any) -> tuple[list[Any], list[Any]]:
    group = cd.LocalGroup(world, timeout=30)
    seen: list[Any] = []

    def one(rank: int) -> Any:
        try:
            return fn(rank, Wire(group.member(rank), seen))
        except BaseException as exc:
            return exc

    with ThreadPoolExecutor(world) as pool:
        return list(pool.map(one, range(world))), seen


def test_every_message_of_saves_loads_and_failures_round_trips(tmp_path: Path) -> None:
    root = str(tmp_path / "ck")
    replicated = np.arange(4096, dtype=np.float32)

    def body(rank: int, comm: Any) -> Any:
        part = {
            "model": {f"shard{rank}": np.full(1000, rank, np.float32), "embed": replicated},
            "scalar": np.float64(2.5),
            "step": 10,
            "order": [1, (2, "three")],
            "opt": {0: {"lr": 0.1}},
        }
        cd.save(root, part, step=1, comm=comm)
        got = cd.load(root, comm=comm, broadcast=True)  # the newest, found by the coordinator
        # a rank that fails is named on every rank
        with pytest.raises((ckptstore.CkptStoreError, ckptstore.UnsupportedLeafError)):
            cd.save(root, {"bad": object()} if rank == 1 else part, step=2, comm=comm)
        return got

    results, seen = run_wired(2, body)
    for result in results:
        assert not isinstance(result, BaseException), repr(result)
        assert result["model"]["embed"].tobytes() == replicated.tobytes()
        assert result["order"] == [1, (2, "three")]
        assert result["opt"] == {0: {"lr": 0.1}}
    kinds = {type(obj).__name__ for obj in seen}
    assert {"_Part", "_Failure", "_Outcome"} <= kinds, kinds
    for obj in seen:
        assert messages.decode(messages.encode(obj)) == obj


def test_a_sharded_save_and_the_manager_send_only_messages(tmp_path: Path) -> None:
    from ckptstore.stage.shards import Shard

    root = tmp_path / "ck"

    def body(rank: int, comm: Any) -> Any:
        rows = np.arange(8, dtype=np.int32).reshape(4, 2) + 100 * rank
        table = Shard(rows, offsets=(4 * rank, 0), global_shape=(8, 2))
        cd.save(root / "sharded", {"table": table}, step=1, comm=comm)
        with cd.CheckpointManager(root / "managed", comm=comm, max_to_keep=2) as mgr:
            mgr.save(1, {f"r{rank}": rows})
            mgr.save(2, {f"r{rank}": rows})
            mgr.restore(1, rollback=True)
        return mgr.set_aside

    results, seen = run_wired(2, body)
    assert results == [[2], [2]]
    assert ckptstore.load(root / "sharded")["table"].shape == (8, 2)
    assert seen
    for obj in seen:
        assert messages.decode(messages.encode(obj)) == obj


def test_a_pickle_and_forged_documents_are_refused_naming_what() -> None:
    with pytest.raises(MessageError, match="not JSON"):
        messages.decode(pickle.dumps(_Failure(0, "E", "m")))
    forged = [
        (b'{"c": "os:system", "f": {}}', "not a ckptstore dataclass"),
        (b'{"c": "ckptstore.never_imported:X", "f": {}}', "not a ckptstore dataclass"),
        (b'{"c": "ckptstore.manager.distributed:Collectives", "f": {}}', "not a ckptstore"),
        (
            b'{"c": "ckptstore.manager.distributed:_Failure", "f": {"rank": 0}}',
            "has the fields",
        ),
        (b'{"x": 1}', "no known kind"),
        (b'{"d": [[1]]}', "not a pair"),
        (b'{"d": [[[1], 2]]}', "key of type"),
        (b'{"b": "***"}', "not base64"),
        (b"[" * 700 + b"]" * 700, "deeper"),
    ]
    for document, why in forged:
        with pytest.raises(MessageError, match=why):
            messages.decode(document)


def test_values_a_message_does_not_carry_are_refused_with_their_path() -> None:
    with pytest.raises(MessageError, match="ndarray at /x/1 is not a value"):
        messages.encode({"x": [1, np.zeros(3)]})
    with pytest.raises(MessageError, match="object at / is not"):
        messages.encode(object())
    part = _Part(3, {"d": ["a"], "c": [0]}, ["a"], ["float32"], [[2]], [8], [None])
    assert messages.decode(messages.encode(part)) == part
    odd = {(1, "a"): b"\x00\xff", 2: float("inf"), "n": None, "t": True, "i": np.int64(7)}
    assert messages.decode(messages.encode(odd)) == {**odd, "i": 7}


def test_the_tree_of_a_state_nested_as_deep_as_states_may_be_is_a_message() -> None:
    from ckptstore.layout.tree import MAX_DEPTH, flatten

    state: Any = np.zeros(2)
    for _ in range(MAX_DEPTH - 1):
        state = {"k": state}
    tree = flatten(state).tree
    assert messages.decode(messages.encode(tree)) == tree
