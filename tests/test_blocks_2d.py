"""32x32 blocks (``mx.quantize(x, blocks="32x32")``, ``MXFP8Tensor2D``): the reference against the
independent numpy oracle byte for byte, every bf16 pattern and arbitrary fp32; the one plane's
rowwise and columnwise views; clear errors."""

import functools

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import mxfp8_jax as mx

import numpy_oracle as oracle
from conftest import as_bytes

ALL_BF16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(ml_dtypes.bfloat16)


@functools.cache
def _tiler(rule):
    return jax.jit(lambda a: mx.quantize(a, scale_rule=rule, blocks="32x32"))


def check_tiles(x, rule="rceil"):
    """The 32x32 quantize of ``x`` against the oracle: the codes and the tile scales."""
    x = np.asarray(x)
    want_q, want_s = oracle.quantize_tiles(x, rule)
    got = _tiler(rule)(jnp.asarray(x))
    assert isinstance(got, mx.MXFP8Tensor2D)
    np.testing.assert_array_equal(np.asarray(got.scale), want_s)
    q = as_bytes(got.data)
    bad = np.flatnonzero(q != want_q.reshape(-1))
    want = want_q.reshape(-1)
    assert bad.size == 0, f"{bad.size} codes differ; first at {bad[0]}: got {q[bad[0]]:#04x}, want {want[bad[0]]:#04x}"
    return got


@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_all_bf16_patterns(rule):
    """Every bf16 pattern, in order (a tile holds 1024 consecutive patterns: 32 rows of 32) and
    shuffled, so that every pattern meets small and large tile maxima."""
    check_tiles(ALL_BF16.reshape(2048, 32), rule)
    perm = np.random.default_rng(0).permutation(ALL_BF16)
    check_tiles(perm.reshape(256, 256), rule)


@given(
    x=hnp.arrays(np.float32, (64, 96), elements=st.floats(width=32, allow_nan=True)),
    rule=st.sampled_from(["rceil", "floor"]),
)
def test_property_arbitrary_fp32(x, rule):
    check_tiles(x, rule)


@given(log_scale=st.integers(-140, 120), seed=st.integers(0, 2**31 - 1))
def test_property_random_scales_fp16_and_bf16(log_scale, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((64, 64)) * np.ldexp(1.0, log_scale)
    for dtype in (ml_dtypes.bfloat16, np.float16):
        with np.errstate(over="ignore"):
            check_tiles(x.astype(dtype))


def test_a_tile_is_one_block_of_1x32_whose_rows_share_its_maximum():
    """Where each row of a tile holds the tile's amax, the 32x32 plane is the 1x32 rowwise one
    (and, columns alike, the columnwise one): the same rule on the same maxima."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 64)).astype(np.float32)
    x[:, ::32] = 8.0  # an 8 starts every 1x32 block of a row
    x[::32, :] = 8.0  # and every 32x1 block of a column: each block's amax is its tile's
    t2 = check_tiles(x)
    t1 = mx.quantize(jnp.asarray(x), backend="jax")
    np.testing.assert_array_equal(as_bytes(t2.data), as_bytes(t1.rowwise_data))
    np.testing.assert_array_equal(as_bytes(t2.data), as_bytes(t1.columnwise_data))
    view = t2.view()
    np.testing.assert_array_equal(np.asarray(view.rowwise_scale), np.asarray(t1.rowwise_scale))
    np.testing.assert_array_equal(np.asarray(view.columnwise_scale), np.asarray(t1.columnwise_scale))


def test_both_views_hold_the_tile_values():
    """The rowwise and columnwise views dequantize to the same values, the oracle's, and are a
    valid ``MXFP8Tensor`` whose scales repeat each tile's byte over its rows or columns."""
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((2, 32, 64)) * np.ldexp(1.0, rng.integers(-20, 20, (2, 32, 64)))).astype(np.float32)
    t = mx.quantize(jnp.asarray(x, jnp.bfloat16), blocks="32x32")
    assert t.shape == (2, 32, 64) and t.dtype == jnp.bfloat16
    view = t.view().validate()
    assert view.rowwise_scale.shape == (64, 2) and view.columnwise_scale.shape == (2, 64)
    q, s = oracle.quantize_tiles(np.asarray(jnp.asarray(x, jnp.bfloat16)).reshape(64, 64))
    tile_bytes = np.kron(s.astype(np.int64), np.ones((32, 32), np.int64))
    want = q.view(oracle.E4M3).astype(np.float64) * np.ldexp(1.0, tile_bytes - 127)
    for got in (
        view.dequantize(dtype=jnp.float32),
        view.dequantize(columnwise=True, dtype=jnp.float32),
        mx.dequantize(t, dtype=jnp.float32),
    ):
        np.testing.assert_array_equal(np.asarray(got).reshape(64, 64), want)
    only = t.view(columnwise=False)
    assert only.planes == ("rowwise",)


@pytest.mark.parametrize(
    ("shape", "kwargs", "match"),
    [
        ((48, 64), {}, "M=48 .* multiple of 32 for 32x32 blocks"),
        ((64, 48), {}, "K=48 .* multiple of 32"),
        ((64, 64), {"rowwise": False}, "one plane that serves both directions"),
        ((64, 64), {"backend": "ffi"}, "no kernel"),
        ((64, 64), {"blocks": "16x16"}, "blocks='16x16'"),
    ],
)
def test_bad_input_is_a_clear_error(shape, kwargs, match):
    kwargs = {"blocks": "32x32", **kwargs}
    with pytest.raises(ValueError, match=match):
        mx.quantize(jnp.zeros(shape, jnp.float32), **kwargs)


def test_to_te_refuses_a_2d_tensor_and_names_the_1x32_view():
    t = mx.quantize(jnp.ones((32, 32), jnp.float32), blocks="32x32")
    with pytest.raises(TypeError, match=r"PyTorch only.*to_te\(t.view\(\)\)"):
        mx.to_te(t)


def test_differentiating_the_2d_quantize_is_an_error():
    with pytest.raises(TypeError, match="not differentiable"):
        jax.grad(lambda a: mx.quantize(a, blocks="32x32").dequantize(dtype=jnp.float32).sum())(jnp.ones((32, 32)))
