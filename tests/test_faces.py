"""One state through every face: what one face saves, every face that can read it loads,
bit-exact and in the same structure, and every face gives the same error for a key that
names nothing and for a bad store option (issue 16's acceptance test).

Faces: ``ckptstore.save``/``load`` ("api"), ``CheckpointManager`` ("manager"),
``ckptstore.distributed`` with a one-rank ``LocalGroup`` ("distributed"), DCP's
``dcp.save``/``dcp.load`` with ``ckptstore.dcp.Writer``/``Reader`` ("dcp") and Lightning's
``StoreCheckpointIO`` ("lightning"). Each saves step 3 of one root; the loaders read it there.

Two kinds of pair cannot work, by design, and assert the clear error instead:

* a DCP checkpoint read by any other face: DCP flattens the state to its own names and stores
  non-tensor values as ``torch.save`` bytes that only DCP's planner puts back, so the native
  faces refuse it with ``CheckpointFormatError`` naming the reader to use;
* any other checkpoint read by ``dcp.load``: it has no DCP metadata for DCP's planner; the
  Reader says so with ``CheckpointFormatError``, which DCP reports inside its
  ``CheckpointException`` (DCP wraps every storage error).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lightning")
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

import ckptstore  # noqa: E402
import ckptstore.dcp  # noqa: E402
import ckptstore.distributed as cd  # noqa: E402
from ckptstore import CheckpointManager  # noqa: E402
from ckptstore.errors import CheckpointFormatError, NotFoundError  # noqa: E402
from ckptstore.lightning import StoreCheckpointIO  # noqa: E402
from ckptstore.stage.torch import numpy_dtype  # noqa: E402
from ckptstore.testing.faces import dcp_template as template  # noqa: E402

pytestmark = [
    pytest.mark.torch,
    pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning"),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),  # lightning vs torch 2.13
]

STEP = 3
FACES = ["api", "manager", "distributed", "dcp", "lightning"]


def make_state(extended: bool) -> dict[str, Any]:
    """torch and numpy leaves of many dtypes, nested dicts and lists, plain values."""
    g = torch.Generator().manual_seed(0)
    state: dict[str, Any] = {
        "model": {
            "w": torch.randn(8, 4, generator=g),
            "bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
            "c64": torch.randn(4, dtype=torch.complex64, generator=g),
            "f8": torch.randn(6, generator=g).to(torch.float8_e4m3fn),
            "steps": torch.arange(5),
        },
        "numpy": {
            "f64": np.linspace(0, 1, 7),
            "c128": (np.arange(3) + 1j * np.arange(3)).astype(np.complex128),
            "bf16": np.arange(4, dtype=np.float32).astype(ml_dtypes.bfloat16),
            "f8": np.array([0.5, -2.0], dtype=ml_dtypes.float8_e5m2),
            "mask": np.array([True, False]),
        },
        "layers": [{"k": torch.ones(2, 2)}, [np.arange(3, dtype=np.int32), 4]],
        "step": 7,
        "lr": 0.25,
        "name": "run-1",
        "done": False,
        "nothing": None,
    }
    if extended:  # the dtypes DCP's and Lightning's own dtype tables used to refuse
        state["model"]["c32"] = torch.randn(3, dtype=torch.complex64, generator=g).to(
            torch.complex32
        )
        state["model"]["e8m0"] = torch.tensor([1.0, 2.0, 0.5]).to(torch.float8_e8m0fnu)
    return state


def described(value: Any) -> tuple[str, Any, tuple[int, ...], bytes]:
    """An array's framework, numpy dtype, shape and bytes."""
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        return "torch", numpy_dtype(tensor.dtype), tuple(tensor.shape), raw
    array = np.ascontiguousarray(value)
    return "numpy", array.dtype, array.shape, array.tobytes()


def assert_same(out: Any, saved: Any, arrays: str, where: str = "") -> None:
    """``out`` has ``saved``'s structure and bits; ``arrays`` says which framework its arrays
    must be: "numpy" for all, or "saved" for each one's own."""
    if isinstance(saved, dict):  # an OrderedDict (a module's state_dict) stays one
        assert type(out) is (OrderedDict if type(saved) is OrderedDict else dict), where
        assert list(out) == list(saved), where
        for key in saved:
            assert_same(out[key], saved[key], arrays, f"{where}/{key}")
    elif isinstance(saved, list):
        assert type(out) is list, where
        assert len(out) == len(saved), where
        for i, (a, b) in enumerate(zip(out, saved, strict=True)):
            assert_same(a, b, arrays, f"{where}/{i}")
    elif isinstance(saved, torch.Tensor | np.ndarray):
        got, want = described(out), described(saved)
        assert got[1:] == want[1:], where
        assert got[0] == ("numpy" if arrays == "numpy" else want[0]), where
    else:
        assert type(out) is type(saved), where
        assert out == saved, where


def local_group() -> cd.Collectives:
    return cd.LocalGroup(1).member(0)


def save_with(face: str, root: Path, state: dict[str, Any]) -> None:
    if face == "api":
        ckptstore.save(root, state, step=STEP)
    elif face == "manager":
        with CheckpointManager(root) as mgr:
            mgr.save(STEP, state)
    elif face == "distributed":
        cd.save(root, state, step=STEP, comm=local_group())
    elif face == "dcp":
        dcp.save(state, storage_writer=ckptstore.dcp.Writer(f"{root}/{STEP}"))
    else:
        StoreCheckpointIO().save_checkpoint(state, f"{root}/{STEP}")


def load_with(face: str, root: Path, saved: dict[str, Any]) -> tuple[Any, str]:
    """The state ``face`` loads, and the framework its arrays come back as."""
    if face == "api":
        return ckptstore.load(root, STEP), "saved"
    if face == "manager":
        with CheckpointManager(root) as mgr:
            return mgr.restore(STEP), "saved"
    if face == "distributed":
        return cd.load(root, STEP, comm=local_group()), "saved"
    if face == "dcp":
        into = template(saved)
        dcp.load(into, storage_reader=ckptstore.dcp.Reader(f"{root}/{STEP}"))
        return into, "saved"
    return StoreCheckpointIO().load_checkpoint(f"{root}/{STEP}"), "saved"


def cells() -> list[Any]:
    out = []
    for extended in (False, True):
        for saver in FACES:
            for loader in FACES:
                name = f"{saver}-to-{loader}{'-extended-dtypes' if extended else ''}"
                out.append(pytest.param(saver, loader, extended, id=name))
    return out


@pytest.mark.parametrize(("saver", "loader", "extended"), cells())
def test_what_one_face_saves_every_face_loads(
    tmp_path: Path, saver: str, loader: str, extended: bool
) -> None:
    state = make_state(extended)
    root = tmp_path / "run"
    save_with(saver, root, state)
    if saver == "dcp" and loader != "dcp":
        # DCP's own format (see the module docstring): refused, naming the reader to use.
        with pytest.raises(CheckpointFormatError, match=r"ckptstore\.dcp\.Reader"):
            load_with(loader, root, state)
        return
    if loader == "dcp" and saver != "dcp":
        # No DCP metadata for DCP's planner; DCP wraps the Reader's error in its own.
        with pytest.raises(CheckpointException, match="not a DCP one; read it with ckptstore"):
            load_with(loader, root, state)
        return
    out, arrays = load_with(loader, root, state)
    assert_same(out, state, arrays)


# ------------------------------------------------------------------ a key naming nothing


@pytest.fixture
def saved_root(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    ckptstore.save(root, make_state(False), step=STEP)
    return root


KEYED_LOADS: dict[str, Callable[[Path, Any, Any], Any]] = {
    "api": lambda root, keys, target: ckptstore.load(root, STEP, keys, target=target),
    "manager": lambda root, keys, target: CheckpointManager(root).restore(
        STEP, keys=keys, target=target
    ),
    "distributed": lambda root, keys, target: cd.load(
        root, STEP, keys=keys, target=target, comm=local_group()
    ),
}


@pytest.mark.parametrize(
    ("keys", "target"),
    [
        (["model", "typo"], None),
        (None, {"model": None, "typo": None}),
        ("typo", "torch"),
    ],
    ids=["keys", "target", "keys-with-a-framework"],
)
def test_a_key_naming_nothing_is_the_same_error_on_every_face(
    saved_root: Path, keys: Any, target: Any
) -> None:
    messages = {}
    for face, load in KEYED_LOADS.items():
        with pytest.raises(NotFoundError, match=r"step 3 has no leaf 'typo'") as caught:
            load(saved_root, keys, target)
        messages[face] = str(caught.value)
    assert len(set(messages.values())) == 1, messages  # word for word
    # DCP: the planner, not the storage reader, matches the state dict's keys against the
    # checkpoint, and DCP reports every error inside its CheckpointException. Lightning loads
    # whole checkpoints: load_checkpoint takes no keys.


def test_a_key_naming_nothing_on_dcp_names_it(tmp_path: Path) -> None:
    url = str(tmp_path / "dcp")
    dcp.save({"model": {"w": torch.ones(2)}}, storage_writer=ckptstore.dcp.Writer(url))
    into = {"model": {"w": torch.zeros(2)}, "typo": torch.zeros(1)}
    with pytest.raises(CheckpointException, match="typo"):
        dcp.load(into, storage_reader=ckptstore.dcp.Reader(url))


# ------------------------------------------------------------------ a bad store option


def option_faces(root: Path) -> dict[str, Callable[..., Any]]:
    """Every face's way of taking store options, as a call that takes them as keywords."""
    state = {"w": np.ones(2)}
    return {
        "api save": lambda target, **o: ckptstore.save(target, state, step=1, **o),
        "api load": lambda target, **o: ckptstore.load(target, **o),
        "api list_steps": lambda target, **o: ckptstore.list_steps(target, **o),
        "api gc": lambda target, **o: ckptstore.gc(target, **o),
        "manager": lambda target, **o: CheckpointManager(target, **o),
        "distributed save": lambda target, **o: cd.save(
            target, state, step=1, comm=local_group(), **o
        ),
        "distributed load": lambda target, **o: cd.load(target, 1, comm=local_group(), **o),
        "dcp writer": lambda target, **o: ckptstore.dcp.Writer(target, **o),
        "dcp reader": lambda target, **o: ckptstore.dcp.Reader(target, **o),
    }


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"bogus_option": 1}, TypeError),
        ({"part_size": "lots"}, ValueError),
    ],
    ids=["unknown-name", "bad-value"],
)
def test_a_bad_store_option_is_the_same_error_on_every_face(
    tmp_path: Path, options: dict[str, Any], error: type[Exception]
) -> None:
    root = tmp_path / "run"
    messages = {}
    for face, call in option_faces(root).items():
        with pytest.raises(error) as caught:
            call(root, **options)
        messages[face] = str(caught.value)
    # Lightning learns its paths later, so the plug-in checks the Settings among its options
    # when built and a backend checks its own options at the first path, with the same error.
    io = StoreCheckpointIO(**options) if "bogus_option" in options else None
    if io is None:
        with pytest.raises(error) as caught:
            StoreCheckpointIO(**options)
    else:
        with pytest.raises(error) as caught:
            io.save_checkpoint({"w": torch.ones(1)}, str(root / "l"))
    messages["lightning"] = str(caught.value)
    assert len(set(messages.values())) == 1, messages
    assert not root.exists()  # nothing was written by any face


def test_options_with_an_open_store_are_the_same_error_on_every_face(tmp_path: Path) -> None:
    store = ckptstore.open_store(tmp_path / "run")
    try:
        messages = {}
        for face, call in option_faces(tmp_path).items():
            with pytest.raises(TypeError, match="given with an open Store") as caught:
                call(store, endpoint_url="http://127.0.0.1:1")
            messages[face] = str(caught.value)
        # Lightning hands the plug-in paths, never a Store: no such call to make there.
        assert len(set(messages.values())) == 1, messages
    finally:
        ckptstore.background.run(store.close())


# ------------------------------------------------------------------ options three ways


def test_load_gives_back_what_was_saved_and_target_overrides_it_on_every_face(
    tmp_path: Path,
) -> None:
    """``model.load_state_dict(ckptstore.load(url)["model"])`` failed: load turned torch
    tensors into numpy arrays while the managers gave torch back. One rule now: the saved
    kind by default, ``target=`` overriding it, the same on every face."""
    model = torch.nn.Linear(4, 3)
    state = {"model": model.state_dict(), "x": np.arange(3, dtype=np.int16)}
    ckptstore.save(tmp_path, state, step=STEP)

    fresh = torch.nn.Linear(4, 3)
    fresh.load_state_dict(ckptstore.load(tmp_path)["model"])
    assert torch.equal(fresh.weight, model.weight)
    assert_same(ckptstore.load(tmp_path), state, "saved")
    assert_same(ckptstore.background.run(ckptstore.aload(tmp_path)), state, "saved")
    with CheckpointManager(tmp_path) as mgr:
        by_face = {
            "api": ckptstore.load(tmp_path, target="numpy"),
            "manager": mgr.restore(STEP, target="numpy"),
            "distributed": cd.load(tmp_path, STEP, comm=local_group(), target="numpy"),
        }
    for face, out in by_face.items():
        assert_same(out, state, "numpy", face)
    as_torch = ckptstore.load(tmp_path, target="torch")
    assert isinstance(as_torch["x"], torch.Tensor)
    assert as_torch["x"].dtype == torch.int16


@pytest.mark.s3
def test_store_options_by_keyword_in_the_url_or_in_an_open_store(moto_s3: Any) -> None:
    """The issue's own example: ckptstore.save("s3://...", state, step=1, endpoint_url=...)
    was refused while the manager took the same options. Every way works on every face."""
    from urllib.parse import urlencode

    options = moto_s3.options()
    root = f"s3://{moto_s3.bucket}/run"
    state = make_state(False)
    ckptstore.save(root, state, step=1, **options)  # keywords
    assert_same(ckptstore.load(f"{root}?{urlencode(options)}", 1), state, "saved")  # the query
    store = ckptstore.open_store(root, **options)
    try:
        assert ckptstore.list_steps(store) == [1]  # an open Store carries its own
        with CheckpointManager(store) as mgr:
            assert_same(mgr.restore(1), state, "saved")
        assert_same(cd.load(store, 1, comm=local_group()), state, "saved")
    finally:
        ckptstore.background.run(store.close())
    loaded = StoreCheckpointIO(**options).load_checkpoint(f"{root}/1")
    assert_same(loaded, state, "saved")
