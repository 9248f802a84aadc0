"""mx.quantize: the FFI kernel and the pure-JAX reference against an independent numpy oracle.

Every comparison is byte for byte, on all four planes. The oracle (tests/numpy_oracle.py) is
written from docs/design.md §2 with float64 arithmetic and ml_dtypes; it shares no code with the package.
"""

import functools
import itertools

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

PLANES = ("rowwise_data", "rowwise_scale", "columnwise_data", "columnwise_scale")
COMPARED = ("ffi", "jax")  # the two implementations checked against each other


@functools.cache
def _quantizer(rule, backend, columnwise, jit):
    """One function per configuration, so that jit compiles each shape once per session."""
    fn = lambda a: mx.quantize(a, rowwise=True, columnwise=columnwise, scale_rule=rule, backend=backend)
    return jax.jit(fn) if jit else fn


def check_planes(x, *, rule="rceil", backends=COMPARED, jit=True):
    """Quantizes x with every backend and asserts each plane equals the oracle's bytes."""
    x = np.asarray(x)
    want = oracle.quantize(x, rule)
    for backend in backends:
        fn = _quantizer(rule, backend, "columnwise_data" in want, jit)
        got = fn(jnp.asarray(x))
        for plane, expected in want.items():
            actual = as_bytes(getattr(got, plane))
            bad = np.flatnonzero(actual != expected.reshape(-1))
            assert bad.size == 0, (
                f"{backend} {plane} ({rule}): {bad.size} bytes differ; first at flat index "
                f"{bad[0]}: got {actual[bad[0]]:#04x}, want {expected.reshape(-1)[bad[0]]:#04x}"
            )


def bf16_from_bits(bits) -> np.ndarray:
    return np.asarray(bits, np.uint16).view(ml_dtypes.bfloat16)


def f32_from_bits(bits) -> np.ndarray:
    return np.asarray(bits, np.uint32).view(np.float32)


ALL_BF16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


# ------------------------------------------------------------------------------------------------
# exhaustive: every bf16 bit pattern as a block member


@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_all_bf16_patterns_in_consecutive_blocks(rule):
    rows = bf16_from_bits(ALL_BF16).reshape(2048, 32)
    check_planes(rows, rule=rule)  # rowwise blocks; columnwise mixes 32 rows
    check_planes(np.ascontiguousarray(rows.T), rule=rule)  # columnwise blocks = the same runs


@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_all_bf16_patterns_shuffled(rule):
    perm = np.random.default_rng(0).permutation(ALL_BF16)
    check_planes(bf16_from_bits(perm).reshape(1024, 64), rule=rule)


# Companion block maxima that put the pattern under every regime: far above it (flushes to 0),
# at the E4M3 subnormal/normal edges, equal-ish, and far below (saturation under floor).
COMPANIONS = [0.0, 2.0**-133, 2.0**-100, 1.0, 448.0, 2.0**64, 3.0e38, float("inf")]


@pytest.mark.parametrize("companion", COMPANIONS)
def test_all_bf16_patterns_with_a_companion_max(companion):
    block = np.zeros((1 << 16, 32), ml_dtypes.bfloat16)
    block[:, 0] = bf16_from_bits(ALL_BF16)
    block[:, 17] = companion
    check_planes(block, rule="rceil", jit=True)
    check_planes(block, rule="floor", jit=True)


# ------------------------------------------------------------------------------------------------
# edge cases


def _boundary_amaxes():
    """448 * 2^k and one fp32 ulp either side, for every k that keeps it finite and non-zero."""
    vals = []
    for k in range(-160, 120):
        c = np.float32(np.ldexp(448.0, k))
        if c == 0 or not np.isfinite(c):
            continue
        vals += [np.nextafter(c, np.float32(0)), c, np.nextafter(c, np.float32(np.inf))]
    return np.array(vals, np.float32)


@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_block_maxima_at_448_times_powers_of_two(rule):
    amax = _boundary_amaxes()
    rng = np.random.default_rng(1)
    blocks = (rng.uniform(-1, 1, (amax.size, 32)) * amax[:, None]).astype(np.float32)
    blocks[:, 5] = amax
    blocks[:, 6] = -amax * np.float32(0.75)
    check_planes(blocks[: (amax.size // 32) * 32], rule=rule)
    check_planes(blocks, rule=rule, backends=("ffi", "jax"))


def test_zero_and_negative_zero_blocks():
    x = np.zeros((64, 96), np.float32)
    x[1::2] = -0.0
    x[32:, 32:64] = np.float32(-0.0)
    for dt in (np.float32, ml_dtypes.bfloat16, np.float16):
        check_planes(x.astype(dt))
    t = mx.quantize(jnp.asarray(x), backend="ffi")
    assert np.all(as_bytes(t.rowwise_scale) == 0)
    assert set(np.unique(as_bytes(t.rowwise_data))) <= {0x00, 0x80}


def test_fp32_subnormal_inputs_and_tiny_maxima_are_not_flushed():
    rng = np.random.default_rng(2)
    sub = rng.integers(1, 1 << 23, size=(64, 64), dtype=np.uint32)
    sign = rng.integers(0, 2, size=(64, 64), dtype=np.uint32) << 31
    x = f32_from_bits(sub | sign)
    x[:, 32:] = f32_from_bits(rng.integers(1, 1 << 8, size=(64, 32), dtype=np.uint32))
    check_planes(x, rule="rceil")
    check_planes(x, rule="floor")
    got = mx.quantize(jnp.asarray(x), backend="ffi")
    assert np.any(as_bytes(got.rowwise_data) & 0x7F), "subnormal blocks must not all flush to 0"


def test_nan_and_inf_inside_blocks():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(64, 128)).astype(np.float32)
    x[0, 3] = np.nan
    x[1, 40] = -np.nan
    x[2, 7] = np.inf
    x[3, 70] = -np.inf
    x[4, :32] = np.nan  # an all-NaN block: amax 0
    x[40, 100] = np.inf
    x[41, 100] = np.nan
    for rule in ("rceil", "floor"):
        check_planes(x, rule=rule)
        check_planes(x.astype(ml_dtypes.bfloat16), rule=rule)
    t = mx.quantize(jnp.asarray(x), backend="ffi")
    s = np.asarray(t.rowwise_scale)
    assert s[2, 0] == 0xFE and s[4, 0] == 0  # +Inf amax -> 0xFE; all-NaN block -> amax 0


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_random_inputs(dtype, rule):
    # K = 17 blocks: two full groups of eight rowwise blocks (the kernel's fast path for bf16)
    # and a group of one
    rng = np.random.default_rng(4)
    scale = np.exp2(rng.integers(-20, 14, size=(96, 1)))
    x = (rng.standard_normal((96, 544)) * scale).astype(dtype)
    check_planes(x, rule=rule)


def test_fp16_subnormals_and_specials():
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    x = bits.view(np.float16).reshape(2048, 32)
    check_planes(x, rule="rceil")
    check_planes(x, rule="floor")


# Few shapes (each is a compilation); the random part is the data and its scale.
@given(
    m=st.sampled_from([32, 96]),
    k=st.sampled_from([64, 288]),
    log_scale=st.integers(-140, 120),
    rule=st.sampled_from(["rceil", "floor"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_random_scales(m, k, log_scale, rule, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((m, k)) * np.ldexp(1.0, log_scale)).astype(np.float32)
    check_planes(x, rule=rule)


@given(x=hnp.arrays(np.float32, (32, 64), elements=st.floats(width=32, allow_nan=True)))
def test_property_arbitrary_fp32(x):
    check_planes(x, rule="rceil")


# ------------------------------------------------------------------------------------------------
# transformations and shapes


def test_nd_input_flattens_leading_axes():
    x = np.random.default_rng(5).standard_normal((2, 3, 32, 64)).astype(np.float32)
    t = mx.quantize(jnp.asarray(x), backend="ffi")
    assert t.shape == x.shape and t.rowwise_data.shape == (192, 64)
    assert t.columnwise_scale.shape == (6, 64)
    want = oracle.quantize(x.reshape(192, 64))
    for plane in PLANES:
        np.testing.assert_array_equal(as_bytes(getattr(t, plane)), want[plane].reshape(-1))
    assert mx.dequantize(t, dtype=jnp.float32).shape == x.shape


@pytest.mark.parametrize("backend", COMPARED)
def test_vmap_matches_per_example(backend):
    x = np.random.default_rng(6).standard_normal((3, 64, 96)).astype(np.float32)
    f = lambda a: mx.quantize(a, backend=backend)
    batched = jax.jit(jax.vmap(f))(jnp.asarray(x))
    for i in range(3):
        single = f(jnp.asarray(x[i]))
        for plane in PLANES:
            np.testing.assert_array_equal(as_bytes(getattr(batched, plane)[i]), as_bytes(getattr(single, plane)))


@pytest.mark.parametrize("rowwise,columnwise", [(True, False), (False, True), (True, True)])
def test_plane_selection(rowwise, columnwise):
    x = jnp.ones((64, 64), jnp.bfloat16)
    for backend in COMPARED:
        t = mx.quantize(x, rowwise=rowwise, columnwise=columnwise, backend=backend)
        assert t.has_rowwise == rowwise and t.has_columnwise == columnwise
        t.validate()


def test_auto_uses_the_kernel_on_cpu():
    hlo = jax.jit(lambda a: mx.quantize(a)).lower(jnp.ones((64, 64), jnp.float32)).as_text()
    assert "mxfp8_quantize" in hlo
    hlo = jax.jit(lambda a: mx.quantize(a, backend="jax")).lower(jnp.ones((64, 64))).as_text()
    assert "mxfp8_quantize" not in hlo


def test_rowwise_only_allows_m_not_multiple_of_32():
    x = np.random.default_rng(7).standard_normal((5, 64)).astype(np.float32)
    for backend in COMPARED:
        t = mx.quantize(jnp.asarray(x), columnwise=False, backend=backend)
        want = oracle.quantize(x)
        np.testing.assert_array_equal(as_bytes(t.rowwise_data), want["rowwise_data"].reshape(-1))


# ------------------------------------------------------------------------------------------------
# dequantize


@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_dequantize_is_exact(rule):
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((64, 64)) * np.exp2(rng.integers(-135, 100, (64, 1)))).astype(np.float32)
    t = mx.quantize(jnp.asarray(x), scale_rule=rule, backend="ffi")
    want = oracle.dequantize_rowwise(as_bytes(t.rowwise_data).reshape(64, 64), np.asarray(t.rowwise_scale))
    got = np.asarray(jax.jit(lambda t: mx.dequantize(t, dtype=jnp.float32))(t)).astype(np.float64)
    np.testing.assert_array_equal(got, want.astype(np.float32).astype(np.float64))
    got_bf16 = np.asarray(mx.dequantize(t, dtype=jnp.bfloat16))
    np.testing.assert_array_equal(got_bf16.view(np.uint16), want.astype(ml_dtypes.bfloat16).view(np.uint16))


def test_requantizing_dequantized_values_keeps_every_value():
    """quantize(dequantize(t)) holds the same values. The bytes are the same too, except in
    blocks whose largest code is 224 (amax/2^s in (224, 232) rounds down to it): there the
    rceil scale of the dequantized block is one lower and every code has its exponent one up."""
    x = jax.random.normal(jax.random.key(0), (128, 256), jnp.float32) * 7
    t = mx.quantize(x, backend="ffi")
    for columnwise in (False, True):
        deq = mx.dequantize(t, columnwise=columnwise, dtype=jnp.float32)
        t2 = mx.quantize(deq, rowwise=not columnwise, columnwise=columnwise, backend="ffi")
        deq2 = mx.dequantize(t2, columnwise=columnwise, dtype=jnp.float32)
        np.testing.assert_array_equal(np.asarray(deq2).view(np.uint32), np.asarray(deq).view(np.uint32))
        plane = "columnwise" if columnwise else "rowwise"
        s1 = np.asarray(getattr(t, f"{plane}_scale")).view(np.uint8).astype(int)
        s2 = np.asarray(getattr(t2, f"{plane}_scale")).view(np.uint8).astype(int)
        q1 = as_bytes(getattr(t, f"{plane}_data")).reshape(128, 256)
        q2 = as_bytes(getattr(t2, f"{plane}_data")).reshape(128, 256)
        # per block: largest code magnitude (0x76 is 224 = 1.75 * 2^7)
        blocks = (
            (q1 & 0x7F).reshape(4, 32, 256).max(axis=1) if columnwise else (q1 & 0x7F).reshape(128, 8, 32).max(axis=2)
        )
        at_224 = blocks == 0x76
        assert at_224.any() and not at_224.all()
        np.testing.assert_array_equal(s2, np.where(at_224, s1 - 1, s1))
        same = np.repeat(~at_224, 32, axis=0) if columnwise else np.repeat(~at_224, 32, axis=1)
        np.testing.assert_array_equal(q2[same], q1[same])
        assert (q2[~same] != q1[~same]).any()


# ------------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize(
    "shape,kwargs,err,match",
    [
        ((64, 48), {}, ValueError, "K=48 .* multiple of 32"),
        ((48, 64), {}, ValueError, "M=48 .* multiple of 32"),
        ((64,), {}, ValueError, "at least 2-D"),
        ((), {}, ValueError, "at least 2-D"),
        ((64, 64), {"scale_rule": "nearest"}, ValueError, "scale_rule='nearest'"),
        ((64, 64), {"backend": "cuda"}, ValueError, "backend='cuda'"),
        ((64, 64), {"rowwise": False, "columnwise": False}, ValueError, "at least one"),
    ],
)
def test_bad_input_is_a_clear_error(shape, kwargs, err, match):
    with pytest.raises(err, match=match):
        mx.quantize(jnp.zeros(shape, jnp.float32), **kwargs)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint8, jnp.float8_e4m3fn, jnp.float64])
def test_non_float_input_is_a_type_error(dtype):
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        mx.quantize(np.zeros((32, 32), dtype))


def test_rowwise_only_m_check_names_columnwise():
    mx.quantize(jnp.zeros((48, 64)), columnwise=False)  # fine: rowwise needs only K
    with pytest.raises(ValueError, match="columnwise"):
        mx.quantize(jnp.zeros((48, 64)), rowwise=False)


# ------------------------------------------------------------------------------------------------
# gradients: one behaviour for every backend (docs/design.md §2)


@pytest.mark.parametrize("backend", ("auto",) + COMPARED)
def test_differentiating_quantize_is_an_error_for_every_backend(backend):
    x = jnp.linspace(-3.0, 3.0, 64 * 64, dtype=jnp.float32).reshape(64, 64)
    loss = lambda a: mx.dequantize(mx.quantize(a, backend=backend), dtype=jnp.float32).sum()
    for transform in (jax.grad, lambda f: jax.jit(jax.grad(f))):
        with pytest.raises(TypeError, match=r"mx\.quantize is not differentiable.*stop_gradient"):
            transform(loss)(x)
    with pytest.raises(TypeError, match=r"mx\.quantize is not differentiable"):
        jax.jvp(lambda a: mx.quantize(a, backend=backend, columnwise=False).rowwise_data, (x,), (x,))


def test_differentiating_dequantize_in_its_data_is_an_error():
    t = mx.quantize(jnp.ones((32, 64), jnp.float32), columnwise=False)
    rebuilt = lambda d: mx.MXFP8Tensor(d, t.rowwise_scale, None, None, shape=t.shape, dtype=jnp.float32)
    with pytest.raises(TypeError, match=r"mx\.dequantize is not differentiable"):
        jax.grad(lambda d: mx.dequantize(rebuilt(d), dtype=jnp.float32).sum())(t.rowwise_data)


@pytest.mark.parametrize("backend", COMPARED)
def test_straight_through_estimator_of_the_error_message(backend):
    # the idiom the error suggests: value dequantize(quantize(x)), gradient the identity
    x = np.random.default_rng(8).standard_normal((64, 64)).astype(np.float32)
    dq = lambda a: mx.dequantize(mx.quantize(a, backend=backend), dtype=jnp.float32)
    ste = lambda a: a + jax.lax.stop_gradient(dq(jax.lax.stop_gradient(a)) - a)
    w = np.random.default_rng(9).standard_normal((64, 64)).astype(np.float32)
    grad = jax.jit(jax.grad(lambda a: (ste(a) * w).sum()))(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(grad), w)
    want = oracle.dequantize_rowwise(*(oracle.quantize(x)[p] for p in ("rowwise_data", "rowwise_scale")))
    np.testing.assert_allclose(np.asarray(ste(jnp.asarray(x))), want, rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# E8M0 helpers


def test_e8m0_views_and_values():
    b = jnp.arange(256, dtype=jnp.uint8)
    v = np.asarray(mx.e8m0_to_float32(b))
    assert np.isnan(v[255])
    np.testing.assert_array_equal(v[:255], np.ldexp(np.float32(1), np.arange(255) - 127))
    view = mx.e8m0_view(b)
    assert view.dtype == jnp.float8_e8m0fnu
    np.testing.assert_array_equal(as_bytes(view), np.arange(256, dtype=np.uint8))


def test_all_byte_pairs_of_rceil_and_floor_are_monotone_in_amax():
    amax = np.sort(np.abs(bf16_from_bits(ALL_BF16).astype(np.float32)))
    amax = amax[~np.isnan(amax)]
    x = np.zeros((amax.size, 32), np.float32)
    x[:, 0] = amax
    for rule in ("rceil", "floor"):
        s = as_bytes(mx.quantize(jnp.asarray(x), columnwise=False, scale_rule=rule, backend="ffi").rowwise_scale)
        assert np.all(np.diff(s.astype(int)) >= 0)
        np.testing.assert_array_equal(s, oracle.quantize(x, rule)["rowwise_scale"].reshape(-1))


def test_combinations_of_planes_and_dtypes_agree_between_backends():
    rng = np.random.default_rng(9)
    for dt, (r, c) in itertools.product((np.float32, ml_dtypes.bfloat16), [(1, 0), (0, 1), (1, 1)]):
        x = jnp.asarray((rng.standard_normal((64, 64)) * 100).astype(dt))
        a = mx.quantize(x, rowwise=bool(r), columnwise=bool(c), backend="ffi")
        b = mx.quantize(x, rowwise=bool(r), columnwise=bool(c), backend="jax")
        for plane in PLANES:
            pa, pb = getattr(a, plane), getattr(b, plane)
            assert (pa is None) == (pb is None)
            if pa is not None:
                np.testing.assert_array_equal(as_bytes(pa), as_bytes(pb))
