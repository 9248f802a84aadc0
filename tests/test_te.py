"""Transformer Engine as an independent oracle, and the MXFP8Tensor <-> TE conversions.

TE's pure-JAX MXFP8 quantizer (``BlockScaleQuantizer._quantize_func``: amax / 448 rounded up to
a power of two on the fp32 bits, x / scale, clip, cast) is a separate implementation of the rule
set docs/design.md §2 fixes; on finite normal-range input it must give our bytes exactly. TE's
tensor classes and dequantizer check that the planes we hand over are what TE expects.

TE comes from the pure-Python ``transformer-engine`` wheel (a pinned test dependency); its CUDA
extension cannot load on a CPU host, so ``_te_stub`` stands in for it. These tests FAIL when TE
cannot be imported; set MXFP8_SKIP_TE=1 to skip them instead, deliberately.
"""

import functools
import os
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mxfp8_jax as mx

import _te_stub
from conftest import as_bytes, assert_same_bytes

# TE 2.20 reads a jax attribute that jax deprecates; that is TE's business, not this test's.
pytestmark = pytest.mark.filterwarnings("ignore:.*thread_resources:DeprecationWarning")


@pytest.fixture(scope="module")
def te():
    """TE JAX's ``quantize`` package, imported through the CPU stand-in for its extension."""
    try:
        module = _te_stub.install()
    except _te_stub.TEUnavailable as e:
        if os.environ.get("MXFP8_SKIP_TE") == "1":
            pytest.skip(f"MXFP8_SKIP_TE=1 and Transformer Engine is not importable: {e}")
        pytest.fail(
            f"Transformer Engine is not importable, so the TE oracle tests cannot run: {e}. "
            "Set MXFP8_SKIP_TE=1 to skip these tests on purpose.",
            pytrace=False,
        )
    yield module
    _te_stub.uninstall()


def _normal_range_input(seed, shape, dtype):
    """Finite, normal-range values whose 32-blocks have very different magnitudes.

    Each element is sign * (1 + u) * 2^e with e drawn around a per-row exponent r, per column
    and per element (so rowwise and columnwise blocks both get spread amaxes); every third row
    gets an rceil boundary as its block maximum (448 * 2^(r + j) and one ulp of the dtype either
    side), and some elements are +0 / -0. Built with numpy: eager jax ops would each compile.
    """
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    m, k = int(np.prod(shape[:-1])), shape[-1]
    r_lo, r_hi = (-8, -1) if dtype == np.float16 else (-60, 60)  # keeps fp16 normal and finite
    r = rng.integers(r_lo, r_hi, (m, 1))
    e = r + rng.integers(-3, 4, (1, k)) + rng.integers(-3, 1, (m, k))  # |x| < 2^(r + 4)
    x = rng.choice([-1.0, 1.0], (m, k)) * (1.0 + rng.random((m, k))) * np.exp2(e)
    x = x.astype(dtype)
    rows = np.arange(0, m, 3)
    base = (448.0 * np.exp2(r[rows, 0] + np.arange(rows.size) % 5)).astype(dtype)  # exact
    bits = np.int16 if dtype.itemsize == 2 else np.int32
    ulp = np.array([0, 1, -1], bits)[np.arange(rows.size) % 3]
    x[rows, 0] = (base.view(bits) + ulp).view(dtype)
    x[1::5, 2], x[2::5, 3] = 0.0, -0.0
    return jnp.asarray(x.reshape(shape))


# Everything runs jitted: op by op, every small op compiles on its own, which is far slower.
_quantize = jax.jit(mx.quantize, static_argnames=("rowwise", "columnwise", "scale_rule", "backend"))
_dequantize = jax.jit(mx.dequantize, static_argnames=("columnwise", "dtype"))


@functools.partial(jax.jit, static_argnames=("te", "q_dtype", "rowwise", "columnwise", "flatten_axis"))
def _te_quantize(x, *, te, q_dtype=jnp.float8_e4m3fn, rowwise=True, columnwise=True, flatten_axis=-1):
    """TE's own pure-JAX MXFP8 quantizer (BlockScaleQuantizer, i.e. its ``_quantize_func``)."""
    quantizer = te.BlockScaleQuantizer(q_dtype=q_dtype)
    return quantizer.quantize(x, is_rowwise=rowwise, is_colwise=columnwise, flatten_axis=flatten_axis)


@functools.partial(jax.jit, static_argnames=("flatten", "dq_dtype"))
def _to_te(t, *, flatten=False, dq_dtype=None):
    return mx.to_te(t, flatten=flatten, dq_dtype=dq_dtype)


@functools.partial(jax.jit, static_argnames=("shape",))
def _from_te(s, *, shape=None):
    return mx.from_te(s, shape=shape)


_te_dequantize = jax.jit(lambda s: s.dequantize())


def _assert_same_tensor(a: mx.MXFP8Tensor, b: mx.MXFP8Tensor):
    assert tuple(a.shape) == tuple(b.shape)
    assert jnp.dtype(a.dtype) == jnp.dtype(b.dtype)
    assert_same_bytes(a, b)


# ------------------------------------------------------------------------------------------------
# TE's quantizer as the oracle


@pytest.mark.parametrize(
    "shape, dtype",
    [
        ((128, 256), jnp.bfloat16),
        ((128, 256), jnp.float32),
        ((128, 256), jnp.float16),
        ((2, 32, 64), jnp.bfloat16),
    ],
    ids=lambda p: jnp.dtype(p).name if not isinstance(p, tuple) else str(p),
)
def test_te_quantizer_is_byte_identical(te, shape, dtype):
    x = _normal_range_input(sum(shape), shape, dtype)
    assert np.all(np.isfinite(np.asarray(x, np.float32)))
    ref = _te_quantize(x, te=te)
    assert isinstance(ref, te.ScaledTensor2x)
    for backend in ("jax", "auto"):
        ours = _quantize(x, backend=backend)
        for name, te_part, data, scale in [
            ("rowwise", ref.rowwise_tensor, ours.rowwise_data, ours.rowwise_scale),
            ("columnwise", ref.colwise_tensor, ours.columnwise_data, ours.columnwise_scale),
        ]:
            where = f"{name} plane, backend={backend}"
            assert np.array_equal(as_bytes(te_part.data), as_bytes(data)), where
            assert np.array_equal(as_bytes(te_part.scale_inv), as_bytes(scale)), where
    # the input really spreads the block scales (not one byte everywhere)
    assert len(np.unique(as_bytes(ref.rowwise_tensor.scale_inv))) > 4


@pytest.mark.parametrize("columnwise", [False, True], ids=["rowwise", "columnwise"])
def test_te_single_plane_quantizer_is_byte_identical(te, columnwise):
    x = _normal_range_input(7, (64, 128), jnp.bfloat16)
    ref = _te_quantize(x, te=te, rowwise=not columnwise, columnwise=columnwise)
    assert isinstance(ref, te.ScaledTensor1x) and ref.is_colwise == columnwise
    _assert_same_tensor(_from_te(ref), _quantize(x, rowwise=not columnwise, columnwise=columnwise))


def test_from_te_follows_te_flatten_axis(te):
    # TE may flatten [64, 2, 32] at axis 1: rows 64, columns 2*32; blocks run along those.
    x = _normal_range_input(5, (64, 64), jnp.bfloat16)
    s = _te_quantize(x.reshape(64, 2, 32), te=te, flatten_axis=1)
    _assert_same_tensor(_from_te(s), _quantize(x))
    _assert_same_tensor(_from_te(s, shape=(2, 32, 64)), _quantize(x.reshape(2, 32, 64)))


# ------------------------------------------------------------------------------------------------
# our planes in TE's classes


@pytest.mark.parametrize(
    "shape, dtype",
    [((64, 96), jnp.bfloat16), ((2, 32, 64), jnp.float32)],
    ids=["2d-bf16", "3d-f32"],
)
def test_to_te_matches_te_own_tensor_and_dequantize(te, shape, dtype):
    x = _normal_range_input(3, shape, dtype)
    t = _quantize(x)
    ours = mx.to_te(t)
    theirs = _te_quantize(x, te=te)
    # Same TE classes and static metadata (scaling mode, layouts, flatten axis, dq dtype, the
    # dequantize function) and leaf shapes/dtypes as TE's own quantizer output ...
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    chex.assert_trees_all_equal_shapes_and_dtypes(ours, theirs)
    assert ours.rowwise_tensor.scale_inv.dtype == jnp.float8_e8m0fnu
    # ... and TE's dequantize of our planes is exactly ours, in either output dtype.
    for dq in (jnp.float32, jnp.bfloat16):
        s = _to_te(t, dq_dtype=dq)
        for columnwise, part in [(False, s.rowwise_tensor), (True, s.colwise_tensor)]:
            want = _dequantize(t, columnwise=columnwise, dtype=dq)
            got = _te_dequantize(part)
            assert got.dtype == want.dtype and got.shape == tuple(shape)
            assert np.array_equal(as_bytes(got), as_bytes(want)), (columnwise, dq)


@pytest.mark.parametrize(
    "shape, rowwise, columnwise",
    [((4, 32, 96), True, True), ((4, 32, 96), True, False), ((32, 64), False, True)],
    ids=["3d-both", "3d-rowwise", "2d-columnwise"],
)
def test_round_trip_is_exact(te, shape, rowwise, columnwise):
    x = jnp.asarray(np.random.default_rng(11).normal(size=shape).astype(np.float32) * 100)
    t = _quantize(x, rowwise=rowwise, columnwise=columnwise)
    s = mx.to_te(t)  # eager
    assert isinstance(s, te.ScaledTensor2x if rowwise and columnwise else te.ScaledTensor1x)
    _assert_same_tensor(mx.from_te(s), t)
    _assert_same_tensor(_from_te(_to_te(t)), t)  # under jit
    flat = _to_te(t, flatten=True)
    assert flat.ndim == 2
    _assert_same_tensor(_from_te(flat, shape=shape), t)


def test_te_padding_and_swizzle_agree(te):
    """TE's GEMM-side padding (2^-127 = byte 0) and its swizzle inverse undo ours exactly."""
    from transformer_engine.jax.quantize.dequantizer import _unswizzle_mxfp8_grouped_scale

    t = _quantize(_normal_range_input(9, (96, 160), jnp.bfloat16))
    for columnwise, scale in [(False, t.rowwise_scale), (True, t.columnwise_scale)]:
        pad = mx.pad_columnwise_scale if columnwise else mx.pad_rowwise_scale
        theirs = te.apply_padding_to_scale_inv(
            mx.e8m0_view(scale), te.ScalingMode.MXFP8_1D_SCALING, (96, 160), is_colwise=columnwise
        )
        padded = pad(scale)
        assert theirs.shape == padded.shape, columnwise
        assert np.array_equal(as_bytes(theirs), as_bytes(padded)), columnwise
        swizzled = mx.swizzle_scale(padded, columnwise=columnwise)
        undone = _unswizzle_mxfp8_grouped_scale(swizzled, padded.shape, columnwise)
        assert np.array_equal(as_bytes(undone), as_bytes(padded)), columnwise
        assert not np.array_equal(as_bytes(swizzled), as_bytes(padded)), "swizzle moved nothing"


# ------------------------------------------------------------------------------------------------
# errors


def test_conversion_errors(te):
    t = _quantize(jnp.ones((2, 48, 32), jnp.float32))  # M = 96, but shape[-2] = 48
    with pytest.raises(ValueError, match=r"shape\[-2\]=48 must be a multiple of 32.*flatten=True"):
        mx.to_te(t)
    _assert_same_tensor(_from_te(_to_te(t, flatten=True), shape=t.shape), t)
    with pytest.raises(ValueError, match="holds no plane"):
        mx.to_te(mx.MXFP8Tensor(None, None, None, None, shape=(32, 32)))
    with pytest.raises(TypeError, match="ScaledTensor2x or ScaledTensor1x"):
        mx.from_te(t)
    x = jnp.ones((32, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"2-D view .*\(32, 64\)"):
        mx.from_te(_to_te(_quantize(x)), shape=(64, 32))
    e5m2 = _te_quantize(x, te=te, q_dtype=jnp.float8_e5m2, columnwise=False)
    with pytest.raises(ValueError, match="float8_e5m2; MXFP8Tensor holds float8_e4m3fn"):
        mx.from_te(e5m2)
    tensor_scaled = jax.jit(
        lambda x: te.CurrentScaleQuantizer(q_dtype=jnp.float8_e4m3fn).quantize(x, is_colwise=False)
    )(x)
    with pytest.raises(ValueError, match="need MXFP8_1D_SCALING"):
        mx.from_te(tensor_scaled)


def test_missing_te_names_the_extra(monkeypatch):
    # A None entry in sys.modules makes the import fail, as on a host without TE.
    monkeypatch.setitem(sys.modules, "transformer_engine.jax.quantize", None)
    t = _quantize(jnp.ones((32, 32), jnp.float32))
    with pytest.raises(ImportError, match=r"\[te\] extra"):
        mx.to_te(t)
    with pytest.raises(ImportError, match=r"\[te\] extra"):
        mx.from_te(object())
