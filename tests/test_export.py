"""``ckptstore export`` / ``ckptstore.export_safetensors`` (issue 29, hand-off): a step's
weights as safetensors files that ``safetensors`` and ``transformers`` load without
ckptstore, from any backend, every byte verified, nothing left under a final name on a
failure."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import ckptstore
from ckptstore.cli.main import main as cli
from ckptstore.errors import AlreadyExistsError, CorruptCheckpointError, UnsupportedTreeError

safetensors = pytest.importorskip("safetensors")


def _every_dtype() -> dict[str, np.ndarray[Any, Any]]:
    """One array of every dtype safetensors names, with the awkward shapes."""
    rng = np.random.default_rng(7)
    out: dict[str, np.ndarray[Any, Any]] = {}
    for dtype in (
        np.bool_,
        np.uint8,
        np.int8,
        np.uint16,
        np.int16,
        np.float16,
        ml_dtypes.bfloat16,
        np.uint32,
        np.int32,
        np.float32,
        np.uint64,
        np.int64,
        np.float64,
        ml_dtypes.float8_e4m3fn,
        ml_dtypes.float8_e5m2,
    ):
        raw = rng.integers(0, 256, size=24 * np.dtype(dtype).itemsize, dtype=np.uint8)
        if dtype is np.bool_:
            raw = raw % 2
        out[np.dtype(dtype).name] = raw.view(dtype).reshape(4, -1)
    out["scalar"] = np.array(3.5, np.float32)  # 0-d
    out["empty"] = np.zeros((0, 5), np.int32)
    out["transposed"] = np.arange(12, dtype=np.float32).reshape(3, 4).T  # not contiguous
    out["big_endian"] = np.arange(6, dtype=">i4")
    return out


def _read(files: list[Path]) -> dict[str, tuple[str, list[int], bytes]]:
    """Every tensor of the files as safetensors' own reader sees it: dtype, shape, bytes."""
    from safetensors import safe_open

    got = {}
    for path in files:
        if path.suffix != ".safetensors":
            continue
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open has keys(), not iteration)
                sliced = f.get_slice(name)
                tensor = f.get_tensor(name)
                got[name] = (sliced.get_dtype(), sliced.get_shape(), _bytes(tensor))
    return got


def _bytes(tensor: Any) -> bytes:
    import torch

    flat = tensor.contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def _expected(array: np.ndarray[Any, Any]) -> bytes:
    return np.ascontiguousarray(array.astype(array.dtype.newbyteorder("<"))).tobytes()


@pytest.mark.torch
def test_every_dtype_and_shape_round_trips_bit_exact(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    arrays = _every_dtype()
    state = {"model": {"block": arrays, "a/b": np.ones(2, np.float32)}, "optim": {"m": 1.0}}
    ckptstore.save(tmp_path / "root", state, step=4)
    info = ckptstore.export_safetensors(tmp_path / "root", tmp_path / "out", keys="model")
    assert info.step == 4
    assert info.files == [tmp_path / "out" / "model.safetensors"]
    got = _read(info.files)
    assert set(got) == {f"block.{k}" for k in arrays} | {"a/b"}  # '/' in a key stays
    for name, array in arrays.items():
        _, shape, body = got[f"block.{name}"]
        assert shape == list(array.shape), name
        assert body == _expected(array), name
    assert got["block.bfloat16"][0] == "BF16"
    assert got["block.float8_e4m3fn"][0] == "F8_E4M3"
    assert info.tensors == len(arrays) + 1
    from safetensors import safe_open

    with safe_open(str(info.files[0]), framework="np") as f:
        meta = f.metadata()
    assert meta["format"] == "pt"
    assert meta["ckptstore_step"] == "4"


@pytest.mark.torch
def test_past_the_shard_size_files_and_an_index(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    state = {f"w{i}": np.full(1000, i, np.float32) for i in range(7)}  # 4000 B each
    ckptstore.save(tmp_path / "root", state, step=1)
    info = ckptstore.export_safetensors(tmp_path / "root", tmp_path / "out", max_shard_size="9KB")
    names = [p.name for p in info.files]
    assert names[-1] == "model.safetensors.index.json"
    assert names[:-1] == [f"model-{n:05d}-of-00004.safetensors" for n in range(1, 5)]
    index = json.loads(info.files[-1].read_text())
    assert index["metadata"]["total_size"] == 7 * 4000
    assert set(index["weight_map"]) == set(state)
    got = _read(info.files)
    for name, array in state.items():
        assert got[name][2] == array.tobytes()
        assert (tmp_path / "out" / index["weight_map"][name]).exists()
    # a second export into the same directory is refused, unless asked
    with pytest.raises(AlreadyExistsError, match="already holds model-00001-of-00004"):
        ckptstore.export_safetensors(tmp_path / "root", tmp_path / "out", max_shard_size="9KB")
    ckptstore.export_safetensors(
        tmp_path / "root", tmp_path / "out", max_shard_size="9KB", overwrite=True
    )


def test_what_safetensors_cannot_hold_is_refused_by_name(tmp_path: Path) -> None:
    ckptstore.save(tmp_path / "root", {"z": np.ones(3, np.complex64), "w": np.ones(2)}, step=1)
    with pytest.raises(UnsupportedTreeError, match="'z' is complex64, which safetensors"):
        ckptstore.export_safetensors(tmp_path / "root", tmp_path / "out")
    ckptstore.export_safetensors(tmp_path / "root", tmp_path / "out", keys="w")
    ckptstore.save(tmp_path / "two", {"a": {"b": np.ones(1)}, "a.b": np.ones(1)}, step=1)
    with pytest.raises(UnsupportedTreeError, match=r"would both be the tensor 'a\.b'"):
        ckptstore.export_safetensors(tmp_path / "two", tmp_path / "out2")
    with pytest.raises(ckptstore.NotFoundError, match="no array leaf under 'nothing'"):
        ckptstore.export_safetensors(tmp_path / "root", tmp_path / "out3", keys="nothing")


def test_a_damaged_checkpoint_leaves_no_file(tmp_path: Path) -> None:
    state = {f"w{i}": np.full(5000, i, np.float32) for i in range(3)}
    ckptstore.save(tmp_path / "root", state, step=2, pack_threshold=1)  # one object per leaf
    objects = sorted((tmp_path / "root" / "2").rglob("attempt-*/*"))
    victim = [p for p in objects if p.stat().st_size >= 20000][-1]
    body = bytearray(victim.read_bytes())
    body[100] ^= 0xFF
    victim.write_bytes(bytes(body))
    with pytest.raises(CorruptCheckpointError):
        ckptstore.export_safetensors(tmp_path / "root", tmp_path / "out", max_shard_size=1)
    assert list((tmp_path / "out").iterdir()) == []  # no shard, no temporary file


@pytest.mark.s3
@pytest.mark.torch
def test_export_from_s3_through_the_cli(moto_s3: Any, tmp_path: Path, capsys: Any) -> None:
    pytest.importorskip("torch")
    url = f"s3://{moto_s3.bucket}/export-{uuid.uuid4().hex[:8]}"
    options = moto_s3.options()
    state = {"model": {"w": np.arange(10, dtype=np.float32)}, "step": 9}
    ckptstore.save(url, state, step=9, **options)
    args = [f"endpoint_url={options['endpoint_url']}", f"region={options['region']}"]
    argv = ["export", url, "latest", str(tmp_path / "out"), "--keys", "model", "--json"]
    assert cli([*argv, *(x for a in args for x in ("-o", a))]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["step"] == 9
    assert report["tensors"] == 1
    assert _read([Path(f) for f in report["files"]])["w"][2] == state["model"]["w"].tobytes()
    assert cli([*argv[:-1], *(x for a in args for x in ("-o", a))]) == 1  # files exist now
    assert "already holds model.safetensors" in capsys.readouterr().err


@pytest.mark.torch
def test_transformers_loads_an_exported_model(tmp_path: Path) -> None:
    """A training run's manager saves the model and its optimizer; the export of ``model``
    beside the model's config.json is what ``from_pretrained`` loads, weights equal."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=64)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 100, (2, 8)), labels=torch.randint(0, 100, (2, 8))).loss.backward()
    optimizer.step()
    with ckptstore.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, {"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    out = tmp_path / "hf"
    config.save_pretrained(out)
    assert cli(["export", str(tmp_path / "run"), "1", str(out), "--keys", "model"]) == 0
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out)
    expected = model.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
