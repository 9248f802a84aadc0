"""MXFP8 FSDP training of a Flax NNX model on 8 simulated CPU devices.

Oracles are independent of the code under test: the single-device reference below quantizes each
kernel with ``mx.quantize`` and differentiates its own custom_vjp linear (forward with the rowwise
dequantized weight, dgrad with the columnwise one, fp32 wgrad); the HLO is parsed here with its
own regular expression.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import as_bytes
from flax import nnx
from jax.sharding import Mesh

import mxfp8_jax as mx
from mxfp8_jax.flax import FSDP, Linear

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
def mesh(cpu_devices):
    return Mesh(np.array(cpu_devices), ("data",))


def params_of(model):
    return {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


# ------------------------------------------------------------------------------------------------
# Single-device reference of the same math


def reference_loss_and_grads(params, batch, *, dgrad_plane="columnwise"):
    """Loss and gradients (keyed like ``params_of``) on one device, written out independently."""

    @jax.custom_vjp
    def linear(x, k_fwd, k_bwd):  # kernels [in, out]
        return x @ k_fwd

    linear.defvjp(
        lambda x, k_fwd, k_bwd: (x @ k_fwd, (x, k_bwd)),
        lambda res, dy: (dy @ res[1].T, res[0].T @ dy, None),
    )

    def planes(k):
        t = mx.quantize(k.T)  # [out, in]: rowwise blocks along in
        row = mx.dequantize(t, dtype=jnp.float32).T
        col = mx.dequantize(t, columnwise=True, dtype=jnp.float32).T
        return row, (col if dgrad_plane == "columnwise" else row)

    (k1f, k1b), (k2f, k2b) = planes(params["l1/kernel"]), planes(params["l2/kernel"])
    plain = {k: v for k, v in params.items() if k not in ("l1/kernel", "l2/kernel")}

    def loss(k1f, k2f, plain):
        x, y = batch
        h = jax.nn.gelu(linear(x, k1f, k1b) + plain["l1/bias"])
        h = jax.nn.gelu(linear(h, k2f, k2b) + plain["l2/bias"])
        mu = h.mean(-1, keepdims=True)
        var = ((h - mu) ** 2).mean(-1, keepdims=True)
        h = (h - mu) * jax.lax.rsqrt(var + 1e-6) * plain["norm/scale"] + plain["norm/bias"]
        logits = h @ plain["head/kernel"] + plain["head/bias"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    value, (g1, g2, gp) = jax.value_and_grad(loss, argnums=(0, 1, 2))(k1f, k2f, plain)
    return value, {"l1/kernel": g1, "l2/kernel": g2, **gp}


@jax.jit
def references(params, batch):
    """The reference with the columnwise dgrad plane, and the gradients with the rowwise one."""
    right = reference_loss_and_grads(params, batch)
    return right, reference_loss_and_grads(params, batch, dgrad_plane="rowwise")[1]


def column_errors(got, ref):
    """max |got - ref| per column, in units of that column's max |ref| (vectors: one column)."""
    got, ref = np.atleast_2d(np.asarray(got).T).T, np.atleast_2d(np.asarray(ref).T).T
    return np.abs(got - ref).max(0) / np.maximum(np.abs(ref).max(0), 1e-30)


@pytest.fixture(scope="module")
def f32_setup(mesh):
    model = make_net(jnp.float32, wide_range=True)
    fsdp = FSDP(model, mesh)
    state = fsdp.init(model, optax.sgd(0.1))
    return model, fsdp, state


def test_plan_eligibility(f32_setup):
    _, fsdp, _ = f32_setup
    eligible = {fsdp.params[j].name for j in fsdp.eligible}
    assert eligible == {"l1/kernel", "l2/kernel"}
    assert fsdp.layout.tensor_shapes == ((HIDDEN, IN), (HIDDEN, HIDDEN))  # [out, in]
    assert fsdp.layout.block_size == 32 and fsdp.master_placements == (mx.BlockAtomic(32),)


def test_init_round_trip_and_quantized_planes(f32_setup):
    model, fsdp, state = f32_setup
    before = params_of(model)
    after = params_of(fsdp.gather(state))
    assert before.keys() == after.keys()
    for k in before:
        np.testing.assert_array_equal(as_bytes(after[k]), as_bytes(before[k]), err_msg=k)
    # The quantized planes are the single-device quantization of each kernel.T, byte for byte.
    full = state.quantized.allgather()
    for i, name in enumerate(("l1/kernel", "l2/kernel")):
        want = mx.quantize(jnp.asarray(before[name]).T)
        got = full.get_tensor_view(i)
        for plane in ("rowwise_data", "rowwise_scale", "columnwise_data", "columnwise_scale"):
            np.testing.assert_array_equal(as_bytes(getattr(got, plane)), as_bytes(getattr(want, plane)), err_msg=f"{name} {plane}")


def test_sharded_gradients_match_single_device_reference(f32_setup):
    """fp32 compute: the only differences are fp32 summation order (batch split, psum_scatter)."""
    model, fsdp, state = f32_setup
    batch = make_batch()
    loss, g_master, g_plain = fsdp.loss_and_grads(loss_fn)(state, batch)
    params = params_of(model)
    (ref_loss, ref), wrong = references(params, batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)

    got = {}
    for j, g in zip(fsdp.eligible, g_master.get_tensors()):
        got[fsdp.params[j].name] = np.asarray(g).T
    for j, g in zip(fsdp.others, g_plain.get_tensors()):
        got[fsdp.params[j].name] = np.asarray(g)
    assert got.keys() == ref.keys()
    tol = 1e-5
    for k in ref:
        err = column_errors(got[k], ref[k])
        assert err.max() < tol, (k, err.max())

    # The tolerance separates the planes: l1's gradient for the features whose l2 weights only
    # the columnwise plane keeps is far off when the dgrad reads the rowwise plane.
    err = column_errors(wrong["l1/kernel"], ref["l1/kernel"])
    assert err[1::2].min() > 100 * tol and err[0::2].max() < 1e-2


# ------------------------------------------------------------------------------------------------
# The jitted train step: HLO and training


_COLLECTIVE = re.compile(r"= (\S+|\([^=]*\)) (all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute)(?:-start)?\(")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")


def collectives_in(hlo):
    out = []
    for m in _COLLECTIVE.finditer(hlo):
        for dtype, dims in _ARRAY.findall(m.group(1)):
            out.append((m.group(2), dtype, tuple(int(d) for d in dims.split(",") if d)))
    return out


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
    found = collectives_in(compiled.as_text())
    phys, plain = fsdp.layout.physical_size, fsdp.plain_layout.physical_size
    gathers = sorted((d, s) for op, d, s in found if op == "all-gather")
    # Forward: rowwise data + scales; backward: columnwise data + scales; plain params in fp32.
    assert gathers == sorted([("u8", (phys,)), ("u8", (phys // 32,))] * 2 + [("f32", (plain,))])
    # Gradients: one reduce-scatter of each flat fp32 buffer into its shard.
    scatters = sorted((d, s) for op, d, s in found if op == "reduce-scatter")
    assert scatters == sorted([("f32", (phys // 8,)), ("f32", (plain // 8,))])
    # Nothing else but the scalar loss mean: no all-reduce of gradients, no weight reshuffles.
    others = [(op, d, s) for op, d, s in found if op not in ("all-gather", "reduce-scatter")]
    assert others == [("all-reduce", "f32", ())]


def test_quantize_after_update_has_no_collective(bf16_training):
    fsdp, state, _, _ = bf16_training
    hlo = jax.jit(lambda m: fsdp._quantize(state.quantized, m)).lower(state.master).compile().as_text()
    assert collectives_in(hlo) == []


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
    # Invariant: the quantized planes are the quantization of the updated master.
    full = state.quantized.allgather()
    for i, w in enumerate(state.master.get_tensors()):
        want, got = mx.quantize(w), full.get_tensor_view(i)
        np.testing.assert_array_equal(as_bytes(got.rowwise_data), as_bytes(want.rowwise_data))
        np.testing.assert_array_equal(as_bytes(got.columnwise_scale), as_bytes(want.columnwise_scale))


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

    class WithDropout(nnx.Module):
        def __init__(self, rngs):
            self.l = Linear(32, 32, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)

    with pytest.raises(ValueError, match="other than nnx.Param"):
        FSDP(abstract(WithDropout), mesh)


def test_batch_must_split_over_devices(f32_setup):
    _, fsdp, _ = f32_setup
    x, y = make_batch()
    with pytest.raises(ValueError, match=r"shape \(60, 32\).*divisible by the mesh's 8 devices"):
        fsdp.place_batch((x[:60], y[:60]))
