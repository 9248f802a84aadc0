"""FSDP at the scale and in the idioms of real training, on the run's devices (``n`` of them).

Stacks of ``flax.nnx.Linear`` (and ``mxfp8_jax.flax.Linear``) layers written three ways: blocks
stacked with ``nnx.vmap`` and run with ``nnx.scan``, the same under ``nnx.remat``, and a Python
loop over a list of blocks. Memory and communication are read from the compiled step
(``memory_analysis()``, HLO collectives with their loops); gradients are compared with an
independent single-device reference whose weights the numpy oracle quantized.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh

from mxfp8_jax._src.compiled import hlo
from mxfp8_jax.flax import FSDP, Linear

import numpy_oracle as npo
from conftest import cpu_only, rows_per_device

MODES = ("scan", "remat", "remat-dots", "loop")


class Block(nnx.Module):
    def __init__(self, d, *, layer, bias, residual=True, rngs):
        self.residual = residual
        if layer == "nnx":
            self.l = nnx.Linear(d, d, use_bias=bias, rngs=rngs)
        else:
            self.l = Linear(d, d, use_bias=bias, dtype=jnp.bfloat16, rngs=rngs)

    def __call__(self, x):
        y = jnp.tanh(self.l(x)).astype(x.dtype)
        return x + y if self.residual else y


class Stack(nnx.Module):
    """``depth`` residual blocks, then an optional ``[d, 10]`` head (plain: 10 is not a multiple
    of 32)."""

    def __init__(self, d, depth, *, mode="scan", layer="nnx", bias=False, head=False, residual=True, rngs):
        self.mode = mode
        make = lambda r: Block(d, layer=layer, bias=bias, residual=residual, rngs=r)
        if mode == "loop":
            self.blocks = nnx.List([make(rngs) for _ in range(depth)])
        else:
            self.blocks = nnx.split_rngs(splits=depth)(nnx.vmap(make, in_axes=(0,), out_axes=0))(rngs)
        self.head = nnx.Linear(d, 10, rngs=rngs) if head else None

    def __call__(self, x):
        if self.mode == "loop":
            for block in self.blocks:
                x = block(x)
        else:
            body = lambda x, block: block(x)
            if self.mode == "remat":
                body = nnx.remat(body)
            elif self.mode == "remat-dots":  # a standard policy: GEMM outputs saved, the rest recomputed
                body = nnx.remat(body, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
            x = nnx.scan(body, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(x, self.blocks)
        return x if self.head is None else self.head(x)


def mse_loss(model, batch):
    x, y = batch
    return jnp.mean((model(x).astype(jnp.float32) - y) ** 2)


def ce_loss(model, batch):
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(model(x).astype(jnp.float32), y).mean()


@pytest.fixture(scope="module")
def mesh(devices):
    return Mesh(np.array(devices), ("data",))


def abstract(*args, **kwargs):
    return nnx.eval_shape(lambda: Stack(*args, **kwargs, rngs=nnx.Rngs(0)))


def compile_step(fsdp, loss_fn, d, batch=64, tx=None):
    """The compiled train step for abstract state and batch (nothing is materialised)."""
    tx = tx or optax.adam(1e-3)
    sds = jax.ShapeDtypeStruct
    b = (sds((batch, d), jnp.float32), sds((batch, d), jnp.float32))
    return fsdp.lower_train_step(loss_fn, tx, fsdp.abstract_state(tx), b).compile()


# ------------------------------------------------------------------------------------------------
# Memory: flat in depth


@pytest.mark.parametrize("layer", ["nnx", "mxfp8_jax"])
def test_step_memory_is_flat_in_depth(mesh, layer):
    """Scanned stacks of square 1024x1024 layers on the mesh's n devices (64 / n rows of the batch
    each), adam: the step's temp memory is what the step must hold, a fraction of the fp32 model
    (the old whole-model gather held 2.0x), and it grows with depth only by each layer's gradient
    shard and saved activations; gathered weights exist for one layer at a time."""
    cpu_only("temp bytes of XLA:CPU's memory_analysis()")
    n, d, batch, temps = mesh.size, 1024, 64, {}
    for depth in (16, 64):
        fsdp = FSDP(abstract(d, depth, layer=layer), mesh)
        temps[depth] = compile_step(fsdp, mse_loss, d, batch).memory_analysis().temp_size_in_bytes
    # Per layer the step must hold this device's fp32 gradient shard (d / n rows: 1024 is whole
    # 32-row blocks on every device) and the saved activations of its batch / n rows: the unit's
    # input (fp32) and the two residuals of jnp.tanh's VJP (its output and 1 - output, in the
    # layer's compute dtype: fp32 for nnx.Linear, bf16 for the bf16 mxfp8_jax Linear); once, two
    # layers' worth of fp32 working set (a gathered, dequantized unit and its neighbour). Nothing
    # the size of a layer may be held per layer or hoisted out of the loop (one such buffer is a
    # whole layer's fp32 bytes).
    layer_bytes, rows = d * d * 4, batch // n
    assert rows_per_device(d, n) * n == d
    tanh_bytes = 4 if layer == "nnx" else 2
    per_layer = layer_bytes / n + rows * d * (4 + 2 * tanh_bytes)
    for depth, temp in temps.items():
        budget = depth * per_layer + 2 * layer_bytes
        assert temp <= budget, (depth, temp / 2**20, budget / 2**20)
    # Growth with depth: at least the added gradient shards (they are temporaries of the step), at
    # most the added layers' holdings and the working set.
    growth = temps[64] - temps[16]
    assert (64 - 16) * layer_bytes / n <= growth <= (64 - 16) * per_layer + 2 * layer_bytes, growth / 2**20


# ------------------------------------------------------------------------------------------------
# Communication: per unit, inside the loop, 8-bit


def loop_collectives(text):
    """``{body: [collectives]}`` of the step's while loops and the collectives outside them."""
    found = hlo.collectives(text)
    bodies = {body for body, _ in hlo.while_loops(text)}
    inside = {b: [c for c in found if c.computation == b] for b in bodies}
    outside = [c for c in found if c.computation not in bodies]
    return inside, outside


def phases(text):
    """(forward loop collectives, backward loop collectives): the backward one reduce-scatters."""
    inside, outside = loop_collectives(text)
    assert len(inside) == 2, list(inside)
    (a, ca), (b, cb) = inside.items()
    fwd, bwd = (ca, cb) if not any(c.op == "reduce-scatter" for c in ca) else (cb, ca)
    return fwd, bwd, outside


def shapes(cs, op="all-gather"):
    return sorted((c.dtypes[0], c.outputs[0][1]) for c in cs if c.op == op)


@pytest.mark.parametrize("mode", ["scan", "remat"])
def test_scanned_step_gathers_one_layer_per_iteration(mesh, mode):
    d = 256
    texts = {}
    for depth in (4, 8):
        fsdp = FSDP(abstract(d, depth, mode=mode), mesh)
        texts[depth] = compile_step(fsdp, mse_loss, d).as_text()
    # The loop is kept: two loops (forward, backward) of `depth` iterations, the same program
    # text; under remat of `depth - 1` and `depth - 2`: the forward's last layer is peeled off,
    # and the backward's last (kept from the forward) and layer 0 (fsdp_fetch)
    for depth, text in texts.items():
        trips = [depth - 1, depth - 2] if mode == "remat" else [depth, depth]
        assert [trip for _, trip in hlo.while_loops(text)] == trips
    assert [(c.op, c.outputs) for c in hlo.collectives(texts[4])] == [
        (c.op, c.outputs) for c in hlo.collectives(texts[8])
    ]

    fwd, bwd, outside = phases(texts[8])
    # W [out, in] padded to whole 32-row blocks on each of the n devices (256 rows: no padding
    # up to 8 devices), gathered whole
    rows = rows_per_device(d, mesh.size)
    out = rows * mesh.size
    row = [("u8", (out, d)), ("u8", (out, d // 32))]  # rowwise codes [out, in] and scales [out, in/32]
    col = [("u8", (out, d)), ("u8", (out // 32, d))]  # columnwise codes and scales [out/32, in]
    assert shapes(fwd) == sorted(row)
    # backward: the columnwise planes for the dgrad (and, under remat, the recomputed forward's rowwise)
    assert shapes(bwd) == sorted(col + (row if mode == "remat" else []))
    # one fp32 reduce-scatter per unit and iteration, into this device's rows (256 / n)
    assert shapes(bwd, "reduce-scatter") == [("f32", (rows, d))]
    assert shapes(fwd, "reduce-scatter") == []
    # outside the loops: the scalar loss mean and the first layer's rowwise planes (each forward
    # iteration gathers the next layer's, double buffered, with or without remat); without
    # remat the last layer's columnwise ones too (each backward iteration gathers the layer
    # before's for the next: the handoff); under remat the backward's peeled layers: the last
    # (its recomputed forward takes the rowwise planes the forward kept; it gathers the
    # columnwise ones for its dgrad, and the layer before's rowwise ones for the loop) and
    # layer 0 (its recomputed forward takes the planes the loop's last iteration gathered, and
    # its dgrad, the batch's gradient, is not needed), a reduce-scatter each; no fp32 gather of
    # master weights
    planes = row + (col if mode == "scan" else col + row)
    peeled = [("reduce-scatter", (("f32", (rows, d)),))] * 2 if mode == "remat" else []
    assert sorted((c.op, c.outputs) for c in outside) == sorted(
        [("all-reduce", (("f32", ()),))] + [("all-gather", ((t, s),)) for t, s in planes] + peeled
    )
    assert all(c.dtypes == ("u8",) for c in fwd + bwd if c.op == "all-gather")


def test_scanned_gathers_move_half_the_bytes_of_bf16(mesh):
    d, depth = 256, 8
    per_phase = {}
    for precision in ("mxfp8", "bf16"):
        fsdp = FSDP(abstract(d, depth), mesh, precision=precision)
        fwd, bwd, _ = phases(compile_step(fsdp, mse_loss, d).as_text())
        gathered = lambda cs: sum(c.bytes_per_step for c in cs if c.op == "all-gather")
        per_phase[precision] = gathered(fwd), gathered(bwd)
    # the gathered W [out, in]: MXFP8 rows padded to 32-row blocks per device, bf16 rows to a
    # multiple of n (256 rows: neither pads up to 8 devices)
    n = mesh.size
    mx_out, bf_out = rows_per_device(d, n) * n, -(-d // n) * n
    for mx, bf in zip(per_phase["mxfp8"], per_phase["bf16"]):
        assert mx == depth * mx_out * d * (1 + 1 / 32)  # 8-bit codes + one scale byte per 32
        assert bf == depth * bf_out * d * 2
        assert mx <= 0.52 * bf


# ------------------------------------------------------------------------------------------------
# Gradients: scanned, rematerialised and plain-loop models against one independent reference


D, DEPTH, BATCH = 64, 3, 64


def host_model(mode, seed=0):
    """``Stack(D, DEPTH, bias, head, no residual)`` with host-drawn values (the same for every mode).

    Odd input features get weights 2^-17 times smaller. Rowwise blocks of ``W = kernel.T``
    (along ``in``) then mix magnitudes and round those weights to (almost) zero, while columnwise
    blocks (along ``out``) keep them: a dgrad through the wrong plane shows up in the previous
    layer's gradient for those features (no residual path hides it).
    """
    model = nnx.eval_shape(lambda: Stack(D, DEPTH, mode=mode, bias=True, head=True, residual=False, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(seed)
    kernels = rng.standard_normal((DEPTH, D, D)) / np.sqrt(D)
    kernels[:, 1::2, :] *= 2.0**-17
    biases = 0.1 * rng.standard_normal((DEPTH, D))
    head_k, head_b = rng.standard_normal((D, 10)) / np.sqrt(D), 0.1 * rng.standard_normal(10)
    for path, var in nnx.to_flat_state(nnx.state(model)):
        if path[0] == "head":
            value = head_k if path[-1] == "kernel" else head_b
        else:
            stacked = kernels if path[-1] == "kernel" else biases
            value = stacked[path[1]] if mode == "loop" else stacked
        var.set_value(jnp.asarray(value, jnp.float32))
    return model, (kernels, biases, head_k, head_b)


@jax.custom_vjp
def reference_linear(x, k_fwd, k_bwd):
    return x @ k_fwd


reference_linear.defvjp(
    lambda x, k_fwd, k_bwd: (x @ k_fwd, (x, k_bwd)),
    lambda res, dy: (dy @ res[1].T, res[0].T @ dy, None),
)


@jax.jit
def reference_grads(fwd, bwd, biases, head_k, head_b, batch):
    def loss(fwd, biases, head_k, head_b):
        x, y = batch
        for i in range(DEPTH):
            x = jnp.tanh(reference_linear(x, fwd[i], bwd[i]) + biases[i])
        logits = x @ head_k + head_b
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(fwd, biases, head_k, head_b)


def column_errors(got, ref):
    """max |got - ref| per column, in units of that column's max |ref| (vectors: one column)."""
    got, ref = np.atleast_2d(np.asarray(got).T).T, np.atleast_2d(np.asarray(ref).T).T
    return np.abs(got - ref).max(0) / np.maximum(np.abs(ref).max(0), 1e-30)


def batch_data(seed=1):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((BATCH, D)).astype(np.float32), rng.integers(0, 10, BATCH).astype(np.int32)


def fsdp_grads(mode, mesh, **fsdp_options):
    """Loss and gradients of the sharded step, as (kernels [DEPTH, in, out], biases, head_k, head_b)."""
    model, values = host_model("scan" if mode == "mesh-2d" else mode)
    fsdp = FSDP(model, mesh, **fsdp_options)
    loss, grads = fsdp.loss_and_grads(ce_loss)(fsdp.init(model, optax.sgd(0.1)), batch_data())
    g = {p.name: np.asarray(fsdp.to_logical(p, grads[p.name])) for p in fsdp.trained}
    if mode == "loop":
        kernels = np.stack([g[f"blocks/{i}/l/kernel"] for i in range(DEPTH)])
        biases = np.stack([g[f"blocks/{i}/l/bias"] for i in range(DEPTH)])
    else:
        kernels, biases = g["blocks/l/kernel"], g["blocks/l/bias"]
    return float(loss), (kernels, biases, g["head/kernel"], g["head/bias"]), values


@pytest.fixture(scope="module")
def grads_by_mode(mesh, devices):
    grads = {mode: fsdp_grads(mode, mesh) for mode in MODES}
    # the scanned model over a 2-D (2, n/2) mesh: FSDP over both axes, every device its own
    # 32-row blocks
    n = len(devices)
    grads["mesh-2d"] = fsdp_grads("mesh-2d", Mesh(np.array(devices).reshape(2, n // 2), ("a", "b")))
    return grads


def oracle_kernels(kernels, rule="rceil"):
    """(forward, dgrad) kernels [DEPTH, in, out] as the GEMMs read them: the rowwise and the
    columnwise values of ``W = kernel.T`` after the numpy oracle's quantization."""
    planes = [npo.mxfp8_weights(k.T, rule) for k in kernels]
    fwd = np.stack([r.T for r, _ in planes]).astype(np.float32)
    bwd = np.stack([c.T for _, c in planes]).astype(np.float32)
    return fwd, bwd


def f32(a):
    return np.asarray(a, np.float32)


def check_against_reference(loss, got, fwd, bwd, values, *, label, tol=1e-5):
    """The sharded loss and gradients against the single-device reference with these kernels."""
    _, biases, head_k, head_b = values
    ref_loss, ref = reference_grads(fwd, bwd, f32(biases), f32(head_k), f32(head_b), batch_data())
    np.testing.assert_allclose(loss, float(ref_loss), rtol=1e-5)
    for name, g, r in zip(("kernels", "biases", "head_kernel", "head_bias"), got, ref):
        r = np.asarray(r)
        per_layer = zip(g, r) if name in ("kernels", "biases") else [(g, r)]
        for i, (gi, ri) in enumerate(per_layer):
            err = column_errors(gi, ri)
            assert err.max() < tol, (label, name, i, err.max())
    return ref


@pytest.mark.parametrize("mode", MODES)
def test_gradients_match_single_device_reference(grads_by_mode, mode):
    loss, got, values = grads_by_mode[mode]
    kernels, biases, head_k, head_b = values
    fwd, bwd = oracle_kernels(kernels)
    tol = 1e-5
    ref = check_against_reference(loss, got, fwd, bwd, values, label=mode, tol=tol)
    # The tolerance separates the planes: layer 0's gradient for the features whose layer-1
    # weights only the columnwise plane keeps is far off when the dgrad reads the rowwise plane.
    _, wrong = reference_grads(fwd, fwd, f32(biases), f32(head_k), f32(head_b), batch_data())
    err = column_errors(np.asarray(wrong[0])[0], np.asarray(ref[0])[0])
    assert err[1::2].min() > 100 * tol and err[0::2].max() < 1e-2


@pytest.mark.parametrize("mode", ["remat", "remat-dots", "loop", "mesh-2d"])
def test_scanned_and_unrolled_models_agree(grads_by_mode, mode):
    """The same model (same values) scanned, rematerialised, unrolled and on a 2-D mesh."""
    loss_scan, scan, _ = grads_by_mode["scan"]
    loss, got, _ = grads_by_mode[mode]
    np.testing.assert_allclose(loss, loss_scan, rtol=1e-6)
    for g, s in zip(got, scan):
        np.testing.assert_allclose(g, s, rtol=1e-5, atol=1e-6 * np.abs(s).max())


def test_training_a_scanned_stack(mesh):
    """Steps of the scanned model: the loss falls, and the planes stay the master's quantization."""
    model, _ = host_model("scan")
    fsdp = FSDP(model, mesh)
    tx = optax.adam(3e-3)
    state, step = fsdp.init(model, tx), fsdp.train_step(ce_loss, tx)
    losses = []
    for _ in range(8):
        state, loss = step(state, batch_data())
        losses.append(float(loss))
    assert losses[-1] < 0.7 * losses[0], losses
    (p,) = fsdp.units
    master = np.asarray(state.master[p.name])  # [DEPTH, out_padded, in]
    q = state.quantized[p.name]
    for i in range(DEPTH):
        want = npo.quantize(master[i])
        for plane, v in want.items():
            np.testing.assert_array_equal(np.asarray(getattr(q, plane))[i].view(np.uint8), v, err_msg=f"{i} {plane}")


# ------------------------------------------------------------------------------------------------
# The other configurations: precision="bf16" and scale_rule="floor", against the same reference


def test_bf16_gradients_match_single_device_reference(mesh):
    """``precision="bf16"``: both GEMMs read the master rounded to bf16 (ml_dtypes, round to
    nearest even); fp32 weights instead are far outside the tolerance."""
    loss, got, values = fsdp_grads("scan", mesh, precision="bf16")
    kernels = values[0]
    bf16 = f32(np.asarray(kernels, np.float32).astype(ml_dtypes.bfloat16))
    ref = check_against_reference(loss, got, bf16, bf16, values, label="bf16")
    _, unrounded = reference_grads(f32(kernels), f32(kernels), *map(f32, values[1:]), batch_data())
    assert column_errors(np.asarray(unrounded[0])[0], np.asarray(ref[0])[0]).max() > 1e-3


def test_floor_rule_planes_and_gradients(mesh):
    """``scale_rule="floor"``: the stored planes are the oracle's floor quantization of the
    masters, and the gradients use those weights (rceil's are outside the tolerance)."""
    model, values = host_model("scan")
    fsdp = FSDP(model, mesh, scale_rule="floor")
    state = fsdp.init(model, optax.sgd(0.1))
    (p,) = fsdp.units
    master, q = np.asarray(state.master[p.name]), state.quantized[p.name]
    for i in range(DEPTH):
        want, rceil = npo.quantize(master[i], "floor"), npo.quantize(master[i])
        assert (want["rowwise_scale"] != rceil["rowwise_scale"]).any()
        for plane, v in want.items():
            np.testing.assert_array_equal(np.asarray(getattr(q, plane))[i].view(np.uint8), v, err_msg=f"{i} {plane}")
    loss, got, _ = fsdp_grads("scan", mesh, scale_rule="floor")
    fwd, bwd = oracle_kernels(values[0], "floor")
    ref = check_against_reference(loss, got, fwd, bwd, values, label="floor")
    _, rceil_ref = reference_grads(*oracle_kernels(values[0]), *map(f32, values[1:]), batch_data())
    assert column_errors(np.asarray(rceil_ref[0])[0], np.asarray(ref[0])[0]).max() > 1e-3
