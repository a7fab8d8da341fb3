"""The states of the golden checkpoints under ``tests/golden/``, built from formulas (numpy
only), so a test rebuilds exactly what each checkpoint must hold, and ``tests/golden/make.py``
can write them with the ckptstore of any commit."""

from __future__ import annotations

from typing import Any

import numpy as np

#: numpy dtypes every format version stores, both byte orders for two of them
DTYPES = [
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
    ">f4",
    ">i8",
]


def values(dtype: str, count: int, seed: int) -> np.ndarray[Any, Any]:
    """``count`` values of ``dtype`` that differ by ``seed``, with every byte position
    used (negative numbers, fractions, large magnitudes)."""
    base = (np.arange(count, dtype=np.float64) - count / 3) * (1.0 + seed / 7)
    kind = np.dtype(dtype).kind
    if kind == "b":
        return ((np.arange(count) + seed) % 3 == 0).astype(dtype)
    if kind in "iu":
        info = np.iinfo(np.dtype(dtype))
        spread = (np.arange(count, dtype=np.int64) * 7919 + seed * 104729) % 65521
        return (info.min + spread * ((int(info.max) - int(info.min)) // 65521)).astype(dtype)
    if kind == "c":
        return (base * np.pi + 1j * (base / np.e)).astype(dtype)
    return (base * np.pi).astype(dtype)


def plain_state(seed: int = 0) -> dict[str, Any]:
    """Packed and whole leaves of every dtype, nested dicts, lists and tuples, int keys, keys
    with ``/`` and ``~``, 0-d and empty arrays, and plain values."""
    arrays = {name.replace(">", "be_"): values(name, 5, seed) for name in DTYPES}
    return {
        "dtypes": arrays,
        "model": {
            "embed": values("float32", 64 * 48, seed).reshape(64, 48),  # 12 KiB: whole
            "bias": values("float32", 48, seed),
            "shapes": [
                np.asarray(values("float64", 1, seed)[0]),  # 0-d
                np.zeros((0, 3), np.float32),  # empty
                values("int16", 24, seed).reshape(2, 3, 4),
            ],
        },
        "optimizer": {0: {"step": 10 + seed, "lr": 0.5}, 1: (1, "two", None)},
        "odd/key~": {"a/b": values("uint8", 3, seed)},
        "plain": [True, 3, -2.5, "text", None, float("inf")],
    }


def incremental_states() -> list[dict[str, Any]]:
    """Three steps of a run whose saves reference the earlier steps' objects: step 2 changes
    one whole leaf, step 3 one packed leaf."""
    first = plain_state(0)
    second = plain_state(0)
    second["model"]["embed"] = values("float32", 64 * 48, 2).reshape(64, 48)
    third = plain_state(0)
    third["model"]["embed"] = second["model"]["embed"]
    third["model"]["bias"] = values("float32", 48, 3)
    return [first, second, third]


#: the global array of the sharded golden checkpoint, and each of its 2 ranks' rows
SHARDED_SHAPE = (8, 6)


def sharded_global() -> np.ndarray[Any, Any]:
    return values("float32", 48, 5).reshape(SHARDED_SHAPE)


#: ml_dtypes types by name, as manifests name them (numpy-native ones are in DTYPES)
ML_DTYPES = ["bfloat16", "float8_e4m3fn", "float8_e5m2", "int4", "uint4"]


def ml_dtype_bytes(name: str, count: int) -> bytes:
    """``count`` elements' bytes of an ml_dtypes type (one byte per element for the 4-bit
    types, two for bfloat16), any bit pattern but NaN-free for the floats."""
    width = 2 if name == "bfloat16" else 1
    raw = (np.arange(count * width, dtype=np.uint16) * 37 % 113).astype(np.uint8)
    if name in ("int4", "uint4"):
        raw = raw % 16 if name == "uint4" else (raw % 16).astype(np.int8) - 8
        return raw.astype(np.uint8).tobytes()
    return raw.tobytes()


#: the files of the golden directory tree (what an adapter uploads), path -> bytes
def tree_files() -> dict[str, bytes]:
    return {
        "config.json": b'{"hidden": 8}\n',
        "model.safetensors": bytes(range(256)) * 9,
        "optimizer/state.bin": values("float32", 300, 4).tobytes(),
        "optimizer/empty.bin": b"",
        "nested/deeper/notes.txt": b"step 3, crc32c everywhere\n",
    }


def dcp_state() -> dict[str, Any]:
    """A model's state dict as numpy arrays (the DCP golden saves them as torch tensors)."""
    return {
        "layer.weight": values("float32", 32, 6).reshape(4, 8),
        "layer.bias": values("float32", 4, 7),
        "steps": values("int64", 3, 8),
    }


def lightning_checkpoint_arrays() -> dict[str, Any]:
    """The tensors of the golden Lightning checkpoint, as numpy arrays."""
    return {
        "layer.weight": values("float32", 12, 9).reshape(3, 4),
        "layer.bias": values("float32", 3, 10),
        "norm.num_batches_tracked": np.asarray(values("int64", 1, 11)[0]),
        "exp_avg": values("float32", 12, 12).reshape(3, 4),
    }


def lightning_dict() -> dict[str, object]:
    """What the golden Lightning checkpoint holds (torch tensors, dtypes, devices and an
    ``OrderedDict``, as Lightning's checkpoint dicts do); imports torch."""
    from collections import OrderedDict

    import torch

    arrays = {k: torch.from_numpy(v.copy()) for k, v in lightning_checkpoint_arrays().items()}
    return {
        "epoch": 0,
        "global_step": 3,
        "pytorch-lightning_version": "2.6.6",
        "state_dict": OrderedDict(
            (k, arrays[k]) for k in ("layer.weight", "layer.bias", "norm.num_batches_tracked")
        ),
        "optimizer_states": [
            {"state": {0: {"exp_avg": arrays["exp_avg"]}}, "param_groups": [{"lr": 0.01}]}
        ],
        "hyper_parameters": {"dtype": torch.bfloat16, "device": torch.device("cpu")},
        "loops": {"fit_loop": {"epoch_progress": {"current": {"ready": 1}}}},
    }


def typed_state() -> dict[str, Any]:
    """What the version-4 golden checkpoint holds: numpy arrays in ``OrderedDict`` s (a
    model's state dict, a nested one with int keys) beside torch dtypes and devices, the
    typed values of the tree; imports torch for those values only."""
    from collections import OrderedDict

    import torch

    return {
        "model": OrderedDict(
            [
                ("layer.weight", values("float32", 12, 13).reshape(3, 4)),
                ("layer.bias", values("float32", 3, 14)),
            ]
        ),
        "optimizer": {"state": OrderedDict([(1, {"lr": 0.5}), (0, {"lr": 0.25})])},
        "dtypes": [torch.bfloat16, torch.float8_e4m3fn, torch.int64],
        "devices": (torch.device("cpu"), torch.device("cuda", 1), torch.device("meta")),
        "plain": {"name": "v4", "step": 5},
    }
