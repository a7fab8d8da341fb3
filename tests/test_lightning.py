"""StoreCheckpointIO under a real Lightning Trainer: ModelCheckpoint saves, top-k removal,
resume, plain and wrapped in AsyncCheckpointIO."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
lightning = pytest.importorskip("lightning")
from lightning.pytorch import LightningModule, Trainer  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import ckptstore  # noqa: E402
from ckptstore import background  # noqa: E402
from ckptstore.errors import CorruptCheckpointError  # noqa: E402
from ckptstore.lightning import StoreCheckpointIO  # noqa: E402
from ckptstore.store.registry import open_store  # noqa: E402

pytestmark = [
    pytest.mark.torch,
    pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),  # lightning vs torch 2.13
    # the resumed run checkpoints into the directory it resumes from, on purpose
    pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty"),
]


class TinyModel(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 4)
        self.norm = torch.nn.BatchNorm1d(4)  # buffers, including an int64 counter

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.norm(self.layer(x)), y)
        self.log("progress", float(self.global_step), on_step=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01)  # moments in optimizer state


def loader() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 4, generator=g))
    return DataLoader(data, batch_size=8)


class RecordStart(Callback):
    """Captures the weights and step the trainer starts from."""

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.step = trainer.global_step
        self.weights = {k: v.clone() for k, v in pl_module.state_dict().items()}


def trainer(io: Any, max_steps: int, callbacks: list[Any]) -> Trainer:
    return Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        plugins=[io],
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def committed(url: str, options: dict[str, Any]) -> list[str]:
    async def keys() -> list[str]:
        async with open_store(url, **options) as store:
            return await store.list_keys()

    return sorted(k.split("/")[0] for k in background.run(keys()) if k.endswith("/manifest.json"))


def top2(base: str) -> ModelCheckpoint:
    return ModelCheckpoint(
        dirpath=base,
        every_n_train_steps=1,
        monitor="progress",
        mode="max",
        save_top_k=2,
        filename="{step}",
    )


def train_and_resume(base: str, io: Any, options: dict[str, Any] | None = None) -> None:
    """Train 4 steps checkpointing every step, keep the top 2, resume from the best to 6.

    Under AsyncCheckpointIO, Lightning may ask to remove a checkpoint whose save is still
    queued; that save then lands after the removal (as with Lightning's own file IO), so only
    the synchronous plugin is held to exactly two survivors.
    """
    options = options or {}
    exact = not isinstance(io, AsyncCheckpointIO)
    checkpoint = top2(base)
    first = trainer(io, 4, [checkpoint])
    first.fit(TinyModel(), loader())
    # top-k kept the last two; the two older ones were removed through the plugin
    kept = committed(base, options)
    assert (
        kept == ["step=3.ckpt", "step=4.ckpt"]
        if exact
        else {"step=3.ckpt", "step=4.ckpt"} <= set(kept)
    )
    best = checkpoint.best_model_path
    assert best.endswith("step=4.ckpt")

    saved = StoreCheckpointIO(**options).load_checkpoint(best)
    assert saved["global_step"] == 4
    assert set(saved["optimizer_states"][0]["state"][0]) >= {"exp_avg", "exp_avg_sq"}

    start = RecordStart()
    second = trainer(io, 6, [start, top2(base)])
    second.fit(TinyModel(), loader(), ckpt_path=best)
    assert start.step == 4
    for name, tensor in saved["state_dict"].items():
        assert torch.equal(start.weights[name], tensor), name
    assert second.global_step == 6
    assert {"step=5.ckpt", "step=6.ckpt"} <= set(committed(base, options))


def test_train_checkpoint_and_resume_on_local_path(tmp_path: Path) -> None:
    train_and_resume(str(tmp_path / "run"), StoreCheckpointIO())


def test_train_checkpoint_and_resume_under_async_checkpoint_io(tmp_path: Path) -> None:
    train_and_resume(str(tmp_path / "run"), AsyncCheckpointIO(StoreCheckpointIO()))


@pytest.mark.s3
def test_train_checkpoint_and_resume_on_s3(moto_s3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    fsspec = pytest.importorskip("fsspec")
    # Lightning asks fsspec (s3fs) whether checkpoint paths exist; point it at moto too.
    monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": moto_s3.endpoint})
    options = moto_s3.options()
    base = f"s3://{moto_s3.bucket}/lightning-run"
    train_and_resume(base, AsyncCheckpointIO(StoreCheckpointIO(**options)), options)


def test_roundtrip_is_exact_and_verified(tmp_path: Path) -> None:
    io = StoreCheckpointIO(pack_threshold=1024)
    state = {
        "big": torch.randn(1000),  # over the threshold: its own object
        "nested": [{"bf16": torch.arange(5, dtype=torch.bfloat16)}, (torch.tensor(7), "x")],
        "empty": torch.empty(0, 3),
        "epoch": 3,
    }
    path = str(tmp_path / "ck")
    io.save_checkpoint(state, path)
    loaded = io.load_checkpoint(path)
    assert torch.equal(loaded["big"], state["big"])
    assert torch.equal(loaded["nested"][0]["bf16"], state["nested"][0]["bf16"])
    assert loaded["nested"][1][0].item() == 7
    assert loaded["nested"][1][1] == "x"
    assert loaded["empty"].shape == (0, 3)
    assert loaded["epoch"] == 3

    manifest = ckptstore.read_manifest(path, 0)  # an ordinary ckptstore checkpoint
    assert manifest.metadata == {"format": "ckptstore.lightning/4"}
    assert set(manifest.paths) == {"big", "nested/0/bf16", "nested/1/0", "empty"}
    plain = ckptstore.load(path, 0)  # which every face reads
    assert plain["nested"][1][1] == "x"
    assert torch.equal(plain["big"], state["big"])
    big = manifest.paths.index("big")
    data = tmp_path / "ck" / manifest.object_key(manifest.leaf_object[big])
    raw = bytearray(data.read_bytes())
    raw[manifest.leaf_offset[big] + 5] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match="crc32c"):
        io.load_checkpoint(path)

    io.save_checkpoint({"epoch": 4}, path)  # a path is saved over, as Lightning expects
    assert io.load_checkpoint(path) == {"epoch": 4}

    io.remove_checkpoint(path)
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint(path)
    io.remove_checkpoint(path)  # nothing there: not an error
    assert background.run(open_store(path).list_keys()) == []


def test_remove_waits_for_a_save_of_the_same_path_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under AsyncCheckpointIO Lightning removes paths whose save is still running; the removal
    must wait and then remove the finished checkpoint, never delete a save's objects under it."""
    import threading

    from ckptstore.integrations import lightning as plugin

    started, proceed = threading.Event(), threading.Event()
    real_save = plugin._save

    def paused_save(*args: Any) -> None:
        started.set()
        assert proceed.wait(30)
        real_save(*args)

    monkeypatch.setattr(plugin, "_save", paused_save)
    io = StoreCheckpointIO()
    path = str(tmp_path / "step=1.ckpt")
    errors: list[BaseException] = []

    def run(fn: Any, *args: Any) -> threading.Thread:
        def body() -> None:
            try:
                fn(*args)
            except BaseException as exc:  # reported below
                errors.append(exc)

        thread = threading.Thread(target=body)
        thread.start()
        return thread

    saver = run(io.save_checkpoint, {"w": torch.ones(3)}, path)
    assert started.wait(30)
    remover = run(io.remove_checkpoint, path)
    remover.join(0.3)
    assert remover.is_alive(), "remove did not wait for the save in flight"
    other = str(tmp_path / "step=2.ckpt")
    io.remove_checkpoint(other)  # another path is not held up
    proceed.set()
    saver.join(30)
    remover.join(30)
    assert errors == []
    assert committed(str(tmp_path), {}) == []  # saved, then removed after it committed

    clone = __import__("pickle").loads(__import__("pickle").dumps(io))
    clone.save_checkpoint({"w": torch.ones(3)}, path)  # picklable, locks rebuilt
    assert committed(str(tmp_path), {}) == ["step=1.ckpt"]


def test_the_non_tensor_part_is_json_never_a_pickle(tmp_path: Path) -> None:
    import collections
    import json

    io = StoreCheckpointIO()
    state = {
        "od": collections.OrderedDict([("b", 1), ("a", torch.ones(2))]),
        "int_keys": {0: {"step": torch.tensor(3.0)}, 1: (1.5, None)},
        "floats": [float("nan"), float("inf"), -0.0],
        "dtype": torch.bfloat16,
        "device": torch.device("cpu"),
        "tag_like": {"t": 0, "d": "x"},  # a user dict shaped like a tag stays a dict
    }
    path = str(tmp_path / "ck")
    io.save_checkpoint(state, path)
    manifest = ckptstore.read_manifest(path, 0)
    # every stored object is a tensor's bytes; the rest is the manifest's JSON, no pickle
    assert sorted(manifest.paths) == ["int_keys/0/step", "od/a"]
    json.loads(json.dumps(manifest.tree))
    # the tree itself says which values are torch's and which dict is ordered (format 4)
    assert manifest.metadata == {"format": "ckptstore.lightning/4"}
    tree = dict(zip(manifest.tree["d"], manifest.tree["c"], strict=True))
    assert tree["dtype"] == {"x": ["torch.dtype", "bfloat16"]}
    assert tree["device"] == {"x": ["torch.device", "cpu"]}
    assert tree["od"]["o"] == 1
    assert "o" not in tree["int_keys"]
    assert (
        (tmp_path / "ck" / "0" / "manifest.json")
        .read_bytes()
        .startswith(b'{"format":"ckptstore","version":4,')
    )
    out = io.load_checkpoint(path)
    assert type(out["od"]) is collections.OrderedDict
    assert list(out["od"]) == ["b", "a"]
    assert torch.equal(out["od"]["a"], torch.ones(2))
    assert out["int_keys"][0]["step"].item() == 3.0
    assert out["int_keys"][1] == (1.5, None)
    assert out["floats"][0] != out["floats"][0]
    assert out["floats"][1:] == [float("inf"), -0.0]
    assert out["dtype"] is torch.bfloat16
    assert out["device"] == torch.device("cpu")
    assert out["tag_like"] == {"t": 0, "d": "x"}
    # and every other face gives back the same kinds: one tree codec
    plain = ckptstore.load(path, 0)
    assert type(plain["od"]) is collections.OrderedDict
    assert list(plain["od"]) == ["b", "a"]
    assert plain["dtype"] is torch.bfloat16
    assert plain["device"] == torch.device("cpu")

    class Opaque:
        pass

    with pytest.raises(TypeError, match=r"'hp/x'.*Opaque is not storable"):
        io.save_checkpoint({"hp": {"x": Opaque()}}, str(tmp_path / "bad"))


def test_checkpoints_of_the_earlier_format_still_load(tmp_path: Path) -> None:
    """Format 2 kept the structure as one tagged-JSON leaf; such checkpoints stay readable."""
    import json

    import numpy as np

    from ckptstore.layout.commit import write_checkpoint
    from ckptstore.layout.tree import FlatState

    structure = {
        "d": [
            ["w", {"t": 0}],
            ["meta", {"od": [["lr", {"float": "nan"}], ["dt", {"dtype": "bfloat16"}]]}],
            ["pair", {"tuple": [1, {"device": "cpu"}]}],
        ]
    }
    blob = np.frombuffer(json.dumps(structure).encode(), np.uint8)
    flat = FlatState(
        tree={"d": ["tensors", "structure"], "c": [{"l": [0]}, 1]},
        paths=["tensors/0", "structure"],
        arrays=[np.arange(4, dtype=np.float32), blob],
        attrs=[None, None],
    )
    path = tmp_path / "old"
    store = open_store(str(path))
    background.run(
        write_checkpoint(store, flat, step=0, metadata={"format": "ckptstore.lightning/2"})
    )
    background.run(store.close())
    out = StoreCheckpointIO().load_checkpoint(str(path))
    assert torch.equal(out["w"], torch.arange(4, dtype=torch.float32))
    assert type(out["meta"]) is __import__("collections").OrderedDict
    assert out["meta"]["lr"] != out["meta"]["lr"]
    assert out["meta"]["dt"] is torch.bfloat16
    assert out["pair"] == (1, torch.device("cpu"))


def test_store_options_are_checked_when_the_plugin_is_built() -> None:
    with pytest.raises(ValueError, match="cannot parse size"):
        StoreCheckpointIO(part_size="lots")


def every_stored_dtype() -> list[Any]:
    from ckptstore.stage.torch import dtype_table

    return list(dtype_table())


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning")
@pytest.mark.parametrize("dtype", every_stored_dtype(), ids=str)
def test_every_dtype_the_manager_stores_round_trips_bit_exact(dtype: Any, tmp_path: Path) -> None:
    # One dtype table for every face: complex32, float8_e8m0fnu, bfloat16, each float8...
    g = torch.Generator().manual_seed(3)
    tensors = []
    for numel in (24, 4096):  # packed, and an object of its own
        if dtype == torch.bool:
            tensors.append(torch.randint(0, 2, (numel,), generator=g).to(torch.bool))
        else:  # random bytes: NaN payloads and all
            raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g)
            tensors.append(raw.view(dtype))
    io = StoreCheckpointIO(pack_threshold=1024)
    path = str(tmp_path / "ck")
    io.save_checkpoint({"state_dict": {"small": tensors[0], "large": tensors[1]}}, path)
    loaded = io.load_checkpoint(path)["state_dict"]
    for key, expected in zip(("small", "large"), tensors, strict=True):
        assert loaded[key].dtype == dtype
        assert torch.equal(loaded[key].view(torch.uint8), expected.view(torch.uint8)), key


class WithHparams(TinyModel):
    def __init__(self, width: int = 4, note: str = "default") -> None:
        super().__init__()
        self.save_hyperparameters()


@pytest.mark.s3
def test_last_and_load_from_checkpoint_on_s3(moto_s3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 29: ``ckpt_path="last"`` on an s3:// dirpath: ``last_checkpoint`` finds the
    checkpoint ``save_last`` wrote (Lightning's own lookup drops the scheme and starts from
    step 0), and ``load_from_checkpoint`` loads a module with its hyperparameters (Lightning's
    reads one file and fails)."""
    from ckptstore.lightning import last_checkpoint, load_from_checkpoint

    fsspec = pytest.importorskip("fsspec")
    monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": moto_s3.endpoint})
    options = moto_s3.options()
    base = f"s3://{moto_s3.bucket}/lightning-last"
    assert last_checkpoint(base, **options) is None  # a first run: nothing to resume

    def checkpointing() -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=base, every_n_train_steps=2, save_last=True)

    first = trainer(StoreCheckpointIO(**options), 4, [checkpointing()])
    first.fit(WithHparams(note="first"), loader())
    last = last_checkpoint(base, **options)
    assert last == f"{base}/last.ckpt"
    saved = StoreCheckpointIO(**options).load_checkpoint(last)
    assert saved["global_step"] == 4

    start = RecordStart()
    second = trainer(StoreCheckpointIO(**options), 6, [start, checkpointing()])
    second.fit(WithHparams(note="second"), loader(), ckpt_path=last_checkpoint(base, **options))
    assert start.step == 4
    for name, tensor in saved["state_dict"].items():
        assert torch.equal(start.weights[name], tensor), name

    loaded = load_from_checkpoint(WithHparams, last, store_options=options)
    assert isinstance(loaded, WithHparams)
    assert loaded.hparams.note == "second"  # last.ckpt is the second run's now
    newest = StoreCheckpointIO(**options).load_checkpoint(last)
    assert newest["global_step"] == 6
    for name, tensor in newest["state_dict"].items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    overridden = load_from_checkpoint(WithHparams, last, store_options=options, note="changed")
    assert overridden.hparams.note == "changed"


def every_second(base: str) -> ModelCheckpoint:
    return ModelCheckpoint(
        dirpath=base, every_n_train_steps=2, save_top_k=-1, save_last=True, filename="{step}"
    )


def rerun_and_roll_back(base: str, options: dict[str, Any]) -> None:
    from ckptstore.lightning import checkpoints, last_checkpoint

    trainer(StoreCheckpointIO(**options), 6, [every_second(base)]).fit(TinyModel(), loader())
    first = checkpoints(base, **options)
    assert first == {"last.ckpt": 6, "step=2.ckpt": 2, "step=4.ckpt": 4, "step=6.ckpt": 6}
    assert last_checkpoint(base, **options) == f"{base}/last.ckpt"

    # the same script from scratch: Lightning would write step=2-v1.ckpt beside the first
    # run's; it is refused before anything is written
    with pytest.raises(ckptstore.CommitConflictError) as refused:
        trainer(StoreCheckpointIO(**options), 6, [every_second(base)]).fit(TinyModel(), loader())
    assert "cannot save step 2: the newest step of this root is 6" in str(refused.value)
    assert "last_checkpoint" in str(refused.value)
    assert "rollback=True" in str(refused.value)
    assert checkpoints(base, **options) == first
    assert not any("-v" in key for key in committed(base, options) + list(first))

    # resuming from step 4 without rollback= is refused at its first save (step 6 exists)
    with pytest.raises(ckptstore.CommitConflictError, match="cannot save step 6"):
        trainer(StoreCheckpointIO(**options), 8, [every_second(base)]).fit(
            TinyModel(), loader(), ckpt_path=f"{base}/step=4.ckpt"
        )

    # rollback=True: loading step 4 sets step=6.ckpt and last.ckpt aside, and the run saves
    # steps 6 and 8 again
    start = RecordStart()
    rolled = trainer(StoreCheckpointIO(rollback=True, **options), 8, [start, every_second(base)])
    rolled.fit(TinyModel(), loader(), ckpt_path=f"{base}/step=4.ckpt")
    assert start.step == 4
    assert rolled.global_step == 8
    now = checkpoints(base, **options)
    assert sorted(now.values()) == [2, 4, 6, 8, 8]
    assert "step=6.ckpt" not in now  # set aside; Lightning named the new one step=6-v1
    assert last_checkpoint(base, **options) == f"{base}/last.ckpt"
    assert StoreCheckpointIO(**options).load_checkpoint(f"{base}/last.ckpt")["global_step"] == 8
    # the set-aside checkpoint is still recoverable, whole
    ckptstore.recover_step(f"{base}/step=6.ckpt", 0, **options)
    assert checkpoints(base, **options)["step=6.ckpt"] == 6


def test_a_rerun_is_refused_and_a_rollback_trains_the_newer_steps_again(tmp_path: Path) -> None:
    """Issue 29: a Lightning job run again from scratch in the same dirpath wrote its
    checkpoints beside the first run's (``step=2-v1.ckpt``) and resumed from whichever was
    written last; now the first save is refused, and ``StoreCheckpointIO(rollback=True)``
    makes an older checkpoint the newest."""
    rerun_and_roll_back(str(tmp_path / "run"), {})


@pytest.mark.s3
def test_a_rerun_is_refused_and_a_rollback_trains_the_newer_steps_again_on_s3(
    moto_s3: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    fsspec = pytest.importorskip("fsspec")
    monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": moto_s3.endpoint})
    rerun_and_roll_back(f"s3://{moto_s3.bucket}/lightning-rollback", moto_s3.options())


def test_roll_back_refuses_a_checkpoint_that_is_not_there(tmp_path: Path) -> None:
    from ckptstore.lightning import roll_back

    with pytest.raises(ckptstore.NotFoundError, match=r"step=4\.ckpt"):
        roll_back(tmp_path / "run" / "step=4.ckpt")


class TermAt(TinyModel):
    """SIGTERM during a training step, as a scheduler sends it."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.global_step + 1 == self.at:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGTERM)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "async"])
def test_save_on_preemption_saves_the_step_and_exits_143(tmp_path: Path, wrapped: bool) -> None:
    """Lightning's own SIGTERM handling ends fit with status 0 and no save; with
    SaveOnPreemption the step is saved (durable, under AsyncCheckpointIO too) and the
    status is 143, and the restart resumes from that step."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from ckptstore.lightning import SaveOnPreemption, checkpoints, last_checkpoint

    base = str(tmp_path / "run")
    io: Any = AsyncCheckpointIO(StoreCheckpointIO()) if wrapped else StoreCheckpointIO()
    stopped = trainer(io, 8, [every_second(base), SaveOnPreemption()])
    with pytest.raises(SIGTERMException) as exit_:
        stopped.fit(TermAt(5), loader())
    assert exit_.value.code == 143
    assert sorted(checkpoints(base).values()) == [2, 4, 4, 5]  # last.ckpt at 4; 5 on notice
    assert last_checkpoint(base) == f"{base}/step=5.ckpt"  # named as the ModelCheckpoint does
    start = RecordStart()
    trainer(StoreCheckpointIO(), 6, [start, every_second(base)]).fit(
        TinyModel(), loader(), ckpt_path=last_checkpoint(base)
    )
    assert start.step == 5


def test_save_on_preemption_needs_the_store_plugin(tmp_path: Path) -> None:
    from ckptstore.lightning import SaveOnPreemption

    plain = Trainer(
        accelerator="cpu",
        max_steps=1,
        callbacks=[ModelCheckpoint(dirpath=str(tmp_path)), SaveOnPreemption()],
        logger=False,
        enable_progress_bar=False,
    )
    with pytest.raises(TypeError, match="needs StoreCheckpointIO"):
        plain.fit(TinyModel(), loader())
