"""The faces of ckptstore, each as one save call and one load call, for the conformance suite
(:class:`~ckptstore.testing.face_tests.FaceTests`).

A *face* is a way users save or restore a checkpoint: ``ckptstore.save``, the managers,
``ckptstore.distributed``, DCP's ``dcp.save``/``dcp.load`` with ckptstore's storage writer
and reader, Lightning's ``CheckpointIO``, the CLI's ``cp``. Each :class:`Face` calls its
library exactly as a user would (DCP through ``torch.distributed.checkpoint``, Lightning
through its plug-in's methods, the CLI through its ``main``), and uses only ckptstore's
public names, so the suite proves what users get.

Where a face lacks a capability on purpose or for now, :attr:`Face.lacks` says so with the
reason; the suite then checks that the capability is really absent (an expected failure
that turns into an error once the face gains it, so the entry must be removed then) rather
than skipping it silently.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

__all__ = ["FACES", "LOADERS", "SAVERS", "Face", "Place"]


@dataclass(frozen=True)
class Place:
    """Where a face saves: a run root and the store options, given as keywords or in the
    URL's query (``in_query``), as users give them."""

    root: str
    options: dict[str, Any] = field(default_factory=dict)
    in_query: bool = False

    def url(self, suffix: str = "") -> str:
        """The root (plus ``suffix``, a path such as ``"/3"``), with the options in its
        query when they travel there."""
        url = self.root.rstrip("/") + suffix
        if self.in_query and self.options:
            url += "?" + urlencode(self.options)
        return url

    def keywords(self) -> dict[str, Any]:
        """The options to pass as keywords (none when they travel in the URL)."""
        return {} if self.in_query else dict(self.options)


Saver = Callable[[Place, Any, int], None]
Loader = Callable[[Place, int, Any, Any, Any], Any]


@dataclass(frozen=True)
class Face:
    """One face: how it saves, how it loads, what it takes.

    Attributes:
        name: the face's name in test ids.
        save: ``save(place, state, step)``; returns once the step is committed.
        load: ``load(place, step, keys, target, like)``: the state of ``step``. ``like`` is
            the state that was saved, for faces that load into a template (DCP).
        keys: the load takes ``keys=`` (a selection by path).
        target: the load takes ``target=`` (a framework name or a state).
        fmt: ``"native"`` for ckptstore's own checkpoints, ``"dcp"`` for DCP's (its planner
            flattens the state to its own names; the two are read by their own faces only).
        url_step: the face names a checkpoint by a URL whose last segment is the step.
        lacks: capability -> why this face lacks it. Capabilities:
            ``"incremental"`` (an unchanged leaf is referenced, not written again).
    """

    name: str
    save: Saver | None = None
    load: Loader | None = None
    keys: bool = True
    target: bool = True
    fmt: str = "native"
    url_step: bool = False
    lacks: dict[str, str] = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"Face({self.name})"


# ---------------------------------------------------------------------------- the calls


def _one_rank() -> Any:
    import ckptstore.distributed as cd

    return cd.LocalGroup(1).member(0)


def _save_api(place: Place, state: Any, step: int) -> None:
    import ckptstore

    ckptstore.save(place.url(), state, step=step, **place.keywords())


def _save_async_api(place: Place, state: Any, step: int) -> None:
    import ckptstore

    ckptstore.background.run(ckptstore.asave(place.url(), state, step=step, **place.keywords()))


def _manager_saver(**manager_options: Any) -> Saver:
    def save(place: Place, state: Any, step: int) -> None:
        import ckptstore

        with ckptstore.CheckpointManager(place.url(), **manager_options, **place.keywords()) as m:
            m.save(step, state)

    return save


def _save_distributed(place: Place, state: Any, step: int) -> None:
    import ckptstore.distributed as cd

    cd.save(place.url(), state, step=step, comm=_one_rank(), **place.keywords())


def _save_distributed_manager(place: Place, state: Any, step: int) -> None:
    import ckptstore.distributed as cd

    with cd.CheckpointManager(place.url(), comm=_one_rank(), **place.keywords()) as m:
        m.save(step, state)


#: The local tier of each place's tiered faces, by place root: a directory of its own,
#: kept for the process's life, so a tiered loader finds what a tiered saver left there.
_LOCAL_TIERS: dict[str, str] = {}


def _local_tier(place: Place) -> str:
    if place.root not in _LOCAL_TIERS:
        import atexit
        import shutil
        import tempfile

        _LOCAL_TIERS[place.root] = local = tempfile.mkdtemp(prefix="ckptstore-local-tier-")
        atexit.register(shutil.rmtree, local, True)
    return _LOCAL_TIERS[place.root]


def _tiered_manager(place: Place, *, distributed: bool) -> Any:
    """A manager whose persistent tier is the place and whose local tier is the place's
    own (:func:`_local_tier`): one process, or one rank of a multi-rank job."""
    if distributed:
        import ckptstore.distributed as cd

        return cd.CheckpointManager(
            place.url(),
            local=_local_tier(place),
            comm=_one_rank(),
            tier_comm=_one_rank(),
            **place.keywords(),
        )
    import ckptstore

    return ckptstore.CheckpointManager(place.url(), local=_local_tier(place), **place.keywords())


def _tiered_saver(*, distributed: bool) -> Saver:
    def save(place: Place, state: Any, step: int) -> None:
        with _tiered_manager(place, distributed=distributed) as m:
            m.save(step, state, persist=True)  # closing waits for the copy to the place

    return save


def _tiered_loader(*, distributed: bool) -> Loader:
    def load(place: Place, step: int, keys: Any, target: Any, like: Any) -> Any:
        with _tiered_manager(place, distributed=distributed) as m:
            return m.restore(step, keys=keys, target=target)

    return load


def _save_dcp(place: Place, state: Any, step: int) -> None:
    from torch.distributed.checkpoint.state_dict_saver import save

    import ckptstore.dcp

    save(state, storage_writer=ckptstore.dcp.Writer(place.url(f"/{step}"), **place.keywords()))


def _save_lightning(place: Place, state: Any, step: int) -> None:
    from ckptstore.lightning import StoreCheckpointIO

    StoreCheckpointIO(**place.keywords()).save_checkpoint(state, place.url(f"/{step}"))


#: The in-memory run each place's ``cp`` face saves to first, by place.
_CP_SOURCES: dict[str, str] = {}


def _save_cp(place: Place, state: Any, step: int) -> None:
    """Saved to an in-memory run of its own (one per place, so a second save is an
    incremental one of the first), then copied to the place by ``ckptstore cp``."""
    import uuid

    import ckptstore
    from ckptstore import cli

    source = _CP_SOURCES.setdefault(place.root, f"memory://faces-cp-{uuid.uuid4().hex}")
    ckptstore.save(source, state, step=step)
    args = ["cp", source, place.url(), "--step", str(step)]
    for key, value in place.keywords().items():
        args += ["--dst-option", f"{key}={value}"]
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = cli.main(args)
    # what cp printed is what a user sees: the suite hunts it for secrets too
    logging.getLogger("ckptstore.testing.faces").info(
        "cp printed: %s%s", out.getvalue(), err.getvalue()
    )
    if code != 0:
        raise RuntimeError(f"ckptstore cp exited with {code}: {err.getvalue().strip()}")


def _load_api(place: Place, step: int, keys: Any, target: Any, like: Any) -> Any:
    import ckptstore

    return ckptstore.load(place.url(), step, keys, target=target, **place.keywords())


def _load_async_api(place: Place, step: int, keys: Any, target: Any, like: Any) -> Any:
    import ckptstore

    return ckptstore.background.run(
        ckptstore.aload(place.url(), step, keys, target=target, **place.keywords())
    )


def _load_manager(place: Place, step: int, keys: Any, target: Any, like: Any) -> Any:
    import ckptstore

    with ckptstore.CheckpointManager(place.url(), **place.keywords()) as m:
        return m.restore(step, keys=keys, target=target)


def _load_manager_streaming(place: Place, step: int, keys: Any, target: Any, like: Any) -> Any:
    import ckptstore

    with ckptstore.CheckpointManager(place.url(), **place.keywords()) as m:
        out = m.restore(step, keys=keys, target=target, stream=True)
        return ckptstore.fence(out)  # JAX leaves come back as Pending until the fence


def _load_distributed(place: Place, step: int, keys: Any, target: Any, like: Any) -> Any:
    import ckptstore.distributed as cd

    return cd.load(
        place.url(), step, keys=keys, target=target, comm=_one_rank(), **place.keywords()
    )


def _load_distributed_manager(place: Place, step: int, keys: Any, target: Any, like: Any) -> Any:
    import ckptstore.distributed as cd

    with cd.CheckpointManager(place.url(), comm=_one_rank(), **place.keywords()) as m:
        return m.restore(step, keys=keys, target=target)


def dcp_template(value: Any) -> Any:
    """What ``dcp.load`` fills in place: a zero tensor of each tensor's dtype and shape, and
    ``None`` where DCP puts back another value."""
    import torch

    if isinstance(value, dict):
        return {k: dcp_template(v) for k, v in value.items()}
    if isinstance(value, list):
        return [dcp_template(v) for v in value]
    if isinstance(value, torch.Tensor):
        return torch.zeros(value.shape, dtype=value.dtype)
    return None


def _load_dcp(place: Place, step: int, keys: Any, target: Any, like: Any) -> Any:
    from torch.distributed.checkpoint.state_dict_loader import load

    import ckptstore.dcp

    into = dcp_template(like)
    load(into, storage_reader=ckptstore.dcp.Reader(place.url(f"/{step}"), **place.keywords()))
    return into


def _load_lightning(place: Place, step: int, keys: Any, target: Any, like: Any) -> Any:
    from ckptstore.lightning import StoreCheckpointIO

    return StoreCheckpointIO(**place.keywords()).load_checkpoint(place.url(f"/{step}"))


#: Every face that saves.
SAVERS: list[Face] = [
    Face("save", save=_save_api),
    Face("asave", save=_save_async_api),
    Face("manager", save=_manager_saver()),
    Face("manager-lazy", save=_manager_saver(snapshot="lazy")),
    Face("distributed", save=_save_distributed),
    Face("distributed-manager", save=_save_distributed_manager),
    Face("manager-tiered", save=_tiered_saver(distributed=False)),
    Face("distributed-manager-tiered", save=_tiered_saver(distributed=True)),
    Face("dcp", save=_save_dcp, fmt="dcp", url_step=True),
    Face("lightning", save=_save_lightning, url_step=True),
    Face("cp", save=_save_cp),
]

#: Every face that restores.
LOADERS: list[Face] = [
    Face("load", load=_load_api),
    Face("aload", load=_load_async_api),
    Face("manager", load=_load_manager),
    Face("manager-stream", load=_load_manager_streaming),
    Face("distributed", load=_load_distributed),
    Face("distributed-manager", load=_load_distributed_manager),
    Face("manager-tiered", load=_tiered_loader(distributed=False)),
    Face("distributed-manager-tiered", load=_tiered_loader(distributed=True)),
    Face("dcp", load=_load_dcp, keys=False, target=False, fmt="dcp", url_step=True),
    Face(
        "lightning",
        load=_load_lightning,
        keys=False,
        target=False,
        url_step=True,
    ),
]

#: Both lists, by name and role.
FACES: dict[str, Face] = {
    **{f"save:{f.name}": f for f in SAVERS},
    **{f"load:{f.name}": f for f in LOADERS},
}
