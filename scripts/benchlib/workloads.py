"""The benchmark workloads, defined once for every suite (DESIGN.md, "Benchmarks").

Before this module each suite built its own states, and the three "transformer" states of the
``format``, ``dcp`` and ``async`` suites differed (4 layers of width 768, 12 of width 1024, 10
of width 512), so the sections of docs/benchmarks.md did not measure the same workload. Every
suite now takes its states, or the sizes of its objects, from here:

* **big**: 1 GiB as 16 float32 arrays of 64 MiB (quick runs: 4 of 16 MiB);
* **small**: 20,000 float32 arrays of 4 KiB, 80 MiB (quick runs: 2,000);
* **transformer**: a transformer-like model (token embedding, 10 layers of width 512 with
  attention, MLP, biases and layer norms, a final norm and an output head; quick runs: 2
  layers of width 256) with an Adam-like optimizer state in ``torch.optim`` layout: two moment
  copies and a 0-d ``step`` per parameter, the param groups as plain values, and an epoch
  counter. 456 MiB in 496 arrays, 370 of them under 1 MiB;
* **torch views**: a GPT-like model (an embedding of 64 MiB, 11 layers of width 384 with
  attention, MLP, biases and layer norms, a final norm) and Adam's two moments, as a training
  script hands them over: float32 numpy arrays that are ``Tensor.numpy()`` views of torch
  tensors, in torch's allocations (not page aligned), 1.5 KiB to 64 MiB; 405 arrays, 415 MiB
  (quick runs: 2 layers of width 128 and a 2 MiB embedding);
* **fine-tuning**: a frozen 200 MiB base (200 float32 matrices of 1 MiB and 24 small norms), a
  trainable low-rank adapter and the Adam moments of the adapter only (quick runs: an 8 MiB
  base); each training step changes the adapter and its moments, never the base. It is the
  state of the incremental-save tests (:class:`ckptstore.testing.incremental_tests.FineTuning`).

States are numpy arrays of random values, drawn from fixed seeds so every suite and every run
sees the same bytes; :func:`as_torch` turns one into torch tensors that share its memory, for
the suites that save torch states.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = [
    "BIG_COUNT",
    "BIG_LEAF_BYTES",
    "SMALL_COUNT",
    "SMALL_LEAF_BYTES",
    "WORKLOADS",
    "as_torch",
    "big",
    "big_shape",
    "fine_tuning",
    "map_leaves",
    "small",
    "small_count",
    "torch_views",
    "transformer",
]

#: The big workload: this many leaves of this many bytes (1 GiB).
BIG_COUNT, BIG_LEAF_BYTES = 16, 64 << 20
#: The small workload: this many leaves of this many bytes (80 MiB).
SMALL_COUNT, SMALL_LEAF_BYTES = 20_000, 4096


def big_shape(quick: bool) -> tuple[int, int]:
    """``(count, bytes per leaf)`` of the big workload."""
    return (4, 16 << 20) if quick else (BIG_COUNT, BIG_LEAF_BYTES)


def small_count(quick: bool) -> int:
    """Leaves of the small workload (each :data:`SMALL_LEAF_BYTES`)."""
    return 2000 if quick else SMALL_COUNT


def big(quick: bool) -> dict[str, Any]:
    """1 GiB as 16 float32 arrays of 64 MiB."""
    count, size = big_shape(quick)
    rng = np.random.default_rng(0)
    return {f"w{i:02d}": rng.standard_normal(size // 4, dtype=np.float32) for i in range(count)}


def small(quick: bool) -> dict[str, Any]:
    """20,000 float32 arrays of 4 KiB, each its own allocation (as a model's would be)."""
    count = small_count(quick)
    rng = np.random.default_rng(1)
    block = rng.standard_normal((count, SMALL_LEAF_BYTES // 4), dtype=np.float32)
    return {f"t{i:05d}": block[i].copy() for i in range(count)}


def transformer(quick: bool) -> dict[str, Any]:
    """A transformer-like model and its Adam state (see the module docstring)."""
    layers, width, vocab = (2, 256, 2048) if quick else (10, 512, 8192)
    rng = np.random.default_rng(2)

    def mat(*shape: int) -> np.ndarray[Any, Any]:
        return rng.standard_normal(shape, dtype=np.float32)

    model: dict[str, np.ndarray[Any, Any]] = {"embed.weight": mat(vocab, width)}
    for i in range(layers):
        p = f"layers.{i}."
        model |= {
            p + "attn.qkv.weight": mat(3 * width, width),
            p + "attn.qkv.bias": mat(3 * width),
            p + "attn.out.weight": mat(width, width),
            p + "attn.out.bias": mat(width),
            p + "mlp.fc1.weight": mat(4 * width, width),
            p + "mlp.fc1.bias": mat(4 * width),
            p + "mlp.fc2.weight": mat(width, 4 * width),
            p + "mlp.fc2.bias": mat(width),
            p + "norm1.weight": mat(width),
            p + "norm1.bias": mat(width),
            p + "norm2.weight": mat(width),
            p + "norm2.bias": mat(width),
        }
    model |= {"norm.weight": mat(width), "norm.bias": mat(width), "head.weight": mat(vocab, width)}
    state = {
        str(i): {
            "step": np.array(1000.0, np.float32),
            "exp_avg": mat(*p.shape),
            "exp_avg_sq": np.abs(mat(*p.shape)),
        }
        for i, p in enumerate(model.values())
    }
    groups = [{"lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8, "params": list(range(len(model)))}]
    return {"model": model, "optim": {"state": state, "param_groups": groups}, "epoch": 3}


def fine_tuning(quick: bool) -> Any:
    """A :class:`~ckptstore.testing.incremental_tests.FineTuning` run: ``.state`` is the
    state, ``.train_step()`` changes its trainable part, ``.changed_bytes()`` says by how
    much."""
    from ckptstore.testing.incremental_tests import FineTuning

    return FineTuning(base_large=8 if quick else 200)


#: The workloads by the name the result tables show.
def torch_views(quick: bool) -> dict[str, Any]:
    """The torch-views workload (see the module docstring): numpy views of torch tensors."""
    import torch

    layers, width, vocab = (2, 128, 4096) if quick else (11, 384, 43_690)
    generator = torch.Generator().manual_seed(3)

    def view(*shape: int) -> np.ndarray[Any, Any]:
        return torch.randn(shape, generator=generator, dtype=torch.float32).numpy()

    params = {"embed.weight": view(vocab, width)}
    for i in range(layers):
        p = f"h.{i}."
        for name, shape in (
            ("attn.qkv", (3 * width, width)),
            ("attn.out", (width, width)),
            ("mlp.fc", (4 * width, width)),
            ("mlp.proj", (width, 4 * width)),
        ):
            params[p + name + ".weight"] = view(*shape)
            params[p + name + ".bias"] = view(shape[0])
        for norm in ("ln1", "ln2"):
            params[p + norm + ".weight"] = view(width)
            params[p + norm + ".bias"] = view(width)
    params |= {"ln_f.weight": view(width), "ln_f.bias": view(width)}
    moments = {
        name: {"exp_avg": view(*a.shape), "exp_avg_sq": view(*a.shape)}
        for name, a in params.items()
    }
    return {"model": params, "optim": moments}


WORKLOADS = {
    "1 GiB as 16 x 64 MiB": big,
    "20,000 x 4 KiB": small,
    "transformer + Adam (~400 MiB)": transformer,
    "torch views + Adam (~415 MiB)": torch_views,
}


def map_leaves(state: Any, kind: type, fn: Callable[[Any], Any]) -> Any:
    """``state`` with every leaf of type ``kind`` replaced by ``fn(leaf)``."""
    if isinstance(state, kind):
        return fn(state)
    if isinstance(state, dict):
        return {k: map_leaves(v, kind, fn) for k, v in state.items()}
    if isinstance(state, list):
        return [map_leaves(v, kind, fn) for v in state]
    return state


def as_torch(state: Any) -> Any:
    """``state`` with every numpy array replaced by a CPU tensor over the same memory."""
    import torch

    return map_leaves(state, np.ndarray, torch.from_numpy)
