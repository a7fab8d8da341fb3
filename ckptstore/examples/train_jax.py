"""A small JAX training loop that checkpoints asynchronously, then proves it.

    python -m ckptstore.examples.train_jax                        # to ./checkpoints-jax
    python -m ckptstore.examples.train_jax --url s3://bucket/run  # any ckptstore URL

An MLP (bfloat16 last layer, float32 elsewhere) learns a fixed random teacher with a
hand-written Adam (no optax needed), jitted. Params, both Adam moments and the step count
are a plain pytree; every ``--save-every`` steps a :class:`~ckptstore.manager.CheckpointManager`
stages it (``copy_to_host_async`` on every leaf first, then one gather into pooled buffers)
and writes it in the background. At the end the latest checkpoint is restored and compared
bit-exact with the live pytree, and training continues from the restored copy identically.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ckptstore.examples.job import job_parser, run_job
from ckptstore.manager import CheckpointManager

Params = dict[str, Any]


def init(width: int, seed: int) -> Params:
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    return {
        "w1": jax.random.normal(k1, (128, width)) / np.sqrt(128),
        "w2": jax.random.normal(k2, (width, width)) / np.sqrt(width),
        "w3": (jax.random.normal(k3, (width, 128)) / np.sqrt(width)).astype(jnp.bfloat16),
        "b": jnp.zeros(width),
    }


def batch(step: int, size: int) -> tuple[jax.Array, jax.Array]:
    x = jax.random.normal(jax.random.PRNGKey(1_000 + step), (size, 128))
    teacher = jax.random.normal(jax.random.PRNGKey(42), (128, 128)) / np.sqrt(128)
    return x, jnp.tanh(x @ teacher)


def loss_fn(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
    h = jax.nn.gelu(x @ params["w1"] + params["b"])
    h = jax.nn.gelu(h @ params["w2"])
    out = (h.astype(jnp.bfloat16) @ params["w3"]).astype(jnp.float32)
    return jnp.mean((out - y) ** 2)


@jax.jit
def train_step(state: dict[str, Any], x: jax.Array, y: jax.Array) -> tuple[dict[str, Any], Any]:
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], x, y)
    count = state["count"] + 1
    b1, b2, lr, eps = 0.9, 0.999, 1e-3, 1e-8
    mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g.astype(m.dtype), state["mu"], grads)
    nu = jax.tree.map(
        lambda v, g: b2 * v + (1 - b2) * jnp.square(g.astype(v.dtype)), state["nu"], grads
    )
    c1, c2 = 1 - b1**count, 1 - b2**count

    def update(p: jax.Array, m: jax.Array, v: jax.Array) -> jax.Array:
        new: jax.Array = (p - lr * (m / c1) / (jnp.sqrt(v / c2) + eps)).astype(p.dtype)
        return new

    params = jax.tree.map(update, state["params"], mu, nu)
    return {"params": params, "mu": mu, "nu": nu, "count": count}, loss


def fresh_state(width: int, seed: int) -> dict[str, Any]:
    params = init(width, seed)
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    return {"params": params, "mu": zeros, "nu": zeros, "count": jnp.int32(0)}


def differences(a: Any, b: Any) -> list[str]:
    leaves_a, tree_a = jax.tree.flatten_with_path(a)
    leaves_b, tree_b = jax.tree.flatten_with_path(b)
    if str(tree_a) != str(tree_b):
        return [f"structure differs: {tree_a} vs {tree_b}"]
    out = []
    for (path, x), (_, y) in zip(leaves_a, leaves_b, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
            out.append(f"{jax.tree_util.keystr(path)}: {x.dtype}{x.shape} vs {y.dtype}{y.shape}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = job_parser("ckptstore.examples.train_jax", __doc__)
    parser.add_argument(
        "--url", default="./checkpoints-jax", help="where checkpoints go (any ckptstore URL)"
    )
    parser.add_argument("--steps", type=int, default=100, help="training steps to run")
    parser.add_argument("--save-every", type=int, default=20, help="steps between saves")
    parser.add_argument("--width", type=int, default=1024, help="hidden width")
    parser.add_argument("--batch", type=int, default=64, help="examples per training step")
    parser.add_argument("--keep", type=int, default=3, help="checkpoints to keep")
    args = parser.parse_args(argv)
    return run_job(parser.prog, lambda: train(args))


def train(args: argparse.Namespace) -> int:
    """The job itself; returns 1 if the restored checkpoint does not match."""
    state = fresh_state(args.width, seed=0)
    mgr = CheckpointManager(args.url, max_to_keep=args.keep, save_interval_steps=args.save_every)
    try:
        start = 0
        latest = mgr.latest_step()
        if latest is not None:
            state = mgr.restore(latest, target=state)
            start = latest + 1
            print(f"resuming from step {latest} in {args.url}")
        n = sum(x.size for x in jax.tree.leaves(state["params"]))
        print(f"training a {n / 1e6:.1f}M-parameter MLP for {args.steps} steps to {args.url}")
        last = start + args.steps - 1
        t0 = time.perf_counter()
        for step in range(start, last + 1):
            state, loss = train_step(state, *batch(step, args.batch))
            if mgr.save(step, state, force=step == last):
                handle = mgr.last_handle
                assert handle is not None
                print(
                    f"step {step:5d}  loss {float(loss):.5f}  save blocked "
                    f"{handle.timing.blocked * 1e3:.1f} ms ({handle.timing.nbytes / 1e6:.1f} MB)",
                    flush=True,
                )
        mgr.wait_until_finished()
        print(f"{args.steps} steps in {time.perf_counter() - t0:.1f} s; kept {mgr.all_steps()}")
        restored = mgr.restore(target=state)
        diffs = differences(restored, state)
        again, _ = train_step(restored, *batch(last + 1, args.batch))
        ahead, _ = train_step(state, *batch(last + 1, args.batch))
        diffs += differences(again, ahead)
        if diffs:
            print("FAIL:\n  " + "\n  ".join(diffs[:10]), file=sys.stderr)
            return 1
        print(f"OK: step {last} restored bit-exact; training resumes identically from it")
        return 0
    finally:
        mgr.close()


if __name__ == "__main__":
    raise SystemExit(main())
