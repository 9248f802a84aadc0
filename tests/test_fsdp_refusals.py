"""What FSDP refuses, and how: a ``ValueError`` or ``NotImplementedError`` that names the parameter,
what the loss does with it and the way out; never an ``AssertionError``.

Refusals tested elsewhere: a loss naming the FSDP axes (``test_fsdp_semantics``), a trained
parameter read inside a ``while_loop`` (``test_fsdp_stacks``), a loss that is not a scalar, a
batch of another structure (``test_fsdp_semantics``), options out of range (``test_flax``).
Here: a step whose loss reads a unit otherwise than the plan's loss, or slices a stack along other
axes; and what the planner does instead of refusing where it can (a stack reshaped before its
scan, a stacked plain parameter also read whole).
"""

from __future__ import annotations

import ast
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax
from jax.sharding import Mesh
from test_fsdp_semantics import (
    Mismatches,
    batch_size,
    compare_params,
    exact_weights,
    fsdp_step,
    lm_batch,
    lm_chain,
    masked_lm_loss,
    tolerance,
    unsharded_step,
)
from test_fsdp_stacks import StackLM, info

from mxfp8_jax.flax import FSDP

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "mxfp8_jax"
FSDP_SOURCES = sorted((PACKAGE / "_src" / "fsdp").glob("*.py")) + [PACKAGE / "flax.py"]


@pytest.fixture(scope="module")
def mesh(devices):
    return Mesh(np.array(devices), ("fsdp",))


def test_no_assert_in_the_fsdp_package():
    """No ``assert`` statement (stripped under ``python -O``, and a bare ``AssertionError`` for a
    user) and no ``AssertionError`` raised or named in the FSDP package."""
    found = []
    for path in FSDP_SOURCES:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Assert) or (isinstance(node, ast.Name) and node.id == "AssertionError"):
                found.append(f"{path.name}:{node.lineno}")
    assert len(FSDP_SOURCES) > 10 and not found, found


def lm_loss(model, batch):
    return masked_lm_loss(model, batch)[0]


def lowered(fsdp, loss_fn, batch):
    tx = optax.sgd(1.0)
    return fsdp.lower_train_step(loss_fn, tx, fsdp.abstract_state(tx), batch)


def test_a_step_whose_loss_reads_a_unit_otherwise_is_refused(mesh):
    """The plan's loss reads ``up`` in GEMMs; a step loss that also adds an L2 penalty on it reads
    it whole: a ``ValueError`` naming ``up``, the op, and the fix."""
    model, batch = StackLM(nnx.Rngs(0), "scan"), lm_batch(batch_size(mesh.size))
    fsdp = FSDP(model, mesh, loss_fn=lm_loss, example_batch=batch)
    penalised = lambda m, b: lm_loss(m, b) + 1e-4 * jnp.sum(m.up[...] ** 2)
    with pytest.raises(ValueError, match=r"^up \[3, \d+, \d+\]: the FSDP plan keeps it as a mxfp8 unit .* read by"):
        lowered(fsdp, penalised, batch)
    with pytest.raises(ValueError, match=r"must read parameters as the loss the plan traced"):
        lowered(fsdp, penalised, batch)


class GridStack(nnx.Module):
    """Weights stacked on two layer axes ``[2, 2, d, h]``, run by two nested scans: axis 0 outer
    (``order="rows"``) or axis 1 outer (``order="columns"``)."""

    def __init__(self, rngs: nnx.Rngs, d: int = 64, h: int = 128):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Param(init(rngs.params(), (2, 2, d, h)))
        self.down = nnx.Param(init(rngs.params(), (2, 2, h, d)))
        self.order = "rows"

    def __call__(self, x, order: str):
        up, down = self.up[...], self.down[...]
        if order == "columns":
            up, down = jnp.moveaxis(up, 1, 0), jnp.moveaxis(down, 1, 0)

        def inner(h, w):
            return h + jnp.tanh(h @ w[0]) @ w[1], None

        def outer(h, w):
            return lax.scan(inner, h, w)[0], None

        return lax.scan(outer, x, (up, down))[0]


def test_a_step_slicing_a_stack_along_other_axes_is_refused(mesh):
    """The plan's loss scans the stack over axis 0 then 1; a step loss scanning axis 1 first reads
    other layers in each iteration: a ``ValueError`` naming the parameter and both orders."""
    model = GridStack(nnx.Rngs(0))
    x = jnp.ones((mesh.size, 64))
    rows = lambda m, x: jnp.mean(m(x, "rows") ** 2)
    columns = lambda m, x: jnp.mean(m(x, "columns") ** 2)
    fsdp = FSDP(model, mesh, loss_fn=rows, example_batch=x)
    assert info(fsdp, "up").unit.layer_axes == (0, 1), str(fsdp)
    with pytest.raises(
        ValueError, match=r"^(up|down) .* sliced into layers along its axes \(1, 0\), where the plan has \(0, 1\)"
    ):
        lowered(fsdp, columns, x)
    # planned with that loss, it is a unit with the layer axes in that order, and the step runs
    fsdp = FSDP(model, mesh, loss_fn=columns, example_batch=x)
    assert info(fsdp, "up").unit.layer_axes == (1, 0), str(fsdp)
    lowered(fsdp, columns, x)


class ReshapedStackLM(StackLM):
    """The up stack flattened (``[L, d, h]`` -> ``[L, d * h]``) before the scan, each layer
    unflattened in its body."""

    def __call__(self, tokens):
        h = self.embed(tokens)
        up = self.up[...]
        flat = up.reshape(up.shape[0], -1)

        def layer(h, w):
            up, down, scale = w
            return self.block(h, up.reshape(self.up.shape[1:]), down, scale), None

        h, _ = lax.scan(layer, h, (flat, self.down[...], self.scale[...]))
        return self.head(h)


def test_a_stack_reshaped_before_its_scan_is_plain_not_refused(mesh):
    """A reshape before the scan that slices it: the stack is kept plain (gathered whole), with the
    reason in the table, and the step runs."""
    batch = lm_batch(batch_size(mesh.size))
    fsdp = FSDP(ReshapedStackLM(nnx.Rngs(0), "scan"), mesh, loss_fn=lm_loss, example_batch=batch)
    up = info(fsdp, "up")
    assert (up.kind, up.reason) == ("plain", "read by sliced by a scan after a reshape of its axes"), str(fsdp)
    assert info(fsdp, "down").kind == "mxfp8"
    lowered(fsdp, lm_loss, batch)


class ScaleReadTwiceLM(StackLM):
    """The stacked norm scale ``[L, d]`` read one layer at a time by the scan and, whole, by a
    penalty on its mean: a plain parameter whose layer axis the plan must not split."""

    def __call__(self, tokens):
        logits = super().__call__(tokens)
        return logits + 0.0 * jnp.mean(self.scale[...])


def test_a_stacked_plain_parameter_also_read_whole_is_split_off_its_layer_axis(mesh):
    """The scale is split along ``d`` (not its layer axis, which the scan slices) and the step is
    the unsharded model's (a scan over a split layer axis was once an ``AssertionError``)."""
    b = batch_size(mesh.size)
    batch = lm_batch(b)
    layers = 8  # the layer axis divides over 2, 4 or 8 devices: a split the plan must not choose
    model = exact_weights(ScaleReadTwiceLM(nnx.Rngs(0), "scan", layers=layers), tops={"embed": 1.0, "head": 1.0})
    fsdp = FSDP(model, mesh, loss_fn=masked_lm_loss, example_batch=batch)
    scale = info(fsdp, "scale")
    assert (scale.kind, scale.layer_axes, scale.shard_axis) == ("plain", (), 1), str(fsdp)
    want_loss, _, want_params, _ = unsharded_step(model, masked_lm_loss, batch, has_aux=True)
    got_loss, _, got_params, _ = fsdp_step(nnx.clone(model), mesh, masked_lm_loss, batch, has_aux=True)
    tol = tolerance(lm_chain(b, layers))
    m = Mismatches(f"a scale read twice on {mesh.size} devices")
    m.close(got_loss, want_loss, abs(float(want_loss)), tol, "loss")
    compare_params(m, got_params, want_params, nnx.state(model, nnx.Param), tol)
    m.done()
    assert jax.tree.leaves(got_params)


def test_a_context_mesh_is_refused_with_the_way_out(mesh):
    """Under ``jax.set_mesh`` (MaxText's trainer sets its many-axis mesh so), the steps are a
    ``ValueError`` naming the context's axes and the fix; outside the block a plan over that
    many-axis mesh (axes of size 1 included) initialises and steps."""
    devices = np.array(mesh.devices).reshape(-1)
    own = Mesh(devices.reshape(1, len(devices), 1), ("data", "fsdp", "tensor"))
    model, batch = StackLM(nnx.Rngs(0), "scan"), lm_batch(batch_size(mesh.size))
    tx = optax.sgd(1.0)
    fsdp = FSDP(model, own, loss_fn=lm_loss, example_batch=batch)
    with (
        jax.set_mesh(own),
        pytest.raises(ValueError, match=r"axes \{'data': 1, 'fsdp': \d+, 'tensor': 1\} the context.*outside"),
    ):
        fsdp.init(model, tx)
    state = fsdp.init(model, tx)
    with jax.set_mesh(own), pytest.raises(ValueError, match=r"outside the jax.set_mesh block"):
        fsdp.train_step(lm_loss, tx)(state, batch)
    state, loss = fsdp.train_step(lm_loss, tx)(state, batch)
    assert np.isfinite(float(loss)) and int(state.step) == 1
