"""What a traced plan makes of single parameters, and how each reads its planes.

- a weight read both as ``x @ W`` and, tied, as ``h @ W.T``: each GEMM's forward reads the planes
  blocked along its own contraction (rowwise for the first, columnwise for the transposed one),
  each dgrad the other direction; gradients against a single-device reference built from the
  numpy oracle's planes;
- an MXFP8 lookup table reads its rowwise planes;
- ``precision_by_path``: regexes and callables, ``"plain"``, clear errors, and checkpoints that
  record the resolved precision of each parameter and refuse another;
- tensor parallelism refuses what is not a Linear-like kernel;
- the model's RNG streams are saved and restored with the state.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh

from mxfp8_jax.bench.styles import model_styles as ms
from mxfp8_jax.flax import FSDP, tensor_parallel

import numpy_oracle as npo

D, BATCH = 64, 64


@pytest.fixture(scope="module")
def mesh(devices):
    return Mesh(np.array(devices), ("fsdp",))


def mse(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


def data(seed=1):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((BATCH, D)).astype(np.float32), rng.standard_normal((BATCH, D)).astype(np.float32)


# ------------------------------------------------------------------------------------------------
# A tied weight: each GEMM reads the planes of its own contraction


SMALL = 2.0**-17  # the odd input features' weights, relative to the others
RESCALE = np.where(np.arange(D) % 2, 1 / SMALL, 1.0).astype(np.float32)  # their decoded outputs back to size


class Tied(nnx.Module):
    """``x @ K`` then ``tanh``, then ``h @ K.T`` (an encoder and its tied decoder), the odd
    decoded features scaled back to the size of the others."""

    def __init__(self, rngs):
        self.l = nnx.Linear(D, D, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return (jnp.tanh(self.l(x)) @ self.l.kernel[...].T) * RESCALE


@jax.custom_vjp
def gemm(a, b_fwd, b_bwd):  # a @ b_fwd forward; the dgrad reads b_bwd
    return a @ b_fwd


gemm.defvjp(lambda a, b_fwd, b_bwd: (a @ b_fwd, (a, b_bwd)), lambda res, dy: (dy @ res[1].T, res[0].T @ dy, None))


@jax.jit
def tied_reference(w_row, w_col, batch):
    """Loss and kernel gradient with ``W = K.T [out, in]``: ``x @ K`` reads W's rowwise values
    (blocks along in, its contraction) and its dgrad the columnwise; ``h @ K.T = h @ W``
    contracts over out: it reads the columnwise values and its dgrad the rowwise."""
    x, y = batch

    def loss(k_first, w_second):
        h = jnp.tanh(gemm(x, k_first, w_col.T))
        return jnp.mean((gemm(h, w_second, w_row) * RESCALE - y) ** 2)

    value, (g1, g2) = jax.value_and_grad(loss, argnums=(0, 1))(w_row.T, w_col)
    return value, g1 + g2.T


def test_tied_weight_reads_the_planes_of_each_contraction(mesh):
    model = Tied(nnx.Rngs(0))
    rng = np.random.default_rng(0)
    kernel = rng.standard_normal((D, D)) / np.sqrt(D)
    kernel[1::2, :] *= SMALL  # odd input features: W's rowwise blocks mix magnitudes, columnwise ones don't
    model.l.kernel.set_value(jnp.asarray(kernel, jnp.float32))
    batch = data()
    fsdp = FSDP(model, mesh, loss_fn=mse, example_batch=batch)
    (unit,) = fsdp.units
    assert (unit.kind, unit.unit.k_axes, unit.unit.n_axes, unit.gemm_sites) == ("mxfp8", (0,), (1,), 2)
    loss, grads = fsdp.loss_and_grads(mse)(fsdp.init(model, optax.sgd(0.1)), batch)
    got = np.asarray(fsdp.to_logical(unit, grads[unit.name]))
    w_row, w_col = (v.astype(np.float32) for v in npo.mxfp8_weights(kernel.T.astype(np.float32)))
    ref_loss, ref = tied_reference(w_row, w_col, batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    err = lambda a, b: np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max()
    assert err(got, ref) < 1e-5
    # the tolerances separate the planes: the transposed GEMM reading the rowwise values loses
    # the small weights (visibly another loss), and the gradients are far apart
    wrong_loss, wrong = tied_reference(w_row, w_row, batch)
    assert abs(float(wrong_loss) - float(ref_loss)) > 100 * 1e-5 * float(ref_loss)
    assert err(wrong, ref) > 100 * 1e-5


# ------------------------------------------------------------------------------------------------
# An MXFP8 lookup table


def test_an_mxfp8_table_is_looked_up_in_its_rowwise_values(mesh):
    """A table made MXFP8 by precision_by_path: the lookup reads each row's rowwise values
    (blocks along the row), not the columnwise ones (blocks along the vocabulary); its gradient
    is the looked-up rows' cotangents scattered back, reduce-scattered into the shards."""
    vocab, rng = 256, np.random.default_rng(0)
    small = np.where(np.arange(vocab) % 2, 2.0**-17, 1.0)[:, None]  # odd tokens' rows much smaller
    table = (rng.standard_normal((vocab, D)) * small).astype(np.float32)

    class Lookup(nnx.Module):
        def __init__(self):
            self.table = nnx.Param(jnp.asarray(table))

        def __call__(self, ids):  # each looked-up row scaled back to size
            return self.table[...][ids] / jnp.asarray(small[:, 0], jnp.float32)[ids][..., None]

    ids = rng.integers(0, vocab, (BATCH,)).astype(np.int32)
    batch = (ids, rng.standard_normal((BATCH, D)).astype(np.float32))
    model = Lookup()
    fsdp = FSDP(model, mesh, loss_fn=mse, example_batch=batch, precision_by_path={"table": "mxfp8"})
    (unit,) = fsdp.units
    assert (unit.kind, unit.role, unit.lookup_sites, unit.gemm_sites) == ("mxfp8", "embedding", 1, 0)
    loss, grads = fsdp.loss_and_grads(mse)(fsdp.init(model, optax.sgd(0.1)), batch)
    row, col = npo.mxfp8_weights(table)  # [V, D] as W [N, K]: rowwise blocks along D
    assert (col[1::2] == 0).mean() > 0.5 and (row[1::2] == 0).mean() < 0.01  # col flushes the small rows
    reference = jax.jit(jax.value_and_grad(lambda t: mse(nnx.merge(nnx.graphdef(model), {"table": t}), batch)))
    ref_loss, ref_grad = reference(jnp.asarray(row, jnp.float32))
    col_loss, _ = reference(jnp.asarray(col, jnp.float32))
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    assert abs(float(col_loss) - float(ref_loss)) > 1e4 * 1e-6 * float(ref_loss)
    got = np.asarray(fsdp.to_logical(unit, grads[unit.name]))
    np.testing.assert_allclose(got, np.asarray(ref_grad), rtol=1e-6, atol=1e-6 * np.abs(ref_grad).max())


# ------------------------------------------------------------------------------------------------
# Precision per parameter


def test_precision_by_path(mesh):
    model = ms.abstract("mha", ms.StyleConfig(depth=2))
    batch = ms.make_batch(ms.StyleConfig(), 8, 16)
    kinds = lambda fsdp: {p.name: p.kind for p in fsdp.params}
    default = kinds(FSDP(model, mesh, loss_fn=ms.loss_fn, example_batch=batch))
    assert (default["embed/embedding"], default["head/kernel"], default["blocks/fc1/kernel"]) == ("bf16",) * 2 + (
        "mxfp8",
    )
    rule = {"^head/": "mxfp8", r"attn/(query|key)/kernel": "bf16", "fc1/kernel": "plain"}
    got = kinds(FSDP(model, mesh, loss_fn=ms.loss_fn, example_batch=batch, precision_by_path=rule))
    assert got["head/kernel"] == "mxfp8" and got["blocks/fc1/kernel"] == "plain"
    assert got["blocks/attn/query/kernel"] == got["blocks/attn/key/kernel"] == "bf16"
    assert got["blocks/attn/value/kernel"] == "mxfp8" and got["embed/embedding"] == "bf16"
    by_role = lambda name, role: "mxfp8" if role == "embedding" else None
    assert (
        kinds(FSDP(model, mesh, loss_fn=ms.loss_fn, example_batch=batch, precision_by_path=by_role))["embed/embedding"]
        == "mxfp8"
    )
    # the global precision sets the projections' default only
    bf16 = kinds(FSDP(model, mesh, precision="bf16", loss_fn=ms.loss_fn, example_batch=batch))
    assert set(bf16.values()) == {"bf16", "plain"}
    moe = ms.abstract("moe", ms.StyleConfig(depth=1))
    with pytest.raises(ValueError, match=r"blocks/moe/router/kernel .* as MXFP8, but its GEMMs have K=256 and N=4"):
        FSDP(moe, mesh, loss_fn=ms.loss_fn, example_batch=batch, precision_by_path={"router": "mxfp8"})
    with pytest.raises(ValueError, match=r"precision_by_path for blocks/\S+='int8' must be one of"):
        FSDP(model, mesh, loss_fn=ms.loss_fn, example_batch=batch, precision_by_path=lambda n, r: "int8")
    with pytest.raises(TypeError, match="precision_by_path must be a mapping"):
        FSDP(model, mesh, loss_fn=ms.loss_fn, example_batch=batch, precision_by_path=["head"])


def test_checkpoints_record_each_parameters_precision(mesh, tmp_path):
    cfg = ms.StyleConfig(depth=1)
    model = ms.build("gemma", cfg)
    batch = ms.make_batch(cfg, 8, 16)
    fsdp = FSDP(model, mesh, loss_fn=ms.loss_fn, example_batch=batch)
    tx = optax.adam(1e-3)
    fsdp.save(fsdp.init(model, tx), tmp_path / "ckpt")
    fsdp.restore(tmp_path / "ckpt", tx)  # the same plan: fine
    other = FSDP(model, mesh, loss_fn=ms.loss_fn, example_batch=batch, precision_by_path={"kv_einsum": "bf16"})
    with pytest.raises(ValueError, match=r"layers/0/attn/kv_einsum/kernel: saved mxfp8, plan bf16"):
        other.restore(tmp_path / "ckpt", tx)


# ------------------------------------------------------------------------------------------------
# Tensor parallelism: Linear-like kernels only


def test_tensor_parallel_refuses_other_units(devices):
    class EinsumTP(nnx.Module):
        def __init__(self, rngs):
            self.q = tensor_parallel(nnx.Einsum("btd,dnh->btnh", (D, 2, 32), rngs=rngs), "column")

        def __call__(self, x):
            return self.q(x).sum(-1)

    fsdp_size = len(devices) // 2  # a (n/2, 2) mesh: tp over pairs of devices
    mesh = Mesh(np.array(devices[: 2 * fsdp_size]).reshape(fsdp_size, 2), ("fsdp", "tp"))
    x = np.ones((2 * fsdp_size, 4, D), np.float32)
    with pytest.raises(
        ValueError, match=r"q/kernel: tensor_parallel applies to a Linear-like kernel \[\*layers, in, out\]"
    ):
        FSDP(EinsumTP(nnx.Rngs(0)), mesh, tp_axis="tp", loss_fn=lambda m, x: m(x).mean(), example_batch=x)


# ------------------------------------------------------------------------------------------------
# RNG streams in checkpoints


def test_rng_streams_are_saved_and_resume_exactly(mesh, tmp_path):
    cfg = ms.StyleConfig(depth=1)
    model = ms.build("dropout", cfg)
    batch = ms.make_batch(cfg, 8, 16)
    fsdp = FSDP(model, mesh, loss_fn=ms.loss_fn, example_batch=batch)
    tx = optax.adam(1e-3)
    state = fsdp.init(model, tx)
    step = fsdp.train_step(ms.loss_fn, tx)
    state, first = step(state, batch)
    fsdp.save(state, tmp_path / "ckpt")
    restored = fsdp.restore(tmp_path / "ckpt", tx)
    is_key = lambda r: jax.dtypes.issubdtype(r.dtype, jax.dtypes.prng_key)
    for a, b in zip(state.rest, restored.rest):
        bits = (lambda r: jax.random.key_data(r)) if is_key(a) else (lambda r: r)
        np.testing.assert_array_equal(np.asarray(bits(a)), np.asarray(bits(b)))
    state, second = step(state, batch)
    restored, again = step(restored, batch)
    assert float(second) == float(again) and float(second) != float(first)  # new masks, the same ones
