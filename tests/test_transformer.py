"""The Llama-style LM of ``mxfp8_jax.models`` trained with FSDP on all of the run's devices."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh

from mxfp8_jax import models
from mxfp8_jax._src.compiled import hlo
from mxfp8_jax.flax import FSDP

CFG = models.TransformerConfig(vocab=64, hidden=64, heads=2, head_dim=32, mlp=128, layers=2)
SEQ, BATCH, STEPS = 32, 64, 50


@pytest.fixture(scope="module")
def mesh(devices):
    return Mesh(np.array(devices), ("data",))


@pytest.fixture(scope="module")
def model():
    return models.init_transformer(CFG, seed=1)


def test_model_is_causal_and_task_is_as_documented(model):
    task = models.SequenceTask(CFG.vocab, SEQ, seed=1)
    x = next(task.batches(1, 4))
    np.testing.assert_array_equal(x[:, 2:], task.perm[x[:, :-2]])
    logits = jax.jit(lambda m, t: m(t))(model, x)
    assert logits.shape == (4, SEQ, CFG.vocab) and logits.dtype == jnp.float32
    changed = x.copy()
    changed[:, 20:] = (changed[:, 20:] + 1) % CFG.vocab
    logits2 = jax.jit(lambda m, t: m(t))(model, changed)
    np.testing.assert_array_equal(np.asarray(logits)[:, :20], np.asarray(logits2)[:, :20])
    assert np.abs(np.asarray(logits)[:, 20:] - np.asarray(logits2)[:, 20:]).max() > 1e-3


def test_every_projection_is_a_unit(mesh, model):
    fsdp = FSDP(model, mesh)
    names = {p.name for p in fsdp.units}
    blocks = {f"blocks/attn/{n}/kernel" for n in "qkvo"} | {f"blocks/mlp/{n}/kernel" for n in ("gate", "up", "down")}
    assert names == blocks | {"head/kernel"}
    assert all(p.stack == (CFG.layers,) for p in fsdp.units if p.name.startswith("blocks/"))
    plain = {p.name for p in fsdp.plain}
    assert plain == {"embed/embedding", "blocks/attn_norm/scale", "blocks/mlp_norm/scale", "norm/scale"}
    # without a trace, the stacked norm scales [L, D] are still read one layer at a time: one
    # layer axis and split along D, whatever the device count (L = 2 would split evenly at 2),
    # as the traced plan has them
    batch = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)
    traced = FSDP(model, mesh, loss_fn=models.next_token_loss, example_batch=batch)
    by_name = {p.name: p for p in traced.params}
    for p in fsdp.plain:
        if p.name.startswith("blocks/"):
            assert (p.level, p.shard_axis) == (1, 1) == (by_name[p.name].level, by_name[p.name].shard_axis), p
    assert [(p.level, p.shard_axis) for p in fsdp.plain if p.name == "norm/scale"] == [(0, 0)]


def test_step_hlo_gathers_units_inside_the_loops(mesh):
    # four layers: the forward loop runs all but its last, the backward's all but the last (kept
    # from the forward) and layer 0 (each loop's ends are peeled off them: fsdp_fetch), and XLA
    # inlines a loop of one trip
    cfg = dataclasses.replace(CFG, layers=4)
    fsdp = FSDP(nnx.eval_shape(lambda: models.init_transformer(cfg, seed=1)), mesh)
    tx = optax.adam(1e-3)
    batch = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)
    text = fsdp.lower_train_step(models.next_token_loss, tx, fsdp.abstract_state(tx), batch).compile().as_text()
    found = hlo.collectives(text)
    assert [trip for _, trip in hlo.while_loops(text)] == [cfg.layers - 1, cfg.layers - 2]
    in_loops = [c for c in found if c.loop_depth == 1]
    fwd = [c for c in in_loops if c.computation == hlo.while_loops(text)[0][0]]
    bwd = [c for c in in_loops if c.computation == hlo.while_loops(text)[1][0]]
    if any(c.op == "reduce-scatter" for c in fwd):
        fwd, bwd = bwd, fwd
    # per layer 7 units (q, k, v, o, gate, up, down): the forward gathers their rowwise planes
    # (codes + scales); the backward their columnwise planes, and, recomputing the block under
    # remat, the rowwise planes of the 6 whose outputs a gradient needs (not down's: nothing
    # downstream of it in the block needs its value); one reduce-scatter per unit. The layers'
    # norm scales (a plain [layers, hidden] stack each, small) are gathered whole once, before
    # the loops, so inside them nothing but the units' planes is gathered; their gradients are
    # summed over the devices per iteration (one all-reduce of the two).
    gathers = lambda cs, dtype: sum(c.op == "all-gather" and c.dtypes == (dtype,) for c in cs)
    assert (gathers(fwd, "u8"), gathers(bwd, "u8")) == (7 * 2, 7 * 2 + 6 * 2)
    assert not [c for c in in_loops if c.op == "all-gather" and c.dtypes != ("u8",)]
    assert sorted(c.outputs[0][0] for c in in_loops if c.op == "reduce-scatter") == ["f32"] * 7
    norm_grads = [c.outputs for c in bwd if c.op == "all-reduce" and ("f32", (cfg.hidden,)) in c.outputs]
    assert norm_grads == [(("f32", (cfg.hidden,)),) * 2], norm_grads
    # outside the loops, fp32: the embedding (plain without a trace), the final norm and the two
    # norm stacks, each gathered once; never a master
    assert all(p.shard_axis is not None for p in fsdp.plain)
    f32 = sorted(c.outputs for c in found if c.op == "all-gather" and c.loop_depth == 0 and c.dtypes == ("f32",))
    stacks = [(("f32", (cfg.layers, cfg.hidden)),)] * 2
    assert f32 == sorted([(("f32", (cfg.vocab, cfg.hidden)),), (("f32", (cfg.hidden,)),), *stacks])


def test_mxfp8_trains_like_bf16(mesh, model):
    """Loss falls at least 5x in 50 steps, and MXFP8 ends within 5% of bf16 FSDP."""
    task = models.SequenceTask(CFG.vocab, SEQ, seed=1)
    curves = {}
    for precision in ("mxfp8", "bf16"):
        fsdp = FSDP(model, mesh, precision=precision)
        tx = optax.adam(1e-2)
        state, step = fsdp.init(model, tx), fsdp.train_step(models.next_token_loss, tx)
        losses = []
        for batch in task.batches(STEPS + 1, BATCH):
            state, loss = step(state, batch)
            losses.append(float(loss))
        curves[precision] = losses
    for precision, losses in curves.items():
        assert np.all(np.isfinite(losses)), precision
        assert losses[0] >= 5 * losses[STEPS], (precision, losses[0], losses[STEPS])
    m, b = curves["mxfp8"][STEPS], curves["bf16"][STEPS]
    assert abs(m - b) <= 0.05 * b, (m, b)
