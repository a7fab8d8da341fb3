"""A JAX mesh change in one process with 8 CPU devices; run by tests/test_sharding_jax.py with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``.

Usage: ``python tests/jax_shards.py ROOT``. Saves arrays sharded over a 4 x 2 mesh through
``ckptstore.distributed.save`` (one rank: a ``LocalGroup`` of one), then loads them onto other
meshes and shardings, and prints ``RESULT <json>``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ckptstore
import ckptstore.distributed as cdist
from ckptstore import background
from ckptstore.store.registry import open_store
from ckptstore.store.wrappers import CountingStore


def main(root: str) -> dict[str, Any]:
    devices = np.array(jax.devices())
    assert devices.size == 8, devices
    saved_mesh = Mesh(devices.reshape(4, 2), ("a", "b"))
    x = jnp.arange(64 * 48, dtype=jnp.float32).reshape(64, 48) / 7
    y = (jnp.arange(32 * 16, dtype=jnp.float32).reshape(32, 16) - 100).astype(jnp.bfloat16)
    state = {
        "x": jax.device_put(x, NamedSharding(saved_mesh, P("a", "b"))),  # 8 boxes
        "y": jax.device_put(y, NamedSharding(saved_mesh, P("a", None))),  # 4 boxes, 2 replicas each
    }
    cdist.save(root, state, step=1, comm=cdist.LocalGroup(1).member(0), chunk_block_size=4096)
    manifest = ckptstore.read_manifest(root)
    assert manifest.chunks is not None
    chunks = {manifest.paths[leaf]: len(c) for leaf, c in manifest.chunks.by_leaf.items()}

    result: dict[str, Any] = {"chunks": chunks, "loads": {}}
    loaded_mesh = Mesh(devices.reshape(2, 4), ("p", "q"))
    line = Mesh(devices, ("n",))
    targets = {
        "2x4 transposed": {
            "x": NamedSharding(loaded_mesh, P("q", "p")),
            "y": NamedSharding(loaded_mesh, P(None, "q")),
        },
        "8 by columns": {"x": NamedSharding(line, P(None, "n")), "y": NamedSharding(line, P("n"))},
        "replicated": {"x": NamedSharding(line, P()), "y": NamedSharding(line, P())},
    }
    for name, shardings in targets.items():
        like = {
            key: jax.ShapeDtypeStruct(state[key].shape, state[key].dtype, sharding=sharding)
            for key, sharding in shardings.items()
        }
        counting = CountingStore(open_store(root))
        got = cdist.load(counting, 1, target=like)
        background.run(counting.close())
        result["loads"][name] = {
            "exact": all(
                np.asarray(got[key]).tobytes() == np.asarray(state[key]).tobytes()
                and got[key].dtype == state[key].dtype
                for key in like
            ),
            "sharding": all(got[key].sharding == like[key].sharding for key in like),
            "read": counting.bytes["read"],
        }
    whole = ckptstore.load(root)
    result["full"] = bool(
        np.array_equal(whole["x"], np.asarray(x))
        and whole["y"].tobytes() == np.asarray(y).tobytes()
    )
    result["nbytes"] = x.nbytes + y.nbytes
    return result


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1])), flush=True)
