"""The step of ``FSDP(model, ...)`` is the step of ``model``: global semantics.

``loss_fn(model, batch)`` is a function of the WHOLE batch, as under ``jax.jit`` with a sharded
batch, whatever the loss does with it: a token-masked mean over uneven padding, per-example
``aux`` arrays and counts (integers too), ``nnx.BatchNorm`` batch statistics in training mode,
``nnx.Dropout`` masks. Each test runs one ``optax.sgd(1.0)`` step of a small model written the
way Flax users write it, on every device of the run (a 1-D ``("fsdp",)`` mesh, and a 2-D
``("data", "fsdp")`` one), and compares the loss, every ``aux`` leaf, the parameters after the
step and the model's other state (running averages, RNG streams) with the unsharded model's own
step, jitted on one device.

The oracle needs no MXFP8 arithmetic: every weight matrix is a signed power of two within a
factor 2^4 of the largest, which MXFP8 holds exactly under any block scale (and bf16 too), and
every layer computes in fp32, so the FSDP step's GEMMs read exactly the unsharded model's
weights and the two steps may differ only in the order their fp32 sums are added. The
tolerances are derived from that (``tolerance``), never from a run's last digits; jit with the
batch split over the mesh (XLA's own partitioning: the same global semantics, sums in another
order) is checked to pass the same comparisons, and each test checks that its data make the old
per-device semantics land far outside them.

A loss or layer that names a mesh axis (``lax.psum(x, "fsdp")``,
``nnx.BatchNorm(axis_name="fsdp")``) is refused by ``FSDP(...)`` with a ``ValueError`` (the
statistics are global already), and bad inputs (a ``precision_by_path`` pattern that does not
compile or matches nothing, a step batch of another structure than ``example_batch``, a loss that
is not a scalar) get clear ``ValueError``s.
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
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mxfp8_jax.flax import FSDP

from conftest import need_devices
from summation import UNIT_ROUNDOFF, gamma

VOCAB, D, H, SEQ, CLASSES = 128, 64, 128, 16, 32  # multiples of 32: the projections are MXFP8 units
LR = 1.0  # optax.sgd(1.0): the parameters after the step are the parameters minus the gradients
MOMENTUM = 0.99  # nnx.BatchNorm's default
LAYERS = 2  # the scanned LM's blocks


def batch_size(n: int) -> int:
    """Two examples (sequences) per device."""
    return 2 * n


@pytest.fixture(scope="module")
def mesh(devices):
    return Mesh(np.array(devices), ("fsdp",))


def mesh_2d(devices) -> Mesh:
    """``("data", "fsdp")``: 2 x m devices, the most of the run's devices that make one (at
    least 4)."""
    need_devices(4)
    m = len(devices) // 2
    return Mesh(np.array(devices[: 2 * m]).reshape(2, m), ("data", "fsdp"))


@pytest.fixture
def partitionable_threefry():
    """Dropout masks of a sharded batch equal the unsharded model's only with
    ``jax_threefry_partitionable`` (the default since jax 0.5): each random bit is then a
    function of the key and its index in the global array, not of how the array is split."""
    before = jax.config.jax_threefry_partitionable
    jax.config.update("jax_threefry_partitionable", True)
    try:
        yield
    finally:
        jax.config.update("jax_threefry_partitionable", before)


# ------------------------------------------------------------------------------------------------
# Tolerances: fp32 summation order, nothing else


def tolerance(k: int) -> float:
    """Relative tolerance of a quantity whose computation chains sums of ``k`` fp32 terms in all
    (forward contractions and reductions, the loss's sum over the batch, backward contractions,
    the gradient's sum over the batch). Any order of adding ``m`` terms is within ``gamma(m - 1)``
    of the exact sum, relative to the sum of the terms' magnitudes (Higham 4.2; ``summation.py``);
    chained sums add their gammas (``gamma(a) + gamma(b) <= gamma(a + b)``), and two such
    computations are at most twice that apart. The other factor 2 allows for the magnitudes'
    sum exceeding the scale the comparisons use (a column's largest value). For these models
    that is 1e-4 to 3e-4; a statistic over one device's slice instead of the batch is off by
    1e-2 and more."""
    return 2 * 2 * gamma(k)


def column_scale(ref) -> np.ndarray:
    """The scale an array is compared at: each column's (last axis's) largest |value| for a
    matrix, the largest |value| for a vector or scalar; a tiny floor, so that an all-zero column
    (an embedding row no token reads) is compared exactly."""
    a = np.abs(np.asarray(ref, np.float64))
    if a.ndim >= 2:
        s = a.reshape(-1, a.shape[-1]).max(0)
    else:
        s = np.full(a.shape, a.max() if a.size else 0.0)
    return np.maximum(s, 1e-30)


def frobenius(got, want) -> float:
    """``||got - want|| / ||want||``."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-300))


class Mismatches:
    """Collects every comparison that fails, so that one run reports all of them."""

    def __init__(self, label: str):
        self.label, self.lines = label, []

    def check(self, ok: bool, what: str) -> None:
        if not ok:
            self.lines.append(what)

    def close(self, got, want, scale, tol: float, what: str, extra=0.0) -> None:
        """``|got - want| <= tol * scale + extra`` elementwise; the shapes must agree."""
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        if got.shape != want.shape:
            self.lines.append(f"{what}: shape {got.shape}, the unsharded model's {want.shape}")
            return
        allowed = tol * np.broadcast_to(np.asarray(scale, np.float64), want.shape) + extra
        excess = np.abs(got - want) - allowed
        if (excess > 0).any():
            i = np.unravel_index(np.argmax(excess), want.shape)
            self.lines.append(
                f"{what}: {int((excess > 0).sum())} of {want.size} values beyond the tolerance (worst at "
                f"{tuple(int(j) for j in i)}: FSDP {got[i]:.7g}, unsharded {want[i]:.7g}, allowed +-{allowed[i]:.3g}; "
                f"relative Frobenius difference {frobenius(got, want):.3g})"
            )

    def equal(self, got, want, what: str) -> None:
        """Same shape, dtype kind and values (integers, RNG key data)."""
        got, want = np.asarray(got), np.asarray(want)
        if got.shape != want.shape or got.dtype.kind != want.dtype.kind or not np.array_equal(got, want):
            self.lines.append(
                f"{what}: FSDP {got.dtype}{list(got.shape)} {got}, unsharded {want.dtype}{list(want.shape)} {want}"
            )

    def done(self) -> None:
        assert not self.lines, f"{self.label}: the FSDP step is not the unsharded model's step:\n  " + "\n  ".join(
            self.lines
        )


# ------------------------------------------------------------------------------------------------
# The oracle: the model's own step


def exact_weights(model: nnx.Module, seed: int = 0, tops: dict[str, float] | None = None) -> nnx.Module:
    """Every weight (kernels, embedding tables: the randomly initialised parameters) a signed power
    of two 2^-4..1 times its top: the power of two nearest its initialiser's largest |value|, or
    ``tops[layer]`` (a power of two) for the layers named there. Exact in MXFP8 under any block
    scale and in bf16. Parameters initialised to a constant (biases, norm scales: zeros and ones)
    keep it."""
    rng, tops = np.random.default_rng(seed), tops or {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = np.asarray(var.get_value())
        if np.all(value == value.flat[0]):
            continue
        top = tops.get(str(path[0]), 2.0 ** np.round(np.log2(np.abs(value).max())))
        powers = 2.0 ** rng.integers(-4, 1, value.shape)
        signs = np.where(rng.random(value.shape) < 0.5, -1.0, 1.0)
        var.set_value(jnp.asarray(signs * powers * top, value.dtype))
    return model


def flat(state) -> dict[str, np.ndarray]:
    """An nnx ``State`` (or a pytree model: its array leaves) as ``{path: numpy array}`` (RNG
    keys as their key data)."""
    if isinstance(state, nnx.State):
        items = [(path, leaf) for path, leaf in nnx.to_flat_state(state)]
    else:
        items = [(tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path), leaf)
                 for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
                 if hasattr(leaf, "dtype")]  # fmt: skip
    out = {}
    for path, leaf in items:
        value = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
        if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
            value = jax.random.key_data(value)
        out["/".join(map(str, path))] = np.asarray(value)
    return out


def unsharded_step(model: nnx.Module, loss_fn, batch, *, has_aux: bool, mesh: Mesh | None = None):
    """The model's own step: ``(loss, aux, params after one sgd(LR) step, the model's other state
    after the step)``, jitted on one device; with ``mesh``, jitted with the batch split over all
    of its axes and the model replicated (XLA's partitioning: the same global semantics with
    other sums' order). ``model`` is not changed."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.sgd(LR)

    def step(params, rest, batch):
        def loss_of(p):
            m = nnx.merge(graphdef, p, rest, copy=True)
            out = loss_fn(m, batch)
            loss, aux = out if has_aux else (out, None)
            return loss, (aux, nnx.split(m, nnx.Param, ...)[2])

        (loss, (aux, rest_after)), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
        updates, _ = tx.update(grads, tx.init(params), params)
        return loss, aux, optax.apply_updates(params, updates), rest_after

    if mesh is None:
        args = jax.device_put((params, rest, batch), jax.devices()[0])
    else:
        replicated = NamedSharding(mesh, PartitionSpec())
        split = NamedSharding(mesh, PartitionSpec(mesh.axis_names))
        args = (*jax.device_put((params, rest), replicated), jax.device_put(batch, split))
    return jax.jit(step)(*args)


def fsdp_step(model: nnx.Module, mesh: Mesh, loss_fn, batch, *, has_aux: bool, **options):
    """One ``FSDP.train_step`` with ``sgd(LR)``: ``(loss, aux, params after, other state after)``,
    the last two as the gathered model holds them. ``options``: more arguments of ``FSDP``."""
    fsdp = FSDP(model, mesh, loss_fn=loss_fn, example_batch=batch, **options)
    assert fsdp.mxfp8_units, str(fsdp)  # the step reads MXFP8 weight gathers
    tx = optax.sgd(LR)
    state = fsdp.init(model, tx)
    out = fsdp.train_step(loss_fn, tx, has_aux=has_aux)(state, batch)
    state, loss, aux = out if has_aux else (*out, None)
    _, params, rest = nnx.split(fsdp.gather(state), nnx.Param, ...)
    return loss, aux, params, rest


def compare_params(m: Mismatches, got, want, before, tol: float) -> None:
    """The parameters after the step: each one's update (``after - before``, -LR times the
    gradient) within ``tol`` of the unsharded update's column scale, plus the fp32 rounding of
    ``before + update`` on each side (``u`` of the result each). A gradient that is zero but for
    rounding (the bias of a layer before a BatchNorm: the terms of its sum over the batch cancel)
    is held to the size of its terms, not of its noise: no scale is below 1% of the model's
    largest update."""
    got, want, before = flat(got), flat(want), flat(before)
    m.check(got.keys() == want.keys(), f"parameters {sorted(got)}, the model's {sorted(want)}")
    updates = {k: want[k].astype(np.float64) - before[k] for k in want}
    floor = 1e-2 * max(np.abs(u).max() for u in updates.values())
    for k in sorted(want.keys() & got.keys()):
        rounding = 2 * UNIT_ROUNDOFF * np.abs(want[k].astype(np.float64))
        scale = np.maximum(column_scale(updates[k]), floor)
        m.close(got[k], want[k], scale, tol, f"parameter {k} after the step", rounding)


def compare_rest(m: Mismatches, got, want, before, tol: float) -> None:
    """The model's other state after the step: floating state (BatchNorm's running averages,
    ``MOMENTUM * before + (1 - MOMENTUM) * statistic``) within ``tol`` of the scale of the
    statistic's share plus the fp32 rounding of each side; integers and RNG keys equal."""
    got, want, before = flat(got), flat(want), flat(before)
    m.check(got.keys() == want.keys(), f"other state {sorted(got)}, the model's {sorted(want)}")
    for k in sorted(want.keys() & got.keys()):
        if want[k].dtype.kind == "f":
            share = want[k].astype(np.float64) - MOMENTUM * before[k]
            rounding = 2 * UNIT_ROUNDOFF * np.abs(want[k].astype(np.float64))
            m.close(got[k], want[k], column_scale(share), tol, f"{k} after the step", rounding)
        else:
            m.equal(got[k], want[k], f"{k} after the step")


# ------------------------------------------------------------------------------------------------
# The models


class TokenLM(nnx.Module):
    """A token LM as Flax users write one: an embedding, an MLP with a residual, an output head."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.up = nnx.Linear(D, H, rngs=rngs)
        self.down = nnx.Linear(H, D, rngs=rngs)
        self.head = nnx.Linear(D, VOCAB, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        h = self.embed(tokens)
        h = h + self.down(jax.nn.gelu(self.up(h)))
        return self.head(h)


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(D, H, rngs=rngs)
        self.down = nnx.Linear(H, D, rngs=rngs)

    def __call__(self, h):
        return h + self.down(jax.nn.gelu(self.up(h)))


class ScannedLM(nnx.Module):
    """The token LM with ``LAYERS`` blocks created stacked (``nnx.split_rngs`` + ``nnx.vmap``)
    and run by ``nnx.scan``, each iteration under ``nnx.remat``, as in Flax's guides."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return Block(rngs)

        self.blocks = create(rngs)
        self.head = nnx.Linear(D, VOCAB, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        def step(h, block):
            return block(h)

        h = nnx.scan(nnx.remat(step), in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(self.embed(tokens), self.blocks)
        return self.head(h)


def masked_lm_loss(model, batch):
    """Padded sequences: the mean cross-entropy over the real tokens of the batch. aux: the token
    count, each sequence's own mean loss ``[B]``, the mean logit of the real tokens and, as its
    scale, their mean |logit|."""
    logits = model(batch["x"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    mask = batch["mask"]
    ntokens = mask.sum()
    aux = {
        "ntokens": ntokens,
        "per_example": (ce * mask).sum(1) / jnp.maximum(mask.sum(1), 1.0),
        "mean_logit": (logits.mean(-1) * mask).sum() / ntokens,
        "mean_abs_logit": (jnp.abs(logits).mean(-1) * mask).sum() / ntokens,
    }
    return (ce * mask).sum() / ntokens, aux


def lm_batch(b: int, seed: int = 2):
    """``{"x", "y", "mask"}`` (mask float32) with uneven padding: the first sequence has 2 real
    tokens of ``SEQ``, the second 3 (the first device's slice holds 5 tokens), the third is full,
    the others 4..SEQ at random; padding tokens are 0."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(4, SEQ + 1, b)
    lengths[:3] = 2, 3, SEQ
    mask = (np.arange(SEQ)[None, :] < lengths[:, None]).astype(np.float32)
    x = np.where(mask > 0, rng.integers(1, VOCAB, (b, SEQ)), 0).astype(np.int32)
    y = np.where(mask > 0, rng.integers(0, VOCAB, (b, SEQ)), 0).astype(np.int32)
    return {"x": x, "y": y, "mask": mask}


def lm_chain(b: int, layers: int = 1) -> int:
    """The LM's chain of sums: the forward's contractions (each block's D and H, the head's D)
    and softmax (VOCAB), the loss's sum over the batch's tokens, the backward's contractions
    (VOCAB, each block's D and H) and the weight gradients' sum over the tokens."""
    tokens = b * SEQ
    return layers * (D + H) + D + VOCAB + tokens + VOCAB + layers * (D + H) + tokens


class BatchNormMLP(nnx.Module):
    """Linear -> BatchNorm (training mode: batch statistics) -> relu -> Linear."""

    def __init__(self, rngs: nnx.Rngs, axis_name=None):
        self.l1 = nnx.Linear(D, H, rngs=rngs)
        self.bn = nnx.BatchNorm(H, use_running_average=False, axis_name=axis_name, rngs=rngs)
        self.l2 = nnx.Linear(H, D, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.bn(self.l1(x))))


class DropoutMLP(nnx.Module):
    """Linear -> relu -> Dropout(0.5) with its own stream -> Linear."""

    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(D, H, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=7))
        self.l2 = nnx.Linear(H, D, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(jax.nn.relu(self.l1(x))))


def mse_loss(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


def regression_batch(b: int, seed: int = 3):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((b, D)).astype(np.float32), rng.standard_normal((b, D)).astype(np.float32)


def mlp_chain(b: int) -> int:
    """The MLPs' chain of sums: forward contractions (D, H), the batch statistics (mean and mean
    square over the batch), the loss's sum over b x D outputs; backward contractions (D, H), the
    statistics' backward (two sums over the batch) and the weight gradients' sum over the batch."""
    return D + 2 * b + H + b * D + D + H + 2 * b + b


class Classifier(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(D, H, rngs=rngs)
        self.l2 = nnx.Linear(H, CLASSES, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


def counting_loss(model, batch):
    """Mean cross-entropy over the valid examples; aux of integers: the count of valid examples,
    of correct predictions, and each example's prediction ``[B]``."""
    logits = model(batch["x"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
    valid = batch["valid"]
    pred = jnp.argmax(logits, -1)
    aux = {"valid": valid.sum(), "correct": ((pred == batch["label"]) * valid).sum(), "pred": pred}
    return (ce * valid).sum() / valid.sum(), aux


def class_batch(b: int, seed: int = 4):
    """Small integer inputs: with power-of-two weights every logit is a sum of dyadic rationals of
    few bits, exact in fp32 in any order, so the predictions are exact too."""
    rng = np.random.default_rng(seed)
    valid = (rng.random(b) < 0.7).astype(np.int32)
    valid[:2] = 0, 1
    return {
        "x": rng.integers(-2, 3, (b, D)).astype(np.float32),
        "label": rng.integers(0, CLASSES, b).astype(np.int32),
        "valid": valid,
    }


@functools.cache
def reference(name: str, b: int):
    """``(model, batch, the unsharded step's result)`` for the models of the tests, batch ``b``."""
    if name in ("lm", "scanned_lm"):
        # logits of rms ~2.5 (table and head weights up to 1): the tokens' losses differ widely,
        # so that weighting the sequences otherwise than by their tokens shows
        model = (TokenLM if name == "lm" else ScannedLM)(nnx.Rngs(0))
        model = exact_weights(model, tops={"embed": 1.0, "head": 1.0})
        batch, loss_fn, has_aux = lm_batch(b), masked_lm_loss, True
    elif name == "batchnorm":
        model, batch, loss_fn, has_aux = exact_weights(BatchNormMLP(nnx.Rngs(0))), regression_batch(b), mse_loss, False
    elif name == "dropout":
        model, batch, loss_fn, has_aux = exact_weights(DropoutMLP(nnx.Rngs(0))), regression_batch(b), mse_loss, False
    else:
        model, batch, loss_fn, has_aux = exact_weights(Classifier(nnx.Rngs(0))), class_batch(b), counting_loss, True
    return model, batch, unsharded_step(model, loss_fn, batch, has_aux=has_aux)


# ------------------------------------------------------------------------------------------------
# The checks of each model's step


def per_device_mean(per_example, mask, n: int) -> float:
    """The old semantics: each device's masked mean over its slice, averaged over devices."""
    lengths = np.asarray(mask).sum(1)
    sums = np.asarray(per_example, np.float64) * lengths
    return float(np.mean([s.sum() / l.sum() for s, l in zip(np.split(sums, n), np.split(lengths, n))]))


def check_lm(got, n: int, label: str, name: str = "lm") -> None:
    model, batch, (loss, aux, params, _) = reference(name, batch_size(n))
    tol = tolerance(lm_chain(batch_size(n), LAYERS if name == "scanned_lm" else 1))
    # the oracle by hand: the token count, and the loss as the sequences' losses weighted by length
    lengths = batch["mask"].sum(1)
    assert float(aux["ntokens"]) == lengths.sum() and lengths[0] == 2
    by_length = (np.asarray(aux["per_example"], np.float64) * lengths).sum() / lengths.sum()
    np.testing.assert_allclose(float(loss), by_length, rtol=tol)
    # the data discriminate: the mean of the devices' masked means is far outside the tolerance
    assert abs(per_device_mean(aux["per_example"], batch["mask"], n) - float(loss)) > 10 * tol * float(loss)

    got_loss, got_aux, got_params, _ = got
    m = Mismatches(label)
    m.close(got_loss, loss, abs(float(loss)), tol, "loss")
    m.check(isinstance(got_aux, dict) and got_aux.keys() == aux.keys(), f"aux {got_aux}, the model's keys {list(aux)}")
    if isinstance(got_aux, dict) and got_aux.keys() == aux.keys():
        scales = {"ntokens": 0.0, "mean_logit": aux["mean_abs_logit"]}  # a count is exact
        for k, want in aux.items():
            g, w = np.asarray(got_aux[k]), np.asarray(want)
            m.check(g.dtype.kind == w.dtype.kind, f"aux[{k!r}] is {g.dtype}, the model's {w.dtype}")
            m.close(g, w, scales.get(k, np.abs(w)), tol, f"aux[{k!r}]")
    compare_params(m, got_params, params, nnx.state(model, nnx.Param), tol)
    m.done()


def check_batchnorm(got, n: int, label: str) -> None:
    model, (x, _), (loss, _, params, rest) = reference("batchnorm", batch_size(n))
    tol = tolerance(mlp_chain(batch_size(n)))
    # the oracle by hand: the running averages hold the first layer's batch statistics (float64)
    l1 = model.l1
    h = x.astype(np.float64) @ np.asarray(l1.kernel.get_value(), np.float64) + np.asarray(l1.bias.get_value())
    stats = flat(rest)
    np.testing.assert_allclose(stats["bn/mean"], (1 - MOMENTUM) * h.mean(0), rtol=0, atol=tol * np.abs(h).max())
    np.testing.assert_allclose(stats["bn/var"], MOMENTUM + (1 - MOMENTUM) * h.var(0), rtol=tol, atol=0)
    # the data discriminate: the devices' own variances, averaged, are far from the batch's
    per_device = np.mean([part.var(0) for part in np.split(h, n)], axis=0)
    assert np.max(np.abs(per_device - h.var(0)) / h.var(0)) > 10 * tol

    got_loss, _, got_params, got_rest = got
    m = Mismatches(label)
    m.close(got_loss, loss, abs(float(loss)), tol, "loss")
    compare_params(m, got_params, params, nnx.state(model, nnx.Param), tol)
    compare_rest(m, got_rest, rest, nnx.split(model, nnx.Param, ...)[2], tol)
    m.done()


def check_dropout(got, n: int, label: str) -> None:
    model, _, (loss, _, params, rest) = reference("dropout", batch_size(n))
    tol = tolerance(mlp_chain(batch_size(n)))
    got_loss, _, got_params, got_rest = got
    m = Mismatches(label)
    m.close(got_loss, loss, abs(float(loss)), tol, "loss")
    compare_params(m, got_params, params, nnx.state(model, nnx.Param), tol)
    compare_rest(m, got_rest, rest, nnx.split(model, nnx.Param, ...)[2], tol)  # the stream's key and count
    m.done()


# ------------------------------------------------------------------------------------------------
# The step is the model's step


def test_masked_lm_loss_aux_and_update_are_the_unsharded_models(mesh):
    """A token-masked mean with uneven padding, ``has_aux=True``: the loss is the masked mean over
    the whole batch; every aux leaf has the unsharded model's shape, dtype kind and value (the
    token count of the whole batch, the ``[B]`` per-example losses in batch order); the
    parameters after one sgd(1.0) step are the unsharded model's."""
    model, batch, _ = reference("lm", batch_size(mesh.size))
    got = fsdp_step(nnx.clone(model), mesh, masked_lm_loss, batch, has_aux=True)
    check_lm(got, mesh.size, f"token LM on {mesh.size} devices")


def test_masked_lm_on_a_2d_mesh_splits_the_batch_over_both_axes(devices):
    """The same on a ``("data", "fsdp")`` mesh of 2 x n/2 devices: the batch is split over both
    axes and the step is still the unsharded model's (per-example aux in batch order)."""
    mesh = mesh_2d(devices)
    model, batch, _ = reference("lm", batch_size(mesh.size))
    got = fsdp_step(nnx.clone(model), mesh, masked_lm_loss, batch, has_aux=True)
    check_lm(got, mesh.size, f"token LM on a {mesh.shape['data']} x {mesh.shape['fsdp']} mesh")


def test_a_scanned_rematerialised_lm_is_the_unsharded_model_too(mesh):
    """The masked LM with its blocks stacked by ``nnx.vmap`` and run by ``nnx.scan`` under
    ``nnx.remat``: the same loss, aux and update as the unsharded model's."""
    model, batch, _ = reference("scanned_lm", batch_size(mesh.size))
    got = fsdp_step(nnx.clone(model), mesh, masked_lm_loss, batch, has_aux=True)
    check_lm(got, mesh.size, f"scanned LM on {mesh.size} devices", "scanned_lm")


def test_batchnorm_training_uses_the_batch_statistics_of_the_whole_batch(mesh):
    """``nnx.BatchNorm(use_running_average=False)``: the loss and the update are the unsharded
    model's (statistics over the whole batch, not each device's two examples), and so are the
    running mean and variance after the step (``fsdp.gather(state)`` holds them)."""
    model, batch, _ = reference("batchnorm", batch_size(mesh.size))
    got = fsdp_step(nnx.clone(model), mesh, mse_loss, batch, has_aux=False)
    check_batchnorm(got, mesh.size, f"BatchNorm MLP on {mesh.size} devices")


def test_dropout_masks_are_the_unsharded_models(mesh, partitionable_threefry):
    """``nnx.Dropout(0.5)`` with its own stream, ``jax_threefry_partitionable`` on (see the
    fixture): the step draws the masks the unsharded model draws from the same stream state, so
    the loss and the update are the unsharded step's; the stream's key and count after the step
    are the unsharded model's."""
    model, batch, _ = reference("dropout", batch_size(mesh.size))
    got = fsdp_step(nnx.clone(model), mesh, mse_loss, batch, has_aux=False)
    check_dropout(got, mesh.size, f"Dropout MLP on {mesh.size} devices")


def test_integer_aux_leaves_keep_their_dtype_shape_and_value(mesh):
    """``has_aux=True`` with integer leaves: counts over the whole batch and a per-example
    ``[B]`` int array (predictions, exact here: the logits are exact in fp32) come back as the
    unsharded model's, dtype kind, shape and value."""
    n = mesh.size
    model, batch, (loss, aux, params, _) = reference("classifier", batch_size(n))
    assert int(aux["valid"]) == batch["valid"].sum() and np.asarray(aux["pred"]).shape == (batch_size(n),)
    got_loss, got_aux, got_params, _ = fsdp_step(nnx.clone(model), mesh, counting_loss, batch, has_aux=True)
    tol = tolerance(mlp_chain(batch_size(n)))
    m = Mismatches(f"integer aux on {n} devices")
    m.close(got_loss, loss, abs(float(loss)), tol, "loss")
    m.check(isinstance(got_aux, dict) and got_aux.keys() == aux.keys(), f"aux {got_aux}, the model's keys {list(aux)}")
    for k in aux.keys() & (got_aux.keys() if isinstance(got_aux, dict) else set()):
        m.equal(got_aux[k], aux[k], f"aux[{k!r}]")
    compare_params(m, got_params, params, nnx.state(model, nnx.Param), tol)
    m.done()


def test_the_tolerances_admit_jit_with_a_sharded_batch(mesh, partitionable_threefry):
    """The oracle's tolerances hold for what global semantics are: the models' own steps jitted
    with the batch split over the mesh (XLA's partitioning, the sums in another order) pass the
    checks the FSDP steps are held to; so a failure of those is a defect, not rounding."""
    for name, loss_fn, has_aux, check in (
        ("lm", masked_lm_loss, True, check_lm),
        ("scanned_lm", masked_lm_loss, True, functools.partial(check_lm, name="scanned_lm")),
        ("batchnorm", mse_loss, False, check_batchnorm),
        ("dropout", mse_loss, False, check_dropout),
    ):
        model, batch, _ = reference(name, batch_size(mesh.size))
        got = unsharded_step(model, loss_fn, batch, has_aux=has_aux, mesh=mesh)
        check(got, mesh.size, f"{name}: jit with the batch split over {mesh.size} devices")


# ------------------------------------------------------------------------------------------------
# Naming a mesh axis is refused by the plan


def psum_loss(axis):
    def loss_fn(model, batch):
        x, y = batch
        return lax.psum(jnp.sum((model(x) - y) ** 2), axis) / y.size

    return loss_fn


def assert_names_the_axis(err, axis: str) -> None:
    msg = str(err.value)
    assert "FSDP" in msg and f"'{axis}'" in msg and "axis_name" in msg, msg


def test_a_loss_that_sums_over_the_fsdp_axis_is_refused_by_the_plan(mesh):
    """``lax.psum(x, "fsdp")`` in the loss: a ``ValueError`` from ``FSDP(...)`` naming the axis
    (drop it: the loss sees the whole batch already), not jax's unbound-axis ``NameError``."""
    model = exact_weights(DropoutMLP(nnx.Rngs(0)))
    with pytest.raises(ValueError) as err:
        FSDP(model, mesh, loss_fn=psum_loss("fsdp"), example_batch=regression_batch(batch_size(mesh.size)))
    assert_names_the_axis(err, "fsdp")


def test_batchnorm_with_the_fsdp_axis_name_is_refused_by_the_plan(mesh):
    """``nnx.BatchNorm(axis_name="fsdp")``: a ``ValueError`` from ``FSDP(...)`` naming the axis
    (its statistics are over the whole batch without it)."""
    model = exact_weights(BatchNormMLP(nnx.Rngs(0), axis_name="fsdp"))
    with pytest.raises(ValueError) as err:
        FSDP(model, mesh, loss_fn=mse_loss, example_batch=regression_batch(batch_size(mesh.size)))
    assert_names_the_axis(err, "fsdp")


def test_a_loss_naming_either_axis_of_a_2d_mesh_is_refused(devices):
    """On a ``("data", "fsdp")`` mesh every axis splits the batch: a loss summing over ``"data"``
    is refused the same way, naming ``'data'``."""
    mesh = mesh_2d(devices)
    model = exact_weights(DropoutMLP(nnx.Rngs(0)))
    with pytest.raises(ValueError) as err:
        FSDP(model, mesh, loss_fn=psum_loss("data"), example_batch=regression_batch(batch_size(mesh.size)))
    assert_names_the_axis(err, "data")


# ------------------------------------------------------------------------------------------------
# Bad inputs


@pytest.mark.parametrize(
    "pattern, says",
    [
        pytest.param("(", [], id="not-a-regex"),
        pytest.param("no_such_layer", ["matches no parameter"], id="matches-nothing"),
    ],
)
def test_a_bad_precision_by_path_pattern_is_a_value_error(mesh, pattern, says):
    """A pattern that does not compile, or that matches no parameter: a ``ValueError`` naming
    ``precision_by_path`` and the pattern."""
    model = Classifier(nnx.Rngs(0))
    batch = class_batch(batch_size(mesh.size))
    with pytest.raises(ValueError) as err:
        FSDP(model, mesh, loss_fn=counting_loss, example_batch=batch, precision_by_path={pattern: "bf16"})
    msg = str(err.value)
    assert "precision_by_path" in msg and repr(pattern) in msg, msg
    for words in says:
        assert words in msg, msg


def test_a_step_batch_of_another_structure_than_the_example_is_a_value_error(mesh):
    """The example is a dict ``{x, y, mask}``; a step (or ``loss_and_grads``) given a dict without
    ``mask``, or the same arrays as a tuple, is a ``ValueError`` naming ``example_batch`` (not the
    loss's ``KeyError``), and the state is not consumed."""
    model, batch, _ = reference("lm", batch_size(mesh.size))
    model = nnx.clone(model)
    fsdp = FSDP(model, mesh, loss_fn=masked_lm_loss, example_batch=batch)
    tx = optax.sgd(LR)
    state = fsdp.init(model, tx)
    step = fsdp.train_step(masked_lm_loss, tx, has_aux=True)
    grads = fsdp.loss_and_grads(masked_lm_loss, has_aux=True)
    without_mask = {"x": batch["x"], "y": batch["y"]}
    as_tuple = (batch["x"], batch["y"], batch["mask"])
    for what, fn in (("train_step", step), ("loss_and_grads", grads)):
        for bad in (without_mask, as_tuple):
            try:
                fn(state, bad)
            except ValueError as err:
                assert "example_batch" in str(err), (what, str(err))
            else:
                pytest.fail(f"{what} took a batch of another structure than example_batch: {jax.tree.structure(bad)}")
    assert not any(a.is_deleted() for a in jax.tree.leaves(state.master))


def test_a_loss_that_is_not_a_scalar_is_refused_by_the_plan(mesh):
    """A ``loss_fn`` returning each example's loss ``[B]`` instead of one number: a ``ValueError``
    from ``FSDP(...)`` (when it traces the loss), saying it must be a scalar."""

    def per_example_loss(model, batch):
        x, y = batch
        return jnp.mean((model(x) - y) ** 2, axis=-1)

    model = exact_weights(DropoutMLP(nnx.Rngs(0)))
    with pytest.raises(ValueError, match="scalar"):
        FSDP(model, mesh, loss_fn=per_example_loss, example_batch=regression_batch(batch_size(mesh.size)))
