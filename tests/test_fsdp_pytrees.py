"""FSDP of models given as pytrees: an Equinox model and a dict of arrays, through the same entry.

Equinox (and Levanter, built on it) keeps a model's parameters in a pytree and writes
``loss(model, batch)``; so does a model kept as nested dicts of arrays. ``FSDP`` takes such a
model as it takes an NNX one: its floating array leaves are the parameters (named by their key
paths), its other arrays the model's other state, everything else (Equinox's non-array fields:
functions, Python numbers) static, kept as it is. The plan traces the loss as for NNX.

Each model here is written the way its users write one. The Equinox model has ``eqx.nn.Linear``
kernels ``[out, in]``, static fields, a Python-float field and layers stacked by
``eqx.filter_vmap`` and run by ``lax.scan`` over their array part. The dict model has a step
counter (an int leaf) beside its weights. The checks:

- the step against the model's own (``jax.jit`` of ``value_and_grad``, one device), with weights
  exact in MXFP8 (powers of two), to the order of fp32 sums;
- the gathered model: the same pytree, static fields included;
- temp memory against the NNX twin (``test_fsdp_stacks.StackLM``) and the fp32 model;
- a checkpoint, named by key paths, restored exactly on another mesh.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax
from jax.sharding import Mesh
from test_fsdp_semantics import (
    LR,
    VOCAB,
    D,
    H,
    Mismatches,
    batch_size,
    compare_params,
    flat,
    lm_batch,
    lm_chain,
    masked_lm_loss,
    tolerance,
)
from test_fsdp_stacks import StackLM, info, rms

from mxfp8_jax import fsdp as mxfsdp

from conftest import need_devices

LAYERS = 3


@pytest.fixture(scope="module")
def mesh(devices):
    return Mesh(np.array(devices), ("fsdp",))


class EqxBlock(eqx.Module):
    """A pre-norm MLP block: an RMSNorm scale array, two bias-free ``eqx.nn.Linear`` (weights
    ``[out, in]``), the activation a static field and a residual gain a plain Python float."""

    scale: jax.Array
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    gain: float
    act: object = eqx.field(static=True)

    def __init__(self, key, d: int, h: int):
        k1, k2 = jax.random.split(key)
        self.scale = jnp.ones((d,))
        self.up = eqx.nn.Linear(d, h, use_bias=False, key=k1)
        self.down = eqx.nn.Linear(h, d, use_bias=False, key=k2)
        self.gain = 1.0
        self.act = jax.nn.gelu

    def __call__(self, h):  # h [..., d]
        u = self.act(rms(h, self.scale) @ self.up.weight.T)
        return h + self.gain * (u @ self.down.weight.T)


class EqxLM(eqx.Module):
    """A token LM in Equinox: an ``eqx.nn.Embedding``, ``layers`` blocks stacked by
    ``eqx.filter_vmap`` and run by ``lax.scan`` over their array part, a bias-free head."""

    embed: eqx.nn.Embedding
    blocks: EqxBlock
    head: eqx.nn.Linear

    def __init__(self, key, layers: int = LAYERS, d: int = D, h: int = H):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(VOCAB, d, key=k1)
        self.blocks = eqx.filter_vmap(lambda k: EqxBlock(k, d, h))(jax.random.split(k2, layers))
        self.head = eqx.nn.Linear(d, VOCAB, use_bias=False, key=k3)

    def __call__(self, tokens):
        h = self.embed.weight[tokens]
        arrays, static = eqx.partition(self.blocks, eqx.is_array)
        h, _ = lax.scan(lambda h, a: (eqx.combine(a, static)(h), None), h, arrays)
        return h @ self.head.weight.T


def dict_model(key, layers: int = LAYERS, d: int = D, h: int = H) -> dict:
    """The token LM as nested dicts of arrays (the NNX twin's weights, ``[in, out]`` kernels), and
    a step counter."""
    k = jax.random.split(key, 4)
    normal = lambda key, shape, fan_in: jax.random.normal(key, shape) / np.sqrt(fan_in)
    return {
        "embed": jax.random.normal(k[0], (VOCAB, d)),
        "blocks": {
            "up": normal(k[1], (layers, d, h), d),
            "down": normal(k[2], (layers, h, d), h),
            "scale": jnp.ones((layers, d)),
        },
        "head": normal(k[3], (d, VOCAB), d),
        "seen": jnp.zeros((), jnp.int32),
    }


def dict_forward(params: dict, tokens):
    h = params["embed"][tokens]
    blocks = params["blocks"]

    def block(h, w):
        up, down, scale = w
        return h + jax.nn.gelu(rms(h, scale) @ up) @ down, None

    h, _ = lax.scan(block, h, (blocks["up"], blocks["down"], blocks["scale"]))
    return h @ params["head"]


def lm_loss(model, batch):
    """Masked next-token cross entropy of an Equinox model (callable) or of the dict model."""
    forward = model if callable(model) else lambda tokens: dict_forward(model, tokens)
    return masked_lm_loss(forward, batch)[0]


def exact(tree, seed: int = 0):
    """Every floating leaf that is not a constant a signed power of two 2^-4..1 times its top
    (the power of two nearest its largest magnitude): exact in MXFP8 and bf16, so that the step
    differs from the model's own only in the order of fp32 sums."""
    rng = np.random.default_rng(seed)

    def one(x):
        if not eqx.is_inexact_array(x) or bool(jnp.all(x == x.reshape(-1)[0])):
            return x
        top = 2.0 ** np.round(np.log2(float(jnp.abs(x).max())))
        powers = 2.0 ** rng.integers(-4, 1, x.shape)
        signs = np.where(rng.random(x.shape) < 0.5, -1.0, 1.0)
        return jnp.asarray(signs * powers * top, x.dtype)

    return jax.tree.map(one, tree)


def own_step(model, batch):
    """The model's own sgd(LR) step on one device: ``(loss, model after)``."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    params, batch = jax.device_put((params, batch), jax.devices()[0])

    @jax.jit
    def step(params, batch):
        loss, grads = jax.value_and_grad(lambda p: lm_loss(eqx.combine(p, static), batch))(params)
        return loss, jax.tree.map(lambda p, g: p - LR * g, params, grads)

    loss, params = step(params, batch)
    return loss, eqx.combine(params, static)


def fsdp_step(model, mesh, batch):
    fsdp = mxfsdp.FSDP(model, mesh, loss_fn=lm_loss, example_batch=batch)
    tx = optax.sgd(LR)
    state, loss = fsdp.train_step(lm_loss, tx)(fsdp.init(model, tx), batch)
    return fsdp, loss, fsdp.gather(state)


def floating(tree) -> dict:
    return {k: v for k, v in flat(tree).items() if v.dtype.kind == "f"}


def check_step(mesh, model, label: str):
    b = batch_size(mesh.size)
    batch = lm_batch(b)
    want_loss, want = own_step(model, batch)
    fsdp, got_loss, got = fsdp_step(model, mesh, batch)
    tol = tolerance(lm_chain(b, LAYERS))
    m = Mismatches(f"{label} on {mesh.size} devices")
    m.close(got_loss, want_loss, abs(float(want_loss)), tol, "loss")
    compare_params(m, floating(got), floating(want), floating(model), tol)
    m.done()
    return fsdp, got


def test_an_equinox_model_trains_as_its_own_step(mesh):
    """The Equinox LM: its stacked ``[out, in]`` kernels are MXFP8 units with one layer axis, the
    embedding and head bf16 units, the norm scales plain; one step is the model's own, and the
    gathered model is an ``EqxLM`` with its static fields."""
    model = exact(EqxLM(jax.random.key(0)))
    fsdp = mxfsdp.FSDP(model, mesh, loss_fn=lm_loss, example_batch=lm_batch(batch_size(mesh.size)))
    up = info(fsdp, "blocks/up/weight")
    assert (up.kind, up.layer_axes, up.unit.k_axes, up.stack) == ("mxfp8", (0,), (2,), (LAYERS,)), str(fsdp)
    assert info(fsdp, "embed/weight").role == "embedding" and info(fsdp, "head/weight").kind == "bf16"
    assert info(fsdp, "blocks/scale").kind == "plain" and fsdp.rest_names == ()
    _, got = check_step(mesh, model, "Equinox LM")
    assert type(got) is EqxLM and got.blocks.act is jax.nn.gelu and got.blocks.gain == 1.0


def test_a_dict_model_trains_as_its_own_step(mesh):
    """The dict LM: the same plan as its NNX twin, the int counter the model's other state (kept
    as it is), one step the model's own."""
    model = exact(dict_model(jax.random.key(0)))
    fsdp, got = check_step(mesh, model, "dict LM")
    twin = nnx_twin(mesh)
    kinds = lambda f, names: [(info(f, n).kind, info(f, n).stack) for n in names]
    assert kinds(fsdp, ["blocks/up", "blocks/down", "embed", "head"]) == kinds(
        twin, ["up", "down", "embed/embedding", "head/kernel"]
    ), str(fsdp)
    assert fsdp.rest_names == ("seen",) and int(got["seen"]) == 0
    assert set(fsdp.param_tree(fsdp.abstract_state(optax.sgd(LR)).master)) == {"blocks", "embed", "head"}


def nnx_twin(mesh, layers: int = LAYERS, d: int = D, h: int = H):
    model = StackLM(nnx.Rngs(0), "scan", layers=layers, d=d, h=h)
    batch = lm_batch(batch_size(mesh.size))
    return mxfsdp.FSDP(model, mesh, loss_fn=lambda m, b: masked_lm_loss(m, b)[0], example_batch=batch)


def step_temp(model, loss_fn, mesh, batch) -> tuple[int, int]:
    """The compiled sgd step's temp bytes per device, and the fp32 model's bytes."""
    fsdp = mxfsdp.FSDP(model, mesh, loss_fn=loss_fn, example_batch=batch)
    tx = optax.sgd(LR)
    compiled = fsdp.lower_train_step(loss_fn, tx, fsdp.abstract_state(tx), batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes, 4 * sum(int(np.prod(p.shape)) for p in fsdp.params)


@pytest.mark.parametrize("kind", ["dict", "equinox"])
def test_a_pytree_model_costs_what_its_nnx_twin_costs(devices, kind):
    """Depth 8, 512 wide (MLP 1024), one sequence per device, on 8 devices: the compiled step's
    temp memory within 10% of the NNX twin's (``StackLM``, the same weights' shapes), and at most
    0.4x the fp32 model (on 4 devices each holds twice the shards: 0.48x)."""
    mesh = Mesh(np.array(need_devices(8)), ("fsdp",))  # the 0.4x is a figure of 8 devices' shards
    layers, d, h = 8, 512, 1024
    batch = lm_batch(mesh.size)
    model = dict_model(jax.random.key(0), layers, d, h) if kind == "dict" else EqxLM(jax.random.key(0), layers, d, h)
    got, fp32 = step_temp(model, lm_loss, mesh, batch)
    twin = StackLM(nnx.Rngs(0), "scan", layers=layers, d=d, h=h)
    want, _ = step_temp(twin, lambda m, b: masked_lm_loss(m, b)[0], mesh, batch)
    assert abs(got - want) <= 0.10 * want, (got, want)
    assert got <= 0.4 * fp32, (got, fp32)


def test_a_pytree_checkpoint_restores_exactly_on_another_mesh(devices, tmp_path):
    """Saved on every device, named by key paths, restored on half of them: the gathered models
    are equal bit for bit, and the step count carries over."""
    n = len(devices)
    full, half = Mesh(np.array(devices), ("fsdp",)), Mesh(np.array(devices[: max(1, n // 2)]), ("fsdp",))
    model, batch = EqxLM(jax.random.key(1)), lm_batch(batch_size(n))
    tx = optax.adam(1e-3)
    fsdp = mxfsdp.FSDP(model, full, loss_fn=lm_loss, example_batch=batch)
    state, _ = fsdp.train_step(lm_loss, tx)(fsdp.init(model, tx), batch)
    fsdp.save(state, tmp_path / "ckpt")
    other = mxfsdp.FSDP(model, half, loss_fn=lm_loss, example_batch=lm_batch(batch_size(half.size)))
    restored = other.restore(tmp_path / "ckpt", tx)
    want, got = flat(fsdp.gather(state)), flat(other.gather(restored))
    assert want.keys() == got.keys() and "blocks/up/weight" in want
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert int(restored.step) == 1


def test_a_trainable_predicate_freezes_leaves_by_path(mesh):
    """``trainable=(path, leaf) -> bool``: the embedding frozen (a frozen unit: no gradient, no
    optimizer state), the rest trained."""
    model, batch = dict_model(jax.random.key(0)), lm_batch(batch_size(mesh.size))
    keep = lambda path, leaf: path[0] != "embed"
    fsdp = mxfsdp.FSDP(model, mesh, loss_fn=lm_loss, example_batch=batch, trainable=keep)
    assert [p.name for p in fsdp.frozen] == ["embed"], str(fsdp)
    tx = optax.sgd(LR)
    state, _ = fsdp.train_step(lm_loss, tx)(fsdp.init(model, tx), batch)
    after = fsdp.gather(state)
    np.testing.assert_array_equal(np.asarray(after["embed"]), np.asarray(model["embed"]))
    assert not np.array_equal(np.asarray(after["head"]), np.asarray(model["head"]))


def test_pytree_models_are_checked(mesh):
    """A pytree model without an example batch, with tp_axis, with a trainable filter that is not
    a predicate, or given to init with another structure: errors that say so."""
    model, batch = dict_model(jax.random.key(0)), lm_batch(batch_size(mesh.size))
    with pytest.raises(ValueError, match="pytree, not an nnx.Module.*needs loss_fn= and example_batch="):
        mxfsdp.FSDP(model, mesh)
    with pytest.raises(TypeError, match=r"trainable=.*a predicate \(path, leaf\) -> bool"):
        mxfsdp.FSDP(model, mesh, loss_fn=lm_loss, example_batch=batch, trainable=nnx.LoRAParam)
    with pytest.raises(TypeError, match="flax.nnx.Module or a pytree of arrays"):
        mxfsdp.FSDP("weights.npz", mesh, loss_fn=lm_loss, example_batch=batch)
    fsdp = mxfsdp.FSDP(model, mesh, loss_fn=lm_loss, example_batch=batch)
    with pytest.raises(ValueError, match="pytree structure"):
        fsdp.init({**model, "extra": jnp.ones(3)}, optax.sgd(LR))
