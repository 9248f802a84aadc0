"""The model's own sharding constraints: reported when they replicate what the step splits, kept or dropped.

MaxText pins its activations with logical constraints over a mesh of its own; on a CPU
configuration they are ``P(None, None, None)``: replicated. The FSDP step evaluates the loss as
``jax.jit`` would, so it honours them: XLA all-gathers the activation at each one and the ops
after it run on the whole batch on every device. The plan finds each such constraint, lists it in
the table, and warns once; ``model_constraints="drop"`` ignores them. Either way the step is the
unsharded model's.
"""

from __future__ import annotations

import warnings

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
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
from mxfp8_jax.flax import FSDP, ModelConstraintWarning


@pytest.fixture(scope="module")
def mesh(devices):
    return Mesh(np.array(devices), ("fsdp",))


class PinnedLM(nnx.Module):
    """A token LM that pins its activations replicated, as MaxText's CPU configuration does: a
    constraint on a mesh of its own (other axis names, the same devices) with every axis
    ``None``, after the embedding and after each of ``pins`` more sublayers."""

    def __init__(self, rngs: nnx.Rngs, own: Mesh):
        self.own = own
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.up = nnx.Linear(D, H, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(H, D, use_bias=False, rngs=rngs)
        self.head = nnx.Linear(D, VOCAB, use_bias=False, rngs=rngs)

    def pin(self, x):
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.own, P(None, None, None)))

    def __call__(self, tokens):
        h = self.pin(self.embed(tokens))
        u = self.pin(jax.nn.gelu(self.up(h)))
        return self.head(self.pin(h + self.down(u)))


PINS = 3


def own_mesh(mesh: Mesh) -> Mesh:
    devices = np.array(mesh.devices).reshape(-1)
    return Mesh(devices.reshape(1, 1, len(devices)), ("data", "stage", "tensor"))


def activation_gathers(fsdp, batch) -> list:
    """The compiled step's all-gathers of floating activations (not the weights' 8-bit or
    16-bit planes)."""
    loss = lambda m, b: masked_lm_loss(m, b)[0]
    tx = optax.sgd(1.0)
    text = fsdp.lower_train_step(loss, tx, fsdp.abstract_state(tx), batch).compile().as_text()
    return [c for c in hlo.collectives(text) if c.op == "all-gather" and any(d == "f32" for d, _ in c.outputs)]


def test_replicating_constraints_are_reported_and_kept_or_dropped(mesh):
    """``keep`` (default): one ``ModelConstraintWarning`` naming the first constraint, where it is
    and what it costs; the table lists them; the compiled step all-gathers activations.
    ``drop``: no warning, the table says so, no activation is gathered. Both steps are the
    unsharded model's, loss and update."""
    b = batch_size(mesh.size)
    batch = lm_batch(b)
    model = exact_weights(PinnedLM(nnx.Rngs(0), own_mesh(mesh)), tops={"embed": 1.0, "head": 1.0})
    with pytest.warns(ModelConstraintWarning) as caught:
        kept = FSDP(model, mesh, loss_fn=masked_lm_loss, example_batch=batch)
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert f"{PINS} replicate activations" in message and "test_fsdp_constraints.py" in message, message
    assert f"pins float32[{b},{lm_batch(b)['x'].shape[1]},{D}] to P(None, None, None)" in message, message
    assert "model_constraints='drop'" in message and caught[0].filename == __file__, message
    assert [c.dims for c in kept.constraints] == [(0,)] * PINS
    assert "model sharding constraints: 3" in str(kept) and "Kept:" in str(kept)

    with warnings.catch_warnings():
        warnings.simplefilter("error", ModelConstraintWarning)
        dropped = FSDP(model, mesh, loss_fn=masked_lm_loss, example_batch=batch, model_constraints="drop")
    assert "Dropped (model_constraints='drop')" in str(dropped)

    assert len(activation_gathers(kept, batch)) >= PINS
    assert activation_gathers(dropped, batch) == []

    # the model's own step under jax.jit (its constraints need the mesh's devices)
    want_loss, _, want_params, _ = unsharded_step(model, masked_lm_loss, batch, has_aux=True, mesh=mesh)
    tol = tolerance(lm_chain(b))
    for mode in ("keep", "drop"):
        m = Mismatches(f"model_constraints={mode!r} on {mesh.size} devices")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ModelConstraintWarning)  # checked above
            got_loss, _, got_params, _ = fsdp_step(
                nnx.clone(model), mesh, masked_lm_loss, batch, has_aux=True, model_constraints=mode
            )
        m.close(got_loss, want_loss, abs(float(want_loss)), tol, "loss")
        compare_params(m, got_params, want_params, nnx.state(model, nnx.Param), tol)
        m.done()


def test_constraints_that_split_the_batch_are_not_reported(mesh):
    """A constraint that splits the batch axis (over the model's own mesh) or leaves it
    unconstrained replicates nothing the step splits: no warning, nothing listed."""

    class Splitting(PinnedLM):
        def pin(self, x):
            spec = P(("data", "stage", "tensor"), P.UNCONSTRAINED, None)
            return jax.lax.with_sharding_constraint(x, NamedSharding(self.own, spec))

    batch = lm_batch(batch_size(mesh.size))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ModelConstraintWarning)
        fsdp = FSDP(Splitting(nnx.Rngs(0), own_mesh(mesh)), mesh, loss_fn=masked_lm_loss, example_batch=batch)
    assert fsdp.constraints == () and "model sharding constraints" not in str(fsdp)


def test_model_constraints_is_checked(mesh):
    with pytest.raises(ValueError, match=r"model_constraints='off' must be one of \('keep', 'drop'\)"):
        FSDP(
            PinnedLM(nnx.Rngs(0), own_mesh(mesh)),
            mesh,
            loss_fn=masked_lm_loss,
            example_batch=lm_batch(batch_size(mesh.size)),
            model_constraints="off",
        )
