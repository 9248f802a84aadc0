"""MXFP8 FSDP training of a Flax NNX model on all of the run's devices (``n`` of them).

Oracles are independent of the code under test: the single-device reference below quantizes and
dequantizes each kernel with the numpy oracle and differentiates its own custom_vjp linear
(forward with the rowwise values, dgrad with the columnwise ones, fp32 wgrad); the HLO is read
with ``mxfp8_jax._src.compiled.hlo``, whose parser has its own tests (test_cli.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh

from mxfp8_jax._src.compiled import hlo
from mxfp8_jax.flax import FSDP, Linear

import numpy_oracle as npo
from conftest import as_bytes, rows_per_device

IN, HIDDEN, CLASSES, BATCH = 32, 64, 10, 64


class Net(nnx.Module):
    """Two eligible kernels ([32, 64], [64, 64]); the [64, 10] head, biases and norm are plain."""

    def __init__(self, dtype, rngs):
        self.l1 = Linear(IN, HIDDEN, dtype=dtype, rngs=rngs)
        self.l2 = Linear(HIDDEN, HIDDEN, dtype=dtype, rngs=rngs)
        self.norm = nnx.LayerNorm(HIDDEN, rngs=rngs)
        self.head = Linear(HIDDEN, CLASSES, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        h = jax.nn.gelu(self.l1(x))
        return self.head(self.norm(jax.nn.gelu(self.l2(h))))


def make_net(dtype, *, wide_range=False, seed=0):
    """``Net`` with host-drawn weights (eager jax.random would compile a program per shape).

    ``wide_range``: l2's odd input features get weights 2^-17 times smaller. Rowwise blocks of
    ``W2 = kernel.T`` (along ``in``) then mix magnitudes and round those weights to (almost) zero,
    while columnwise blocks (along ``out``) keep them: a dgrad through the wrong plane shows up in
    l1's gradient for those features.
    """
    model = nnx.eval_shape(lambda: Net(dtype, nnx.Rngs(0)))
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(nnx.state(model)):
        shape = var.get_value().shape
        if path[-1] == "kernel":
            value = rng.standard_normal(shape) / np.sqrt(shape[0])
            if wide_range and path[0] == "l2":
                value[1::2] *= 2.0**-17
        else:
            value = rng.uniform(0.5, 1.5, shape) if path[-1] == "scale" else 0.1 * rng.standard_normal(shape)
        var.set_value(jnp.asarray(value, jnp.float32))
    return model


def loss_fn(model, batch):
    x, y = batch
    logits = model(x).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def make_batch(seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BATCH, IN)).astype(np.float32)
    y = ((x[:, 0] > 0).astype(np.int32) + 2 * (x[:, 1] > 0)).astype(np.int32)
    return x, y


@pytest.fixture(scope="module")
def mesh(devices):
    return Mesh(np.array(devices), ("data",))


def params_of(model):
    return {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def oracle_planes(kernel):
    """Numpy-oracle planes of ``W = kernel.T`` ([out, in]: rowwise blocks along in)."""
    return npo.quantize(np.asarray(kernel, np.float32).T)


def mxfp8_kernels(kernel):
    """The kernel ``[in, out]`` as the forward GEMM reads it (rowwise values of W) and as the
    dgrad reads it (columnwise values), from the numpy oracle."""
    row, col = npo.mxfp8_weights(np.asarray(kernel, np.float32).T)
    return row.T.astype(np.float32), col.T.astype(np.float32)


# ------------------------------------------------------------------------------------------------
# Single-device reference of the same math


@jax.custom_vjp
def reference_linear(x, k_fwd, k_bwd):  # kernels [in, out]
    return x @ k_fwd


reference_linear.defvjp(
    lambda x, k_fwd, k_bwd: (x @ k_fwd, (x, k_bwd)),
    lambda res, dy: (dy @ res[1].T, res[0].T @ dy, None),
)


def reference_loss(kernels, plain, batch):
    """``Net``'s loss on one device; ``kernels`` maps l1/l2 to (forward, dgrad) kernels."""
    (k1f, k1b), (k2f, k2b) = kernels["l1/kernel"], kernels["l2/kernel"]
    x, y = batch
    h = jax.nn.gelu(reference_linear(x, k1f, k1b) + plain["l1/bias"])
    h = jax.nn.gelu(reference_linear(h, k2f, k2b) + plain["l2/bias"])
    mu = h.mean(-1, keepdims=True)
    var = ((h - mu) ** 2).mean(-1, keepdims=True)
    h = (h - mu) * jax.lax.rsqrt(var + 1e-6) * plain["norm/scale"] + plain["norm/bias"]
    logits = h @ plain["head/kernel"] + plain["head/bias"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@jax.jit
def reference_grads(kernels, plain, batch):
    """Loss and gradients keyed like ``params_of`` (kernel gradients are the forward kernels')."""

    def loss(fwd, plain):
        return reference_loss({k: (fwd[k], kernels[k][1]) for k in fwd}, plain, batch)

    fwd = {k: v[0] for k, v in kernels.items()}
    value, (gk, gp) = jax.value_and_grad(loss, argnums=(0, 1))(fwd, plain)
    return value, {**gk, **gp}


def column_errors(got, ref):
    """max |got - ref| per column, in units of that column's max |ref| (vectors: one column)."""
    got, ref = np.atleast_2d(np.asarray(got).T).T, np.atleast_2d(np.asarray(ref).T).T
    return np.abs(got - ref).max(0) / np.maximum(np.abs(ref).max(0), 1e-30)


def grads_by_name(fsdp, grads):
    return {p.name: np.asarray(fsdp.to_logical(p, grads[p.name])) for p in fsdp.trained}


@pytest.fixture(scope="module")
def f32_setup(mesh):
    model = make_net(jnp.float32, wide_range=True)
    fsdp = FSDP(model, mesh)
    state = fsdp.init(model, optax.sgd(0.1))
    return model, fsdp, state


def test_plan_eligibility(f32_setup):
    _, fsdp, _ = f32_setup
    assert [p.name for p in fsdp.units] == ["l1/kernel", "l2/kernel"]
    g1, g2 = (p.unit for p in fsdp.units)
    # W = kernel.T [out, in]; 64 rows are 2 blocks of 32, padded to the same number of whole
    # blocks on each of the n devices: one each (2 or more devices)
    n = fsdp.mesh.size
    rows = rows_per_device(HIDDEN, n)
    padded = rows * n
    assert (g1.out_features, g1.in_features, g1.out_padded, g1.rows) == (HIDDEN, IN, padded, rows)
    assert (g2.out_features, g2.in_features, g2.out_padded, g2.rows) == (HIDDEN, HIDDEN, padded, rows)
    assert fsdp.weight_elements == IN * HIDDEN + HIDDEN * HIDDEN
    assert fsdp.stored_elements == padded * (IN + HIDDEN)
    plain = {p.name for p in fsdp.plain}
    assert plain == {"l1/bias", "l2/bias", "norm/scale", "norm/bias", "head/kernel", "head/bias"}


def test_init_round_trip_and_quantized_planes(f32_setup):
    model, fsdp, state = f32_setup
    before = params_of(model)
    after = params_of(fsdp.gather(state))
    assert before.keys() == after.keys()
    for k in before:
        np.testing.assert_array_equal(as_bytes(after[k]), as_bytes(before[k]), err_msg=k)
    for p in fsdp.units:
        # the master is W = kernel.T with zero rows below out; the planes its oracle quantization
        master = np.asarray(state.master[p.name])
        np.testing.assert_array_equal(master[: p.unit.out_features], before[p.name].T)
        assert not master[p.unit.out_features :].any()
        want = oracle_planes(before[p.name])
        q = state.quantized[p.name]
        out = p.unit.out_features
        got = {
            "rowwise_data": np.asarray(q.rowwise_data)[:out],
            "rowwise_scale": np.asarray(q.rowwise_scale)[:out],
            "columnwise_data": np.asarray(q.columnwise_data)[:out],
            "columnwise_scale": np.asarray(q.columnwise_scale)[: out // 32],
        }
        for plane, v in want.items():
            np.testing.assert_array_equal(as_bytes(got[plane]), as_bytes(v), err_msg=f"{p.name} {plane}")


def test_sharded_gradients_match_single_device_reference(f32_setup):
    """fp32 compute: the only differences are fp32 summation order (batch split, psum_scatter)."""
    model, fsdp, state = f32_setup
    batch = make_batch()
    loss, grads = fsdp.loss_and_grads(loss_fn)(state, batch)
    params = params_of(model)
    kernels = {k: mxfp8_kernels(params[k]) for k in ("l1/kernel", "l2/kernel")}
    plain = {k: v for k, v in params.items() if k not in kernels}
    ref_loss, ref = reference_grads(kernels, plain, batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    got = grads_by_name(fsdp, grads)
    assert got.keys() == ref.keys()
    # padding rows of the masters receive exactly zero
    for p in fsdp.units:
        assert not np.asarray(grads[p.name])[p.unit.out_features :].any()
    tol = 1e-5
    for k in ref:
        err = column_errors(got[k], ref[k])
        assert err.max() < tol, (k, err.max())

    # The tolerance separates the planes: l1's gradient for the features whose l2 weights only
    # the columnwise plane keeps is far off when the dgrad reads the rowwise plane.
    wrong_kernels = {k: (v[0], v[0]) for k, v in kernels.items()}
    _, wrong = reference_grads(wrong_kernels, plain, batch)
    err = column_errors(wrong["l1/kernel"], ref["l1/kernel"])
    assert err[1::2].min() > 100 * tol and err[0::2].max() < 1e-2


# ------------------------------------------------------------------------------------------------
# The jitted train step: HLO and training


@pytest.fixture(scope="module")
def bf16_training(mesh):
    model = make_net(jnp.bfloat16)
    fsdp = FSDP(model, mesh)
    tx = optax.adam(1e-2)
    state = fsdp.init(model, tx)
    batch = make_batch()
    compiled = fsdp.lower_train_step(loss_fn, tx, state, batch).compile()
    return fsdp, state, batch, compiled


def test_step_hlo_moves_weights_as_8_bit(bf16_training):
    fsdp, _, _, compiled = bf16_training
    n = fsdp.mesh.size
    found = [(c.op, c.dtypes[0], c.outputs[0][1]) for c in hlo.collectives(compiled.as_text())]
    # The plain parameters (without a trace the head's [64, 10] kernel is plain): one that the
    # device count divides along an axis is split; the others are whole on every device.
    plain = {
        "l1/bias": (HIDDEN,),
        "l2/bias": (HIDDEN,),
        "norm/scale": (HIDDEN,),
        "norm/bias": (HIDDEN,),
        "head/kernel": (HIDDEN, CLASSES),
        "head/bias": (CLASSES,),
    }
    split = {k for k, shape in plain.items() if any(d % n == 0 for d in shape)}
    assert {p.name for p in fsdp.plain} == set(plain)
    assert {p.name for p in fsdp.plain if p.shard_axis is not None} == split
    # the split ones travel as fp32, each where the op that reads it with the layer's activation runs
    gathers = sorted((d, s) for op, d, s in found if op == "all-gather")
    want = [("f32", plain[k]) for k in split]
    for p in fsdp.units:
        g = p.unit
        want += [("u8", (g.out_padded, g.in_features)), ("u8", (g.out_padded, g.in_features // 32))]  # forward
        if p.name != "l1/kernel":  # l1's input is the data: it needs no dgrad, XLA drops its gather
            want += [("u8", (g.out_padded, g.in_features)), ("u8", (g.out_padded // 32, g.in_features))]
    assert gathers == sorted(want)
    # Gradients: one reduce-scatter per unit into its rows, one per split plain parameter.
    scatters = sorted((d, s) for op, d, s in found if op == "reduce-scatter")
    split_shape = lambda shape: tuple(
        d // n if a == next(a for a, d in enumerate(shape) if d % n == 0) else d for a, d in enumerate(shape)
    )
    assert scatters == sorted(
        [("f32", split_shape(plain[k])) for k in split]
        + [("f32", (p.unit.rows, p.unit.in_features)) for p in fsdp.units]
    )
    # Nothing else but the scalar loss mean and the gradients of the parameters kept whole on
    # every device (head/bias, 10 elements, unless the device count divides 10); no weight
    # reshuffles.
    others = [c for c in hlo.collectives(compiled.as_text()) if c.op not in ("all-gather", "reduce-scatter")]
    assert [c.op for c in others] == ["all-reduce"] * len(others)
    whole = [("f32", plain[k]) for k in plain if k not in split]
    assert sorted(o for c in others for o in c.outputs) == sorted([("f32", ())] + whole)


def test_quantize_after_update_has_no_collective(bf16_training):
    fsdp, state, _, _ = bf16_training
    text = fsdp._layout.quantize_fn.lower(state.master).compile().as_text()
    assert hlo.collectives(text) == []


def test_training_decreases_loss_and_keeps_planes_in_sync(bf16_training):
    fsdp, state, batch, compiled = bf16_training
    state = jax.tree.map(jnp.copy, state)  # the step donates its input
    losses = []
    for _ in range(12):
        state, loss = compiled(state, fsdp.place_batch(batch))
        losses.append(float(loss))
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.5 * losses[0], losses
    assert int(state.step) == 12
    # Invariant: all four planes are the (oracle) quantization of the updated master.
    for p in fsdp.units:
        master = np.asarray(state.master[p.name])
        want = npo.quantize(master)
        q = state.quantized[p.name]
        for plane, v in want.items():
            np.testing.assert_array_equal(as_bytes(getattr(q, plane)), as_bytes(v), err_msg=f"{p.name} {plane}")


# ------------------------------------------------------------------------------------------------
# Errors


def test_errors_name_the_rule(mesh):
    class NoEligible(nnx.Module):
        def __init__(self, rngs):
            self.l = Linear(30, 10, rngs=rngs)

    abstract = lambda cls: nnx.eval_shape(lambda: cls(nnx.Rngs(0)))  # FSDP reads only structure
    with pytest.raises(ValueError, match="no eligible weight.*multiples of 32"):
        FSDP(abstract(NoEligible), mesh)
    net = nnx.eval_shape(lambda: Net(jnp.float32, nnx.Rngs(0)))
    with pytest.raises(ValueError, match="precision='fp8'"):
        FSDP(net, mesh, precision="fp8")
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        FSDP(net, "data")
    with pytest.raises(ValueError, match="loss_fn and example_batch go together"):
        FSDP(net, mesh, loss_fn=loss_fn)
    with pytest.raises(ValueError, match=r"precision_by_path\['head'\]='fp8' must be one of"):
        FSDP(net, mesh, precision_by_path={"head": "fp8"})


def test_batch_must_split_over_devices(f32_setup):
    _, fsdp, _ = f32_setup
    x, y = make_batch()
    n = fsdp.mesh.size
    rows = BATCH - n // 2  # not a multiple of n (60 for 8 devices)
    with pytest.raises(ValueError, match=rf"shape \({rows}, {IN}\).*divisible by the {n} devices it is split over"):
        fsdp.place_batch((x[:rows], y[:rows]))


def custom_dot(lhs, rhs, dims, precision=None, preferred_element_type=None, out_sharding=None):
    return jax.lax.dot_general(lhs, rhs, dims, precision=precision)


def test_which_layers_are_units(mesh):
    class M(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(32, 64, rngs=rngs)  # a unit
            self.b = nnx.Linear(64, 48, rngs=rngs)  # 48 is not a multiple of 32: plain
            self.c = nnx.Linear(48, 32, dot_general=custom_dot, rngs=rngs)  # the user's own GEMM: plain
            self.d = nnx.split_rngs(splits=3)(nnx.vmap(lambda r: nnx.Linear(32, 32, rngs=r), in_axes=(0,)))(rngs)

    fsdp = FSDP(nnx.eval_shape(lambda: M(nnx.Rngs(0))), mesh)
    assert [(p.name, p.stack) for p in fsdp.units] == [("a/kernel", ()), ("d/kernel", (3,))]
    assert {p.name for p in fsdp.plain} == {
        "a/bias",
        "b/kernel",
        "b/bias",
        "c/kernel",
        "c/bias",
        "d/bias",
    }


def test_misused_units_raise_clear_errors(mesh):
    class Ensemble(nnx.Module):  # a stacked layer applied by nnx.vmap over its stack, not scanned
        def __init__(self, rngs):
            self.l = nnx.split_rngs(splits=2)(nnx.vmap(lambda r: nnx.Linear(32, 32, rngs=r), in_axes=(0,)))(rngs)

        def __call__(self, x):
            return nnx.vmap(lambda layer, x: layer(x), in_axes=(0, None))(self.l, x)

    x = np.ones((2 * mesh.size, 32), np.float32)  # a batch the devices split
    loss = lambda m, x: m(x).mean()
    # without a trace, the plan takes the stacked kernel for one layer per scan iteration
    model = Ensemble(nnx.Rngs(0))
    fsdp = FSDP(model, mesh)
    with pytest.raises(
        ValueError,
        match=r"l/kernel \[2, 32, 32\]: the FSDP plan keeps it as a mxfp8 unit.*"
        r"read with 0 layer axes sliced off by scans, where the plan has 1.*example_batch",
    ):
        fsdp.loss_and_grads(loss)(fsdp.init(model, optax.sgd(0.1)), x)
    # traced, the plan follows the loss: vmap of x @ kernel over the kernels alone is one GEMM
    # whose N spans the stack and the outputs (2 x 32)
    fsdp = FSDP(model, mesh, loss_fn=loss, example_batch=x)
    (unit,) = fsdp.units
    g = unit.unit
    assert (g.level, g.batch_axes, g.n_axes, g.k_axes, g.out_features, g.in_features) == (0, (), (0, 2), (1,), 64, 32)
    loss_value, _ = fsdp.loss_and_grads(loss)(fsdp.init(model, optax.sgd(0.1)), x)
    assert np.isfinite(float(loss_value))

    class VectorLoss(nnx.Module):
        def __init__(self, rngs):
            self.l = nnx.Linear(32, 32, rngs=rngs)

        def __call__(self, x):
            return self.l(x)

    model = VectorLoss(nnx.Rngs(0))
    fsdp = FSDP(model, mesh)
    with pytest.raises(ValueError, match="loss_fn must return a scalar"):
        fsdp.loss_and_grads(lambda m, x: m(x).mean(0))(fsdp.init(model, optax.sgd(0.1)), x)
