"""Stacks on any axis: MaxText's scanned layout (layer axis 1) and stacks moved to lead before a scan.

MaxText stacks its scanned layers' weights with the layer axis at ``param_scan_axis`` (1 by
default: a kernel ``[embed, layers, mlp]``), and ``nnx.scan`` moves that axis to lead before
``lax.scan`` slices it. A model may also keep a raw stack ``[d, layers, h]`` and ``jnp.moveaxis``
or transpose it before a ``lax.scan``. Either way the weight is read one layer at a time, so it is
a unit like a stack on axis 0: its shards are stacked along their leading axis, whatever the
parameter's layout, and a scan gathers one layer per iteration.

Each model here is compared with the same model stacked on axis 0 (same weights, moved): the
plan, the step (loss and update, to the order of fp32 sums, against the unsharded model and
against the axis-0 form's FSDP step), the compiled step's per-layer gathers, and the temp memory
each added layer costs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax
from jax.sharding import Mesh
from test_fsdp_semantics import (
    VOCAB,
    D,
    H,
    Mismatches,
    batch_size,
    compare_params,
    exact_weights,
    flat,
    fsdp_step,
    lm_batch,
    lm_chain,
    masked_lm_loss,
    tolerance,
    unsharded_step,
)
from test_fsdp_stacks import StackLM, info, rms

from mxfp8_jax._src.compiled import hlo
from mxfp8_jax.flax import FSDP

from conftest import need_devices

LAYERS = 3


@pytest.fixture(scope="module")
def mesh(devices):
    return Mesh(np.array(devices), ("fsdp",))


class MlpBlock(nnx.Module):
    """A pre-norm MLP block: an RMSNorm scale and two bias-free projections."""

    def __init__(self, rngs: nnx.Rngs, d: int, h: int):
        self.scale = nnx.Param(jnp.ones((d,)))
        self.up = nnx.Linear(d, h, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(h, d, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(rms(x, self.scale[...]))))


class MaxTextLM(nnx.Module):
    """A token LM in MaxText's scanned layout: ``layers`` blocks created by ``nnx.vmap`` with their
    layer axis at ``axis`` of every stacked weight (``param_scan_axis``: 1 in MaxText, so
    ``up.kernel`` is ``[d, layers, h]``), run by ``nnx.scan`` over that axis, each iteration under
    ``nnx.remat``."""

    def __init__(self, rngs: nnx.Rngs, axis: int, layers: int = LAYERS, d: int = D, h: int = H):
        self.axis = axis
        self.embed = nnx.Embed(VOCAB, d, rngs=rngs)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=axis)
        def create(rngs):
            return MlpBlock(rngs, d, h)

        self.blocks = create(rngs)
        self.head = nnx.Linear(d, VOCAB, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        def step(h, block):
            return block(h)

        scan = nnx.scan(nnx.remat(step), in_axes=(nnx.Carry, self.axis), out_axes=nnx.Carry)
        return self.head(scan(self.embed(tokens), self.blocks))


class MovedStackLM(nnx.Module):
    """Raw stacks with the layer axis second (``up [d, layers, h]``, ``down [h, layers, d]``,
    ``scale [d, layers]``), moved to lead before a ``lax.scan``: by ``jnp.moveaxis`` (``how="moveaxis"``)
    or by ``.T`` / ``jnp.transpose`` (``how="transpose"``)."""

    def __init__(self, rngs: nnx.Rngs, how: str, layers: int = LAYERS, d: int = D, h: int = H):
        self.how = how
        self.embed = nnx.Embed(VOCAB, d, rngs=rngs)
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Param(jnp.moveaxis(init(rngs.params(), (layers, d, h)), 0, 1))
        self.down = nnx.Param(jnp.moveaxis(init(rngs.params(), (layers, h, d)), 0, 1))
        self.scale = nnx.Param(jnp.ones((d, layers)))
        self.head = nnx.Linear(d, VOCAB, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        if self.how == "moveaxis":
            stacks = (jnp.moveaxis(self.up[...], 1, 0), jnp.moveaxis(self.down[...], 1, 0), self.scale[...].T)
        else:
            stacks = tuple(jnp.transpose(w[...], (1, 0, 2)) for w in (self.up, self.down)) + (self.scale[...].T,)

        def block(h, w):
            up, down, scale = w
            return h + jax.nn.gelu(rms(h, scale) @ up) @ down, None

        return self.head(lax.scan(block, self.embed(tokens), stacks)[0])


def moved_to_axis_0(model: nnx.Module, like: nnx.Module) -> nnx.Module:
    """``like`` (the axis-0 form) with the values of ``model``'s parameters, each stack's layer
    axis moved to lead."""
    values = {k: v for k, v in flat(nnx.state(model, nnx.Param)).items()}
    for path, var in nnx.to_flat_state(nnx.state(like, nnx.Param)):
        name = "/".join(map(str, path))
        value = values[name]
        shape = var.get_value().shape
        if value.shape != shape:
            axis = next(a for a in range(value.ndim) if np.moveaxis(value, a, 0).shape == shape)
            value = np.moveaxis(value, axis, 0)
        var.set_value(jnp.asarray(value))
    return like


def check_step(mesh, model, model0, label: str) -> None:
    """One sgd step of ``model`` under FSDP: its loss and update those of the unsharded model, and
    those of the axis-0 form ``model0``'s FSDP step, to the order of fp32 sums."""
    b = batch_size(mesh.size)
    batch = lm_batch(b)
    tol = tolerance(lm_chain(b, LAYERS))
    before = nnx.state(model, nnx.Param)
    want_loss, _, want_params, _ = unsharded_step(model, masked_lm_loss, batch, has_aux=True)
    got_loss, _, got_params, _ = fsdp_step(nnx.clone(model), mesh, masked_lm_loss, batch, has_aux=True)
    m = Mismatches(f"{label} on {mesh.size} devices")
    m.close(got_loss, want_loss, abs(float(want_loss)), tol, "loss")
    compare_params(m, got_params, want_params, before, tol)
    # the axis-0 form's FSDP step, its parameters moved back to this layout
    loss0, _, params0, _ = fsdp_step(nnx.clone(model0), mesh, masked_lm_loss, batch, has_aux=True)
    m.close(got_loss, loss0, abs(float(loss0)), tol, "loss against the axis-0 form's")
    after = nnx.clone(model)
    nnx.update(after, got_params)
    after0 = moved_to_axis_0(after, nnx.clone(model0))
    compare_params(m, nnx.state(after0, nnx.Param), params0, nnx.state(model0, nnx.Param), tol)
    m.done()


@pytest.mark.parametrize("axis", [1, -1])
def test_maxtext_scanned_layout_is_a_unit_per_layer_and_trains_as_the_axis_0_form(mesh, axis):
    """``nnx.scan`` over stacks whose layer axis is 1 (MaxText's default) or last: the kernels are
    MXFP8 units with that layer axis (shards ``[layers, rows, K]``), the norm scales plain and
    split along another axis; the step is the unsharded model's and the axis-0 form's."""
    model = exact_weights(MaxTextLM(nnx.Rngs(0), axis), tops={"embed": 1.0, "head": 1.0})
    model0 = moved_to_axis_0(model, MaxTextLM(nnx.Rngs(0), 0))
    fsdp = FSDP(model, mesh, loss_fn=masked_lm_loss, example_batch=lm_batch(batch_size(mesh.size)))
    layer_axis = {1: 1, -1: 2}[axis]
    for name in ("blocks/up/kernel", "blocks/down/kernel"):
        p = info(fsdp, name)
        assert (p.kind, p.unit.layer_axes, p.stack, p.gathers) == ("mxfp8", (layer_axis,), (LAYERS,), 3.0), str(fsdp)
    scale = info(fsdp, "blocks/scale")
    assert (scale.kind, scale.layer_axes) == ("plain", (1,)) and scale.shard_axis in (0, None), str(fsdp)
    check_step(mesh, model, model0, f"MaxText layout, layer axis {axis}")


@pytest.mark.parametrize("how", ["moveaxis", "transpose"])
def test_a_stack_moved_to_lead_before_lax_scan_is_a_unit(mesh, how):
    """Raw stacks ``[d, layers, h]`` moved to lead by ``jnp.moveaxis`` or a transpose before a
    ``lax.scan``: units with layer axis 1, the step the unsharded model's and the axis-0 form's."""
    model = exact_weights(MovedStackLM(nnx.Rngs(0), how), tops={"embed": 1.0, "head": 1.0})
    fsdp = FSDP(model, mesh, loss_fn=masked_lm_loss, example_batch=lm_batch(batch_size(mesh.size)))
    up, down, scale = info(fsdp, "up"), info(fsdp, "down"), info(fsdp, "scale")
    assert (up.kind, up.unit.layer_axes, up.unit.k_axes, up.unit.n_axes) == ("mxfp8", (1,), (0,), (2,)), str(fsdp)
    assert (down.kind, down.unit.layer_axes) == ("mxfp8", (1,)), str(fsdp)
    assert (scale.kind, scale.layer_axes, scale.shard_axis) == ("plain", (1,), 0), str(fsdp)
    model0 = moved_to_axis_0(model, StackLM(nnx.Rngs(0), "scan"))
    check_step(mesh, model, model0, f"stack moved by {how}")


def lm_loss(model, batch):
    return masked_lm_loss(model, batch)[0]


def test_the_axis_1_scan_gathers_one_layer_per_iteration(mesh):
    """In the compiled step of the axis-1 layout the scan's all-gathers move one layer's 8-bit rows
    of each kernel, never the stack, in a loop that runs once per layer; the first GEMM's (``up``)
    codes and scales are gathered an iteration ahead, in the forward loop and in the backward's."""
    model, batch = MaxTextLM(nnx.Rngs(0), 1), lm_batch(batch_size(mesh.size))
    fsdp = FSDP(model, mesh, loss_fn=lm_loss, example_batch=batch)
    tx = optax.sgd(1.0)
    text = fsdp.lower_train_step(lm_loss, tx, fsdp.abstract_state(tx), batch).compile().as_text()
    # a loop runs once per layer but one (its last layer is peeled off it: fsdp_fetch)
    assert {trip for _, trip in hlo.while_loops(text)} == {LAYERS - 1}, hlo.while_loops(text)
    in_loops = [c for c in hlo.collectives(text) if c.op == "all-gather" and c.loop_depth >= 1]
    units = [info(fsdp, f"blocks/{n}/kernel").unit for n in ("up", "down")]
    layer = max(g.out_padded * g.in_features for g in units)
    shapes = [(d, s) for c in in_loops for d, s in c.outputs]
    assert shapes and all(int(np.prod(s)) <= layer for _, s in shapes), shapes
    assert {(g.out_padded, g.in_features) for g in units} <= {s for d, s in shapes if d == "u8"}, shapes
    ahead = [(g.computation, g.dtypes) for g in hlo.gather_overlaps(text) if g.ahead]
    loops = {body for body, _ in hlo.while_loops(text)}
    assert sorted(ahead) == sorted((body, ("u8",)) for body in loops for _ in range(2)), ahead


def temp_bytes(axis: int, layers: int, mesh) -> int:
    model = MaxTextLM(nnx.Rngs(0), axis, layers=layers, d=256, h=512)
    batch = lm_batch(mesh.size)
    fsdp = FSDP(model, mesh, loss_fn=lm_loss, example_batch=batch)
    tx = optax.sgd(1.0)
    compiled = fsdp.lower_train_step(lm_loss, tx, fsdp.abstract_state(tx), batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_memory_per_layer_of_the_axis_1_layout_is_that_of_axis_0(devices):
    """Temp memory of the compiled step per added layer (depth 2 -> 6, wide layers, one sequence
    per device, so the weights dominate): the axis-1 layout within 10% of the axis-0 form's."""
    mesh = Mesh(np.array(need_devices(8)), ("fsdp",))
    slope = {axis: (temp_bytes(axis, 6, mesh) - temp_bytes(axis, 2, mesh)) / 4 for axis in (0, 1)}
    assert slope[0] > 0, slope
    assert abs(slope[1] - slope[0]) <= 0.10 * slope[0], slope
