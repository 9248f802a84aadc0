"""FSDP on models written the ways Flax users write them (``mxfp8_jax.bench.styles.model_styles``), on all
of the run's devices (``n``), adam; one sequence per device.

The styles: (mha) ``nnx.MultiHeadAttention`` + ``nnx.Linear`` MLP, scanned; (gemma) ``nnx.Einsum``
projections with stacked kernels, a tied ``nnx.Embed`` (lookup + attend), blocks in an
``nnx.List`` run by a Python loop; (maxtext) a DenseGeneral of several axes under
``lax.dot_general``, scanned; (einsum) ``nnx.Param`` + ``jnp.einsum`` / ``@`` layers, an indexed
table, a loop; (moe) stacked experts ``[E, D, F]`` whose einsums batch over the expert axis,
scanned; (dropout) ``nnx.Dropout`` layers with their own RNG streams, a loop.

Memory and communication are read from the compiled step (``memory_analysis()``, HLO
collectives with their loops); gradients are compared with the unsharded model run by plain
jax on one device. The gradient oracle needs no MXFP8 reference: every weight is a signed power
of two within a factor 2^6 of the others, which MXFP8 represents exactly under any block scale
(and bf16 too), so the MXFP8 units' forward and backward GEMMs read exactly the fp32 weights
and the only differences left are fp32 summation order.
"""

import collections
import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh

from mxfp8_jax._src.compiled import hlo
from mxfp8_jax.bench.styles import model_styles as ms
from mxfp8_jax.flax import FSDP

from conftest import cpu_only
from summation import gamma, order_bound

# one xdist group per style: its tests share the compiled steps cached on one worker
STYLES = [pytest.param(s, marks=pytest.mark.xdist_group(f"style-{s}"), id=s) for s in ms.STYLES]
LOOPS = [p for p in STYLES if p.values[0] in ("gemma", "einsum")]  # an nnx.List run by a Python loop
# "dropout" is mha's nnx.MultiHeadAttention and nnx.Linear units in a Python loop like gemma's
# and einsum's (their units, gathers, remat and memory checks cover its parts): its own checks
# are the masks and streams, and bf16 (it is the costliest style to compile, by far)
NOT_DROPOUT = [p for p in STYLES if p.values[0] != "dropout"]
TOKENS = 16  # per device: activations small beside a layer
SEQ = 16
SDS = jax.ShapeDtypeStruct
# The depths of the compiled steps: a Python-loop model unrolls every layer into the compiled
# step, so each layer costs compile time; two layers more are enough to see what a layer adds.
DEPTHS = (2, 4)


def sequences(devices: int) -> int:
    """The batch's sequences: ``TOKENS`` per device."""
    return devices * TOKENS // SEQ


@pytest.fixture(scope="module")
def mesh(devices):
    return Mesh(np.array(devices), ("fsdp",))


@pytest.fixture(scope="module")
def compiled(mesh):
    """``(style, depth, remat) -> (fsdp, temp bytes, HLO text)`` of the compiled adam step on
    abstract state (nothing is materialised), cached for the module."""

    batch = (SDS((sequences(mesh.size), SEQ), jnp.int32),) * 2

    @functools.cache
    def get(style, depth, remat=False):
        model = ms.abstract(style, ms.StyleConfig(depth=depth, remat=remat))
        fsdp = FSDP(model, mesh, loss_fn=ms.loss_fn, example_batch=batch)
        tx = optax.adam(1e-3)
        step = fsdp.lower_train_step(ms.loss_fn, tx, fsdp.abstract_state(tx), batch).compile()
        return fsdp, step.memory_analysis().temp_size_in_bytes, step.as_text()

    return get


def model_bytes(fsdp) -> int:
    """The fp32 bytes of the whole model's trained parameters."""
    return sum(int(np.prod(p.shape)) * 4 for p in fsdp.trained)


def unsharded_temp(style: str, depth: int) -> int:
    """Temp memory of the model's own step, unsharded on one device with one device's batch
    (plain jax: its saved activations and working set)."""
    model = ms.abstract(style, ms.StyleConfig(depth=depth))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def grads(params, rest, batch):
        return jax.grad(lambda p: ms.loss_fn(nnx.merge(graphdef, p, rest, copy=True), batch))(params)

    local = (SDS((sequences(1), SEQ), jnp.int32),) * 2
    return jax.jit(grads).lower(params, rest, local).compile().memory_analysis().temp_size_in_bytes


# ------------------------------------------------------------------------------------------------
# The plan


@pytest.mark.parametrize("style", NOT_DROPOUT)
def test_units_hold_the_parameter_bytes(style, compiled):
    fsdp, _, _ = compiled(style, DEPTHS[-1])
    units = sum(int(np.prod(p.shape)) * 4 for p in fsdp.units)
    assert units >= 0.95 * model_bytes(fsdp), str(fsdp)
    # embeddings and output heads are bf16 units by default, the projections MXFP8
    roles = {p.role for p in fsdp.units if p.kind == "bf16"}
    assert roles <= {"embedding", "head", "projection"} and "embedding" in roles
    for p in fsdp.units:
        if p.role == "projection" and p.kind == "bf16":  # only what MXFP8 cannot block
            assert p.unit.in_features % 32 or p.unit.out_features % 32, p.name


@pytest.mark.xdist_group("style-gemma")
def test_the_plan_reads_as_a_table(compiled):
    fsdp, _, _ = compiled("gemma", DEPTHS[-1])
    text = str(fsdp)
    lines = text.splitlines()
    assert "units found by tracing the loss" in lines[0]
    for p in fsdp.params:  # every parameter, with what it became
        (row,) = [line for line in lines if line.startswith(p.name + " ")]
        assert p.kind in row
    kv = next(line for line in lines if line.startswith("layers/0/attn/kv_einsum/kernel "))
    assert "[2, 4, 256, 64]" in kv and "mxfp8 projection N=512 K=256" in kv
    emb = next(line for line in lines if line.startswith("embedder/embedding "))
    assert "bf16 embedding N=512 K=256" in emb and "tied" in emb
    norm = next(line for line in lines if line.startswith("final_norm/scale "))
    assert "plain fp32" in norm and "read by mul" in norm
    assert "units hold 99." in text and "gathered per step" in lines[-2]
    assert lines[-1].startswith("GEMMs (cpu mesh): forward in the layer's dtype; dgrad and wgrad: fp32 where lowered")


@pytest.mark.xdist_group("style-mha")
def test_stacked_plain_parameters_split_within_a_layer(compiled):
    """A scanned stack's norm scale [L, D] is split along D, not L: one layer's slice is spread
    over the devices. Being small, the stack is gathered whole once, before the loop, not per
    iteration (``test_fsdp_overlap``: the per-iteration path)."""
    fsdp, _, text = compiled("mha", DEPTHS[-1])
    stacked = [p for p in fsdp.plain if p.name.startswith("blocks/")]
    assert stacked and all(p.level == 1 and p.shard_axis >= 1 for p in stacked)
    f32 = [c for c in hlo.collectives(text) if c.op == "all-gather" and c.dtypes == ("f32",)]
    assert f32 and {c.loop_depth for c in f32} == {0}
    assert all(c.count == DEPTHS[-1] for c in f32 if c.loop_depth == 1)


# ------------------------------------------------------------------------------------------------
# Memory: flat in depth, in scans and in Python loops


# Each added layer may add to the step's temp memory its fp32 gradient shard (1/n of the layer)
# and this much of the layer's fp32 bytes beside it (its saved activations of one device's
# batch): 0.4x in all on 8 devices. A step that gathered the whole model would add a whole
# layer (1x) and more per layer.
BEYOND_THE_SHARD = 0.4 - 1 / 8


@pytest.mark.parametrize("style", NOT_DROPOUT)
def test_step_memory_is_flat_in_depth(style, compiled, mesh):
    """Temp memory of the step within what it must hold at each depth: the fp32 gradient shard,
    what the model itself saves and works with (its unsharded step on one device's batch) and
    two units' gathered fp32 weights; from depth 2 to 4 it grows by at most 1/n + 0.275 of the
    model's growth (0.4x on 8 devices), where a whole-model gather grows by more than 1x."""
    cpu_only("temp memory budgets from XLA:CPU's memory_analysis()")
    n = mesh.size
    temps, models = {}, {}
    for depth in DEPTHS:
        fsdp, temp, _ = compiled(style, depth)
        shard = sum(int(np.prod(p.stored_shape)) * 4 for p in fsdp.trained) / n
        unit = max(int(np.prod(p.unit.padded_shape(p.unit.stack[p.unit.level :]))) * 4 for p in fsdp.units)
        budget = shard + unsharded_temp(style, depth) + 2 * unit
        assert temp <= budget, (depth, temp / 2**20, budget / 2**20)
        temps[depth], models[depth] = temp, model_bytes(fsdp)
    (low, high), ratio = DEPTHS, 1 / n + BEYOND_THE_SHARD
    assert temps[high] - temps[low] <= ratio * (models[high] - models[low]), (n, temps, models)


# ------------------------------------------------------------------------------------------------
# Communication


def reads(style: str, p) -> tuple[int, int]:
    """(GEMMs, lookups) of the loss that read unit ``p`` per layer, from the models' code: one
    GEMM per projection and head, one lookup per embedding, and the tied table of "gemma" both."""
    if p.role == "embedding":
        return (1 if style == "gemma" else 0), 1
    return 1, 0


@pytest.mark.parametrize("style", NOT_DROPOUT)
def test_step_gathers_units_as_8_bit_planes(style, compiled):
    """Each GEMM gathers its unit once forward and once backward (a scan's q, k and v once more
    a step: the unused fetch of its last trip; its last GEMM's too: in the backward's handoff
    each trip gathers the layer before's, layer 0 twice, and the last layer's is gathered after
    the loop), each lookup once: MXFP8 units
    as uint8 planes (codes + scales), the forward's rowwise ([N, K/32] scales), the backward's
    columnwise ([N/32, K] scales); bf16 units as 16-bit words; fp32 gathers (plain parameters)
    move at most 5% of the model's fp32 bytes."""
    fsdp, _, text = compiled(style, DEPTHS[-1])
    gathers = [c for c in hlo.collectives(text) if c.op == "all-gather"]
    # the MoE routes the whole batch's tokens, as the unsharded model does: a token's slot in its
    # expert's buffer is a cumsum over every token before it (int32), and the dispatch einsum
    # contracts over all of them (XLA gathers the tokens for it)
    routing = {("s32",)} if style == "moe" else set()
    assert {c.dtypes for c in gathers} == {("u8",), ("u16",), ("f32",)} | routing
    f32 = sum(c.bytes_per_step for c in gathers if c.dtypes == ("f32",))
    assert f32 <= 0.05 * model_bytes(fsdp)
    want, codes, scales = {"u8": 0, "u16": 0}, set(), collections.Counter()
    for p in fsdp.units:
        gemms, lookups = reads(style, p)
        g = p.unit
        layers, batch = int(np.prod(g.stack[: g.level])), g.stack[g.level :]
        if p.kind == "mxfp8":
            # a scan's first GEMMs (q, k and v) take planes gathered one trip ahead: the last
            # trip's are gathered once more, unused (fsdp_fetch)
            ahead = int(g.level >= 1 and re.search(r"/(query|key|value|[qkv]_proj)/kernel$", p.name) is not None)
            # and the body's last GEMM (the MLP's output projection) once more: in the backward,
            # each trip gathers the layer before's for the next (the handoff), the last layer's
            # after the loop (fsdp_fetch)
            last = int(g.level >= 1 and re.search(r"/(fc2/kernel|mlp/wo/kernel|moe/wo)$", p.name) is not None)
            want["u8"] += layers * 2 * 2 * gemms + 2 * ahead + 2 * last  # codes + scales, forward + backward
            codes.add((*batch, g.out_padded, g.in_features))
            scales[(*batch, g.out_padded, g.in_features // 32)] += layers * gemms + ahead  # forward: rowwise
            scales[(*batch, g.out_padded // 32, g.in_features)] += layers * gemms + last  # backward: columnwise
        else:
            want["u16"] += layers * (2 * gemms + lookups)
    got = {d: sum(c.count for c in gathers if c.dtypes == (d,)) for d in want}
    assert got == want
    got_scales = collections.Counter()
    for c in gathers:
        if c.dtypes == ("u8",) and c.outputs[0][1] not in codes:
            got_scales[c.outputs[0][1]] += c.count
    assert got_scales == scales


@pytest.mark.parametrize("style", LOOPS)
def test_loop_remat_gathers_again_in_the_backward(style, compiled):
    """A Python loop under nnx.remat: each unit's forward gather runs again in the backward for
    the recomputation (none merged with the forward's by XLA), but for the block's last
    projection, whose output nothing in the block's backward needs."""
    depth = DEPTHS[0]
    fsdp, _, plain = compiled(style, depth)
    _, _, remat = compiled(style, depth, True)
    count = lambda text: sum(c.count for c in hlo.collectives(text) if c.op == "all-gather" and c.dtypes == ("u8",))
    per_layer = sum(1 for p in fsdp.mxfp8_units if p.path[1] == 0)
    assert count(plain) == depth * 4 * per_layer
    assert count(remat) == depth * (4 * per_layer + 2 * (per_layer - 1))


# ------------------------------------------------------------------------------------------------
# Gradients against the unsharded model


def exact_values(model, seed=0):
    """``model`` with every parameter a signed power of two 2^-6..1 times its scale (exact in
    MXFP8 whatever the block scale, and in bf16); scales as the model's initialisers have them."""
    rng = np.random.default_rng(seed)
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = np.asarray(var.get_value())
        scale = np.abs(value).max() if value.size and np.abs(value).max() > 0 else 1.0
        scale = 2.0 ** np.round(np.log2(scale))
        powers = 2.0 ** rng.integers(-6, 1, value.shape)
        var.set_value(jnp.asarray(np.where(rng.random(value.shape) < 0.5, -1, 1) * powers * scale, jnp.float32))
    return model


def column_errors(got, ref, floor=1e-30):
    """max |got - ref| per column of the last axis, in units of that column's max |ref| (or of
    ``floor`` when larger: a gradient that is zero up to rounding, like an attention key bias's,
    is compared with the model's gradients, not with its own noise)."""
    got, ref = np.asarray(got).reshape(-1, np.shape(got)[-1]), np.asarray(ref).reshape(-1, np.shape(ref)[-1])
    return np.abs(got - ref).max(0) / np.maximum(np.abs(ref).max(0), floor)


@functools.cache
def unsharded_step(graphdef):
    """The unsharded model's jitted loss and gradients (one compile per model structure)."""

    @jax.jit
    def loss_and_grads(params, rest, batch):
        return jax.value_and_grad(lambda p: ms.loss_fn(nnx.merge(graphdef, p, rest, copy=True), batch))(params)

    return loss_and_grads


def per_device_reference(model, batch, devices, rest_of=lambda i: None):
    """The data-parallel step of ``devices`` devices computed by the unsharded model on one
    device: each device's slice of the batch on its own (an MoE routes within its slice, as
    each device does; ``rest_of(i)``: the RNG streams device ``i`` draws from), then the mean
    over devices in float64. Returns (loss, gradients by parameter name, the devices' parts
    ``[device, ...]``)."""
    graphdef, params, model_rest = nnx.split(model, nnx.Param, ...)
    loss_and_grads = unsharded_step(graphdef)
    x, y = batch
    per = len(x) // devices
    losses, parts = [], []
    for i in range(devices):
        rest = rest_of(i)
        slice_ = (x[i * per : (i + 1) * per], y[i * per : (i + 1) * per])
        loss, grads = loss_and_grads(params, model_rest if rest is None else rest, slice_)
        losses.append(float(loss))
        parts.append({"/".join(map(str, k)): np.asarray(v) for k, v in nnx.to_flat_state(grads)})
    terms = {k: np.stack([g[k] for g in parts]).astype(np.float64) / devices for k in parts[0]}
    return np.mean(losses), {k: t.sum(0) for k, t in terms.items()}, terms


def fsdp_loss_and_grads(fsdp, state, batch):
    loss, grads = fsdp.loss_and_grads(ms.loss_fn)(state, batch)
    return float(loss), {p.name: np.asarray(fsdp.to_logical(p, grads[p.name])) for p in fsdp.trained}


# Within a device, FSDP's step and the unsharded model's are two programs whose GEMMs, reductions
# and elementwise functions XLA evaluates in orders and fusions of its choosing: allowed gamma(512)
# of each gradient's scale, the size of the fp32 error bound of one sum of these models' longest
# contraction (the MLP's hidden features, the vocabulary), whatever the device count.
WITHIN_A_DEVICE = gamma(max(ms.StyleConfig().mlp, ms.StyleConfig().vocab))


def gradient_scale(w: np.ndarray, layers: int) -> np.ndarray:
    """Each column's largest |value| (the last axis); for a vector (fewer than two axes of its
    own once the ``layers`` leading scan axes are set aside), each layer's vector's largest."""
    a = np.abs(w)
    if w.ndim - layers >= 2:
        return a.reshape(-1, w.shape[-1]).max(0)
    return a.reshape(*w.shape[:layers], -1).max(-1).reshape(w.shape[:layers] + (1,) * (w.ndim - layers))


def assert_grads_close(fsdp, got, want, terms, label):
    """FSDP's gradients against the per-device reference: within the bound of summing the
    devices' parts in another order (``summation.order_bound``), plus ``WITHIN_A_DEVICE`` of the
    gradient's scale (each column's largest; a vector's largest, per layer for a scanned stack
    of vectors) for the same within a device. A gradient that is zero up to rounding (an
    attention key bias: softmax ignores it) has the scale of 1% of the model's largest."""
    assert got.keys() == want.keys()
    layers = {p.name: p.unit.level if p.unit is not None else p.level for p in fsdp.trained}
    floor = 1e-2 * max(np.abs(w).max() for w in want.values())
    for k in want:
        g, w = np.asarray(got[k], np.float64), want[k]
        scale = gradient_scale(w, layers[k])
        allowed = order_bound(terms[k]) + WITHIN_A_DEVICE * np.maximum(scale, floor)
        assert (np.abs(g - w) <= allowed).all(), (label, k, float(np.abs(g - w).max()), float(allowed.max()))


@pytest.mark.parametrize("style", NOT_DROPOUT)
def test_gradients_match_the_unsharded_model(style, mesh):
    cfg = ms.StyleConfig(depth=1)  # one block: the plumbing of every op; depth is the other tests'
    model = exact_values(ms.build(style, cfg))
    batch = ms.make_batch(cfg, sequences(mesh.size), SEQ, seed=1)
    fsdp = FSDP(model, mesh, loss_fn=ms.loss_fn, example_batch=batch)
    assert fsdp.mxfp8_units
    loss, got = fsdp_loss_and_grads(fsdp, fsdp.init(model, optax.sgd(0.1)), batch)
    ref_loss, want, terms = per_device_reference(model, batch, mesh.size)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert_grads_close(fsdp, got, want, terms, style)


@pytest.mark.xdist_group("style-dropout")
def test_dropout_draws_the_unsharded_models_masks_and_advances_its_streams(mesh):
    """The step draws from the model's own streams on the whole batch's shapes; with jax's
    partitionable threefry (the default from jax 0.5 on) each bit is a function of its index, so
    the masks, and the gradient, are the unsharded model's on the whole batch; a step advances
    the streams' counts as the unsharded model does."""
    assert jax.config.jax_threefry_partitionable
    cfg = ms.StyleConfig(depth=1, dropout=0.3)
    model = exact_values(ms.build("dropout", cfg))
    x, y = ms.make_batch(cfg, sequences(mesh.size), SEQ, seed=1)
    fsdp = FSDP(model, mesh, loss_fn=ms.loss_fn, example_batch=(x, y))
    state = fsdp.init(model, optax.sgd(0.1))
    assert state.rest and any(jax.dtypes.issubdtype(r.dtype, jax.dtypes.prng_key) for r in state.rest)
    loss, got = fsdp_loss_and_grads(fsdp, state, (x, y))
    _, _, rest = nnx.split(model, nnx.Param, ...)
    ref_loss, want, terms = per_device_reference(model, (x, y), 1)  # one program over the batch
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert_grads_close(fsdp, got, want, terms, "dropout")
    # per-device masks (each device's slice drawn on its own shapes) give another gradient
    _, per_slice, _ = per_device_reference(model, (x, y), mesh.size)
    assert max(np.abs(got[k] - per_slice[k]).max() / np.abs(per_slice[k]).max() for k in got) > 1e-2
    # a step advances the streams' counts; the keys stay
    step = fsdp.train_step(ms.loss_fn, optax.sgd(0.1))
    new, _ = step(state, (x, y))
    counts = lambda s: [int(r) for r in s.rest if not jax.dtypes.issubdtype(r.dtype, jax.dtypes.prng_key)]
    model_after = nnx.clone(model)
    nnx.jit(ms.loss_fn)(model_after, (x[:1], y[:1]))  # the unsharded model's own call advances them once
    _, _, rest_after = nnx.split(model_after, nnx.Param, ...)
    assert counts(new) == [int(r) for r in jax.tree.leaves(rest_after) if r.dtype == jnp.uint32]
    assert counts(new) != [int(r) for r in jax.tree.leaves(rest) if r.dtype == jnp.uint32]


@pytest.mark.parametrize("style", STYLES)
def test_bf16_first_loss_and_gradients_match_the_unsharded_model_with_bf16_weights(style, mesh):
    """``precision="bf16"``: every unit reads its master rounded to bf16 (round to nearest even),
    so the step is the unsharded model with those weights rounded, up to summation order."""
    cfg = ms.StyleConfig(depth=1, dropout=0.0)
    model = ms.build(style, cfg, seed=3)
    batch = ms.make_batch(cfg, sequences(mesh.size), SEQ, seed=2)
    fsdp = FSDP(model, mesh, precision="bf16", loss_fn=ms.loss_fn, example_batch=batch)
    assert not fsdp.mxfp8_units and fsdp.units
    loss, got = fsdp_loss_and_grads(fsdp, fsdp.init(model, optax.sgd(0.1)), batch)
    rounded = nnx.clone(model)
    units = {p.name for p in fsdp.units}
    for path, var in nnx.to_flat_state(nnx.state(rounded, nnx.Param)):
        if "/".join(map(str, path)) in units:
            value = np.asarray(var.get_value(), np.float32)
            var.set_value(jnp.asarray(value.astype(ml_dtypes.bfloat16).astype(np.float32)))
    ref_loss, want, terms = per_device_reference(rounded, batch, mesh.size)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert_grads_close(fsdp, got, want, terms, style)
    _, unrounded, _ = per_device_reference(model, batch, mesh.size)
    assert max(column_errors(unrounded[k], want[k]).max() for k in units) > 1e-3  # the rounding shows
