"""FSDP units of 32x32 weight blocks (``FSDP(weight_blocks="32x32")``): one plane per unit, the
same plane gathered for the forward and for the dgrad, tile scales expanded after the gather.

Oracles are independent of the code under test: the numpy oracle's 32x32 quantize
(tests/numpy_oracle.py) gives the stored bytes and, dequantized, the kernels of test_flax's
single-device reference (both directions read the same values); the HLO is read with
``mxfp8_jax._src.compiled.hlo``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh
from test_flax import (
    HIDDEN,
    IN,
    column_errors,
    grads_by_name,
    loss_fn,
    make_batch,
    make_net,
    params_of,
    reference_grads,
)

from mxfp8_jax._src.buffers import checkpoint
from mxfp8_jax._src.compiled import hlo
from mxfp8_jax._src.fsdp import fsdp_table
from mxfp8_jax.flax import FSDP

import numpy_oracle as npo
from conftest import as_bytes

E4M3 = np.dtype(jnp.float8_e4m3fn)


@pytest.fixture(scope="module")
def mesh(devices):
    return Mesh(np.array(devices), ("data",))


def tile_values(kernel) -> np.ndarray:
    """The kernel ``[in, out]`` as a 32x32 unit reads it (both directions): ``W = kernel.T``
    quantized in 32x32 tiles by the oracle, dequantized exactly, as ``[in, out]``."""
    q, s = npo.quantize_tiles(np.asarray(kernel, np.float32).T)
    scales = np.repeat(np.repeat(s.astype(np.int64), 32, axis=0), 32, axis=1)
    return (q.view(E4M3).astype(np.float64) * np.ldexp(1.0, scales - 127)).T.astype(np.float32)


@pytest.fixture(scope="module")
def tiled(mesh):
    model = make_net(jnp.float32, wide_range=True)
    fsdp = FSDP(model, mesh, weight_blocks="32x32")
    return model, fsdp, fsdp.init(model, optax.sgd(0.1))


def test_a_unit_stores_one_plane_the_oracles_tiles(tiled):
    model, fsdp, state = tiled
    before = params_of(model)
    assert [p.name for p in fsdp.units] == ["l1/kernel", "l2/kernel"]
    for p in fsdp.units:
        planes = state.quantized[p.name]
        assert planes.tiled and planes.columnwise_data is None and planes.columnwise_scale is None
        out = p.unit.out_features
        want_q, want_s = npo.quantize_tiles(before[p.name].T)
        np.testing.assert_array_equal(
            as_bytes(np.asarray(planes.rowwise_data)[:out]), want_q.reshape(-1), err_msg=p.name
        )
        np.testing.assert_array_equal(np.asarray(planes.rowwise_scale)[: out // 32], want_s, err_msg=p.name)
        # the padding rows' tiles: zero codes
        assert not np.asarray(planes.rowwise_data)[out:].any()
        # what the table says a device stores: its master rows, codes and tile scales
        held = [state.master[p.name], *jax.tree.leaves(planes)]
        assert sum(a.addressable_shards[0].data.nbytes for a in held) == fsdp_table.stored_bytes(p, fsdp.mesh.size)
    # the round trip: the master as it was
    after = params_of(fsdp.gather(state))
    for k in before:
        np.testing.assert_array_equal(as_bytes(after[k]), as_bytes(before[k]), err_msg=k)


def test_gradients_match_the_single_device_reference(tiled):
    """fp32 compute: the forward and the dgrad read the same tile values; the only differences
    from the reference are fp32 summation order (batch split, psum_scatter)."""
    model, fsdp, state = tiled
    batch = make_batch()
    loss, grads = fsdp.loss_and_grads(loss_fn)(state, batch)
    params = params_of(model)
    kernels = {k: (tile_values(params[k]),) * 2 for k in ("l1/kernel", "l2/kernel")}
    plain = {k: v for k, v in params.items() if k not in kernels}
    ref_loss, ref = reference_grads(kernels, plain, batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    got = grads_by_name(fsdp, grads)
    tol = 1e-5
    for k in ref:
        assert column_errors(got[k], ref[k]).max() < tol, k
    # The tolerance separates the block shapes: the 1x32 planes' values give other gradients.
    one_by_32 = {k: tuple(v.T.astype(np.float32) for v in npo.mxfp8_weights(params[k].T)) for k in kernels}
    _, other = reference_grads(one_by_32, plain, batch)
    assert column_errors(other["l1/kernel"], ref["l1/kernel"]).max() > 100 * tol


@pytest.mark.parametrize("gemm", ["dequantized", "mxfp8"])
def test_weights_the_tiles_represent_train_the_same_as_1x32(mesh, gemm):
    """A weight whose values 32x32 tiles represent exactly is represented exactly by 1x32
    blocks too (a block's scale is at most its tile's): the two block shapes give the same
    loss and gradients, bit for bit, with dequantized GEMMs and with MXFP8 GEMMs (whose weight
    operands are the tile scales expanded to each direction's blocks)."""
    model = make_net(jnp.float32)
    for path, var in nnx.to_flat_state(nnx.state(model)):
        if path[-1] == "kernel" and path[0] in ("l1", "l2"):
            var.set_value(jnp.asarray(tile_values(var.get_value())))
    assert_same_step_under_either_blocks(model, mesh, loss_fn, make_batch(), gemm=gemm)


def assert_same_step_under_either_blocks(model, mesh, loss, batch, **kw):
    """1x32 and 32x32 units of ``model`` give the same loss and gradients, bit for bit."""
    results = []
    for blocks in ("1x32", "32x32"):
        fsdp = FSDP(model, mesh, weight_blocks=blocks, **kw)
        assert all(p.unit.blocks == blocks for p in fsdp.units if p.kind == "mxfp8")
        value, grads = fsdp.loss_and_grads(loss)(fsdp.init(model, optax.sgd(0.1)), batch)
        results.append((np.asarray(value), grads_by_name(fsdp, grads)))
    (loss_a, grads_a), (loss_b, grads_b) = results
    np.testing.assert_array_equal(as_bytes(loss_a), as_bytes(loss_b))
    for k in grads_a:
        np.testing.assert_array_equal(as_bytes(grads_a[k]), as_bytes(grads_b[k]), err_msg=k)


def test_the_step_gathers_one_plane_per_pass(mesh):
    """From the compiled step: each unit's forward and dgrad gather the same 8-bit arrays, its
    codes and tile scales (8 + 8/1024 bits a weight), what the plan's table counts; a 1x32 unit
    gathers 8 + 8/32."""
    model = make_net(jnp.bfloat16)
    tx = optax.sgd(0.1)
    moved = {}
    for blocks in ("1x32", "32x32"):
        fsdp = FSDP(model, mesh, weight_blocks=blocks, loss_fn=loss_fn, example_batch=make_batch())
        text = fsdp.lower_train_step(loss_fn, tx, fsdp.abstract_state(tx), make_batch()).compile().as_text()
        gathers = [c for c in hlo.collectives(text) if c.op == "all-gather" and "u8" in c.dtypes]
        moved[blocks] = sum(c.bytes for c in gathers)
        # the plan's table: every unit forward and backward, less l1's dgrad gather, which XLA
        # drops (l1's input needs no gradient)
        table = {p.name: fsdp_table.gathered_bytes(p, mesh.size) for p in fsdp.params if p.kind == "mxfp8"}
        assert moved[blocks] == table["l2/kernel"] + table["l1/kernel"] / 2, blocks
    n = mesh.size
    rows = -(-HIDDEN // (32 * n)) * 32 * n
    # l1's input needs no gradient: its dgrad gather is dropped
    weights = rows * IN + 2 * rows * HIDDEN
    assert moved["32x32"] == weights * (1 + 1 / 1024) <= 0.501 * 2 * weights  # bf16's bytes
    assert moved["1x32"] == weights * (1 + 1 / 32)


def test_blocks_by_path_and_bad_values(mesh):
    model = make_net(jnp.float32)
    fsdp = FSDP(model, mesh, weight_blocks={"l2/": "32x32"})
    assert {p.name: p.unit.blocks for p in fsdp.units} == {"l1/kernel": "1x32", "l2/kernel": "32x32"}
    state = fsdp.init(model, optax.sgd(0.1))
    assert not state.quantized["l1/kernel"].tiled and state.quantized["l2/kernel"].tiled
    assert "32x32 blocks" in str(fsdp)
    with pytest.raises(ValueError, match=r"weight_blocks='2d' must be one of \('1x32', '32x32'\)"):
        FSDP(model, mesh, weight_blocks="2d")
    with pytest.raises(ValueError, match="the pattern 'head' matches no MXFP8 unit"):
        FSDP(model, mesh, weight_blocks={"head": "32x32"})
    with pytest.raises(TypeError, match="weight_blocks must be one of"):
        FSDP(model, mesh, weight_blocks=32)
    # a state of the other block shape is named, not fed to the step
    other = FSDP(model, mesh)
    with pytest.raises(ValueError, match="holds two planes of 1x32 blocks for l2/kernel.*32x32 blocks"):
        fsdp.loss_and_grads(loss_fn)(other.init(model, optax.sgd(0.1)), make_batch())


def test_a_1x32_checkpoint_resumes_into_32x32_units(mesh, tmp_path):
    """The checkpoint records each unit's blocks; the planes are made again from the master in
    the restoring plan's blocks."""
    model = make_net(jnp.float32)
    tx = optax.sgd(0.1)
    saver = FSDP(model, mesh)
    saver.save(saver.init(model, tx), tmp_path / "c")
    recorded = checkpoint.read_metadata(tmp_path / "c").metadata["weight_blocks"]
    assert recorded == {"l1/kernel": "1x32", "l2/kernel": "1x32"}
    fsdp = FSDP(model, mesh, weight_blocks="32x32")
    restored = fsdp.restore(tmp_path / "c", tx)
    fresh = fsdp.init(model, tx)
    for p in fsdp.units:
        assert restored.quantized[p.name].tiled
        for a, b in zip(jax.tree.leaves(restored.quantized[p.name]), jax.tree.leaves(fresh.quantized[p.name])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=p.name)


def _tile_representable(fsdp, model):
    """``model`` with each MXFP8 unit's weight replaced by its 32x32 oracle values, layer by
    layer of its ``W [*stack, N, K]`` view (the plan's geometry)."""
    by_path = {p.path: p for p in fsdp.units if p.kind == "mxfp8"}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        p = by_path.get(tuple(path))
        if p is None:
            continue
        w = np.asarray(p.unit.to_master(jnp.asarray(var.get_value(), jnp.float32)))
        layers = w.reshape(-1, *w.shape[-2:])
        tiles = np.stack([tile_values(layer.T).T for layer in layers]).reshape(w.shape)
        var.set_value(jnp.asarray(p.unit.from_master(jnp.asarray(tiles)), var.get_value().dtype))
    return model


@pytest.mark.parametrize(
    ("loop", "remat", "gemm"),
    [
        ("scan", True, "mxfp8"),
        ("python", True, "mxfp8"),
        ("scan", True, "dequantized"),
        ("scan", False, "dequantized"),
        ("python", False, "dequantized"),
    ],
)
def test_a_transformer_trains_the_same_under_either_block_shape(mesh, loop, remat, gemm):
    """The package's transformer (scanned stacks of [layers, N, K] or a Python loop; remat
    blocks, or none: the backward's handoff of gathered planes), weights the tiles represent:
    32x32 units give 1x32's loss and gradients bit for bit, with MXFP8 GEMMs and with dequantized
    ones, each layer's tiles gathered and expanded in its own rows."""
    from mxfp8_jax import models

    cfg = models.TransformerConfig(layers=2, dtype="float32", layer_loop=loop, remat=remat)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab, (2 * mesh.size, 33)).astype(np.int32)
    kw = dict(loss_fn=models.next_token_loss, example_batch=tokens, gemm=gemm)
    model = _tile_representable(FSDP(models.init_transformer(cfg), mesh, **kw), models.init_transformer(cfg))
    assert_same_step_under_either_blocks(model, mesh, models.next_token_loss, tokens, **kw)


def test_tensor_parallel_units_hold_whole_tiles(devices):
    """Under tensor parallelism a row-parallel unit's K is split over tp (32 columns a rank
    here): each rank's slice is whole tiles, and the first steps' losses are FSDP-alone's on
    the same states (to test_tp's bound: fp32 partial sums added in another order)."""
    import test_tp

    from mxfp8_jax import models

    model = models.init_transformer(test_tp.CFG, seed=0)
    task = models.SequenceTask(test_tp.CFG.vocab, test_tp.SEQ + 1, seed=1)
    batches = [models.next_token_pairs(t) for t in task.batches(2, test_tp.BATCH)]
    _, alone = test_tp.plan(model, devices, "fsdp", weight_blocks="32x32")
    _, tp = test_tp.plan(model, devices, "fsdp+tp", weight_blocks="32x32")
    assert {"row", "column"} <= {p.tp for p in tp.units if p.kind == "mxfp8"}
    assert all(tp.init(model, test_tp.TX).quantized[p.name].tiled for p in tp.units if p.kind == "mxfp8")
    (got, at_states) = test_tp.losses(
        model, alone, batches, 2, also=(tp, tp.train_step(models.next_token_loss, test_tp.TX))
    )
    np.testing.assert_allclose(at_states, got, rtol=test_tp.LOSS_RTOL)


@pytest.mark.parametrize("remat", [True, False])
def test_a_stack_of_2048_layers_gathers_half_of_bf16_per_pass(mesh, remat):
    """A scanned stack of 2048x2048 layers (a pytree model: ``w [4, 2048, 2048]``) on the run's
    devices, from the compiled steps (abstract state, nothing runs): every weight gather of the
    step, counted with its loop's trips, 32x32 units against bf16 units of the same plan: a
    layer's gather moves 0.5005x bf16's bytes. With a rematerialised body the backward gathers
    each layer's plane once, for its recomputed forward and its dgrad, as bf16 units their
    weight; without, as many layers as bf16 units too: the linked backward's unused gather in
    layer 0's trip is made up for by the last layer's plane, kept from the forward."""
    from jax import lax

    layers, d = 4, 2048
    model = {"w": jnp.zeros((layers, d, d), jnp.float32)}
    x = jax.ShapeDtypeStruct((8 * mesh.size, d), jnp.float32)
    layer = lambda h, w: (jnp.tanh(h @ w), None)

    def loss(m, x):
        h, _ = lax.scan(jax.checkpoint(layer) if remat else layer, x, m["w"])
        return jnp.mean(h * h)

    tx = optax.sgd(0.1)
    moved = {}
    for name, kw in (("32x32", {"weight_blocks": "32x32"}), ("bf16", {"precision": "bf16"})):
        fsdp = FSDP(model, mesh, loss_fn=loss, example_batch=x, **kw)
        text = fsdp.lower_train_step(loss, tx, fsdp.abstract_state(tx), x).compile().as_text()
        gathers = [c for c in hlo.collectives(text) if c.op == "all-gather"]
        moved[name] = sum(c.bytes_per_step for c in gathers if c.bytes >= d * d // 1024)
        dtypes = {t for c in gathers if c.bytes >= d * d // 1024 for t in c.dtypes}
        assert dtypes == ({"u8"} if name == "32x32" else {"u16"}), (name, dtypes)  # bf16 bits as u16
    if remat:
        # forward: each layer once (the next one's gathered an iteration ahead); backward: each
        # layer but the last once more (the last's the forward kept), for both its recomputed
        # forward and its dgrad (a 32x32 plane and a bf16 weight serve both: fsdp_fetch)
        mx = bf = 2 * layers - 1
    else:
        # forward and dgrad of each layer and the forward loop's fetch of a next layer in its
        # last trip; for MXFP8 units the backward loop's carried link gathers a layer before
        # the first in its last trip, and takes the last layer's plane from the forward
        # (docs/fsdp.md, Overlap)
        mx = bf = 2 * layers + 1
    assert moved["32x32"] == mx * d * d * (1 + 1 / 1024), moved
    assert moved["bf16"] == bf * d * d * 2, moved
    # all of the step's gathers counted
    assert moved["32x32"] <= 0.501 * moved["bf16"], moved


def test_the_last_layers_kept_from_the_forward_gather_nothing_in_the_backward(mesh):
    """``keep_layers``: the forward's last ``k`` layers of a remat scan return every plane they
    gathered, and the backward recomputes those layers on them and takes them for the dgrads
    too (32x32 planes serve both directions). From the compiled steps' HLO: with ``k = 0``
    the backward's first layer gathers all but its first GEMMs' planes (o, gate, up, down;
    q, k and v are the forward's last fetch); each kept layer gathers none, so ``k = 1``
    saves those four units' planes and ``k = 2`` a whole layer more, with the same gradients
    bit for bit; keeping one layer costs at most that layer's planes in temp memory."""
    from test_fsdp_overlap import compiled, same_bits

    from mxfp8_jax import models

    cfg = models.TransformerConfig(layers=4)
    model = models.init_transformer(cfg)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab, (2 * mesh.size, 33)).astype(np.int32)
    moved, temp, grads = {}, {}, {}
    for k in (0, 1, 2):
        fsdp, step, grads[k] = compiled(
            model, mesh, models.next_token_loss, tokens, prefetch=1, weight_blocks="32x32", keep_layers=k
        )
        assert fsdp.keep_layers == k
        gathers = [c for c in hlo.collectives(step.as_text()) if c.op == "all-gather" and c.dtypes == ("u8",)]
        moved[k] = sum(c.bytes_per_step for c in gathers)
        temp[k] = step.memory_analysis().temp_size_in_bytes
    planes = {  # one layer's 32x32 plane of each stacked unit: codes and a scale per tile
        p.name.split("/")[-2]: int(np.prod(p.unit.padded_shape()[1:])) * 1025 // 1024
        for p in fsdp.units
        if p.unit.level
    }
    assert moved[0] - moved[1] == sum(planes[u] for u in ("o", "gate", "up", "down")), (moved, planes)
    assert moved[1] - moved[2] == sum(planes.values()), (moved, planes)
    assert temp[1] <= temp[0] + sum(planes.values()), temp
    assert same_bits(grads[0], grads[1]) and same_bits(grads[1], grads[2])


def test_keep_layers_must_be_a_count_of_layers(mesh):
    x = jax.ShapeDtypeStruct((8 * mesh.size, 64), jnp.float32)
    model = {"w": jnp.zeros((2, 64, 64), jnp.float32)}
    loss = lambda m, x: jnp.mean(x @ m["w"][0])
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=r"keep_layers=.* must be an int >= 0"):
            FSDP(model, mesh, loss_fn=loss, example_batch=x, keep_layers=bad)
