"""The optimizer sees the model's parameters by path, and FSDP's remaining input rules.

The references are an unsharded fp32 model's parameters (in their logical shapes) updated by
the same optax chain, fed the same gradients the sharded step computed (read back in logical
shape); the FSDP trajectory must equal it. Each optimizer test also shows that its option
matters (the chain without the mask, with one label, unclipped, lands elsewhere), so an FSDP
that ignored it would fail.
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh

from mxfp8_jax.flax import FSDP, Linear

from conftest import need_devices, rows_per_device

IN, HIDDEN, CLASSES, BATCH = 32, 64, 10, 64


class Net(nnx.Module):
    """Two units; biases, a norm, a [64, 10] head and a 0-D temperature are plain parameters;
    an int32 table is a frozen one (read in the forward, never trained)."""

    def __init__(self, rngs):
        self.l1 = Linear(IN, HIDDEN, dtype=jnp.float32, rngs=rngs)
        self.l2 = nnx.Linear(HIDDEN, HIDDEN, rngs=rngs)
        self.norm = nnx.RMSNorm(HIDDEN, rngs=rngs)
        self.head = nnx.Linear(HIDDEN, CLASSES, rngs=rngs)
        self.temperature = nnx.Param(jnp.asarray(1.5, jnp.float32))
        self.perm = nnx.Param(jnp.asarray(np.random.default_rng(3).permutation(CLASSES), jnp.int32))

    def __call__(self, x):
        h = jax.nn.gelu(self.l2(jax.nn.gelu(self.l1(x))))
        logits = self.head(self.norm(h)) / self.temperature.get_value()
        return logits[:, self.perm.get_value()]


def make_net(seed=0):
    model = nnx.eval_shape(lambda: Net(nnx.Rngs(0)))
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(nnx.state(model)):
        v = var.get_value()
        if jnp.issubdtype(v.dtype, jnp.integer):
            var.set_value(jnp.asarray(rng.permutation(CLASSES), v.dtype))
        elif v.ndim == 0:
            var.set_value(jnp.asarray(1.5, v.dtype))
        elif path[-1] == "kernel":
            var.set_value(jnp.asarray(rng.standard_normal(v.shape) / np.sqrt(v.shape[0]), jnp.float32))
        else:
            var.set_value(jnp.asarray(rng.uniform(0.5, 1.5, v.shape), jnp.float32))
    return model


def loss_fn(model, batch):
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def make_batch(seed=1):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((BATCH, IN)).astype(np.float32), rng.integers(0, CLASSES, BATCH).astype(np.int32)


@pytest.fixture(scope="module")
def mesh(devices):
    return Mesh(np.array(devices), ("fsdp",))


def logical(fsdp, stored):
    """``{name: stored array}`` -> ``{name: numpy array in the parameter's own shape}``."""
    return {p.name: np.asarray(fsdp.to_logical(p, stored[p.name])) for p in fsdp.trained}


def by_path(p) -> bool:
    return p.path[-1] == "kernel"


def run_fsdp_and_reference(mesh, tx, steps=3):
    """The FSDP trajectory and the unsharded one fed its gradients, as logical params per step."""
    model = make_net()
    fsdp = FSDP(model, mesh)
    state = fsdp.init(model, tx)
    grads_fn = fsdp.loss_and_grads(loss_fn)
    step = fsdp.train_step(loss_fn, tx)
    ref = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    ref = {k: v for k, v in fsdp.from_param_tree(ref).items()}  # the trained ones, by name
    ref_tree = fsdp.param_tree(ref)
    ref_opt = tx.init(ref_tree)
    got, want = [], []
    for i in range(steps):
        batch = make_batch(i)
        _, grads = grads_fn(state, batch)
        g = fsdp.param_tree(logical(fsdp, grads))
        updates, ref_opt = tx.update(g, ref_opt, ref_tree)
        ref_tree = optax.apply_updates(ref_tree, updates)
        state, _ = step(state, batch)
        got.append(logical(fsdp, state.master))
        want.append({k: np.asarray(v) for k, v in fsdp.from_param_tree(ref_tree).items()})
    return fsdp, state, got, want


def assert_trajectories_equal(got, want, rtol=2e-6):
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys()
        for k in w:
            np.testing.assert_allclose(g[k], w[k], rtol=rtol, atol=1e-7, err_msg=f"step {i} {k}")


def max_difference(a, b):
    return max(float(np.abs(a[-1][k] - b[-1][k]).max()) for k in a[-1])


def test_param_tree_has_the_models_paths(mesh):
    model = make_net()
    fsdp = FSDP(model, mesh)
    state = fsdp.init(model, optax.sgd(0.1))
    trained = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    del trained["perm"]  # integer: frozen, not the optimizer's
    assert jax.tree.structure(fsdp.param_tree(state.master)) == jax.tree.structure(trained)
    kinds = {p.name: p.kind for p in fsdp.params}
    assert kinds["l1/kernel"] == kinds["l2/kernel"] == "mxfp8"
    assert kinds["temperature"] == "plain" and kinds["perm"] == "frozen"
    # every optimizer moment is sharded like its parameter
    state = fsdp.init(model, optax.adam(1e-3))
    mu = state.opt_state[0].mu
    for p in fsdp.trained:
        leaf = fsdp.from_param_tree(mu)[p.name]
        assert leaf.shape == p.stored_shape and leaf.sharding == fsdp.master_sharding(p), p.name


def test_adamw_mask_by_path(mesh):
    wd = dict(learning_rate=1e-2, weight_decay=0.5)
    mask = lambda params: jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key == "kernel", params)
    fsdp, _, got, want = run_fsdp_and_reference(mesh, optax.adamw(**wd, mask=mask))
    assert_trajectories_equal(got, want)
    _, _, unmasked, _ = run_fsdp_and_reference(mesh, optax.adamw(**wd))
    # the mask matters: after the first step the kernels agree, the biases (not decayed) do not
    assert float(np.abs(unmasked[0]["l1/bias"] - got[0]["l1/bias"]).max()) > 1e-3
    np.testing.assert_allclose(unmasked[0]["l1/kernel"], got[0]["l1/kernel"], rtol=1e-6)


def test_multi_transform_two_labels(mesh):
    labels = lambda params: jax.tree_util.tree_map_with_path(
        lambda path, _: "matrices" if path[-1].key == "kernel" else "vectors", params
    )
    tx = optax.multi_transform({"matrices": optax.adam(1e-2), "vectors": optax.sgd(0.5)}, labels)
    _, _, got, want = run_fsdp_and_reference(mesh, tx)
    assert_trajectories_equal(got, want)
    _, _, one, _ = run_fsdp_and_reference(mesh, optax.adam(1e-2))
    assert abs(max_difference(got, one)) > 1e-3


def test_clip_by_global_norm(mesh):
    tx = optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.5))
    _, _, got, want = run_fsdp_and_reference(mesh, tx)
    assert_trajectories_equal(got, want, rtol=1e-5)
    _, _, unclipped, _ = run_fsdp_and_reference(mesh, optax.sgd(0.5))
    assert max_difference(got, unclipped) > 1e-3


def test_stepping_with_another_optimizer_is_an_error(mesh):
    model = make_net()
    fsdp = FSDP(model, mesh)
    state = fsdp.init(model, optax.sgd(0.1))
    with pytest.raises(ValueError, match="not initialised by the tx given to train_step"):
        fsdp.train_step(loss_fn, optax.adam(1e-3))(state, make_batch())


def test_scalar_and_integer_params_against_one_device(mesh, devices):
    """The 0-D temperature trains (its gradient summed over devices), the int table stays."""
    model = make_net()
    grads = {}
    for name, m in (("all", mesh), ("1", Mesh(np.array(devices[:1]), ("fsdp",)))):
        fsdp = FSDP(model, m)
        _, g = fsdp.loss_and_grads(loss_fn)(fsdp.init(model, optax.sgd(0.1)), make_batch())
        grads[name] = logical(fsdp, g)
    assert grads["all"].keys() == grads["1"].keys() and "perm" not in grads["all"]
    assert abs(float(grads["1"]["temperature"])) > 1e-3
    for k in grads["1"]:
        np.testing.assert_allclose(grads["all"][k], grads["1"][k], rtol=2e-5, atol=1e-7, err_msg=k)

    fsdp = FSDP(model, mesh)
    tx = optax.sgd(0.1)
    state = fsdp.init(model, tx)
    state, _ = fsdp.train_step(loss_fn, tx)(state, make_batch())
    out = fsdp.gather(state)
    np.testing.assert_array_equal(np.asarray(out.perm.get_value()), np.asarray(model.perm.get_value()))
    assert out.perm.get_value().dtype == jnp.int32
    np.testing.assert_allclose(
        float(out.temperature.get_value()), 1.5 - 0.1 * float(grads["all"]["temperature"]), rtol=1e-6
    )


def test_has_aux_returns_the_losss_aux(mesh):
    model = make_net()
    fsdp = FSDP(model, mesh)
    tx = optax.sgd(0.1)
    with_aux = lambda m, b: (loss_fn(m, b), {"twice": 2 * loss_fn(m, b), "ones": jnp.ones(3)})
    state = fsdp.init(model, tx)
    (loss, aux), grads = fsdp.loss_and_grads(with_aux, has_aux=True)(state, make_batch())
    _, plain = fsdp.loss_and_grads(loss_fn)(state, make_batch())
    np.testing.assert_allclose(float(aux["twice"]), 2 * float(loss), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(aux["ones"]), np.ones(3))
    for k in plain:
        np.testing.assert_array_equal(np.asarray(grads[k]), np.asarray(plain[k]), err_msg=k)
    state2, loss2, aux2 = fsdp.train_step(with_aux, tx, has_aux=True)(state, make_batch())
    assert float(loss2) == float(loss) and float(aux2["twice"]) == float(aux["twice"])
    with pytest.raises(ValueError, match="has_aux=True"):
        fsdp.train_step(with_aux, tx)(state2, make_batch())
    with pytest.raises(ValueError, match=r"loss_fn must return \(loss, aux\)"):
        fsdp.loss_and_grads(loss_fn, has_aux=True)(state2, make_batch())
    # any leaf, as the loss computed it on the whole batch (an integer count included)
    (_, count), _ = fsdp.loss_and_grads(lambda m, b: (loss_fn(m, b), jnp.int32(len(b[0]))), has_aux=True)(
        state2, make_batch()
    )
    assert count.dtype == jnp.int32 and int(count) == len(make_batch()[0])


def test_asking_for_a_step_again_reuses_its_compiled_program(mesh, caplog):
    """``loss_and_grads`` / ``eval_step`` / ``train_step`` asked again for the same loss (and
    optimizer), as a loop that builds its step each iteration does, run the program compiled
    the first time; another loss or optimizer compiles its own."""
    model = make_net()
    fsdp = FSDP(model, mesh)
    tx = optax.sgd(0.1)
    state = fsdp.init(model, tx)

    def compiles(run):
        caplog.clear()
        with jax.log_compiles(True), caplog.at_level(logging.WARNING):
            out = run()
        return out, [r.getMessage() for r in caplog.records if "Finished XLA compilation" in r.getMessage()]

    for make in (lambda: fsdp.loss_and_grads(loss_fn), lambda: fsdp.eval_step(loss_fn)):
        first, compiled = compiles(lambda: make()(state, make_batch()))
        assert compiled
        again, compiled = compiles(lambda: make()(state, make_batch()))
        assert compiled == [] and jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), first, again))
    (state, _), compiled = compiles(lambda: fsdp.train_step(loss_fn, tx)(state, make_batch()))
    assert compiled
    (state, _), compiled = compiles(lambda: fsdp.train_step(loss_fn, tx)(state, make_batch()))
    assert compiled == []
    _, compiled = compiles(lambda: fsdp.loss_and_grads(lambda m, b: 2 * loss_fn(m, b))(state, make_batch()))
    assert compiled


def test_state_of_another_mesh_is_named(mesh, devices):
    """A state made on the n devices, handed to the plan of n/2: l1's 64 rows are padded
    otherwise. It needs 4 devices: on 2, 64 rows are 2 blocks, one each, and one device stores
    them alike."""
    need_devices(4)
    n = len(devices)
    model = make_net()
    state = FSDP(model, mesh).init(model, optax.sgd(0.1))
    other = FSDP(model, Mesh(np.array(devices[: n // 2]), ("fsdp",)))
    here, there = rows_per_device(HIDDEN, n) * n, rows_per_device(HIDDEN, n // 2) * (n // 2)
    assert here != there
    with pytest.raises(
        ValueError,
        match=rf"not a state of this FSDP plan.*l1/kernel: \({here}, {IN}\) float32, the plan stores \({there}, {IN}\)",
    ):
        other.gather(state)


def test_state_of_another_plan_and_consumed_state(mesh):
    model = make_net()
    fsdp = FSDP(model, mesh)
    tx = optax.sgd(0.1)
    state = fsdp.init(model, tx)
    with pytest.raises(
        ValueError, match=r"MXFP8 planes for \['l1/kernel', 'l2/kernel'\].*are \[\] \(precision='bf16'\)"
    ):
        FSDP(model, mesh, precision="bf16").gather(state)
    with pytest.raises(TypeError, match="state must be a TrainState"):
        fsdp.gather(state.master)
    step = fsdp.train_step(loss_fn, tx)
    new, _ = step(state, make_batch())
    with pytest.raises(ValueError, match="consumed by an earlier step"):
        step(state, make_batch())
    step(new, make_batch())  # the returned state is the one to use
