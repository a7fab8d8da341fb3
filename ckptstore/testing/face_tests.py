"""The faces conformance suite: every face that saves against every face that restores.

A test module subclasses :class:`FaceTests` and provides two fixtures, ``saver`` and
``loader`` (each a :class:`~ckptstore.testing.faces.Face`, usually parametrized over
:data:`~ckptstore.testing.faces.SAVERS` and :data:`~ckptstore.testing.faces.LOADERS`), and,
for the credential checks, ``s3`` (an :class:`S3Place`: a bucket on a real S3 server, the
store options whose secret the suite hunts, and a way to read back every object)::

    class TestFaces(FaceTests):
        @pytest.fixture(params=SAVERS, ids=lambda f: f.name)
        def saver(self, request):
            return request.param
        ...

Each check is one promise ckptstore makes on every face:

* one reference state (every dtype of the dtype registry, bf16 and the float8s included, in
  torch where torch has the dtype and in numpy everywhere; 0-d, empty and non-contiguous
  arrays; dicts, lists, tuples, named tuples, ``OrderedDict``, dataclasses, an optax state,
  JAX arrays; plain values, torch dtypes and devices) comes back bit-exact from every face
  that reads what the saver wrote, in the documented structure (:func:`plain`), and a
  checkpoint of the other format is refused with the error that names its reader;
* what was saved comes back as the same kind (torch as torch, numpy as numpy, JAX as JAX),
  and ``target=`` overrides it, containers included;
* a key that matches nothing is the same error, word for word, on every face that takes keys;
* a second save with an unchanged 64 MiB leaf writes under a tenth of the first's bytes;
* a flipped byte in a data object and a hostile manifest are refused by every reader;
* no credential given in a URL or as a keyword appears in any object written or any message
  printed or logged;
* a URL whose last segment is a step number is that step, with or without a query.

A capability a face lacks is listed in its :attr:`~ckptstore.testing.faces.Face.lacks`, with
the reason; the check then runs and must fail (an expected failure). It turns into an error
the day the face gains the capability, so the list cannot go stale.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptstore.testing.faces import Face, Place

__all__ = ["FaceTests", "S3Place", "plain", "reference_state"]

STEP = 3


class Pair(typing.NamedTuple):
    """A named tuple in the reference state (an optax state is one too)."""

    weights: Any
    steps: int


@dataclasses.dataclass
class Config:
    """A dataclass in the reference state."""

    table: Any
    name: str


@dataclasses.dataclass
class S3Place:
    """A bucket on a real S3 server for the credential checks.

    Attributes:
        root: ``s3://bucket/prefix``, a fresh run root.
        options: the store options to reach it (``endpoint_url``, the keys); ``secret`` is
            among their values.
        secret: the value that must appear nowhere.
        objects: reads back every object of the bucket as ``(key, bytes)``.
    """

    root: str
    options: dict[str, str]
    secret: str
    objects: Callable[[], list[tuple[str, bytes]]]


# ---------------------------------------------------------------------- the reference state


def _torch_leaves() -> dict[str, Any]:
    import torch

    from ckptstore.stage.torch import dtype_table

    out: dict[str, Any] = {}
    for dtype in dtype_table():
        name = str(dtype).removeprefix("torch.")
        if dtype is torch.bool:
            out[name] = torch.arange(8) % 3 == 0
        elif dtype.is_complex:
            out[name] = (torch.arange(8, dtype=torch.float32) * (1 + 2j)).to(dtype)
        else:
            out[name] = (torch.arange(8, dtype=torch.float32) - 2).to(dtype)
    return out


def _integer_range(dtype: np.dtype[Any]) -> tuple[int, int] | None:
    """The smallest and largest value of an integer ``dtype`` (numpy's or an ml_dtypes one,
    ``int4``, ``uint2``, ``int1``...), ``None`` for any other dtype."""
    import ml_dtypes

    try:
        info = ml_dtypes.iinfo(dtype)  # type: ignore[no-untyped-call]
    except ValueError:
        return None
    return int(info.min), int(info.max)


def _numpy_leaves(native_order: bool) -> dict[str, Any]:
    from ckptstore.layout.dtypes import dtype_from_name, known_dtype_names

    out: dict[str, Any] = {}
    for name in sorted(known_dtype_names()):
        dtype = dtype_from_name(name)
        assert dtype is not None
        if native_order and not dtype.isnative:
            continue
        if dtype.kind == "b":
            value = np.arange(8) % 3 == 0
        elif dtype.kind == "c":
            value = (np.arange(8) * (1 + 2j)).astype(dtype)
        elif (span := _integer_range(dtype)) is not None:
            # -2 to 5 where the dtype holds them, wrapped where it does not: ml_dtypes'
            # sub-byte ints hold as little as {-1, 0}
            low, high = span
            start = max(low, -2)
            value = np.array([start + i % (high - start + 1) for i in range(8)]).astype(dtype)
        else:
            value = (np.arange(8, dtype=np.float32) - 2).astype(dtype)
        out[name] = value
    return out


def reference_state(*, dcp: bool = False) -> dict[str, Any]:
    """The state every face must give back bit-exact (see the module docstring).

    DCP's planner flattens dicts and lists only and stores every other value (a numpy
    array, a tuple) with ``torch.save`` and reads it back with ``torch.load``, which gives a
    numpy array of the other byte order back in the native one; with ``dcp=True`` the state
    keeps to what DCP itself round-trips: dicts, lists, tensors, plain values and numpy
    arrays of the native byte order."""
    import torch

    g = torch.Generator().manual_seed(0)
    grid = np.arange(48, dtype=np.float32).reshape(6, 8)
    state: dict[str, Any] = {
        "torch": _torch_leaves(),
        "numpy": _numpy_leaves(native_order=dcp),
        "shapes": {
            "t0d": torch.tensor(3.5),
            "n0d": np.array(7, dtype=np.int64),
            "tempty": torch.zeros(0, 3),
            "nempty": np.zeros((2, 0), dtype=np.float16),
            "tstrided": torch.randn(6, 8, generator=g).t()[::2],
            "nstrided": grid[::2, 1::3],
        },
        "list": [torch.ones(2), [np.arange(3, dtype=np.int32), 4], "x"],
        "plain": {"step": 7, "lr": 0.25, "name": "run-1", "done": False, "nothing": None},
    }
    if dcp:
        return state
    state["tuple"] = (np.ones(2), 3, (torch.zeros(1),))
    state["named"] = Pair(torch.arange(3), 5)
    state["ordered"] = collections.OrderedDict([("z", np.ones(1)), ("a", 2)])
    state["typed"] = {"dtype": torch.bfloat16, "device": torch.device("cpu")}
    state["dataclass"] = Config(np.arange(3), "cfg")
    try:
        import jax.numpy as jnp
        import optax  # type: ignore[import-untyped]
    except ImportError:  # the suite runs without JAX; its leaves are then left out
        return state
    params = {"w": jnp.arange(6, dtype=jnp.float32).reshape(2, 3)}
    state["jax"] = {
        "f32": params["w"],
        "bf16": jnp.ones(3, dtype=jnp.bfloat16),
        "opt": optax.adam(1e-3).init(params),
    }
    return state


def plain(state: Any) -> Any:
    """What a load without a target gives back for ``state``: named tuples as tuples,
    dataclasses and other registered nodes (an optax state's fields) as dicts of their
    children, an ``OrderedDict`` as one and any other mapping as a ``dict``; arrays and
    typed values as they are."""
    if isinstance(state, dict):
        out = {k: plain(v) for k, v in state.items()}
        return collections.OrderedDict(out) if type(state) is collections.OrderedDict else out
    if isinstance(state, list):
        return [plain(v) for v in state]
    if isinstance(state, tuple):
        return tuple(plain(v) for v in state)
    if dataclasses.is_dataclass(state) and not isinstance(state, type):
        fields = dataclasses.fields(state)
        return {f.name: plain(getattr(state, f.name)) for f in fields}
    return state


def _kind(value: Any) -> str | None:
    module = type(value).__module__.split(".")[0]
    if module == "torch" and hasattr(value, "dtype"):
        return "torch"
    if isinstance(value, np.ndarray):
        return "numpy"
    if module in ("jax", "jaxlib") and hasattr(value, "dtype"):
        return "jax"
    return None


def _described(value: Any) -> tuple[Any, tuple[int, ...], bytes]:
    """An array's numpy dtype, shape and bytes in C order."""
    if _kind(value) == "torch":
        from ckptstore.stage.torch import numpy_dtype

        tensor = value.detach().cpu().contiguous()
        raw = tensor.reshape(-1).view(torch_uint8()).numpy().tobytes() if tensor.numel() else b""
        return numpy_dtype(tensor.dtype), tuple(tensor.shape), raw
    array = np.asarray(value)
    return array.dtype, array.shape, array.tobytes(order="C")


def torch_uint8() -> Any:
    import torch

    return torch.uint8


def assert_same(out: Any, want: Any, kind: str | None = None, where: str = "") -> None:
    """``out`` has ``want``'s structure, container types, values and array bytes; its arrays
    are of ``want``'s kind, or all of ``kind`` when given."""
    if _kind(want) is not None:
        assert _kind(out) == (kind or _kind(want)), f"{where}: {type(out).__name__}"
        assert _described(out) == _described(want), f"{where}: dtype, shape or bytes differ"
        return
    assert type(out) is type(want), f"{where}: {type(out).__name__}, not {type(want).__name__}"
    if isinstance(want, dict):
        assert list(out) == list(want), f"{where}: keys {list(out)} != {list(want)}"
        for key in want:
            assert_same(out[key], want[key], kind, f"{where}/{key}")
    elif isinstance(want, list | tuple):
        assert len(out) == len(want), where
        for i, (a, b) in enumerate(zip(out, want, strict=True)):
            assert_same(a, b, kind, f"{where}/{i}")
    elif dataclasses.is_dataclass(want):
        for f in dataclasses.fields(want):
            assert_same(getattr(out, f.name), getattr(want, f.name), kind, f"{where}/{f.name}")
    else:
        assert out == want, f"{where}: {out!r} != {want!r}"


# ----------------------------------------------------------------------------- helpers


@contextmanager
def lacking(face: Face, capability: str) -> Iterator[None]:
    """Run a capability's check; where ``face`` lacks it, the check must fail (xfail)."""
    why = face.lacks.get(capability)
    if why is None:
        yield
        return
    try:
        yield
    except AssertionError:
        pytest.xfail(f"{face.name} lacks {capability}: {why}")
    raise AssertionError(f"{face.name} now has {capability}: remove it from the face's `lacks`")


def _files(root: Path) -> dict[str, int]:
    return {
        os.path.join(where, name): os.path.getsize(os.path.join(where, name))
        for where, _, names in os.walk(root)
        for name in names
    }


def _native_saver(fmt: str) -> Face:
    from ckptstore.testing.faces import SAVERS

    return next(f for f in SAVERS if f.fmt == fmt)


def _refusal(loader: Face) -> tuple[type[BaseException], str]:
    """The error a face gives for a checkpoint of the other format, and its message."""
    from ckptstore.errors import CheckpointFormatError

    if loader.fmt == "dcp":
        from torch.distributed.checkpoint.api import CheckpointException

        return CheckpointException, "not a DCP one; read it with ckptstore"
    return CheckpointFormatError, r"ckptstore\.dcp\.Reader"


def _manifests(root: Path) -> list[Path]:
    return sorted(root.rglob("manifest.json"))


def _rewrite_manifest(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Change a manifest's body and give it a valid checksum: hostile, not damaged."""
    from ckptstore.store.checksum import crc32c

    raw = path.read_bytes()
    head = json.loads(raw)
    body = head["body"]
    change(body)
    encoded = json.dumps(body, separators=(",", ":")).encode()
    envelope = (
        f'{{"format":"ckptstore","version":{head["version"]},"crc32c":{crc32c(encoded)},"body":'
    ).encode()
    path.write_bytes(envelope + encoded + b"}")


def _shown(caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]) -> list[str]:
    """Everything printed or logged so far."""
    printed = capsys.readouterr()
    return [printed.out, printed.err, caplog.text, *(r.getMessage() for r in caplog.records)]


def _assert_hidden(s3: S3Place, shown: list[str]) -> None:
    assert not [text for text in shown if s3.secret in text], "a secret was printed or logged"
    written = [key for key, body in s3.objects() if s3.secret.encode() in body]
    assert not written, f"objects holding the secret: {written}"


# ------------------------------------------------------------------------------- the suite


class FaceTests:
    """The checks; see the module docstring. Needs fixtures ``saver``, ``loader``, ``s3``."""

    def test_what_one_face_saves_every_face_loads(
        self, saver: Face, loader: Face, tmp_path: Path
    ) -> None:
        assert saver.save is not None
        assert loader.load is not None
        place = Place(str(tmp_path / "run"))
        if saver.fmt != loader.fmt:
            state = reference_state(dcp=True)
            saver.save(place, state, STEP)
            error, message = _refusal(loader)
            with pytest.raises(error, match=message):
                loader.load(place, STEP, None, None, state)
            return
        state = reference_state(dcp=saver.fmt == "dcp")
        saver.save(place, state, STEP)
        out = loader.load(place, STEP, None, None, state)
        assert_same(out, plain(state))

    def test_target_makes_every_array_its_kind_and_rebuilds_containers(
        self, loader: Face, tmp_path: Path
    ) -> None:
        assert loader.load is not None
        if not loader.target:
            pytest.skip(f"{loader.name} fills the caller's state in place: it takes no target")
        place = Place(str(tmp_path / "run"))
        state = reference_state()
        _native_saver("native").save(place, state, STEP)  # type: ignore[misc]
        assert_same(loader.load(place, STEP, None, state, state), state)
        # every array as numpy (JAX arrays have JAX's own dtypes), then as torch (the numpy
        # leaves hold dtypes torch lacks, float128 and the sub-byte ones: those are refused)
        for kind, leave_out in (("numpy", {"jax"}), ("torch", {"jax", "numpy"})):
            part = {k: v for k, v in state.items() if k not in leave_out}
            out = loader.load(place, STEP, list(part), kind, state)
            assert_same(out, plain(part), kind)
        with pytest.raises(TypeError, match=r"leaf 'numpy/<f16': .*float128 has no torch equiv"):
            loader.load(place, STEP, ["numpy/<f16"], "torch", state)

    def test_a_key_naming_nothing_is_the_same_error_on_every_face(
        self, loader: Face, tmp_path: Path
    ) -> None:
        from ckptstore.errors import NotFoundError
        from ckptstore.testing.faces import LOADERS

        assert loader.load is not None
        if not loader.keys:
            pytest.skip(f"{loader.name} takes no keys: it loads whole checkpoints")
        place = Place(str(tmp_path / "run"))
        state = reference_state(dcp=True)
        _native_saver("native").save(place, state, STEP)  # type: ignore[misc]
        messages = []
        for face in (LOADERS[0], loader):
            assert face.load is not None
            with pytest.raises(NotFoundError, match="has no leaf 'typo'") as caught:
                face.load(place, STEP, ["plain", "typo"], None, state)
            messages.append(str(caught.value))
        assert messages[0] == messages[1]

    def test_an_unchanged_leaf_is_not_written_again(self, saver: Face, tmp_path: Path) -> None:
        import torch

        assert saver.save is not None
        place = Place(str(tmp_path / "run"))
        frozen = torch.arange(16 * 2**20, dtype=torch.float32)  # 64 MiB
        saver.save(place, {"frozen": frozen, "w": torch.ones(8)}, STEP)
        first = _files(tmp_path)
        saver.save(place, {"frozen": frozen, "w": torch.ones(8) * 2}, STEP + 1)
        second = sum(size for name, size in _files(tmp_path).items() if name not in first)
        with lacking(saver, "incremental"):
            assert second < 0.1 * sum(first.values()), (second, sum(first.values()))

    def test_a_flipped_byte_is_refused(self, loader: Face, tmp_path: Path) -> None:
        from ckptstore.errors import CorruptCheckpointError

        assert loader.load is not None
        root = tmp_path / "run"
        place = Place(str(root))
        state = reference_state(dcp=True)
        state["big"] = np.arange(2**18, dtype=np.float64)  # an object of its own
        _native_saver(loader.fmt).save(place, state, STEP)  # type: ignore[misc]
        data = max(
            (p for p in root.rglob("*") if p.is_file() and p.name != "manifest.json"),
            key=lambda p: p.stat().st_size,
        )
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x40
        data.write_bytes(bytes(raw))
        # DCP's CheckpointException is a BaseException, and holds the reader's error
        with pytest.raises(BaseException, match="crc32c mismatch") as caught:
            loader.load(place, STEP, None, None, state)
        assert isinstance(caught.value, CorruptCheckpointError) or (
            "CorruptCheckpointError" in str(caught.value)
        ), repr(caught.value)

    def test_a_hostile_manifest_is_refused(self, loader: Face, tmp_path: Path) -> None:
        from ckptstore.errors import CkptStoreError

        assert loader.load is not None
        root = tmp_path / "run"
        place = Place(str(root))
        state = reference_state(dcp=True)
        _native_saver(loader.fmt).save(place, state, STEP)  # type: ignore[misc]
        outside = tmp_path / "outside"
        outside.write_bytes(b"\0" * 4096)

        def escape(body: dict[str, Any]) -> None:
            body["objects"]["key"][0] = "../../outside"

        (manifest,) = _manifests(root)
        _rewrite_manifest(manifest, escape)
        hostile = r"invalid manifest: object '\.\./\.\./outside'"
        with pytest.raises(BaseException, match=hostile) as caught:  # DCP wraps it in its own
            loader.load(place, STEP, None, None, state)
        if loader.fmt == "native":
            assert isinstance(caught.value, CkptStoreError), repr(caught.value)

    @pytest.mark.parametrize("in_query", [False, True], ids=["keywords", "query"])
    def test_a_saver_writes_and_shows_no_credential(
        self,
        saver: Face,
        s3: S3Place,
        in_query: bool,
        caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str],
    ) -> None:
        import ckptstore

        assert saver.save is not None
        caplog.set_level(logging.DEBUG)
        saver.save(Place(s3.root, s3.options, in_query), reference_state(dcp=True), STEP)
        # a URL whose last segment is the step is that step, with the options in its query
        assert ckptstore.list_steps(s3.root, **s3.options) == [STEP]
        _assert_hidden(s3, _shown(caplog, capsys))

    @pytest.mark.parametrize("in_query", [False, True], ids=["keywords", "query"])
    def test_a_loader_shows_no_credential(
        self,
        loader: Face,
        s3: S3Place,
        in_query: bool,
        caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str],
    ) -> None:
        assert loader.load is not None
        place = Place(s3.root, s3.options, in_query)
        state = reference_state(dcp=True)
        _native_saver(loader.fmt).save(place, state, STEP)  # type: ignore[misc]
        caplog.set_level(logging.DEBUG)
        assert_same(loader.load(place, STEP, None, None, state), plain(state))
        shown: list[str] = []
        try:  # an error message a user reads
            loader.load(place, STEP + 1, None, None, state)
        except BaseException as exc:  # what is shown is what is checked
            shown += [str(exc), repr(exc)]
        else:
            raise AssertionError(f"{loader.name} loaded step {STEP + 1}, which was not saved")
        _assert_hidden(s3, shown + _shown(caplog, capsys))

    def test_a_step_in_the_url_is_that_step(self, saver: Face, tmp_path: Path) -> None:
        import ckptstore

        assert saver.save is not None
        if not saver.url_step:
            pytest.skip(f"{saver.name} takes the step as an argument, not in the URL")
        root = tmp_path / "run"
        saver.save(Place(str(root)), reference_state(dcp=True), 12)
        assert ckptstore.list_steps(root) == [12]
        assert (root / "12" / "manifest.json").is_file()
