"""Write one golden checkpoint with the ckptstore that is importable (tests/golden/README.md
says which commit wrote each, and the command).

    PYTHONPATH=<checkout of the commit>:<this repo>/tests \\
        python tests/golden/make.py KIND OUT_DIR

KIND: ``plain`` (one step, packed and whole leaves of every dtype), ``incremental`` (three
steps, each referencing the one before), ``sharded`` (one leaf saved as chunks by 2 ranks),
``dtypes`` (the ml_dtypes types too), ``tree`` (a directory uploaded by the file
adapters), ``dcp`` (a ``torch.distributed.checkpoint`` save through ckptstore's Writer),
``lightning`` (a checkpoint dict saved by ``StoreCheckpointIO``), ``typed`` (one step of
manifest version 4: ``OrderedDict`` s, torch dtypes and devices).
Each kind uses only the calls of the commit that wrote it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import golden_states

import ckptstore

#: small thresholds, so the golden checkpoints stay a few KiB and still hold both kinds of
#: object: leaves under 4 KiB packed, larger ones objects of their own
OPTIONS = {"pack_threshold": 4096, "pack_size": 1 << 16}


def plain(out: Path) -> None:
    ckptstore.save(ckptstore.open_store(str(out), **OPTIONS), golden_states.plain_state(), step=1)


def incremental(out: Path) -> None:
    store = ckptstore.open_store(str(out), **OPTIONS)
    for step, state in enumerate(golden_states.incremental_states(), start=1):
        ckptstore.save(store, state, step=step)


def sharded(out: Path) -> None:
    from ckptstore.distributed import LocalGroup, save

    try:
        from ckptstore.distributed import Shard
    except ImportError:  # its first home
        from ckptstore.stage.shards import Shard

    full = golden_states.sharded_global()
    group = LocalGroup(2, timeout=60)
    rows = full.shape[0] // 2

    def one(rank: int) -> object:
        part = full[rank * rows : (rank + 1) * rows]
        leaf = Shard(part, offsets=(rank * rows, 0), global_shape=full.shape)
        state = {"w": leaf, "step": 7, "replicated": golden_states.values("int32", 4, 1)}
        return save(str(out), state, step=7, comm=group.member(rank))

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(one, range(2)))


def dtypes(out: Path) -> None:
    import ml_dtypes
    import numpy as np

    state = {
        name: np.frombuffer(golden_states.ml_dtype_bytes(name, 6), getattr(ml_dtypes, name))
        for name in golden_states.ML_DTYPES
    }
    state["numpy"] = golden_states.plain_state(1)["dtypes"]
    ckptstore.save(ckptstore.open_store(str(out), **OPTIONS), state, step=2)


def tree(out: Path) -> None:
    import tempfile

    from ckptstore import files

    with tempfile.TemporaryDirectory() as scratch:
        for name, data in golden_states.tree_files().items():
            path = Path(scratch) / "checkpoint-3" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        files.upload(Path(scratch) / "checkpoint-3", str(out), step=3, **OPTIONS)


def dcp(out: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    import ckptstore.dcp

    state = {k: torch.from_numpy(v.copy()) for k, v in golden_states.dcp_state().items()}
    dcp.save({"model": state, "step": 4}, storage_writer=ckptstore.dcp.Writer(f"{out}/4"))


def lightning(out: Path) -> None:
    from ckptstore.lightning import StoreCheckpointIO

    path = f"{out}/epoch=0-step=3.ckpt"
    StoreCheckpointIO(**OPTIONS).save_checkpoint(golden_states.lightning_dict(), path)


def typed(out: Path) -> None:
    ckptstore.save(ckptstore.open_store(str(out), **OPTIONS), golden_states.typed_state(), step=5)


if __name__ == "__main__":
    kind, out = sys.argv[1], Path(sys.argv[2])
    kinds = {"plain": plain, "incremental": incremental, "sharded": sharded}
    kinds.update(dtypes=dtypes, tree=tree, dcp=dcp, lightning=lightning, typed=typed)
    kinds[kind](out)
    root = Path(ckptstore.__file__).resolve().parent.parent
    commit = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    written = {"kind": kind, "commit": commit}
    out.with_name(out.name + ".json").write_text(json.dumps(written) + "\n")
