"""The local fused RMSNorm + MXFP8 kernel (mxfp8_rmsnorm_quantize) and its pure-JAX twin.

Oracles: normed against an independent numpy implementation of the canonical evaluation order
(byte for byte) and a float64 RMSNorm (within 1 bf16 ulp); quant/scales against the pure-JAX
quantize reference applied to normed (or to the fp32 oracle value with quantize_from="fp32").
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mxfp8_jax as mx

from conftest import as_bytes
from numpy_oracle import CANONICAL_NAN_BF16, CANONICAL_NAN_E4M3
from rmsnorm_oracle import BF16, canonical, float64, within_one_bf16_ulp

pytestmark = pytest.mark.skipif("cpu" not in mx.available_backends(), reason="needs the compiled CPU extension")


def _data(rng, r, h, scale=1.0):
    x = (rng.standard_normal((r, h)) * scale).astype(BF16)
    gamma = (rng.standard_normal(h) * 0.5 + 1.0).astype(BF16)
    return x, gamma


@functools.partial(jax.jit, static_argnames="columnwise")
def _reference_quantize(src, columnwise):
    return mx.quantize(src, rowwise=True, columnwise=columnwise, backend="jax")


@functools.partial(jax.jit, static_argnames=("eps", "offset", "backend"))
def _fused(x, gamma, eps=1e-6, offset=0.0, backend="ffi"):
    return mx.rmsnorm_quant(x, gamma, eps=eps, weight_offset=offset, backend=backend)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _fused_columnwise(x, gamma, quantize_from, backend):
    return mx.rmsnorm_quant(x, gamma, columnwise=True, quantize_from=quantize_from, backend=backend)


def _check_planes(normed, q, s, src, *, columnwise=False, cq=None, cs=None):
    """q/s (and the columnwise planes) equal the pure-JAX quantize of src, byte for byte."""
    ref = _reference_quantize(jnp.asarray(src), columnwise)
    np.testing.assert_array_equal(as_bytes(q), as_bytes(ref.rowwise_data))
    np.testing.assert_array_equal(as_bytes(s), as_bytes(ref.rowwise_scale))
    if columnwise:
        np.testing.assert_array_equal(as_bytes(cq), as_bytes(ref.columnwise_data))
        np.testing.assert_array_equal(as_bytes(cs), as_bytes(ref.columnwise_scale))


@pytest.mark.parametrize(
    "r,h,eps,offset,also_jax",
    [
        (1, 32, 1e-6, 0.0, False),
        (17, 96, 1e-5, 1.0, True),
        (64, 288, 1e-6, 0.0, False),
        (3, 8192, 1e-5, 1.0, False),
        (32, 6144, 1e-6, 0.0, True),
    ],
)
def test_kernel_matches_oracles(r, h, eps, offset, also_jax):
    rng = np.random.default_rng(r * 1000 + h)
    x, gamma = _data(rng, r, h, scale=3.0)
    normed, q, s = _fused(jnp.asarray(x), jnp.asarray(gamma), eps=eps, offset=offset)
    want, _ = canonical(x, gamma, eps=eps, offset=offset)
    np.testing.assert_array_equal(as_bytes(normed), as_bytes(want))
    assert within_one_bf16_ulp(normed, float64(x, gamma, eps=eps, offset=offset)).all()
    _check_planes(normed, q, s, want)
    if not also_jax:  # (each pure-JAX compile is slow; two shapes suffice)
        return
    # the pure-JAX path of the same order gives the same bytes on normal data
    ref = _fused(jnp.asarray(x), jnp.asarray(gamma), eps=eps, offset=offset, backend="jax")
    for a, b in zip((normed, q, s), ref):
        np.testing.assert_array_equal(as_bytes(a), as_bytes(b))


@pytest.mark.parametrize("quantize_from", ["normed", "fp32"])
def test_columnwise_and_fp32_source(quantize_from):
    rng = np.random.default_rng(7)
    x, gamma = _data(rng, 64, 160)
    normed, q, s, cq, cs = _fused_columnwise(jnp.asarray(x), jnp.asarray(gamma), quantize_from, "ffi")
    want, y = canonical(x, gamma, eps=1e-6)
    np.testing.assert_array_equal(as_bytes(normed), as_bytes(want))
    src = want if quantize_from == "normed" else y
    _check_planes(normed, q, s, src, columnwise=True, cq=cq, cs=cs)
    ref = _fused_columnwise(jnp.asarray(x), jnp.asarray(gamma), quantize_from, "jax")
    for a, b in zip((normed, q, s, cq, cs), ref):
        np.testing.assert_array_equal(as_bytes(a), as_bytes(b))
    if quantize_from == "fp32":  # the option changes the bytes (else this test proves nothing)
        plain = _reference_quantize(jnp.asarray(want), False)
        assert (as_bytes(plain.rowwise_data) != as_bytes(q)).any()


def test_subnormals_are_kept():
    """Squares and products below 2^-126 survive XLA:CPU's flush-to-zero (ScopedIeeeFp)."""
    h = 64
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((4, h)) * 2.0**-70).astype(BF16)  # x^2 ~ 2^-140: subnormal
    gamma = np.full(h, 2.0**-128, np.float32).astype(BF16)  # a subnormal gamma
    gamma[: h // 2] = 1.0
    normed, q, s = _fused(jnp.asarray(x), jnp.asarray(gamma), eps=0.0)
    want, _ = canonical(x, gamma, eps=0.0)
    assert np.isfinite(want.astype(np.float32)).all()  # flushing sumsq would give inf
    assert (want.astype(np.float32)[:, h // 2 :] != 0).any()  # subnormal outputs exist
    np.testing.assert_array_equal(as_bytes(normed), as_bytes(want))
    _check_planes(normed, q, s, want)


def test_special_values():
    h = 64
    x = np.ones((4, h), np.float32)
    x[0] = 0.0  # zero row: inv = 1/sqrt(eps)
    x[1, 3] = np.nan
    x[2, 5] = np.inf
    x[3] = 3.0e38  # squares overflow to inf
    x = x.astype(BF16)
    gamma = np.ones(h, BF16)
    normed, q, s = _fused(jnp.asarray(x), jnp.asarray(gamma))
    want, _ = canonical(x, gamma, eps=1e-6)
    np.testing.assert_array_equal(as_bytes(normed), as_bytes(want))
    _check_planes(normed, q, s, want)


def _nan_rows():
    """Rows that make NaN every way the product can: an input NaN (either sign, a payload), an
    Inf (Inf * 0 in x * inv), squares that overflow (x * 0 = 0, then 0 * Inf gamma), a zero times
    an infinite gamma, a NaN gamma (negative, with a payload). The sum of squares adds
    non-negative terms and gamma + offset has a finite offset, so Inf - Inf cannot arise in the
    forward. Returns (x, gamma, where NaN is expected, derived by hand)."""
    r, h = 32, 64
    bits = np.full((r, h), 0x3F80, np.uint16)  # 1.0
    bits[:, 1::2] = 0xBFC0  # -1.5
    bits[0, 3] = 0x7FC0  # +NaN
    bits[1, 5] = 0xFFA5  # -NaN, signalling payload
    bits[2, 7] = 0x7F80  # +Inf: inv = 0, Inf * 0
    bits[3, :] = 0x7F61  # ~3e38: squares overflow, inv = 0
    bits[4, 20] = 0x0000  # 0 * (+Inf gamma)
    g = np.full(h, 0x3F80, np.uint16)
    g[10] = 0xFF81  # -NaN gamma, signalling payload
    g[20], g[21] = 0x7F80, 0xFF80  # +-Inf gamma: only 0 * Inf is NaN
    nan = np.zeros((r, h), bool)
    nan[:, 10] = True
    nan[0:2, :] = True
    nan[2, [7, 20, 21]] = True
    nan[3, [20, 21]] = True
    nan[4, 20] = True
    return bits.view(BF16), g.view(BF16), nan


@pytest.mark.parametrize("quantize_from", ["normed", "fp32"])
def test_nan_is_canonical(quantize_from):
    """Every NaN of normed is the canonical 0x7FC0 and its E4M3 code 0x7F, in both quantize
    sources and both directions, whatever NaN the hardware made (docs/design.md §2)."""
    x, gamma, nan = _nan_rows()
    out = _fused_columnwise(jnp.asarray(x), jnp.asarray(gamma), quantize_from, "ffi")
    normed, q, cq = (as_bytes(a) for a in (out[0], out[1], out[3]))
    normed = normed.view(np.uint16).reshape(nan.shape)
    assert (normed[nan] == CANONICAL_NAN_BF16).all()
    assert not np.isnan(normed[~nan].view(BF16).astype(np.float32)).any()
    assert (normed[5:, 20:22] == 0x7F80).all()  # 1 * Inf and -1.5 * -Inf stay +Inf
    # a block holding a NaN codes it 0x7F (its amax ignores NaN); all-NaN rows: scale byte 0
    assert (q.reshape(nan.shape)[nan] == CANONICAL_NAN_E4M3).all()
    assert (cq.reshape(nan.shape)[nan] == CANONICAL_NAN_E4M3).all()
    want, y = canonical(x, gamma, eps=1e-6)
    np.testing.assert_array_equal(normed, as_bytes(want).view(np.uint16).reshape(nan.shape))
    _check_planes(
        out[0], out[1], out[2], want if quantize_from == "normed" else y, columnwise=True, cq=out[3], cs=out[4]
    )
    ref = _fused_columnwise(jnp.asarray(x), jnp.asarray(gamma), quantize_from, "jax")
    for a, b in zip(out, ref):
        np.testing.assert_array_equal(as_bytes(a), as_bytes(b))


@settings(max_examples=12)  # each new shape compiles; the values vary freely
@given(
    r=st.sampled_from([0, 1, 7, 33]),
    h=st.sampled_from([32, 96, 288, 1056]),
    eps=st.sampled_from([1e-6, 0.0]),
    offset=st.sampled_from([0.0, -0.5]),
    log_scale=st.integers(-30, 30),
    seed=st.integers(0, 2**31 - 1),
)
def test_kernel_bytes_random(r, h, eps, offset, log_scale, seed):
    rng = np.random.default_rng(seed)
    x, gamma = _data(rng, r, h, scale=2.0**log_scale)
    normed, q, s = _fused(jnp.asarray(x), jnp.asarray(gamma), eps=eps, offset=offset)
    # shapes first: with r = 0 the byte comparisons below compare empty arrays
    assert (normed.shape, q.shape, s.shape) == ((r, h), (r, h), (r, h // 32))
    assert (normed.dtype, q.dtype, s.dtype) == (jnp.bfloat16, jnp.float8_e4m3fn, jnp.uint8)
    want, _ = canonical(x, gamma, eps=eps, offset=offset)
    np.testing.assert_array_equal(as_bytes(normed), as_bytes(want))
    _check_planes(normed, q, s, want)


def test_gradients_match_plain_rmsnorm():
    rng = np.random.default_rng(11)
    x, gamma = (jnp.asarray(a) for a in _data(rng, 8, 64))
    w = jnp.asarray(rng.standard_normal((8, 64)), jnp.float32)

    def fused(x, gamma):
        return jnp.sum(mx.rmsnorm_quant(x, gamma, weight_offset=1.0)[0].astype(jnp.float32) * w)

    def plain(x, gamma):
        xf = x.astype(jnp.float32)
        inv = jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6)
        return jnp.sum(xf * inv * (gamma.astype(jnp.float32) + 1.0) * w)

    got = jax.jit(jax.grad(fused, argnums=(0, 1)))(x, gamma)
    want = jax.jit(jax.grad(plain, argnums=(0, 1)))(x, gamma)
    for a, b in zip(got, want):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2 * np.abs(b).max())


@pytest.mark.parametrize(
    "kwargs,x,gamma,err,match",
    [
        ({}, np.zeros((4, 48), BF16), np.zeros(48, BF16), ValueError, "H=48.*multiple of 32"),
        ({}, np.zeros((4, 64), np.float32), np.zeros(64, BF16), TypeError, "float32.*bfloat16"),
        ({}, np.zeros((4, 64), BF16), np.zeros(64, np.float32), TypeError, "gamma.*bfloat16"),
        ({}, np.zeros((4, 64), BF16), np.zeros(32, BF16), ValueError, "gamma has shape"),
        ({"columnwise": True}, np.zeros((4, 64), BF16), np.zeros(64, BF16), ValueError, "R=4.*multiple of 32"),
        ({"quantize_from": "x"}, np.zeros((4, 64), BF16), np.zeros(64, BF16), ValueError, "quantize_from"),
        ({"eps": -1.0}, np.zeros((4, 64), BF16), np.zeros(64, BF16), ValueError, "eps"),
        ({"backend": "gpu"}, np.zeros((4, 64), BF16), np.zeros(64, BF16), ValueError, "backend"),
    ],
)
def test_errors(kwargs, x, gamma, err, match):
    with pytest.raises(err, match=match):
        mx.rmsnorm_quant(jnp.asarray(x), jnp.asarray(gamma), **kwargs)
