"""Frozen weights: ``FSDP(trainable=...)`` trains only the variables a filter names.

Two models hold a frozen base under trained adapters, as LoRA fine-tuning does: an LM whose
projections are ``nnx.LoRA`` around an ``nnx.Linear`` base, trained with
``trainable=nnx.LoRAParam`` (the base kernels, the embedding and the head are ``nnx.Param``s left
out), and an LM whose base kernels are a custom ``nnx.Variable`` (bf16) next to ``nnx.Param``
adapters, trained with the default ``trainable=nnx.Param``. Each base the loss contracts is a
frozen MXFP8 unit: stored by rows in its own dtype, its planes quantized once, gathered for
its GEMMs, never updated, no gradient reduce-scattered.

One step is compared with the unsharded model's step (``jax.grad`` with respect to the
trainable variables only, the same ``optax.sgd``) as ``test_fsdp_semantics`` compares them:
every weight is a signed power of two within 2^4 of its top, exact in MXFP8 and bf16, so the
two steps may differ only in the order of their fp32 sums (``tolerance``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax
from jax.sharding import Mesh
from test_fsdp_semantics import Mismatches, compare_params, exact_weights, flat, tolerance

from mxfp8_jax import models
from mxfp8_jax._src.buffers import checkpoint
from mxfp8_jax._src.compiled import hlo
from mxfp8_jax._src.numerics.format import BLOCK
from mxfp8_jax._src.ops.quantize import quantize
from mxfp8_jax.flax import FSDP

D, H, V, R, SEQ, LAYERS = 64, 128, 64, 8, 8, 2
LR = 1.0
TX = optax.sgd(LR)


@pytest.fixture(scope="module")
def mesh(devices):
    return Mesh(np.array(devices), ("fsdp",))


# ------------------------------------------------------------------------------------------------
# The models


class LoRABlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.LoRA(D, R, H, base_module=nnx.Linear(D, H, rngs=rngs), rngs=rngs)
        self.down = nnx.LoRA(H, R, D, base_module=nnx.Linear(H, D, use_bias=False, rngs=rngs), rngs=rngs)

    def __call__(self, h):
        return h + self.down(jax.nn.gelu(self.up(h)))


class LoRALM(nnx.Module):
    """Embedding, ``LAYERS`` residual MLP blocks of ``nnx.LoRA`` projections (rank ``R``), head."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.blocks = nnx.List([LoRABlock(rngs) for _ in range(LAYERS)])
        self.head = nnx.Linear(D, V, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class Base(nnx.Variable):
    """A frozen base kernel: not an ``nnx.Param``."""


class Calls(nnx.Variable):
    """A counter the forward pass assigns: model state, not a weight."""


class Temperature(nnx.Variable):
    """A floating variable the loss multiplies in (no GEMM reads it): model state."""


class Adapted(nnx.Module):
    """``x @ base + (x @ a) @ b``: ``base`` a bf16 ``Base``, ``a``/``b`` ``nnx.Param``s."""

    def __init__(self, n_in: int, n_out: int, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.base = Base(init(rngs.params(), (n_in, n_out)).astype(jnp.bfloat16))
        self.a = nnx.Param(init(rngs.params(), (n_in, R)))
        self.b = nnx.Param(init(rngs.params(), (R, n_out)))

    def __call__(self, x):
        return x @ self.base[...] + (x @ self.a[...]) @ self.b[...]


class CustomLM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.up = nnx.List([Adapted(D, H, rngs) for _ in range(LAYERS)])
        self.down = nnx.List([Adapted(H, D, rngs) for _ in range(LAYERS)])
        self.head = nnx.Linear(D, V, use_bias=False, rngs=rngs)
        self.calls = Calls(jnp.zeros((), jnp.float32))
        self.temperature = Temperature(jnp.full((), 0.5, jnp.float32))

    def __call__(self, tokens):
        self.calls.set_value(self.calls.get_value() + 1)
        h = self.embed(tokens)
        for up, down in zip(self.up, self.down):
            h = h + down(jax.nn.gelu(up(h)))
        return self.head(h) * self.temperature[...]


def lm_loss(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()


def lm_batch(b: int, seed: int = 2):
    rng = np.random.default_rng(seed)
    return {"x": rng.integers(0, V, (b, SEQ)).astype(np.int32), "y": rng.integers(0, V, (b, SEQ)).astype(np.int32)}


def exact_bases(model: CustomLM, seed: int = 1) -> CustomLM:
    """``exact_weights`` for the ``Base`` variables (it sets ``nnx.Param``s): signed powers of two
    2^-4..1 times the power of two nearest the largest |value|, in bf16."""
    rng = np.random.default_rng(seed)
    for _, var in nnx.to_flat_state(nnx.state(model, Base)):
        value = np.asarray(var.get_value(), np.float32)
        top = 2.0 ** np.round(np.log2(np.abs(value).max()))
        signs = np.where(rng.random(value.shape) < 0.5, -1.0, 1.0)
        var.set_value(jnp.asarray(signs * 2.0 ** rng.integers(-4, 1, value.shape) * top, jnp.bfloat16))
    return model


def lora_model() -> LoRALM:
    """Exact weights; the zero-initialised ``lora_b`` and the up bias drawn first, so that every
    adapter has a gradient and the frozen bias is not all zeros."""
    model = LoRALM(nnx.Rngs(0))
    rng = np.random.default_rng(5)
    for block in model.blocks:
        for lora in (block.up, block.down):
            lora.lora_b.set_value(jnp.asarray(0.02 * rng.standard_normal(lora.lora_b.shape), jnp.float32))
        block.up.base_module.bias.set_value(jnp.asarray(0.1 * rng.standard_normal((H,)), jnp.float32))
    return exact_weights(model, tops={"embed": 1.0, "head": 0.25})


def custom_model() -> CustomLM:
    return exact_bases(exact_weights(CustomLM(nnx.Rngs(0)), tops={"embed": 1.0, "head": 0.25}))


def chain(b: int) -> int:
    """The chain of sums (``tolerance``): each block's forward contractions (the bases' K, the
    adapters' K and rank), the head's D and softmax's V, the loss's sum over the tokens; the
    backward's contractions, the same, and the gradients' sum over the tokens."""
    tokens = b * SEQ
    block = D + D + R + H + H + R
    return 2 * (LAYERS * block + D + V + tokens)


def unsharded_step(model, loss_fn, batch, wrt):
    """The model's own step on one device: ``(loss, the variables ``wrt`` after one sgd(LR)
    step, the other state after the step)``, gradients with respect to ``wrt`` only."""
    graphdef, params, rest = nnx.split(model, wrt, ...)

    def step(params, rest, batch):
        def loss_of(p):
            m = nnx.merge(graphdef, p, rest, copy=True)
            return loss_fn(m, batch), nnx.split(m, wrt, ...)[2]

        (loss, rest_after), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
        updates, _ = TX.update(grads, TX.init(params), params)
        return loss, optax.apply_updates(params, updates), rest_after

    return jax.jit(step)(*jax.device_put((params, rest, batch), jax.devices()[0]))


def host(tree):
    return jax.tree.map(np.asarray, tree)


def run(fsdp, model, batch, steps: int = 2) -> dict:
    """``steps`` steps of the compiled train step (``lower_train_step``): the losses, the
    frozen arrays and planes before and after, the model gathered after the first step, the
    compiled HLO text and the last (live) state."""
    state = fsdp.init(model, TX)
    frozen_names = {p.name for p in fsdp.frozen}
    before = host((state.frozen, {k: v for k, v in state.quantized.items() if k in frozen_names}))
    compiled = fsdp.lower_train_step(lm_loss, TX, state, batch).compile()
    losses, gathered = [], None
    for _ in range(steps):
        state, loss = compiled(state, fsdp.place_batch(batch))
        losses.append(float(loss))
        gathered = gathered or fsdp.gather(state)
    after = host((state.frozen, {k: v for k, v in state.quantized.items() if k in frozen_names}))
    return dict(losses=losses, before=before, after=after, gathered=gathered, hlo=compiled.as_text(), state=state)


@functools.cache
def lora_case(n: int):
    model, batch = lora_model(), lm_batch(2 * n)
    return model, batch, unsharded_step(model, lm_loss, batch, nnx.LoRAParam)


@pytest.fixture(scope="module")
def lora(mesh):
    model, batch, _ = lora_case(mesh.size)
    fsdp = FSDP(nnx.clone(model), mesh, loss_fn=lm_loss, example_batch=batch, trainable=nnx.LoRAParam)
    return fsdp, run(fsdp, nnx.clone(model), batch)


BASES = [f"blocks/{i}/{p}/base_module/kernel" for i in range(LAYERS) for p in ("up", "down")]
ADAPTERS = [f"blocks/{i}/{p}/lora_{ab}" for i in range(LAYERS) for p in ("up", "down") for ab in "ab"]


# ------------------------------------------------------------------------------------------------
# (1) The plan


def test_lora_bases_are_frozen_mxfp8_units_and_the_adapters_trained(lora, mesh):
    """With ``trainable=nnx.LoRAParam`` the base kernels are frozen MXFP8 units, the embedding and
    head frozen bf16 units, the up bias (read by an add) frozen whole; only the adapters are
    trained: the masters and the optimizer state hold them alone, the planes of the frozen bases
    are the quantization of their rows, and ``print(fsdp)`` shows what each costs."""
    fsdp, out = lora
    n = mesh.size
    by_name = {p.name: p for p in fsdp.params}
    for name in BASES:
        p = by_name[name]
        assert (p.kind, p.trained) == ("mxfp8", False), (name, p)
    assert [(by_name[k].kind, by_name[k].trained) for k in ("embed/embedding", "head/kernel")] == [("bf16", False)] * 2
    bias = by_name["blocks/0/up/base_module/bias"]
    assert (bias.kind, bias.trained, bias.is_unit) == ("frozen", False, False)
    assert sorted(p.name for p in fsdp.trained) == sorted(ADAPTERS)
    state = out["state"]
    assert sorted(state.master) == sorted(ADAPTERS)
    assert sorted(state.frozen) == sorted(p.name for p in fsdp.frozen)
    assert sorted(state.quantized) == sorted(BASES)
    for leaf in jax.tree.leaves(state.opt_state):  # sgd: no moments; any leaf is a trained one's
        assert np.size(leaf) <= max(int(np.prod(by_name[k].stored_shape)) for k in ADAPTERS)
    for name in BASES:
        p, frozen = by_name[name], state.frozen[name]
        assert frozen.shape == p.stored_shape and frozen.dtype == jnp.float32
        assert frozen.sharding == fsdp.master_sharding(p)
        t = quantize(jnp.asarray(out["before"][0][name]), scale_rule=fsdp.scale_rule)
        planes = out["before"][1][name]
        as_bytes = lambda q: np.asarray(lax.bitcast_convert_type(q, jnp.uint8))
        np.testing.assert_array_equal(planes.rowwise_data, as_bytes(t.rowwise_data))
        np.testing.assert_array_equal(planes.columnwise_data, as_bytes(t.columnwise_data))
        np.testing.assert_array_equal(planes.rowwise_scale, np.asarray(t.rowwise_scale))
        np.testing.assert_array_equal(planes.columnwise_scale, np.asarray(t.columnwise_scale))
    text = str(fsdp)
    for name in BASES:
        p = by_name[name]
        line = next(row for row in text.splitlines() if row.startswith(name + " "))
        assert ", frozen" in line, line
        elements = int(np.prod(p.stored_shape)) // n
        assert f"{elements * (4 + 2 + 2 / BLOCK) / 1024:.1f} KiB" in line, line  # own dtype (fp32) + planes
    assert f"frozen (trainable={nnx.LoRAParam!r} leaves them out): {len(fsdp.frozen)} parameters" in text
    assert "0 optimizer state" in text


def test_custom_variable_bases_are_frozen_units_in_their_own_dtype(mesh):
    """A base held in a custom ``nnx.Variable`` (bf16), contracted by ``@``: a frozen MXFP8 unit
    stored in bf16 ((2 + 2 + 2/32) / n bytes per element with its planes); the counter the
    forward assigns and the temperature it multiplies in stay the model's other state. Without a
    traced loss only ``trainable`` splits the ``nnx.Param``s: the LoRA model's base kernels
    are frozen units by layer class, its embedding kept whole."""
    model, batch = custom_model(), lm_batch(2 * mesh.size)
    fsdp = FSDP(model, mesh, loss_fn=lm_loss, example_batch=batch)
    by_name = {p.name: p for p in fsdp.params}
    bases = [f"{p}/{i}/base" for p in ("up", "down") for i in range(LAYERS)]
    for name in bases:
        p = by_name[name]
        assert (p.kind, p.trained, jnp.dtype(p.dtype)) == ("mxfp8", False, jnp.bfloat16), p
        line = next(row for row in str(fsdp).splitlines() if row.startswith(name + " "))
        assert f"{int(np.prod(p.stored_shape)) // mesh.size * (2 + 2 + 2 / BLOCK) / 1024:.1f} KiB" in line, line
    assert sorted(fsdp.rest_names) == ["calls/value", "temperature/value"]
    assert all(p.trained for p in fsdp.params if p.name not in bases)

    untraced = FSDP(lora_model(), mesh, trainable=nnx.LoRAParam)
    kinds = {p.name: (p.kind, p.trained) for p in untraced.params}
    assert all(kinds[name] == ("mxfp8", False) for name in BASES), kinds
    assert kinds["embed/embedding"] == ("frozen", False) and kinds["head/kernel"] == ("mxfp8", False)
    assert all(kinds[name] == ("plain", True) for name in ADAPTERS), kinds


# ------------------------------------------------------------------------------------------------
# (2) The step is the unsharded model's step, frozen weights untouched


def test_lora_step_is_the_unsharded_step_and_the_base_is_unchanged(lora, mesh):
    fsdp, out = lora
    model, batch, (loss, params, _) = lora_case(mesh.size)
    tol = tolerance(chain(2 * mesh.size))
    m = Mismatches(f"LoRA LM on {mesh.size} devices, trainable=nnx.LoRAParam")
    m.close(out["losses"][0], loss, abs(float(loss)), tol, "loss")
    before = nnx.state(model, nnx.LoRAParam)
    assert all(np.abs(v - flat(before)[k]).max() > 0 for k, v in flat(params).items())  # every adapter moves
    compare_params(m, nnx.state(out["gathered"], nnx.LoRAParam), params, before, tol)
    # everything not trained comes back exactly as it was: gathered, and as stored after two steps
    frozen_now = flat(nnx.state(out["gathered"], nnx.Not(nnx.LoRAParam)))
    for k, v in flat(nnx.state(model, nnx.Not(nnx.LoRAParam))).items():
        m.check(frozen_now[k].dtype == v.dtype and np.array_equal(frozen_now[k], v), f"{k} changed")
    m.done()
    for a, b in zip(jax.tree.leaves(out["before"]), jax.tree.leaves(out["after"])):
        np.testing.assert_array_equal(a, b)
    assert np.isfinite(out["losses"][1])


def test_custom_variable_step_is_the_unsharded_step(mesh):
    """The custom-Variable LM with the default ``trainable=nnx.Param``: loss and trained
    parameters as the unsharded step's, the bf16 bases bit for bit as they were, the counter
    advanced once per step and the temperature kept."""
    model, batch = custom_model(), lm_batch(2 * mesh.size)
    loss, params, rest = unsharded_step(model, lm_loss, batch, nnx.Param)
    fsdp = FSDP(nnx.clone(model), mesh, loss_fn=lm_loss, example_batch=batch)
    out = run(fsdp, nnx.clone(model), batch, steps=1)
    tol = tolerance(chain(2 * mesh.size))
    m = Mismatches(f"custom-Variable LM on {mesh.size} devices")
    m.close(out["losses"][0], loss, abs(float(loss)), tol, "loss")
    compare_params(m, nnx.state(out["gathered"], nnx.Param), params, nnx.state(model, nnx.Param), tol)
    got_rest, want_rest = flat(nnx.split(out["gathered"], nnx.Param, ...)[2]), flat(rest)
    m.check(got_rest.keys() == want_rest.keys(), f"other state {sorted(got_rest)}, the model's {sorted(want_rest)}")
    for k in want_rest:
        m.equal(got_rest.get(k), want_rest[k], k)  # bases exact (bf16), calls == 1, temperature 0.5
    m.done()
    assert float(want_rest["calls"]) == 1.0


# ------------------------------------------------------------------------------------------------
# (3) What the compiled step communicates


def test_the_frozen_bases_have_no_gradient_collectives(lora, mesh):
    """In the compiled LoRA step the only reduce-scatters are the adapters' gradients (exactly
    their fp32 shards' bytes), every all-reduce is a scalar, and the bases' 8-bit planes are
    all-gathered; the same model with every ``nnx.Param`` trained reduce-scatters every trained
    parameter's gradient (exactly their fp32 shards' bytes), the bases' among them: at least
    their ``[rows, in_features]`` fp32 shards more than the adapters alone."""
    fsdp, out = lora
    n = mesh.size
    found = hlo.collectives(out["hlo"])
    adapters = sum(int(np.prod(p.stored_shape)) // n * 4 for p in fsdp.trained)
    assert hlo.bytes_by_op(out["hlo"])["reduce-scatter"] == adapters, hlo.bytes_by_op(out["hlo"])
    assert all(c.bytes <= 8 for c in found if c.op == "all-reduce"), [c for c in found if c.op == "all-reduce"]
    gathered = {(d, s) for c in found if c.op == "all-gather" for d, s in c.outputs}
    for p in (p for p in fsdp.params if p.name in BASES):
        assert ("u8", p.stored_shape) in gathered, (p.name, p.stored_shape, sorted(gathered))

    model, batch, _ = lora_case(n)
    everything = FSDP(nnx.clone(model), mesh, loss_fn=lm_loss, example_batch=batch)
    state = everything.init(nnx.clone(model), TX)
    text = everything.lower_train_step(lm_loss, TX, state, batch).compile().as_text()
    scattered = {(d, s) for c in hlo.collectives(text) if c.op == "reduce-scatter" for d, s in c.outputs}
    bases = [p for p in everything.params if p.name in BASES]
    for p in bases:
        assert ("f32", (p.unit.rows, p.unit.in_features)) in scattered, (p.name, sorted(scattered))
    trained = sum(int(np.prod(p.stored_shape)) // n * 4 for p in everything.trained)
    assert hlo.bytes_by_op(text)["reduce-scatter"] == trained, (hlo.bytes_by_op(text), trained)
    assert trained >= adapters + sum(p.unit.rows * p.unit.in_features * 4 for p in bases)


# ------------------------------------------------------------------------------------------------
# (4) gather, checkpoints


def test_checkpoint_round_trip_and_restore_onto_another_mesh(lora, mesh, tmp_path):
    """``save`` writes the frozen bases under ``frozen/<path>`` in their own shape and dtype;
    ``restore`` gives back every array of the state bit for bit (planes re-quantized), and onto a
    mesh of half the devices the same model."""
    fsdp, out = lora
    state = out["state"]
    fsdp.save(state, tmp_path / "ckpt")
    restored = fsdp.restore(tmp_path / "ckpt", TX)
    fsdp.check_state(restored)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(state)[0], jax.tree.leaves(restored)):
        assert a.dtype == b.dtype and a.sharding == b.sharding, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
    stored = {t.name: t for t in checkpoint.read_metadata(tmp_path / "ckpt").tensors}
    by_name = {p.name: p for p in fsdp.params}
    for name in BASES + ["embed/embedding", "blocks/0/up/base_module/bias"]:
        t = stored[f"frozen/{name}"]
        assert (t.shape, t.dtype) == (by_name[name].shape, jnp.dtype(by_name[name].dtype)), t
    assert sorted(k for k in stored if k.startswith("params/")) == sorted(f"params/{k}" for k in ADAPTERS)

    half = Mesh(np.array(mesh.devices[: mesh.size // 2]), ("fsdp",))
    model, batch, _ = lora_case(mesh.size)
    other = FSDP(
        nnx.clone(model), half, loss_fn=lm_loss, example_batch=lm_batch(half.size * 2), trainable=nnx.LoRAParam
    )
    moved = other.restore(tmp_path / "ckpt", TX)
    want, got = flat(nnx.state(fsdp.gather(state))), flat(nnx.state(other.gather(moved)))
    assert want.keys() == got.keys()
    for k in want:
        assert want[k].dtype == got[k].dtype and np.array_equal(want[k], got[k]), k


# ------------------------------------------------------------------------------------------------
# (5) Errors, and tensor parallelism


def test_trainable_filters_that_cannot_be_trained_are_refused(mesh):
    model, batch = custom_model(), lm_batch(2 * mesh.size)
    with pytest.raises(ValueError, match=r"trainable=.*LoRAParam.* matches no floating variable"):
        FSDP(model, mesh, loss_fn=lm_loss, example_batch=batch, trainable=nnx.LoRAParam)
    with pytest.raises(ValueError, match=r"trainable=.* matches no floating variable"):
        FSDP(model, mesh, trainable=lambda path, v: "nothing" in path)
    with pytest.raises(TypeError, match=r"trainable=3 is not an nnx filter"):
        FSDP(model, mesh, trainable=3)
    with pytest.raises(ValueError, match=r"trainable=.* matches calls, which the loss assigns"):
        FSDP(model, mesh, loss_fn=lm_loss, example_batch=batch, trainable=nnx.Any(nnx.Param, Calls))


def test_frozen_units_under_tensor_parallelism(devices):
    """Frozen column- and row-parallel units (the transformer's q, o and up kernels) on a
    (n/2, 2) mesh: stay bit for bit what they were, and the step's losses are FSDP alone's on
    the same parameters to ``test_tp``'s tolerance (the order of the tp partial sums)."""
    if len(devices) < 4:
        pytest.skip("needs 4 devices")
    cfg = models.TransformerConfig(vocab=64, hidden=64, heads=2, head_dim=32, mlp=128, layers=2, norm="mxfp8")
    model = models.init_transformer(cfg, seed=0)
    task = models.SequenceTask(cfg.vocab, 17, seed=1)
    b0, b1 = (models.next_token_pairs(t) for t in task.batches(2, 8))
    frozen = ("q", "o", "up")
    trainable = lambda path, v: isinstance(v, nnx.Param) and not any(str(k) in frozen for k in path)
    kw = dict(loss_fn=models.next_token_loss, example_batch=b0, trainable=trainable)
    tp = FSDP(model, Mesh(np.array(devices).reshape(-1, 2), ("fsdp", "tp")), tp_axis="tp", **kw)
    roles = {p.name: (p.tp, p.trained) for p in tp.units}
    assert roles["blocks/attn/q/kernel"] == ("column", False) and roles["blocks/attn/o/kernel"] == ("row", False)
    alone = FSDP(model, Mesh(np.array(devices), ("fsdp",)), **kw)
    state = tp.init(model, TX)
    before = host(state.frozen)
    step = tp.train_step(models.next_token_loss, TX)
    state, loss0 = step(state, b0)
    gathered = tp.gather(state)
    state, loss1 = step(state, b1)
    for k, v in before.items():
        np.testing.assert_array_equal(v, np.asarray(state.frozen[k]), err_msg=k)
    evaluate = alone.eval_step(models.next_token_loss)
    want0 = evaluate(alone.init(model, TX), b0)
    want1 = evaluate(alone.init(gathered, TX), b1)
    np.testing.assert_allclose([float(loss0), float(loss1)], [float(want0), float(want1)], rtol=2.0**-8)
