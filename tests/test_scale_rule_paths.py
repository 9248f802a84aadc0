"""``scale_rule="floor"`` reaches every fused path: ``rmsnorm_quant`` (kernel and reference) and
``allgather_rmsnorm_quant`` (both strategies) give the numpy oracle's floor bytes.

The oracles are independent of the package: tests/rmsnorm_oracle.py for the normed rows and
tests/numpy_oracle.py for their MXFP8 planes. Floor and rceil differ on the blocks whose amax lies
in ``[448, 512) * 2^k``; the data has enough of them that a path dropping the rule cannot pass.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import mxfp8_jax as mx

import numpy_oracle as npo
from conftest import as_bytes
from rmsnorm_oracle import BF16, canonical

pytestmark = pytest.mark.skipif("cpu" not in mx.available_backends(), reason="needs the compiled CPU extension")

R, H = 32, 96


def _data(seed=0, rows=R):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, H)) * 3.0).astype(BF16)
    gamma = (rng.standard_normal(H) * 0.5 + 1.0).astype(BF16)
    return x, gamma


def _expected(x, gamma, rule):
    normed, _ = canonical(x, gamma, eps=1e-6)
    planes = npo.quantize(np.asarray(normed), rule)
    other = npo.quantize(np.asarray(normed), "rceil" if rule == "floor" else "floor")
    # the rules disagree where amax lies in [448, 512) * 2^k (about a fifth of the blocks);
    # enough of them here that a path dropping the rule cannot pass
    assert (planes["rowwise_scale"] != other["rowwise_scale"]).sum() >= 10
    assert (planes["columnwise_scale"] != other["columnwise_scale"]).sum() >= 10
    return normed, planes


def _check(outs, normed, planes):
    got_normed, q, s, cq, cs = outs[:5]
    np.testing.assert_array_equal(as_bytes(got_normed), as_bytes(normed))
    for name, got in (
        ("rowwise_data", q),
        ("rowwise_scale", s),
        ("columnwise_data", cq),
        ("columnwise_scale", cs),
    ):
        np.testing.assert_array_equal(as_bytes(got), planes[name].reshape(-1), err_msg=name)


@pytest.mark.parametrize("rule", ["floor", "rceil"])
@pytest.mark.parametrize("backend", ["ffi", "jax"])
def test_rmsnorm_quant_follows_the_scale_rule(rule, backend):
    x, gamma = _data()
    normed, planes = _expected(x, gamma, rule)
    fn = jax.jit(lambda a, g: mx.rmsnorm_quant(a, g, columnwise=True, scale_rule=rule, backend=backend))
    _check(fn(jnp.asarray(x), jnp.asarray(gamma)), normed, planes)


@pytest.mark.parametrize("rule", ["floor", "rceil"])
@pytest.mark.parametrize("strategy", ["xla", "p2p"])
def test_allgather_rmsnorm_quant_follows_the_scale_rule(devices, rule, strategy):
    # all n devices of the run, each holding rows / n of x: the gathered [rows, H] is the whole x,
    # whole columnwise blocks (rows = R = 32 for n = 2, 4, 8)
    x, gamma = _data(1, rows=math.lcm(R, len(devices)))
    normed, planes = _expected(x, gamma, rule)
    outs = mx.allgather_rmsnorm_quant(
        jnp.asarray(x),
        jnp.asarray(gamma),
        mesh=Mesh(np.array(devices), ("x",)),
        axis="x",
        columnwise=True,
        strategy=strategy,
        scale_rule=rule,
    )
    normed_out, q, s, residual, cq, cs = outs
    _check((normed_out, q, s, cq, cs), normed, planes)
    np.testing.assert_array_equal(as_bytes(residual), as_bytes(x))
