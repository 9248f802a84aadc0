"""Layers read by index, in loops and branches: each gathered a layer at a time, the step exact.

Models keep their layers as stacked arrays and index them (``w[i]``) in a ``fori_loop`` (static
bounds: a scan whose consts hold the stack), in a Python loop (static slices), inside
``lax.cond`` branches (LayerDrop), or apply one block many times. Each test runs one
``optax.sgd(1.0)`` step of such a model with power-of-two weights, the one-device step as the
oracle (``test_fsdp_semantics``: the two may differ only in the order of fp32 sums), and reads
the plan and the compiled step: the stacked weights are MXFP8 units gathered one layer per read,
the plan counts the gathers a step runs, and memory grows with depth as for the same model under
``lax.scan``.
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
    fsdp_step,
    lm_batch,
    lm_chain,
    masked_lm_loss,
    tolerance,
    unsharded_step,
)

from mxfp8_jax._src.compiled import hlo
from mxfp8_jax.flax import FSDP

from conftest import need_devices

LAYERS = 3


@pytest.fixture(scope="module")
def mesh(devices):
    return Mesh(np.array(devices), ("fsdp",))


def rms(h, scale):
    return h * lax.rsqrt((h * h).mean(-1, keepdims=True) + 1e-6) * scale


class StackLM(nnx.Module):
    """A token LM whose blocks are stacked ``nnx.Param``s ``[L, ...]`` (a norm scale, an up and a
    down projection), run as ``loop`` says: ``"fori"`` (``lax.fori_loop`` reading ``w[i]``),
    ``"python"`` (``w[i]`` with a static ``i``), ``"scan"`` (``lax.scan`` over the stacks),
    ``"cond"`` (LayerDrop: a Python loop whose block ``i`` runs under ``lax.cond`` on a
    predicate of the tokens) or ``"shared"`` (block 0 applied ``layers`` times by a
    ``fori_loop``)."""

    def __init__(self, rngs: nnx.Rngs, loop: str, layers: int = LAYERS, d: int = D, h: int = H):
        self.loop, self.layers = loop, layers
        self.embed = nnx.Embed(VOCAB, d, rngs=rngs)
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Param(init(rngs.params(), (layers, d, h)))
        self.down = nnx.Param(init(rngs.params(), (layers, h, d)))
        self.scale = nnx.Param(jnp.ones((layers, d)))
        self.head = nnx.Linear(d, VOCAB, use_bias=False, rngs=rngs)

    def block(self, h, up, down, scale):
        return h + jax.nn.gelu(rms(h, scale) @ up) @ down

    def layer(self, i, h):
        return self.block(h, self.up[i], self.down[i], self.scale[i])

    def __call__(self, tokens):
        h = self.embed(tokens)
        if self.loop == "fori":
            h = lax.fori_loop(0, self.layers, self.layer, h)
        elif self.loop == "python":
            for i in range(self.layers):
                h = self.layer(i, h)
        elif self.loop == "scan":
            h, _ = lax.scan(lambda h, w: (self.block(h, *w), None), h, (self.up[...], self.down[...], self.scale[...]))
        elif self.loop == "cond":
            for i in range(self.layers):
                keep = (tokens.sum() + i) % 3 != 0
                h = lax.cond(keep, lambda h, i=i: self.layer(i, h), lambda h: h, h)
        elif self.loop == "shared":
            h = lax.fori_loop(0, self.layers, lambda _, h: self.layer(0, h), h)
        elif self.loop == "while":
            h = lax.while_loop(lambda c: c[0] < self.layers, lambda c: (c[0] + 1, self.layer(c[0], c[1])), (0, h))[1]
        return self.head(h)


def model_of(loop: str, **kw) -> StackLM:
    return exact_weights(StackLM(nnx.Rngs(0), loop, **kw), tops={"embed": 1.0, "head": 1.0})


def lm_loss(model, batch):
    return masked_lm_loss(model, batch)[0]


def info(fsdp, name):
    return next(p for p in fsdp.params if p.name == name)


@pytest.mark.parametrize("loop", ["fori", "python", "cond", "shared"])
def test_a_stack_read_by_index_is_a_unit_read_a_layer_at_a_time_and_the_step_is_exact(mesh, loop):
    """The stacked projections are MXFP8 units with one layer axis and the stacked norm scale a
    plain parameter split after its layer axis; the plan counts each read once per trip, of the
    layer it reads; the step's loss and update are the unsharded model's."""
    b = batch_size(mesh.size)
    model, batch = model_of(loop), lm_batch(b)
    fsdp = FSDP(model, mesh, loss_fn=masked_lm_loss, example_batch=batch)
    up, scale = info(fsdp, "up"), info(fsdp, "scale")
    assert (up.kind, up.level, up.stack, up.unit.k_axes) == ("mxfp8", 1, (LAYERS,), (1,)), str(fsdp)
    assert (scale.kind, scale.level, scale.shard_axis) == ("plain", 1, 1), str(fsdp)
    # the whole stack gathered once forward and once backward per step; the shared block's
    # layer 0 once per trip (a third of the stack each), the others never
    assert up.gathers == pytest.approx(2.0), str(fsdp)
    assert scale.gathers == pytest.approx(1.0)

    want_loss, _, want_params, _ = unsharded_step(model, masked_lm_loss, batch, has_aux=True)
    got_loss, _, got_params, _ = fsdp_step(nnx.clone(model), mesh, masked_lm_loss, batch, has_aux=True)
    tol = tolerance(lm_chain(b, LAYERS))
    m = Mismatches(f"{loop} stack on {mesh.size} devices")
    m.close(got_loss, want_loss, abs(float(want_loss)), tol, "loss")
    compare_params(m, got_params, want_params, nnx.state(model, nnx.Param), tol)
    m.done()
    if loop == "cond":  # the data take both branches
        keeps = [(int(batch["x"].sum()) + i) % 3 != 0 for i in range(LAYERS)]
        assert any(keeps) and not all(keeps)


def test_the_fori_loop_gathers_one_layer_per_iteration(mesh):
    """In the compiled step the loops' all-gathers move one layer of a stacked unit (its 8-bit
    rows), never the stack; the loops run once per layer."""
    b = batch_size(mesh.size)
    model, batch = model_of("fori"), lm_batch(b)
    fsdp = FSDP(model, mesh, loss_fn=lm_loss, example_batch=batch)
    tx = optax.sgd(1.0)
    text = fsdp.lower_train_step(lm_loss, tx, fsdp.abstract_state(tx), batch).compile().as_text()
    loops = hlo.while_loops(text)
    assert [trip for _, trip in loops] == [LAYERS, LAYERS], loops
    in_loops = [c for c in hlo.collectives(text) if c.op == "all-gather" and c.loop_depth >= 1]
    # one layer of up or down: its rows padded to whole 32-row blocks on every device
    layers = {name: info(fsdp, name).unit for name in ("up", "down")}
    layer = max(g.out_padded * g.in_features for g in layers.values())
    shapes = [(d, s) for c in in_loops for d, s in c.outputs]
    assert shapes and all(int(np.prod(s)) <= layer for _, s in shapes), shapes
    codes = {s for d, s in shapes if d == "u8"}
    want = {(g.out_padded, g.in_features) for g in layers.values()}
    assert want <= codes, (want, shapes)  # each projection's codes, a layer at a time


def temp_bytes(loop: str, layers: int, mesh) -> int:
    model = StackLM(nnx.Rngs(0), loop, layers=layers, d=256, h=512)
    batch = lm_batch(mesh.size)
    fsdp = FSDP(model, mesh, loss_fn=lm_loss, example_batch=batch)
    tx = optax.sgd(1.0)
    compiled = fsdp.lower_train_step(lm_loss, tx, fsdp.abstract_state(tx), batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_memory_per_layer_of_an_indexed_stack_is_that_of_lax_scan(devices):
    """Temp memory of the compiled step per added layer (depth 2 -> 6, wide layers and one
    sequence per device, so the weights dominate), on 8 devices: the Python-loop and LayerDrop
    forms within 10% of the lax.scan form's (or below it). The fori_loop form is run as the
    scan (``core.jaxprs.counted_stacks``), so it is not measured again."""
    mesh = Mesh(np.array(need_devices(8)), ("fsdp",))
    loops = ("scan", "python", "cond")
    slope = {loop: (temp_bytes(loop, 6, mesh) - temp_bytes(loop, 2, mesh)) / 4 for loop in loops}
    assert slope["scan"] > 0, slope
    for loop in loops[1:]:
        assert slope[loop] <= 1.10 * slope["scan"], slope


def test_a_while_loop_is_evaluated_and_refused_for_training(mesh):
    """``lax.while_loop`` over the layers: ``eval_step`` gives the unsharded model's loss; a
    training step is a clear error (jax has no reverse-mode derivative of a while loop)."""
    b = batch_size(mesh.size)
    model, batch = model_of("while"), lm_batch(b)

    loss_fn = lm_loss
    fsdp = FSDP(model, mesh, loss_fn=loss_fn, example_batch=batch)
    up = info(fsdp, "up")
    assert (up.kind, up.level, up.in_while) == ("mxfp8", 1, True), str(fsdp)
    assert "a while trip" in next(line for line in str(fsdp).splitlines() if line.startswith("up "))
    tx = optax.sgd(1.0)
    state = fsdp.init(model, tx)
    got = fsdp.eval_step(loss_fn)(state, batch)
    want = jax.jit(loss_fn)(model, batch)
    tol = tolerance(lm_chain(b, LAYERS))
    np.testing.assert_allclose(float(got), float(want), rtol=tol)
    with pytest.raises(ValueError, match=r"reads (up|down) inside a lax.while_loop.*fori_loop Python int bounds"):
        fsdp.train_step(loss_fn, tx)(state, batch)


def test_an_unused_parameter_is_listed_as_unused(mesh):
    class WithSpare(StackLM):
        def __init__(self, rngs):
            super().__init__(rngs, "fori")
            self.spare = nnx.Param(jnp.ones((64, 64)))

    b = batch_size(mesh.size)
    fsdp = FSDP(WithSpare(nnx.Rngs(0)), mesh, loss_fn=lm_loss, example_batch=lm_batch(b))
    spare = info(fsdp, "spare")
    assert spare.gathers == 0
    row = next(line for line in str(fsdp).splitlines() if line.startswith("spare "))
    assert "unused" in row and "not read by the loss" in row, row
