"""The fused all-gather + RMSNorm + MXFP8 quantize inside training: a sequence- and
tensor-parallel transformer on a (fsdp=n/2, tp=2) mesh of the run's n devices.

References: the same model (same weights, same batches) run by FSDP alone on (n,) devices and
on one device, where its norms are the local ``rmsnorm_quant`` (the same activations quantized
the same way); only GEMM summation order and the bf16 rounding of tp partial sums differ.
"""

import collections
import dataclasses

import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

from mxfp8_jax import models
from mxfp8_jax._src.compiled import hlo
from mxfp8_jax.flax import FSDP

CFG = models.TransformerConfig(vocab=64, hidden=64, heads=2, head_dim=32, mlp=128, layers=2, norm="mxfp8")
BATCH, SEQ = 8, 16
TX = optax.adam(1e-3)


@pytest.fixture(scope="module")
def model():
    return models.init_transformer(CFG, seed=0)


@pytest.fixture(scope="module")
def task_batches():
    task = models.SequenceTask(CFG.vocab, SEQ + 1, seed=1)
    return [models.next_token_pairs(t) for t in task.batches(10, BATCH)]


TP = 2  # the tensor-parallel axis; FSDP over the other n / TP devices


def plan(model, devs, layout, cfg=CFG, **kw):
    """FSDP of ``model`` on ``devs``: ``layout`` "fsdp+tp" a (n / TP, TP) mesh, "fsdp" all n
    devices on one FSDP axis, "one" the first device."""
    if cfg is not CFG:
        model = models.init_transformer(cfg, seed=0)
    if layout == "fsdp":
        return model, FSDP(model, Mesh(np.array(devs), ("fsdp",)), **kw)
    if layout == "one":
        return model, FSDP(model, Mesh(np.array(devs[:1]), ("fsdp",)), **kw)
    assert layout == "fsdp+tp", layout
    mesh = Mesh(np.array(devs).reshape(len(devs) // TP, TP), ("fsdp", "tp"))
    return model, FSDP(model, mesh, tp_axis="tp", **kw)


def losses(model, fsdp, batches, steps, *, step=None, also=None):
    """The losses of ``steps`` training steps of ``fsdp`` (``step``: its compiled train step, made
    here if not given), each the loss of the state its step starts from. With ``also``, another
    plan of the same model and its train step, also that plan's loss at each of those states
    (the same parameters in its layout, through ``gather``: exact; its step's loss is that of
    the state given): its forward against ``fsdp``'s on the same values, with no trajectory of
    its own."""
    state = fsdp.init(model, TX)
    step = step or fsdp.train_step(models.next_token_loss, TX)
    out, out_there = [], []
    for b in batches[:steps]:
        if also is not None:
            other, other_step = also
            _, loss_there = other_step(other.init(fsdp.gather(state), TX), b)
            out_there.append(float(loss_there))
        state, loss = step(state, b)
        out.append(float(loss))
    return out if also is None else (out, out_there)


@pytest.fixture(scope="module")
def tp_plan(model, devices):
    """The (n / TP, TP) plan of ``model``, shared: its compiled steps serve every test that
    asks it for the same loss."""
    return plan(model, devices, "fsdp+tp")[1]


@pytest.fixture(scope="module")
def runs(model, tp_plan, devices, task_batches):
    tp = tp_plan
    tp_step = tp.train_step(models.next_token_loss, TX)
    fsdp_only, tp_at_its_states = losses(*plan(model, devices, "fsdp"), task_batches, 10, also=(tp, tp_step))
    return {
        "fsdp": fsdp_only,
        "fsdp+tp at fsdp's states": tp_at_its_states,
        "fsdp+tp": losses(model, tp, task_batches, 10, step=tp_step),
    }


# The tp forward against FSDP alone on the same parameters: the row-parallel o and down GEMMs'
# partial sums are added over tp in fp32 and then rounded once, so only the order of fp32 sums
# differs, and a value differs only where that order changes a rounding (to bf16, or to an E4M3
# code in the next norm's quantization): isolated elements, each by one unit in its last place.
# The loss, a mean over every token of the batch, moves far less than one bf16 ulp (2^-8,
# relative); a layout error under tp (a mis-sliced head, a partial sum dropped or counted twice)
# changes every element it touches. Whole trajectories are not compared: adam's sign-like first
# steps and the discontinuous re-quantization amplify any rounding difference (two FSDP-only
# runs that differ only in fp32 summation order drift apart by the same ~2e-3 within 10 steps).
LOSS_RTOL = 2.0**-8


def test_plan_splits_the_projections(tp_plan, devices):
    fsdp = tp_plan
    roles = {p.name: p.tp for p in fsdp.units}
    assert roles == {
        **{f"blocks/attn/{n}/kernel": "column" for n in "qkv"},
        "blocks/attn/o/kernel": "row",
        "blocks/mlp/gate/kernel": "column",
        "blocks/mlp/up/kernel": "column",
        "blocks/mlp/down/kernel": "row",
        "head/kernel": None,  # not split: FSDP over the fsdp axis, the same on every tp rank
    }
    # a column-parallel unit: each tp rank its half of the outputs (heads x head_dim),
    # stored over the n / TP devices of the fsdp axis; a row-parallel one: its half of the inputs
    n = len(devices)
    q = next(p for p in fsdp.units if p.name == "blocks/attn/q/kernel")
    attn = CFG.heads * CFG.head_dim
    assert (q.unit.in_features, q.unit.out_features, q.unit.num_shards) == (CFG.hidden, attn // TP, n // TP)
    o = next(p for p in fsdp.units if p.name == "blocks/attn/o/kernel")
    assert (o.unit.in_features, o.unit.out_features) == (attn // TP, CFG.hidden)
    head = next(p for p in fsdp.units if p.name == "head/kernel")
    assert head.unit.num_shards == n // TP


def test_losses_match_fsdp_only_and_tp_learns(runs):
    want, got = np.array(runs["fsdp"]), np.array(runs["fsdp+tp at fsdp's states"])
    assert want[-1] < 0.92 * want[0]  # it learns
    np.testing.assert_allclose(got, want, rtol=LOSS_RTOL)  # at each of the 10 states
    own = np.array(runs["fsdp+tp"])  # tp's own optimizer steps learn alike
    assert own[-1] < 0.92 * own[0], own


def test_mxfp8_gemms_from_the_fused_op_match_fsdp_only(devices, task_batches):
    """FSDP(gemm="mxfp8") with the norms' planes as the q/k/v and gate/up GEMMs' operands (the
    fused op's rowwise planes for the forward, its columnwise ones for the wgrad): at each state
    of the (n,) run the (n/2, 2) plan's loss agrees as the dequantized-GEMM plans' do (the same
    fp32 partial sums, rounded once), and its own steps learn alike."""
    cfg = models.TransformerConfig(**{**CFG.__dict__, "gemm": "mxfp8"})
    example = dict(loss_fn=models.next_token_loss, example_batch=task_batches[0], gemm="mxfp8")
    model, tp = plan(None, devices, "fsdp+tp", cfg, **example)
    tp_step = tp.train_step(models.next_token_loss, TX)
    want, got = losses(*plan(None, devices, "fsdp", cfg, **example), task_batches, 6, also=(tp, tp_step))
    assert want[-1] < 0.95 * want[0]  # it learns
    np.testing.assert_allclose(got, want, rtol=LOSS_RTOL)
    own = losses(model, tp, task_batches, 6, step=tp_step)
    assert own[-1] < 0.95 * own[0], own


@pytest.mark.xdist_group("tp-loss-and-grads")
def test_gradients_match_one_device(model, tp_plan, devices, task_batches):
    grads = {}
    for layout in ("fsdp+tp", "one"):
        m, fsdp = (model, tp_plan) if layout == "fsdp+tp" else plan(model, devices, layout)
        _, g = fsdp.loss_and_grads(models.next_token_loss)(fsdp.init(m, TX), task_batches[0])
        grads[layout] = {p.name: np.asarray(fsdp.to_logical(p, g[p.name])) for p in fsdp.trained}
    assert grads["fsdp+tp"].keys() == grads["one"].keys()
    for k, want in grads["one"].items():
        err = np.abs(grads["fsdp+tp"][k] - want).max() / np.abs(want).max()
        # bf16 activations: each program rounds its intermediates to bf16 where its own fusions
        # put the casts (XLA partitions the 8-device step, not the 1-device one), and the partial
        # sums over tp are bf16: a few bf16 ulps (2^-8) of the largest gradient, 8 allowed
        assert err < 8 * 2.0**-8, (k, err)


def test_hlo_fused_call_in_the_loop_and_no_weight_gathered_whole(devices):
    # four layers: the forward loop runs all but its last, the backward's all but the last (kept
    # from the forward) and layer 0, and XLA inlines a loop of one trip
    cfg = dataclasses.replace(CFG, layers=4)
    _, fsdp = plan(models.init_transformer(cfg, seed=0), devices, "fsdp+tp")
    batch = (jax.ShapeDtypeStruct((BATCH, SEQ), np.int32),) * 2
    text = fsdp.lower_train_step(models.next_token_loss, TX, fsdp.abstract_state(TX), batch).compile().as_text()
    loops = hlo.while_loops(text)
    assert [trip for _, trip in loops] == [cfg.layers - 1, cfg.layers - 2]
    fused = [c for c in hlo.custom_calls(text) if c.target == "mxfp8_allgather_rmsnorm_quantize"]
    # per layer its two norms in the forward loop, and again in the backward loop (remat
    # recomputes the block; the op's own VJP is a reduce-scatter, not another fused call), and
    # as often in the three layers peeled off them (the forward's last, the backward's last
    # and layer 0)
    assert sorted(c.loop_depth for c in fused) == [0] * 6 + [1] * 4
    found = hlo.collectives(text)
    # the row-parallel outputs: each device's part of the batch summed over tp by an all-to-all
    # (o and down, forward and remat), not a reduce-scatter of the whole batch
    a2a = [c for c in found if c.op == "all-to-all" and c.loop_depth == 1]
    assert len(a2a) >= 2 * 2
    local_rows = BATCH // (len(devices) // TP)
    assert all(o[1][1] == local_rows for c in a2a for o in c.outputs), a2a
    # the fused op keeps each device's rows where they are: inside the loops nothing but
    # weight planes (u8) is gathered (the layers' norm scales, a small [layers, hidden] fp32
    # stack each, sharded over the FSDP axis, are gathered whole before the loops); an
    # activation or its codes gathered over the FSDP axes would show here as a float gather. A
    # one-device FSDP axis (n = 2) shards no plain parameter: there, no stack is gathered
    fsdp_devices = len(devices) // TP
    moved = [c for c in found if c.op == "all-gather" and c.loop_depth and c.dtypes != ("u8",)]
    assert moved == [], moved
    stacks = [
        c for c in found if c.op == "all-gather" and not c.loop_depth and ("f32", (cfg.layers, cfg.hidden)) in c.outputs
    ]
    assert bool(stacks) == (fsdp_devices > 1), stacks
    # no master weight moves in fp32: the fp32 gathers are plain parameters (a layer's norm
    # scales, the embedding) or activations. A unit's master, gathered, would have its stored
    # shape: a layer's slice of it inside a loop, the whole outside; outside, a plain
    # parameter of that shape (the embedding where it pads like the head) takes one gather
    whole = {p.stored_shape for p in fsdp.units}
    per_layer = {p.stored_shape[1:] for p in fsdp.units if p.stored_shape[0] == cfg.layers}
    plain = collections.Counter(tuple(p.shape) for p in fsdp.plain)

    def squeezed(shape):
        return tuple(d for i, d in enumerate(shape) if d != 1 or i == len(shape) - 1)

    f32_gathers = [c for c in found if c.op == "all-gather" and c.dtypes == ("f32",)]
    if fsdp_devices > 1:
        assert f32_gathers  # the embedding's at least: the check below looks at something
    else:
        assert f32_gathers == [], f32_gathers
    assert not [c for c in f32_gathers if c.loop_depth and squeezed(c.outputs[0][1]) in per_layer], per_layer
    outside = collections.Counter(squeezed(c.outputs[0][1]) for c in f32_gathers if not c.loop_depth)
    assert all(outside[shape] <= plain[shape] for shape in whole), (outside, plain, whole)


@pytest.mark.xdist_group("tp-loss-and-grads")
def test_fused_and_unfused_blocks_give_identical_losses(model, tp_plan, devices, task_batches):
    """The same state through the fused op and through all_gather + rmsnorm_quant: the forward
    is byte-identical, so the losses are equal; the gradients differ only in where the tp
    partial sums are rounded to bf16 (inside the fused op's VJP in fp32, after the unfused
    norm's VJP in bf16)."""
    import dataclasses

    fused = tp_plan
    _, unfused = plan(None, devices, "fsdp+tp", cfg=dataclasses.replace(CFG, norm_path="unfused"))
    state = fused.init(model, TX)
    for b in task_batches[:2]:
        (l1, g1), (l2, g2) = (f.loss_and_grads(models.next_token_loss)(state, b) for f in (fused, unfused))
        assert float(l1) == float(l2)
        for k in g1:
            err = np.abs(np.asarray(g1[k]) - np.asarray(g2[k])).max() / np.abs(np.asarray(g1[k])).max()
            assert err < 2e-2, (k, err)
