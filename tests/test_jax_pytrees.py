"""JAX training states as users have them: optax states (named tuples), flax ``TrainState``
(a registered ``struct.dataclass``), dataclasses and registered pytree nodes are saved, and a
restore into a target gives back the exact pytree, so the next training step is bit-identical
to the one the uninterrupted run takes."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest

import ckptstore
import ckptstore.distributed as cd
from ckptstore import CheckpointManager

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
optax = pytest.importorskip("optax")

pytestmark = pytest.mark.jax


def same_tree(a: Any, b: Any) -> None:
    """``a`` and ``b`` have one pytree structure and bit-identical leaves of one dtype."""
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        assert type(x) is type(y)
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype
        assert x.shape == y.shape
        assert x.tobytes() == y.tobytes()


def data() -> tuple[Any, Any]:
    key = jax.random.PRNGKey(1)
    x = jax.random.normal(key, (16, 4))
    return x, x @ jnp.arange(4.0).reshape(4, 1)


def init_params(seed: int) -> dict[str, Any]:
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return {
        "dense": {"w": jax.random.normal(k1, (4, 8)), "b": jnp.zeros(8)},
        "out": {"w": jax.random.normal(k2, (8, 1)), "b": jnp.zeros(1, jnp.bfloat16)},
    }


def loss(params: Any, x: Any, y: Any) -> Any:
    hidden = jnp.tanh(x @ params["dense"]["w"] + params["dense"]["b"])
    out = hidden @ params["out"]["w"] + params["out"]["b"].astype(jnp.float32)
    return jnp.mean((out - y) ** 2)


def make_step(tx: Any) -> Any:
    x, y = data()

    @jax.jit
    def step(params: Any, opt_state: Any) -> tuple[Any, Any]:
        grads = jax.grad(loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


TRANSFORMS = {
    "adam": lambda: optax.adam(1e-2),
    "chain": lambda: optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.scale_by_adam(b1=0.8),
        optax.add_decayed_weights(1e-4),
        optax.scale_by_schedule(optax.cosine_decay_schedule(1e-2, 100)),
        optax.scale(-1.0),
    ),
}


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_optax_state_resumes_bit_identically(tmp_path: Path, name: str) -> None:
    tx = TRANSFORMS[name]()
    step = make_step(tx)
    params = init_params(0)
    opt_state = tx.init(params)
    for _ in range(3):
        params, opt_state = step(params, opt_state)
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(3, {"params": params, "opt": opt_state})
        mgr.wait_until_finished()
        fresh = init_params(7)  # a new process builds its target from scratch
        target = {"params": fresh, "opt": tx.init(fresh)}
        back = mgr.restore(target=target)
        plain = mgr.restore()
    same_tree(back, {"params": params, "opt": opt_state})
    assert any(
        type(s).__name__ == "ScaleByAdamState"
        for s in jax.tree_util.tree_leaves(
            back["opt"], is_leaf=lambda n: type(n).__name__ == "ScaleByAdamState"
        )
    )
    # Without a target the named tuples come back as the tuples they are.
    assert type(plain["opt"]) is tuple
    expected = step(*step(params, opt_state))
    resumed = step(*step(back["params"], back["opt"]))
    same_tree(resumed, expected)


def test_flax_train_state_resumes_bit_identically(tmp_path: Path) -> None:
    nn = pytest.importorskip("flax.linen")
    from flax.training import train_state

    class MLP(nn.Module):  # type: ignore[misc]
        @nn.compact
        def __call__(self, x: Any) -> Any:
            return nn.Dense(1)(nn.relu(nn.Dense(8)(x)))

    model = MLP()
    x, y = data()
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))

    @jax.jit
    def train_step(state: Any) -> Any:
        grads = jax.grad(lambda p: jnp.mean((state.apply_fn(p, x) - y) ** 2))(state.params)
        return state.apply_gradients(grads=grads)

    def create(seed: int) -> Any:
        params = model.init(jax.random.PRNGKey(seed), x)
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    state = create(0)
    for _ in range(2):
        state = train_step(state)
    with CheckpointManager(f"file://{tmp_path}") as mgr:
        mgr.save(int(state.step), state)
        mgr.wait_until_finished()
        back = mgr.restore(target=create(5))
        paths = ckptstore.read_manifest(f"file://{tmp_path}").paths
    assert type(back) is train_state.TrainState
    assert back.apply_fn == model.apply  # static fields come from the target
    assert back.tx is tx
    assert "step" in paths
    # adamw's first moments: a named tuple is stored as the tuple it is (mu is field 1)
    assert any(p.startswith("opt_state/1/0/1/params/") for p in paths)
    same_tree(back, state)
    same_tree(train_step(train_step(back)), train_step(train_step(state)))


@dataclasses.dataclass(frozen=True)
class Frozen:
    weights: Any
    scale: float
    tag: str = dataclasses.field(default="plain", compare=False)


class Moments(NamedTuple):
    mu: Any
    nu: Any


@jax.tree_util.register_pytree_node_class
class Registered:
    """A node registered without keys: its children are keyed by position."""

    def __init__(self, a: Any, b: Any, name: str) -> None:
        self.a, self.b, self.name = a, b, name

    def tree_flatten(self) -> tuple[tuple[Any, Any], str]:
        return (self.a, self.b), self.name

    @classmethod
    def tree_unflatten(cls, name: str, children: Any) -> Registered:
        return cls(*children, name)


def test_named_tuples_dataclasses_and_registered_nodes(tmp_path: Path) -> None:
    state = {
        "frozen": Frozen(np.arange(3.0), 0.5),
        "moments": Moments(jnp.ones(2), np.zeros(2, np.float16)),
        "node": Registered(jnp.arange(4), [1, 2], "static"),
    }
    like = {
        "frozen": Frozen(np.zeros(3), 0.0, tag="from-target"),
        "moments": Moments(jax.ShapeDtypeStruct((2,), jnp.float32), np.empty(2, np.float16)),
        "node": Registered(jax.ShapeDtypeStruct((4,), jnp.int32), [0, 0], "other"),
    }
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(0, state)
        mgr.wait_until_finished()
        back = mgr.restore(target=like)
        plain = mgr.restore()
    assert type(back["frozen"]) is Frozen
    assert back["frozen"].scale == 0.5
    assert back["frozen"].tag == "plain"  # a field is state, whatever the target holds
    assert np.array_equal(back["frozen"].weights, np.arange(3.0))
    assert type(back["moments"]) is Moments
    assert isinstance(back["moments"].mu, jax.Array)
    assert back["moments"].nu.dtype == np.float16
    assert type(back["node"]) is Registered
    assert back["node"].name == "other"  # aux data is the target's, as JAX rebuilds it
    assert back["node"].b == [1, 2]
    assert np.array_equal(np.asarray(back["node"].a), np.arange(4))
    # Without a target: the plain containers they are stored as.
    assert plain["frozen"]["scale"] == 0.5
    assert type(plain["moments"]) is tuple
    assert plain["node"][1] == [1, 2]  # keyed by position, as JAX flattens it


def test_a_target_leaf_the_checkpoint_lacks_is_named(tmp_path: Path) -> None:
    tx = optax.adam(1e-3)
    params = init_params(0)
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(0, {"params": params})
        mgr.wait_until_finished()
        with pytest.raises(ckptstore.NotFoundError, match=r"no leaf 'opt/0/0', .* and 4 more"):
            mgr.restore(target={"params": params, "opt": tx.init(params)})


def test_distributed_load_rebuilds_the_target_pytree(tmp_path: Path) -> None:
    tx = optax.adam(1e-2)
    params = init_params(0)
    opt_state = tx.init(params)
    comm = cd.LocalGroup(1).member(0)
    cd.save(tmp_path, {"opt": opt_state}, step=1, comm=comm)
    back = cd.load(tmp_path, 1, target={"opt": tx.init(init_params(3))}, comm=comm)
    same_tree(back["opt"], opt_state)


def test_ckptstore_save_and_load_take_pytrees_too(tmp_path: Path) -> None:
    """The functional face saves JAX arrays and pytree nodes through the same stager, and
    load(target=...) rebuilds them through the same restore path as the manager."""
    tx = TRANSFORMS["chain"]()
    step = make_step(tx)
    params = init_params(0)
    params, opt_state = step(params, tx.init(params))
    ckptstore.save(tmp_path, {"params": params, "opt": opt_state}, step=1)
    fresh = init_params(4)
    back = ckptstore.load(tmp_path, target={"params": fresh, "opt": tx.init(fresh)})
    same_tree(back, {"params": params, "opt": opt_state})
    as_saved = ckptstore.load(tmp_path)  # without a target: JAX arrays, plain containers
    assert isinstance(as_saved["params"]["dense"]["w"], jax.Array)
    assert type(as_saved["opt"]) is tuple
    as_numpy = ckptstore.load(tmp_path, target="numpy")
    assert type(as_numpy["params"]["dense"]["w"]) is np.ndarray
