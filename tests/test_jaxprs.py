"""Reading jaxprs on every supported jax (``core/jaxprs.py``): each primitive the FSDP trace
enters or stops at, as the installed jax spells it, and clear errors for spellings it does not
know. CI runs this module on the oldest and the newest tested jax."""

import re
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from jax.extend import core as jcore
from jax.sharding import Mesh, PartitionSpec

from mxfp8_jax import flax as mxflax
from mxfp8_jax._src.core import jaxprs
from mxfp8_jax._src.fsdp.fsdp_trace import trace_uses

W = jax.ShapeDtypeStruct((4, 64, 64), jnp.float32)  # a stacked weight [L, K, N]
X = jax.ShapeDtypeStruct((8, 64), jnp.float32)


def uses_of(fn):
    """The uses of the one parameter of ``fn(w, x)``."""
    uses, closed = trace_uses(lambda params, x: fn(params[0], x), [W], X)
    return uses.by_param[0], closed


def test_scan_slices_a_stacked_weight_on_this_jax():
    """A scan over the layers (with a closed-over constant and two carries) reads each layer in
    a GEMM, one stack axis sliced off: the scan's consts, carry and xs are told apart."""
    bias = jnp.arange(32, dtype=jnp.float32)

    def fn(w, x):
        def body(carry, wi):
            h, count = carry
            return (jnp.tanh(h @ wi) + bias.sum(), count + 1), h.sum()

        (h, _), ys = lax.scan(body, (x, 0), w)
        return h.sum() + ys.sum()

    (use,), closed = uses_of(fn)
    assert (use.kind, use.level, use.remat) == ("gemm", 1, False)
    scan = next(e for e in closed.jaxpr.eqns if e.primitive is jaxprs.SCAN)
    parts = jaxprs.scan_parts(scan)
    assert (parts.num_consts, parts.num_carry, parts.length) == (len(scan.invars) - 3, 2, 4)
    assert len(parts.jaxpr.invars) == len(scan.invars)
    assert len(parts.jaxpr.constvars) == len(parts.consts)


def test_jit_and_remat_bodies_are_followed():
    def fn(w, x):
        layer = jax.jit(lambda a, ws: jnp.einsum("bk,lkn->bln", a, ws))
        h = jax.checkpoint(lambda a: jnp.sin(layer(a, w)))(x)
        return h.sum()

    uses, _ = uses_of(fn)
    assert [(u.kind, u.level, u.remat) for u in uses] == [("gemm", 0, True)]


def test_cond_branches_and_while_bodies_are_followed():
    """A parameter read in a ``cond`` branch or a ``while`` body is read there: by index (a
    layer axis), with the branch marked and the while's trips unknown; a ``fori_loop`` with
    static bounds is a scan whose trips are known."""

    def branches(w, x):
        return lax.cond(x.sum() > 0, lambda a: a @ w[0], lambda a: a @ w[1], x).sum()

    def while_body(w, x):
        return lax.while_loop(lambda c: c[1] < 3, lambda c: (c[0] @ w[0, :, :], c[1] + 1), (x, 0))[0].sum()

    def fori(w, x):
        return lax.fori_loop(0, 5, lambda i, a: a @ w[i % 4], x).sum()

    uses, _ = uses_of(branches)
    assert sorted((u.kind, u.level, u.trips, u.branch) for u in uses) == [("gemm", 1, 1, True)] * 2
    uses, _ = uses_of(while_body)
    assert [(u.kind, u.level, u.trips, u.branch) for u in uses] == [("gemm", 1, None, False)]
    uses, _ = uses_of(fori)
    assert [(u.kind, u.level, u.trips) for u in uses] == [("gemm", 1, 5)]


def _scan_of(fn):
    closed = jax.make_jaxpr(fn)(W, X)
    return closed, next(e for e in closed.jaxpr.eqns if e.primitive is jaxprs.SCAN)


@pytest.mark.parametrize(
    ("fn", "moved"),
    [
        (lambda w, x: lax.fori_loop(0, 4, lambda i, a: jnp.tanh(a @ w[i]), x), True),
        (lambda w, x: lax.fori_loop(1, 5, lambda i, a: jnp.tanh(a @ w[i - 1]), x), True),
        (lambda w, x: lax.fori_loop(0, 4, lambda i, a: jax.checkpoint(lambda a, v: a @ v)(a, w[i]), x), True),
        (lambda w, x: lax.fori_loop(0, 4, lambda i, a: jnp.tanh(a @ w[3 - i]), x), False),
        (lambda w, x: lax.fori_loop(0, 4, lambda i, a: jnp.tanh(a @ w[i] + a @ w[0]), x), False),
        (lambda w, x: lax.fori_loop(0, 3, lambda i, a: jnp.tanh(a @ w[i]), x), False),
    ],
    ids=["w[i]", "w[i-1] from 1", "w[i] into a remat region", "w[3-i]", "w[i] and w[0]", "3 of 4 layers"],
)
def test_a_fori_loop_reading_a_stack_by_its_counter_is_a_scan_over_it(fn, moved):
    """``counted_stacks`` moves a stack the body reads only as its trip's layer into the scan's
    xs, and the rebuilt scan computes what the loop did; a stack read at another layer, or only
    partly, stays a const."""
    closed, eqn = _scan_of(fn)
    counted = jaxprs.counted_stacks(eqn, range(jaxprs.scan_parts(eqn).num_consts))
    if not moved:
        assert counted is None
        return
    assert counted is not None and counted.stacks == (0,)
    parts = counted.parts
    assert not any(e.primitive is lax.dynamic_slice_p for e in parts.jaxpr.eqns), parts.jaxpr
    w = np.random.default_rng(0).normal(size=W.shape).astype(np.float32) / 8
    x = np.random.default_rng(1).normal(size=X.shape).astype(np.float32)
    value = {closed.jaxpr.invars[0]: w, closed.jaxpr.invars[1]: x}
    operands = [v.val if isinstance(v, jcore.Literal) else value[v] for v in counted.operands(eqn.invars)]
    nc, ncar = parts.num_consts, parts.num_carry
    consts, init, (stack,) = operands[:nc], operands[nc : nc + ncar], operands[nc + ncar :]

    def body(carry, layer):
        return tuple(jax.core.eval_jaxpr(parts.jaxpr, parts.consts, *consts, *carry, layer)), None

    got = lax.scan(body, tuple(init), stack)[0][-1]
    want = jax.jit(fn)(w, x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize(
    "prim, fn",
    [
        ("custom_jvp_call", lambda w, x: jax.nn.relu(x @ w[0]).sum() + jax.nn.relu(w).sum()),
    ],
)
def test_higher_order_primitives_the_trace_does_not_enter_are_named(prim, fn):
    """A parameter handed to a primitive the trace does not enter is read by 'other' with the
    primitive named (the plan keeps it plain and says why)."""

    def loss(w, x):
        out = fn(w, x)
        return jax.tree.leaves(out)[0].sum()

    uses, _ = uses_of(loss)
    others = [u for u in uses if u.kind == "other"]
    assert any(f"passed into {prim}" in u.what and "does not follow" in u.what for u in others), uses


def test_custom_vjp_and_shard_map_are_named(devices):
    mesh = Mesh(np.array(devices[:1]), ("a",))

    @jax.custom_vjp
    def double(v):
        return 2 * v

    double.defvjp(lambda v: (double(v), None), lambda _, g: (2 * g,))

    def loss(w, x):
        s = jax.shard_map(lambda v: v * 3, mesh=mesh, in_specs=PartitionSpec(), out_specs=PartitionSpec())(w)
        return (x @ double(w)[0]).sum() + s.sum()

    uses, _ = uses_of(loss)
    what = " | ".join(u.what for u in uses)
    assert "passed into custom_vjp_call" in what and "passed into shard_map" in what, what


def test_body_takes_every_spelling_of_a_sub_jaxpr():
    table = jnp.arange(3.0)  # a concrete array closed over: a const of the jaxpr
    closed = jax.make_jaxpr(lambda x: x * table)(jnp.ones(3))
    inner, consts = jaxprs.body(closed)
    assert len(inner.constvars) == len(consts) == 1
    assert np.array_equal(np.asarray(consts[0]), np.arange(3.0))
    plain = jax.make_jaxpr(lambda x: x * 2)(jnp.ones(3)).jaxpr  # an open jaxpr: no consts
    open_jaxpr, none = jaxprs.body(plain)
    assert open_jaxpr is plain and none == []
    with pytest.raises(jaxprs.UnsupportedJax, match="a Jaxpr or ClosedJaxpr"):
        jaxprs.body("not a jaxpr")


def test_unknown_scan_parameters_are_a_clear_error():
    """What a jax release that renamed scan's parameters again would meet: the primitive, this
    jax, the tested range and what to do, never a KeyError."""
    params = {"jaxpr": None, "length": 3, "reverse": False, "unroll": 1, "num_leading": 1}
    eqn = types.SimpleNamespace(params=params, primitive=jaxprs.SCAN)
    with pytest.raises(jaxprs.UnsupportedJax) as err:
        jaxprs.scan_parts(eqn)
    message = str(err.value)
    oldest, newest = jaxprs.TESTED_JAX
    assert "'scan' primitive" in message and f"jax {jax.__version__}" in message
    assert f"jax {oldest} to {newest}" in message and "pip install" in message
    assert "num_leading" in message
    with pytest.raises(jaxprs.UnsupportedJax, match="'scan' primitive.*'length'"):
        jaxprs.scan_parts(types.SimpleNamespace(params={"length": 3}, primitive=jaxprs.SCAN))


def test_call_without_a_body_is_a_clear_error():
    eqn = types.SimpleNamespace(params={"fun": None}, primitive=types.SimpleNamespace(name="jit"))
    with pytest.raises(jaxprs.UnsupportedJax, match="'jit' primitive.*'jaxpr' or 'call_jaxpr'"):
        jaxprs.call_body(eqn)


def test_versions_compare_as_numbers():
    assert jaxprs.version_tuple("0.12.0.1") == (0, 12, 0, 1)
    assert jaxprs.version_tuple("0.10.2") < jaxprs.version_tuple("0.12.0.1") < jaxprs.version_tuple("0.13")
    assert jaxprs.version_tuple("0.13.0.dev20270101") == (0, 13, 0)
    oldest, newest = map(jaxprs.version_tuple, jaxprs.TESTED_JAX)
    assert oldest <= jaxprs.version_tuple(jax.__version__) <= newest, "CI runs inside the tested range"


@jax.custom_vjp
def _matmul(a, w):
    return a @ w


_matmul.defvjp(lambda a, w: (a @ w, (a, w)), lambda r, g: (g @ r[1].T, r[0].T @ g))


class _Tiny(nnx.Module):
    def __init__(self):
        self.w = nnx.Linear(32, 32, use_bias=False, rngs=nnx.Rngs(0))
        self.gate = nnx.Param(jnp.ones((32, 32)))

    def __call__(self, x):
        return _matmul(self.w(x), self.gate.get_value())


def test_the_plan_names_a_parameter_the_trace_stops_at(devices, monkeypatch):
    mesh = Mesh(np.array(devices), ("fsdp",))
    batch = jax.ShapeDtypeStruct((len(devices) * 2, 32), jnp.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxprs.UntestedJaxWarning)  # inside the range: no warning
        fsdp = mxflax.FSDP(_Tiny(), mesh, loss_fn=lambda m, x: m(x).sum(), example_batch=batch)
    row = next(line for line in str(fsdp).splitlines() if line.startswith("gate "))
    assert "plain fp32" in row and "passed into custom_vjp_call" in row, row
    assert next(p for p in fsdp.params if p.name == "w/kernel").is_unit
    # outside the range: one warning naming the jax and the range
    monkeypatch.setattr(jax, "__version__", "99.0.0")
    monkeypatch.setattr(jaxprs, "_warned", set())
    span = " to ".join(map(re.escape, jaxprs.TESTED_JAX))
    with pytest.warns(jaxprs.UntestedJaxWarning, match=rf"jax 99\.0\.0 is outside.*{span}"):
        mxflax.FSDP(_Tiny(), mesh, loss_fn=lambda m, x: m(x).sum(), example_batch=batch)
