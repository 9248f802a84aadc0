"""Gathers ahead of compute: with ``prefetch=1`` a layer's weight gathers can run while the layer
before it computes.

Read from the compiled step's HLO dependency graph (``hlo.gather_overlaps``: for each gather,
the GEMMs that must finish before the GEMMs it feeds but need not finish before it starts, nor
wait for it), on CPU: the dependencies are the program's, whatever a GPU's scheduler then makes
of them. With ``prefetch=0`` every gather waits for the input of the op that reads it, so none
can overlap a GEMM; with ``prefetch=1`` every forward gather but the first layer's can, in a
Python loop over ``nnx.Linear`` blocks and in the package's scanned transformer. The two
programs compute the same loss and gradients bit for bit, and the early gathers cost at most
one layer's gathered weights of temp memory. In the Python loop's backward, each op's gathers
run beside the GEMMs of the op after it (``fsdp_unit.Handoff``).
"""

from __future__ import annotations

import collections
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

from conftest import need_devices

D = 128
BLOCKS = 4


@pytest.fixture(scope="module")
def mesh(devices):
    return Mesh(np.array(devices), ("fsdp",))


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(D, 2 * D, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(2 * D, D, use_bias=False, rngs=rngs)

    def __call__(self, h):
        return h + self.down(jax.nn.gelu(self.up(h)))


class Blocks(nnx.Module):
    """``nnx.Linear`` blocks in a Python loop over an ``nnx.List``, and an output head."""

    def __init__(self, rngs: nnx.Rngs):
        self.blocks = nnx.List([Block(rngs) for _ in range(BLOCKS)])
        self.head = nnx.Linear(D, 32, use_bias=False, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def mse(model, x):
    return (model(x) ** 2).mean()


def keeps_grads() -> optax.GradientTransformation:
    """An optimizer whose state is the step's gradients as they are (its updates are zeros):
    one compiled step gives both the schedule and the gradients."""
    return optax.GradientTransformation(
        lambda params: jax.tree.map(jnp.zeros_like, params),
        lambda grads, state, params=None: (jax.tree.map(jnp.zeros_like, grads), grads),
    )


def compiled(model, mesh, loss_fn, batch, prefetch: int, **options):
    """``(fsdp, compiled train step, (loss, gradients))`` of one step from ``model``."""
    fsdp = FSDP(model, mesh, loss_fn=loss_fn, example_batch=batch, prefetch=prefetch, **options)
    tx = keeps_grads()
    step = fsdp.lower_train_step(loss_fn, tx, fsdp.abstract_state(tx), batch).compile()
    state, loss = step(fsdp.init(model, tx), fsdp.place_batch(batch))
    # the gradients the tests compare bit for bit are the step's, not the optimizer's zeros
    assert any(np.any(np.asarray(g)) for g in jax.tree.leaves(state.opt_state))
    return fsdp, step, (loss, state.opt_state)


def forward_gathers(step) -> list[hlo.GatherOverlap]:
    """The 8-bit forward gathers whose GEMM has GEMMs before it (in its computation)."""
    return [g for g in hlo.gather_overlaps(step.as_text()) if "u8" in g.dtypes and g.before and not g.backward]


def backward_gathers(step) -> list[hlo.GatherOverlap]:
    """The 8-bit gathers of the backward (jax's ``transpose`` names them)."""
    return [g for g in hlo.gather_overlaps(step.as_text()) if "u8" in g.dtypes and g.backward]


def same_bits(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


def layer_bytes(fsdp, prefix: str) -> int:
    """One layer's gathered weights as its GEMMs read them (fp32, padded rows)."""
    return sum(4 * int(np.prod(p.unit.padded_shape())) for p in fsdp.units if p.name.startswith(prefix))


def test_a_python_loop_gathers_each_layer_while_the_layer_before_computes(mesh):
    model = Blocks(nnx.Rngs(0))
    x = np.random.default_rng(0).normal(size=(8 * mesh.size, D)).astype(np.float32)
    f0, step0, grads0 = compiled(model, mesh, mse, x, prefetch=0)
    f1, step1, grads1 = compiled(model, mesh, mse, x, prefetch=1)
    waiting = forward_gathers(step0)
    early = forward_gathers(step1)
    # codes and scales of up and down in every block but the first one's up
    assert len(waiting) == len(early) == 2 * (2 * BLOCKS - 1), (waiting, early)
    assert all(g.overlap == 0 for g in waiting), waiting
    overlapped = [g for g in early if g.overlap >= 1]
    assert len(overlapped) == len(early) - 2, early  # all but the first block's down: its own input
    # the backward: each op's gathers run beside the GEMMs of the op after it (the handoff),
    # where without prefetch each waits for its own op's cotangent
    waiting, early = backward_gathers(step0), backward_gathers(step1)
    assert len(waiting) == len(early) >= 2 * (2 * BLOCKS - 1), (waiting, early)
    assert all(g.overlap == 0 for g in waiting), waiting
    assert all(g.overlap >= 1 for g in early), early
    assert same_bits(grads0, grads1)
    temp0 = step0.memory_analysis().temp_size_in_bytes
    temp1 = step1.memory_analysis().temp_size_in_bytes
    assert temp1 <= temp0 + layer_bytes(f1, "blocks/1/"), (temp0, temp1)


class RematBlocks(Blocks):
    """The same blocks, each under ``nnx.remat`` (as Flax's Gemma example writes them)."""

    def __call__(self, x):
        for block in self.blocks:
            x = nnx.remat(lambda b, h: b(h))(block, x)
        return self.head(x)


def test_a_python_loop_of_remat_blocks_gathers_each_block_while_the_block_before_computes(mesh):
    """Each block is a region of its own; under ``prefetch=1`` its forward gathers wait for the
    input of the block before (``fsdp_fetch.region_ahead``), not its own. In the backward the
    recomputed forward waits for the block's cotangent, as without prefetch."""
    model = RematBlocks(nnx.Rngs(0))
    x = np.random.default_rng(0).normal(size=(8 * mesh.size, D)).astype(np.float32)
    _, step0, grads0 = compiled(model, mesh, mse, x, prefetch=0)
    _, step1, grads1 = compiled(model, mesh, mse, x, prefetch=1)
    waiting, early = forward_gathers(step0), forward_gathers(step1)
    assert len(waiting) == len(early) == 2 * (2 * BLOCKS - 1), (waiting, early)
    assert all(g.overlap == 0 for g in waiting), waiting
    # all but the first block's down projection, which waits for the block's own input
    assert sum(g.overlap >= 1 for g in early) == len(early) - 2, early
    assert same_bits(grads0, grads1)


def test_a_scanned_transformer_gathers_without_waiting_for_the_carried_activation(mesh, monkeypatch):
    """The package's transformer (``nnx.scan`` over ``nnx.remat`` blocks): with ``prefetch=1``
    every gather in the loop bodies that has GEMMs before its own can overlap one, forward and
    backward, and none depends on the loop's carried values. The weights of each iteration's
    first GEMMs (the q, k and v projections, which read one activation) are gathered in the
    iteration before and carried to it, in the forward loop (once that iteration's first GEMM
    has run) and in the backward's (whose recomputed forward reads them first).

    The norm scales (plain ``[layers, hidden]`` stacks) are gathered whole once, before the
    loops, so the loop bodies gather only the units' 8-bit planes (on a GPU, which runs one
    collective at a time, no small gather holds back a weight gather). Gathered per iteration
    instead (stacks over ``WHOLE_BEFORE_LOOP`` bytes) the gradients are the same bits."""
    from mxfp8_jax._src.compiled import hlo_schedule
    from mxfp8_jax._src.fsdp import fsdp_eval

    cfg = models.TransformerConfig(layers=4)  # loops of 3 and 2 trips: XLA inlines a loop of one
    model = models.init_transformer(cfg)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab, (2 * mesh.size, 33)).astype(np.int32)
    f0, step0, grads0 = compiled(model, mesh, models.next_token_loss, tokens, prefetch=0)
    f1, step1, grads1 = compiled(model, mesh, models.next_token_loss, tokens, prefetch=1)
    loops = {body for body, _ in hlo.while_loops(step1.as_text())}
    waiting = [g for g in forward_gathers(step0)]
    early = [g for g in forward_gathers(step1) if g.computation in loops]
    assert waiting and all(g.overlap == 0 for g in waiting), waiting
    assert early and all(g.overlap >= 1 for g in early), early
    # the backward's gathers in the reverse loop too
    backward = [
        g
        for g in hlo.gather_overlaps(step1.as_text())
        if g.backward and g.before and g.computation in loops and "u8" in g.dtypes
    ]
    assert backward and all(g.overlap >= 1 for g in backward), backward
    # no 8-bit gather in a loop waits for what the loop carries (the activation forward, the
    # cotangent backward, the recomputed forward's too): XLA:GPU's collective pipeliner may move
    # each one into the iteration before; with prefetch=0 every one of them does wait
    # (the forward's gathers of the next layer's first weights wait for this layer's first GEMM,
    # which the carry feeds: XLA then cannot run them, or a gather it combines them with, before it)
    carried = lambda step: [
        g.carried
        for g in hlo.gather_overlaps(step.as_text())
        if g.computation in loops and "u8" in g.dtypes and not g.ahead
    ]
    assert carried(step1) and not any(carried(step1)), carried(step1)
    assert all(carried(step0)), carried(step0)
    # gathered an iteration ahead: codes and scales of q, k and v, in each loop; none without prefetch
    ahead = lambda step: collections.Counter(
        g.computation for g in hlo.gather_overlaps(step.as_text()) if g.ahead and "u8" in g.dtypes
    )
    assert ahead(step1) == dict.fromkeys(loops, 6), ahead(step1)
    assert not ahead(step0), ahead(step0)
    assert same_bits(grads0, grads1)
    temp0 = step0.memory_analysis().temp_size_in_bytes
    temp1 = step1.memory_analysis().temp_size_in_bytes
    layer = sum(4 * int(np.prod(p.unit.padded_shape())) // cfg.layers for p in f1.units if p.unit.level)
    assert temp1 <= temp0 + layer, (temp0, temp1, layer)

    def loop_gathers(step):
        gathers = hlo_schedule.async_collectives(step.as_text(), "all-gather")
        return [c for c in gathers if c.computation in loops], [c for c in gathers if c.computation not in loops]

    inside, outside = loop_gathers(step1)
    assert inside and all(d == "u8" for c in inside for d, _ in c.outputs), [c.outputs for c in inside]
    assert [c for c in outside if ("f32", (cfg.layers, cfg.hidden)) in c.outputs], [c.outputs for c in outside]
    monkeypatch.setattr(fsdp_eval, "WHOLE_BEFORE_LOOP", 0)
    _, per_layer, grads_per_layer = compiled(model, mesh, models.next_token_loss, tokens, prefetch=1)
    loops = {body for body, _ in hlo.while_loops(per_layer.as_text())}
    inside, _ = loop_gathers(per_layer)
    assert any(d == "f32" for c in inside for d, _ in c.outputs), [c.outputs for c in inside]
    assert same_bits(grads1, grads_per_layer)


def test_a_fori_loop_picking_stacked_blocks_by_its_counter_is_the_scanned_step(mesh):
    """``layer_loop="fori"``: a ``lax.fori_loop`` picks each stacked block's state by its counter
    (``blocks[i]``). The step is the scanned form's: two loops, one trip per layer but the peeled ones
    (the forward loop's last layer is peeled off it; the backward's last, kept from the forward,
    and layer 0), q, k and v gathered an iteration ahead in each, and the same gradients bit
    for bit."""
    cfg = models.TransformerConfig(layers=4, layer_loop="fori")
    model = models.init_transformer(cfg)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab, (2 * mesh.size, 33)).astype(np.int32)
    _, step, grads = compiled(model, mesh, models.next_token_loss, tokens, prefetch=1)
    text = step.as_text()
    loops = hlo.while_loops(text)
    assert [trips for _, trips in loops] == [cfg.layers - 1, cfg.layers - 2], loops
    ahead = collections.Counter(g.computation for g in hlo.gather_overlaps(text) if g.ahead and "u8" in g.dtypes)
    assert ahead == dict.fromkeys((body for body, _ in loops), 6), ahead
    scanned = models.init_transformer(dataclasses.replace(cfg, layer_loop="scan"))
    _, _, want = compiled(scanned, mesh, models.next_token_loss, tokens, prefetch=1)
    assert same_bits(grads, want)


def test_a_scan_without_remat_gathers_its_first_weights_ahead_in_the_forward(mesh):
    """``remat=False``: the forward loop gathers the next layer's q, k and v an iteration ahead.
    The backward is jax's derivative of the scan (it saves the forward's residuals), with the
    layer's unit GEMMs linked in the handoff: each op's backward gathers the backward weight of
    the op before it, and the first op's, that of the layer before's last op, which the loop
    carries to the next iteration. Gradients bit for bit those of ``prefetch=0``."""
    cfg = models.TransformerConfig(layers=2, remat=False)
    model = models.init_transformer(cfg)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab, (2 * mesh.size, 33)).astype(np.int32)
    _, step, grads = compiled(model, mesh, models.next_token_loss, tokens, prefetch=1)
    text = step.as_text()
    (forward, _), (backward, _) = hlo.while_loops(text)
    gathers = [g for g in hlo.gather_overlaps(text) if "u8" in g.dtypes]
    ahead = collections.Counter(g.computation for g in gathers if g.ahead)
    # forward: q, k and v (codes and scales); backward: the down projection's planes
    assert ahead == {forward: 6, backward: 2}, (ahead, forward, backward)
    # the other backward gathers can run beside a GEMM of the op after them in the forward,
    # but one op's: the cotangents of q, k and v come together, from the attention's backward
    handed = [g for g in gathers if g.computation == backward and not g.ahead]
    assert len(handed) == 12 and sum(g.overlap >= 1 for g in handed) == 10, handed
    _, _, want = compiled(model, mesh, models.next_token_loss, tokens, prefetch=0)
    assert same_bits(grads, want)


def test_prefetch_must_be_a_count_of_layers(mesh):
    x = np.zeros((8 * mesh.size, D), np.float32)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="prefetch="):
            FSDP(Blocks(nnx.Rngs(0)), mesh, loss_fn=mse, example_batch=x, prefetch=bad)


def test_gather_overlaps_reads_the_dependency_graph():
    """A gather that depends only on a parameter can overlap the GEMM that feeds its own GEMM's
    other operand; one made to wait for that GEMM's output cannot; a GEMM inside a fusion
    counts; a gather with no GEMM before its consumer has nothing to overlap."""
    text = """HloModule m

%fused_dot (a: f32[4,4], b: f32[4,4]) -> f32[4,4] {
  %a = f32[4,4]{1,0} parameter(0)
  %b = f32[4,4]{1,0} parameter(1)
  ROOT %dot.9 = f32[4,4]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (p0: f32[4,4], p1: u8[1,4], p2: f32[4,4]) -> f32[4,4] {
  %p0 = f32[4,4]{1,0} parameter(0)
  %p1 = u8[1,4]{1,0} parameter(1)
  %p2 = f32[4,4]{1,0} parameter(2)
  %free = u8[4,4]{1,0} all-gather(%p1), dimensions={0}
  %first = f32[4,4]{1,0} fusion(%p0, %p2), kind=kCustom, calls=%fused_dot
  %w = f32[4,4]{1,0} convert(%free)
  %second = f32[4,4]{1,0} dot(%first, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %token = u8[1,4]{1,0} convert(%second)
  %waiting = u8[4,4]{1,0} all-gather(%token), dimensions={0}, metadata={op_name="jit(step)/transpose(jvp())/all_gather"}
  %w2 = f32[4,4]{1,0} convert(%waiting)
  ROOT %third = f32[4,4]{1,0} dot(%second, %w2), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""
    got = {g.name: (g.before, g.overlap, g.backward, g.dtypes) for g in hlo.gather_overlaps(text)}
    assert got == {"free": (1, 1, False, ("u8",)), "waiting": (2, 0, True, ("u8",))}, got


def test_under_tensor_parallelism_the_loop_gathers_do_not_wait_for_the_carry(devices):
    """The transformer on an (n/2 fsdp, 2 tp) mesh, its norms fused all-gather + RMSNorm + MXFP8
    ops over tp: with ``prefetch=1`` no 8-bit gather in the loops depends on what they carry,
    each loop gathers the next layer's q, k and v an iteration ahead, and the loss and gradients
    are those of ``prefetch=0`` bit for bit."""
    devs = need_devices(4)
    cfg = models.TransformerConfig(vocab=64, hidden=64, heads=2, head_dim=32, mlp=128, layers=3, norm="mxfp8")
    model = models.init_transformer(cfg, seed=0)
    mesh = Mesh(np.array(devs).reshape(len(devs) // 2, 2), ("fsdp", "tp"))
    task = models.SequenceTask(cfg.vocab, 17, seed=1)
    batch = models.next_token_pairs(next(iter(task.batches(1, 2 * len(devs)))))
    carried, ahead, grads = {}, {}, {}
    for prefetch in (0, 1):
        _, step, grads[prefetch] = compiled(model, mesh, models.next_token_loss, batch, prefetch, tp_axis="tp")
        text = step.as_text()
        loops = {body for body, _ in hlo.while_loops(text)}
        carried[prefetch] = [
            g.carried for g in hlo.gather_overlaps(text) if g.computation in loops and "u8" in g.dtypes and not g.ahead
        ]
        ahead[prefetch] = collections.Counter(g.computation for g in hlo.gather_overlaps(text) if g.ahead)
    assert carried[0] and all(carried[0]), carried[0]
    assert carried[1] and not any(carried[1]), carried[1]
    assert not ahead[0] and ahead[1] == dict.fromkeys(loops, 6), ahead
    assert same_bits(grads[0], grads[1])
