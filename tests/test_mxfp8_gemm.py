"""MXFP8 GEMMs (``mxfp8_jax._src.ops.mxfp8_gemm``) and ``FSDP(gemm="mxfp8")`` against numpy references.

- ``scaled_matmul`` (the exact path CPUs take): operands quantized by the independent numpy
  oracle (tests/numpy_oracle.py, both scale rules), multiplied exactly in float64; the fp32
  result lies within the bound of fp32 accumulation, ``gamma(C) * sum_c |a_c w_c|`` (Higham
  3.1: any order of the ``C - 1`` additions of the exact fp32 products). Operand dtypes, errors.
- the recipe (Transformer Engine's MXFP8BlockScaling): ``forward`` / ``backward`` against
  numpy GEMMs of the oracle's planes, every operand blocked along its own contraction; the
  planes ``quantize_tokens`` makes are the oracle's bytes, padding rows included.
- ``jax.nn.scaled_dot_general`` with its MXFP8 configs quantizes the same bytes and multiplies
  to the same values (its last step, the block-scaled GEMM, has no CPU lowering: it is
  evaluated here in float64 from the operands jax made).
- a training step of ``FSDP(..., gemm="mxfp8")`` on the run's devices (the most of them that
  are a power of two): loss and gradients against a numpy reference of the recipe that blocks
  each device's tokens on their own; the data are built so that every quantizer input is
  computed exactly (see ``MLP``), so the reference is the recipe itself and only the fp32 sums
  of the last GEMMs differ. Kernels of several axes (``jnp.einsum``) exercise the canonical
  GEMM's axis mapping.
- what the unit's GEMM saves for its backward: uint8 planes, no activation.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.extend import core as jcore
from jax.sharding import Mesh

from mxfp8_jax._src.ops import mxfp8_gemm as mg
from mxfp8_jax.flax import FSDP

import numpy_oracle as npo
from conftest import as_bytes, rows_per_device
from summation import UNIT_ROUNDOFF, gamma

E4M3, E8M0 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e8m0fnu
RULES = ("rceil", "floor")
# the float64 reference's own sums: relative error at most C * 2^-53 of sum |a w|; far below
# the fp32 bounds, but the bounds below are stated for the exact value
F64 = 2.0**-40


# ------------------------------------------------------------------------------------------------
# numpy: the oracle's planes as values, and exact products


def values(codes, scales) -> np.ndarray:
    """float64 values of codes ``[..., C]`` (uint8) blocked along C by scales ``[..., C/32]``."""
    v = np.asarray(codes).view(E4M3).astype(np.float64)
    return v * np.ldexp(1.0, np.repeat(np.asarray(scales).astype(np.int64), 32, axis=-1) - 127)


def q_row(x, rule) -> tuple[np.ndarray, np.ndarray]:
    """The oracle's rowwise planes of ``x [..., M, C]`` (blocks along C): codes, scales."""
    x = np.asarray(x)
    flat = x.reshape(-1, x.shape[-1])
    p = npo.quantize(flat, rule)
    return p["rowwise_data"].reshape(x.shape), p["rowwise_scale"].reshape(*x.shape[:-1], -1)


def q_col(x, rule) -> tuple[np.ndarray, np.ndarray]:
    """The oracle's columnwise planes of ``x [B, M, C]`` with M zero-padded to a multiple of 32
    (blocks along M): codes ``[B, Mp, C]``, scales ``[B, Mp/32, C]``."""
    x = np.asarray(x)
    b, m, c = x.shape
    mp = -(-m // 32) * 32
    xp = np.zeros((b, mp, c), x.dtype)
    xp[:, :m] = x
    planes = [npo.quantize(xp[i], rule) for i in range(b)]
    return (
        np.stack([p["columnwise_data"] for p in planes]),
        np.stack([p["columnwise_scale"] for p in planes]),
    )


def values_col(codes, scales) -> np.ndarray:
    """float64 values of columnwise planes ``[B, Mp, C]`` / ``[B, Mp/32, C]``."""
    return np.stack([npo.dequantize_columnwise(c, s) for c, s in zip(codes, scales)])


def rows(x, rule="rceil") -> np.ndarray:
    """float64 values of ``x [..., C]`` quantized along C."""
    return values(*q_row(x, rule))


def cols(x, rule="rceil") -> np.ndarray:
    """float64 values of ``x [M, C]`` quantized along M (zero rows padding M to 32): ``[Mp, C]``."""
    return values_col(*q_col(np.asarray(x)[None], rule))[0]


def product(a, w) -> tuple[np.ndarray, np.ndarray]:
    """``a [..., M, C] . w [..., N, C]^T`` in float64 and ``sum_c |a_c w_c|`` (the bound's scale)."""
    a, w = np.asarray(a, np.float64), np.asarray(w, np.float64)
    t = lambda v: np.swapaxes(v, -1, -2)
    return a @ t(w), np.abs(a) @ np.abs(t(w))


def assert_within(got, exact, scale, terms: int, what: str, *, absolute: float = 0.0) -> None:
    """``|got - exact| <= gamma(terms) * scale + absolute`` everywhere (``scale``: sum of the
    absolute values of the exact fp32 terms; ``terms``: how many are added)."""
    got, exact = np.asarray(got, np.float64), np.asarray(exact, np.float64)
    assert got.shape == exact.shape, (what, got.shape, exact.shape)
    bound = (gamma(terms) + F64) * np.asarray(scale) + absolute
    excess = np.abs(got - exact) - bound
    worst = np.unravel_index(np.argmax(excess), excess.shape) if excess.size else ()
    assert (excess <= 0).all(), (
        f"{what}: {int((excess > 0).sum())} of {excess.size} elements outside the fp32 accumulation bound; "
        f"worst at {worst}: got {got[worst]!r}, exact {exact[worst]!r}, bound {bound[worst]!r}"
    )


def exceeds(got, exact, scale, terms: int) -> bool:
    """Some element lies outside the bound by more than the bound itself (a clear miss)."""
    diff = np.abs(np.asarray(got, np.float64) - np.asarray(exact, np.float64))
    return bool((diff > 2 * (gamma(terms) + F64) * np.asarray(scale) + 1e-300).any())


def blocky(rng, shape, spread=12) -> np.ndarray:
    """Gaussian values whose magnitude changes by powers of two from one 32-block (along the
    last axis) and row to the next: the scales differ across a tensor."""
    *lead, c = shape
    mag = np.exp2(rng.integers(-spread, spread + 1, size=(*lead, c // 32)))
    return rng.standard_normal(shape) * np.repeat(mag, 32, axis=-1)


# ------------------------------------------------------------------------------------------------
# 1. scaled_matmul, the exact path, against float64


@functools.cache
def jitted_matmul(path: str):
    return jax.jit(functools.partial(mg.scaled_matmul, path=path))


def oracle_operands(rng, b, m, n, c, rule, dtype=np.float32):
    a = blocky(rng, (b, m, c)).astype(dtype)
    w = blocky(rng, (b, n, c)).astype(dtype)
    return q_row(a, rule), q_row(w, rule)


SHAPES = [  # (B, M, N, C): M and N not multiples of 32, C a multiple
    pytest.param(1, 40, 24, 64, id="2d"),
    pytest.param(3, 17, 45, 96, id="batched"),
]


@pytest.mark.parametrize(("b", "m", "n", "c"), SHAPES)
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("path", ["exact", "bf16"])
def test_exact_and_bf16_paths_are_the_exact_product_within_fp32_accumulation(b, m, n, c, rule, path):
    """Both dequantize exactly (fp32, or bf16: a 4-bit significand times a power of two is a
    bf16 value) and accumulate in fp32: the exact product within gamma(C)."""
    rng = np.random.default_rng(b * 1000 + m)
    (a, sa), (w, sw) = oracle_operands(rng, b, m, n, c, rule)
    y = np.asarray(jitted_matmul(path)(a, sa, w, sw))
    assert y.shape == (b, m, n) and y.dtype == np.float32
    exact, scale = product(values(a, sa), values(w, sw))
    assert np.abs(exact).max() > 0 and (exact != 0).mean() > 0.99
    assert_within(y, exact, scale, c - 1, f"scaled_matmul {path} {rule}")
    # the bound is tight enough to see one quantization step of one element of one operand
    a2 = a.copy()
    a2[0, 0, 0] ^= 1  # the code's last significand bit: one E4M3 ulp (2^-3 relative)
    wrong, _ = product(values(a2, sa), values(w, sw))
    assert exceeds(y, wrong, scale, c - 1)
    # ... and one scale byte
    sa2 = sa.copy()
    sa2[-1, -1, -1] += 1
    wrong, _ = product(values(a, sa2), values(w, sw))
    assert exceeds(y, wrong, scale, c - 1)


@pytest.mark.parametrize("path", ["auto", "exact"])
def test_operands_as_bytes_or_as_fp8_dtypes_give_the_same_product(path):
    """Codes as uint8 or float8_e4m3fn, scales as uint8 or float8_e8m0fnu: the same bits out;
    on CPU "auto" is the exact path (bit for bit)."""
    assert mg.gemm_paths()["cpu"] == "exact"
    rng = np.random.default_rng(7)
    (a, sa), (w, sw) = oracle_operands(rng, 2, 33, 40, 64, "rceil")
    ref = np.asarray(jitted_matmul("exact")(a, sa, w, sw))
    for args in (
        (a.view(E4M3), sa.view(E8M0), w.view(E4M3), sw.view(E8M0)),
        (a.view(E4M3), sa, w, sw.view(E8M0)),
        (jnp.asarray(a), jnp.asarray(sa.view(E8M0)), jnp.asarray(w.view(E4M3)), jnp.asarray(sw)),
    ):
        got = np.asarray(jitted_matmul(path)(*args))
        np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))


# A few shapes (each is a compilation); the random part is the codes and the scales.
@pytest.mark.parametrize("path", ["exact", "bf16"])
@settings(max_examples=20)
@given(
    shape=st.sampled_from([(1, 1, 1, 32), (1, 7, 33, 64), (2, 31, 5, 128), (3, 40, 9, 32)]),
    lo=st.integers(74, 150),
    span=st.integers(0, 20),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_arbitrary_codes_and_scales(path, shape, lo, span, seed):
    """Any finite E4M3 codes (subnormals, +-0, +-448) under scale bytes whose products stay
    normal fp32 (bytes 74..170: values 2^-62 .. 2^52): within gamma(C) of the exact product."""
    b, m, n, c = shape
    rng = np.random.default_rng(seed)

    def codes(rows):
        q = rng.integers(0, 256, size=(b, rows, c), dtype=np.uint8)
        return np.where((q & 0x7F) == 0x7F, q ^ 0x01, q).astype(np.uint8)  # no NaN codes

    scales = lambda rows: rng.integers(lo, lo + span + 1, size=(b, rows, c // 32)).astype(np.uint8)
    a, sa, w, sw = codes(m), scales(m), codes(n), scales(n)
    y = np.asarray(jitted_matmul(path)(a, sa, w, sw))
    exact, scale = product(values(a, sa), values(w, sw))
    assert_within(y, exact, scale, c - 1, f"arbitrary codes ({path})")


@settings(max_examples=12)
@given(
    shape=st.sampled_from([(1, 5, 3, 64), (2, 37, 32, 96)]),
    log_scale=st.integers(-60, 60),
    rule=st.sampled_from(RULES),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_quantized_data(shape, log_scale, rule, seed):
    """Data of any magnitude quantized by the oracle (both rules): within gamma(C)."""
    b, m, n, c = shape
    rng = np.random.default_rng(seed)
    a = (blocky(rng, (b, m, c), 6) * np.ldexp(1.0, log_scale)).astype(np.float32)
    w = (blocky(rng, (b, n, c), 6) * np.ldexp(1.0, -log_scale // 2)).astype(np.float32)
    (qa, sa), (qw, sw) = q_row(a, rule), q_row(w, rule)
    y = np.asarray(jitted_matmul("exact")(qa, sa, qw, sw))
    exact, scale = product(values(qa, sa), values(qw, sw))
    assert_within(y, exact, scale, c - 1, f"quantized data ({rule})")


def test_operand_values_outside_the_fp32_normal_range_still_multiply():
    """A value 2^-127 (code 0.5, scale byte 1) times 2^100 is 2^-27, a normal fp32 product
    that the fp32 accumulation of the native GEMM keeps."""
    a = np.zeros((1, 1, 32), np.uint8)
    w = np.zeros((1, 1, 32), np.uint8)
    a[..., 0] = np.array(0.5, E4M3).view(np.uint8)
    w[..., 0] = np.array(1.0, E4M3).view(np.uint8)
    sa, sw = np.full((1, 1, 1), 1, np.uint8), np.full((1, 1, 1), 227, np.uint8)
    exact, _ = product(values(a, sa), values(w, sw))
    assert exact[0, 0, 0] == 2.0**-27
    y = np.asarray(jitted_matmul("exact")(a, sa, w, sw))
    assert y[0, 0, 0] == np.float32(2.0**-27)
    # and above: 448 * 2^127 (beyond fp32) times 2^-126 is 448 * 2, normal again
    a[..., 0] = np.array(448.0, E4M3).view(np.uint8)
    sa, sw = np.full((1, 1, 1), 254, np.uint8), np.full((1, 1, 1), 1, np.uint8)
    assert np.asarray(jitted_matmul("exact")(a, sa, w, sw))[0, 0, 0] == np.float32(896.0)
    # a NaN scale (0xFF) makes its products NaN
    assert np.isnan(np.asarray(jitted_matmul("exact")(a, np.full_like(sa, 0xFF), w, sw))[0, 0, 0])


def test_errors_name_the_problem():
    a, sa = np.zeros((1, 4, 64), np.uint8), np.zeros((1, 4, 2), np.uint8)
    w, sw = np.zeros((1, 8, 64), np.uint8), np.zeros((1, 8, 2), np.uint8)
    sm = mg.scaled_matmul
    with pytest.raises(ValueError, match=r"path='fast' must be one of \('auto', 'native', 'bf16', 'exact'\)"):
        sm(a, sa, w, sw, path="fast")
    with pytest.raises(ValueError, match=r"gemm_path='native': platform 'cpu' has no native block-scaled GEMM"):
        sm(a, sa, w, sw, path="native")
    with pytest.raises(TypeError, match=r"codes must be float8_e4m3fn \(or their uint8 bytes\), got float32"):
        sm(a.astype(np.float32), sa, w, sw)
    with pytest.raises(TypeError, match=r"codes must be .*got int8"):
        sm(a, sa, w.astype(np.int8), sw)
    with pytest.raises(TypeError, match=r"scales must be uint8 E8M0 bytes \(or float8_e8m0fnu\), got float32"):
        sm(a, sa.astype(np.float32), w, sw)
    with pytest.raises(ValueError, match=r"operands must be \[B, M, C\] and \[B, N, C\], got \(4, 64\)"):
        sm(a[0], sa[0], w, sw)
    with pytest.raises(ValueError, match=r"differ in B or C"):
        sm(a, sa, w[..., :32], sw[..., :1])
    with pytest.raises(ValueError, match=r"differ in B or C"):
        sm(np.zeros((2, 4, 64), np.uint8), np.zeros((2, 4, 2), np.uint8), w, sw)
    with pytest.raises(ValueError, match=r"contraction C=48 must be a multiple of 32"):
        sm(a[..., :48], sa[..., :1], w[..., :48], sw[..., :1])
    with pytest.raises(ValueError, match=r"a_scales has shape \(1, 4, 1\); a \(1, 4, 64\) needs \(1, 4, 2\)"):
        sm(a, sa[..., :1], w, sw)
    with pytest.raises(ValueError, match=r"w_scales has shape \(1, 2, 8\); w \(1, 8, 64\) needs \(1, 8, 2\)"):
        sm(a, sa, w, sw.reshape(1, 2, 8))
    # the mode of a unit, and FSDP's arguments
    with pytest.raises(ValueError, match=r"gemm_path='fast' must be one of"):
        mg.GemmMode("fast")
    with pytest.raises(ValueError, match=r"scale_rule='ceil' is not a known MXFP8 scale rule"):
        mg.GemmMode("auto", "ceil")
    with pytest.raises(ValueError, match=r"gemm='fp8' must be one of \('dequantized', 'mxfp8'\)"):
        mg.check_mode("fp8", "auto", "rceil")
    with pytest.raises(ValueError, match=r"gemm_path='native': platform 'cpu'"):
        mg.check_mode("mxfp8", "native", "rceil")
    assert mg.check_mode("dequantized", "auto", "rceil") is None
    assert mg.check_mode("mxfp8", "exact", "floor") == mg.GemmMode("exact", "floor")


# ------------------------------------------------------------------------------------------------
# 2. the recipe: forward and backward against numpy GEMMs of the oracle's planes


def recipe_reference(x, w, dy, rule):
    """TE's MXFP8BlockScaling in numpy for ``x [B, M, K]``, ``W [B, N, K]``, ``dy [B, M, N]``:
    ``(exact, scale)`` of y (blocks along K), dx (dy along N, W along N) and dW (dy and x
    along the tokens, zero-padded to 32)."""
    w_row = rows(w, rule)
    w_col = np.stack([npo.mxfp8_weights(wi, rule)[1] for wi in np.asarray(w, np.float32)])  # [B, N, K]
    y = product(rows(x, rule), w_row)
    dx = product(rows(dy, rule), np.swapaxes(w_col, 1, 2))
    dw = product(np.swapaxes(values_col(*q_col(dy, rule)), 1, 2), np.swapaxes(values_col(*q_col(x, rule)), 1, 2))
    return y, dx, dw


def weight_planes(w, rule):
    """The oracle's planes of ``W [B, N, K]`` as the GEMM operands the recipe takes (uint8):
    rowwise ``[B, N, K]``/``[B, N, K/32]``, columnwise transposed ``[B, K, N]``/``[B, K, N/32]``."""
    planes = [npo.quantize(np.asarray(wi, np.float32), rule) for wi in w]
    stack = lambda key: jnp.asarray(np.stack([p[key] for p in planes]))
    row = mg.weight_operand(stack("rowwise_data"), stack("rowwise_scale"), columnwise=False)
    col = mg.weight_operand(stack("columnwise_data"), stack("columnwise_scale"), columnwise=True)
    return row, col


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize(("b", "m", "n", "k"), [(1, 40, 96, 64), (3, 20, 64, 96)], ids=["2d", "batched"])
def test_recipe_forward_and_backward(b, m, n, k, rule, dtype):
    rng = np.random.default_rng(m + n + k)
    x = blocky(rng, (b, m, k)).astype(dtype)
    w = blocky(rng, (b, n, k)).astype(np.float32)
    dy = (blocky(rng, (b, m, n)) * 1e-3).astype(dtype)
    mode = mg.GemmMode("auto", rule)
    w_row, w_col_t = weight_planes(w, rule)
    (y_ref, y_s), (dx_ref, dx_s), (dw_ref, dw_s) = recipe_reference(x, w, dy, rule)

    y, x_col = jax.jit(mg.forward, static_argnums=2)(jnp.asarray(x), w_row, mode)
    assert y.dtype == jnp.float32 and x_col.row is None and x_col.rows == m
    assert_within(y, y_ref, y_s, k - 1, "forward")
    # what the forward keeps for the wgrad: the oracle's columnwise planes of x, padding included
    codes, scales = q_col(x, rule)
    assert x_col.col[0].dtype == jnp.uint8 and x_col.col[0].shape == codes.shape
    np.testing.assert_array_equal(np.asarray(x_col.col[0]), codes)
    np.testing.assert_array_equal(np.asarray(x_col.col[1]), scales)

    dx, dw = jax.jit(mg.backward, static_argnums=3)(jnp.asarray(dy), x_col, w_col_t, mode)
    assert dx.dtype == dw.dtype == jnp.float32 and dx.shape == (b, m, k) and dw.shape == (b, n, k)
    assert_within(dx, dx_ref, dx_s, n - 1, "dgrad")
    mp = -(-m // 32) * 32
    assert_within(dw, dw_ref, dw_s, mp - 1, "wgrad")
    # each GEMM reads the planes of its own contraction: W's rowwise values in the dgrad, or
    # the tokens blocked along K in the wgrad, land outside the bounds
    wrong_dx = product(rows(dy, rule), np.swapaxes(rows(w, rule), 1, 2))[0]
    assert exceeds(dx, wrong_dx, dx_s, n - 1)
    pad = lambda v: np.pad(v, ((0, 0), (0, mp - m), (0, 0)))
    wrong_dw = product(np.swapaxes(pad(rows(dy, rule)), 1, 2), np.swapaxes(pad(rows(x, rule)), 1, 2))[0]
    assert exceeds(dw, wrong_dw, dw_s, mp - 1)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("rule", RULES)
def test_quantize_tokens_planes_are_the_oracles_bytes(rule, dtype):
    rng = np.random.default_rng(3)
    x = (blocky(rng, (2, 45, 96), 4)).astype(dtype)
    x[1, 3, :32] = 0  # a zero block
    q = mg.quantize_tokens(jnp.asarray(x), mg.GemmMode(scale_rule=rule).scale_rule)
    assert q.rows == 45
    codes, scales = q_row(np.pad(x, ((0, 0), (0, 19), (0, 0))), rule)  # padding rows: zero codes and scales
    assert q.row[0].dtype == q.row[1].dtype == jnp.uint8
    np.testing.assert_array_equal(as_bytes(q.row[0]), codes.reshape(-1))
    np.testing.assert_array_equal(as_bytes(q.row[1]), scales.reshape(-1))
    assert not np.asarray(q.row[0])[:, 45:].any() and not np.asarray(q.row[1])[:, 45:].any()
    codes, scales = q_col(x, rule)
    np.testing.assert_array_equal(as_bytes(q.col[0]), codes.reshape(-1))
    np.testing.assert_array_equal(as_bytes(q.col[1]), scales.reshape(-1))
    # the operands: rowwise without the padding rows, columnwise transposed with them
    rc, rs = q.rowwise()
    assert rc.shape == (2, 45, 96) and rs.shape == (2, 45, 3)
    cc, cs = q.columnwise_t()
    assert cc.shape == (2, 96, 64) and cs.shape == (2, 96, 2)
    np.testing.assert_array_equal(np.asarray(cs), np.swapaxes(scales, 1, 2))
    only_row = mg.quantize_tokens(jnp.asarray(x), mg.GemmMode().scale_rule, columnwise=False)
    assert only_row.col is None and only_row.row is not None


# ------------------------------------------------------------------------------------------------
# 3. jax.nn.scaled_dot_general (jax's own MXFP8 quantize-and-multiply)
#
# jax 0.10.2 quantizes each operand in jnp (jax/_src/cudnn/scaled_matmul_stablehlo.py,
# ``quantize``): scale = amax / 448 in the input's dtype, rounded UP to a power of two on its
# fp32 bits (``cast_to_e8m0_with_rounding_up``, the rceil rule: TE's), the block divided by
# it, clipped to +-448 and cast to E4M3. Its last step, ``scaled_matmul_wrapper`` (the
# ``scaled_matmul`` primitive), is lowered for CUDA and ROCm only: on CPU it raises. For
# normal inputs the quotient amax/448 is a power of two exactly when TE's rule says so (448 =
# 1.75 * 2^8: a ratio m/1.75 of significands rounds to 1 only when m = 1.75, in fp32 and bf16
# alike), and the divisions by the scale are exact, so the bytes must be those of the
# package's quantize. The GEMM is replaced by its documented definition (``jax.nn.scaled_matmul``:
# a * repeat(a_scales) . b * repeat(b_scales)) evaluated in float64 from the very bytes jax
# produced and rounded once to fp32: the package's fp32 accumulation must lie within
# gamma(C) * sum |a w| of it, plus that one rounding (u |exact|).

SMH = "jax._src.cudnn.scaled_matmul_stablehlo"


class JaxGemms:
    """Stands in for ``scaled_matmul_wrapper`` (the step jax cannot run on CPU): records each
    GEMM's operand bytes and returns the float64 product rounded to fp32."""

    def __init__(self):
        self.calls = []

    def __call__(self, lhs, rhs, lhs_scales, rhs_scales, preferred_element_type=np.float32):
        assert lhs.dtype == rhs.dtype == jnp.float8_e4m3fn
        assert lhs_scales.dtype == rhs_scales.dtype == jnp.float8_e8m0fnu
        out = jax.ShapeDtypeStruct((lhs.shape[0], lhs.shape[1], rhs.shape[1]), preferred_element_type)
        u8 = lambda v: jax.lax.bitcast_convert_type(v, jnp.uint8)

        def host(a, b, sa, sb):
            self.calls.append(tuple(np.asarray(v) for v in (a, sa, b, sb)))
            return product(values(a, sa), values(b, sb))[0].astype(preferred_element_type)

        return jax.pure_callback(host, out, u8(lhs), u8(rhs), u8(lhs_scales), u8(rhs_scales))

    def call(self, shape_a, shape_b):
        (hit,) = [c for c in self.calls if c[0].shape == shape_a and c[2].shape == shape_b]
        return hit


CONFIGS = [jax.nn.get_scaled_dot_general_config("mxfp8")] * 3
XW = (((1,), (1,)), ((), ()))  # x [M, K] . W [N, K] -> [M, N]


def test_jax_cpu_block_scaled_gemm_is_absent_or_exact():
    """What the comparison below replaces: the block-scaled GEMM itself. jax up to 0.10 lowers
    it for CUDA and ROCm only; later releases lower it on CPU too (an expansion of the block
    scales), and there the whole call gives the exact path's numbers on normal-range operands,
    with its fp32 accumulation (the products of E4M3 values and power-of-two scales are exact
    in fp32, and so is each sum of 32 of them here: every block's values share one scale)."""
    rng = np.random.default_rng(5)
    x, w = blocky(rng, (1, 64, 96), 6), blocky(rng, (1, 40, 96), 6)
    qx = mg.quantize_tokens(jnp.asarray(x, jnp.float32), mg.GemmMode().scale_rule)
    qw = mg.quantize_tokens(jnp.asarray(w, jnp.float32), mg.GemmMode().scale_rule)
    (a, sa), (b, sb) = qx.rowwise(), qw.rowwise()
    a, b = mg._codes(a), mg._codes(b)  # E4M3 codes, as the native path takes them
    try:
        native = jax.jit(mg._native)(a, sa, b, sb)
    except NotImplementedError as err:
        assert "'scaled_matmul' not found for platform cpu" in str(err)
        return
    exact = mg.scaled_matmul(a, sa, b, sb, path="exact")
    np.testing.assert_allclose(np.asarray(native), np.asarray(exact), rtol=gamma(96), atol=0)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["fp32", "bf16"])
def test_forward_matches_jax_scaled_dot_general(monkeypatch, dtype):
    gemms = JaxGemms()
    monkeypatch.setattr(f"{SMH}.scaled_matmul_wrapper", gemms)
    rng = np.random.default_rng(11)
    m, n, k = 40, 72, 96
    x = blocky(rng, (m, k), 8).astype(dtype)
    w = blocky(rng, (n, k), 8).astype(dtype)
    y_jax = np.asarray(jax.jit(lambda x, w: jax.nn.scaled_dot_general(x, w, XW, configs=CONFIGS))(x, w))
    assert y_jax.shape == (m, n)
    a, sa, b, sb = gemms.call((1, m, k), (1, n, k))
    # jax's bytes are the package's (and the oracle's)
    q = mg.quantize_tokens(jnp.asarray(x)[None], mg.GemmMode().scale_rule)
    np.testing.assert_array_equal(a, np.asarray(q.rowwise()[0]))
    np.testing.assert_array_equal(sa, np.asarray(q.rowwise()[1]))
    w_codes, w_scales = q_row(w[None], "rceil")
    np.testing.assert_array_equal(b, w_codes)
    np.testing.assert_array_equal(sb, w_scales)
    # the same product: the package's GEMM on its own planes vs jax's product of its bytes
    y, _ = jax.jit(mg.forward, static_argnums=2)(x[None], (w_codes, w_scales), mg.GemmMode())
    exact, scale = product(values(a, sa), values(b, sb))
    rounding = UNIT_ROUNDOFF * np.abs(exact[0])  # jax's value here: the exact product rounded once
    assert_within(y[0], y_jax, scale[0], k - 1, "forward vs scaled_dot_general", absolute=rounding)
    assert_within(y_jax, exact[0], np.abs(exact[0]), 1, "jax's product: one rounding")


def test_backward_matches_jax_scaled_dot_general(monkeypatch):
    """jax's VJP quantizes dy along N with W along N (dgrad) and dy with x along the tokens
    (wgrad): TE's recipe, the package's bytes. Tokens a multiple of 32 (jax does not pad)."""
    gemms = JaxGemms()
    monkeypatch.setattr(f"{SMH}.scaled_matmul_wrapper", gemms)
    rng = np.random.default_rng(12)
    m, n, k = 64, 96, 128
    x = blocky(rng, (m, k), 8).astype(np.float32)
    w = blocky(rng, (n, k), 8).astype(np.float32)
    dy = blocky(rng, (m, n), 8).astype(np.float32)

    @jax.jit
    def jax_grads(x, w, dy):
        _, vjp = jax.vjp(lambda x, w: jax.nn.scaled_dot_general(x, w, XW, configs=CONFIGS), x, w)
        return vjp(dy)

    dx_jax, dw_jax = (np.asarray(v) for v in jax_grads(x, w, dy))
    mode = mg.GemmMode()
    w_row, w_col_t = weight_planes(w[None], "rceil")
    tok = jax.jit(lambda v: mg.quantize_tokens(v[None], mode.scale_rule))

    @jax.jit
    def package_grads(x, w_row, w_col_t, dy):
        _, x_col = mg.forward(x[None], w_row, mode)
        return mg.backward(dy[None], x_col, w_col_t, mode)

    dx, dw = package_grads(x, w_row, w_col_t, dy)
    checks = {  # jax's GEMM (operand shapes) -> the package's operands and result
        "dgrad": ((1, m, n), (1, k, n), tok(dy).rowwise(), w_col_t, dx[0], dx_jax, n),
        "wgrad": ((1, n, m), (1, k, m), tok(dy).columnwise_t(), tok(x).columnwise_t(), dw[0], dw_jax, m),
    }
    for what, (sh_a, sh_b, ours_a, ours_b, got, theirs, c) in checks.items():
        a, sa, b, sb = gemms.call(sh_a, sh_b)
        for mine, jaxs in zip((*ours_a, *ours_b), (a, sa, b, sb)):
            np.testing.assert_array_equal(np.asarray(mine), jaxs, err_msg=what)
        exact, scale = product(values(a, sa), values(b, sb))
        rounding = UNIT_ROUNDOFF * np.abs(exact[0])
        assert_within(got, theirs, scale[0], c - 1, f"{what} vs scaled_dot_general", absolute=rounding)
        assert np.abs(exact).max() > 0


# ------------------------------------------------------------------------------------------------
# 4. FSDP(gemm="mxfp8"): a training step's loss and gradients against the recipe in numpy
#
# Every quantizer input of the step is computed exactly, so that the reference quantizes the
# very values the step does (a quantizer is discontinuous: an input one fp32 ulp off may move
# a code by an E4M3 step): data and weights are given, the loss is linear in the output (its
# cotangent is the target over the n devices, exact for n a power of two), and the GEMMs whose
# results are quantized again (layer 1's forward, layer 2's dgrad) add exact fp32 numbers: their
# operands' quantized values are multiples of 2^-3 (magnitudes 1..8, E4M3's four significant
# bits) times one power of two per dot product, so that every partial sum is an integer below
# 2^24 in those units. The rest (the wgrads, layer 2's forward and the loss) is compared
# within fp32 summation bounds: a wgrad of one device adds 32 padded tokens, the
# reduce-scatter n devices.
#
# MXFP8 blocking shows only where a block mixes magnitudes (a value far below its block's
# maximum flushes to zero), so the data mix them on purpose, with powers of two undone after
# each GEMM (exact):
#   W1 [256, 64]: rows 33, 35, .., 63 tiny (2^-24): its rowwise blocks (along K) keep them,
#     columnwise blocks (along N) would flush them; h = x W1^T is scaled back per feature;
#   W2 [64, 256]: rows 33, 35, .., 63 tiny, out scaled back: the forward (rowwise) keeps
#     them, the dgrad's columnwise blocks flush them, and in the dgrad the matching
#     cotangents (2^24 larger) flush the others of their block: that block adds nothing;
#   tokens: device 3n/8's are tiny inputs with huge targets (its own 32-token blocks keep them,
#     blocks across devices would not), and token 7 of device 5n/8 too (its blocks along the
#     tokens flush it, or its 23 neighbours);
#   targets of W2's tiny rows' outputs: the outputs' signs (a forward that flushes those rows
#     loses all of them from the loss, whatever the number of tokens).

TOK = 24  # tokens per device: not a multiple of 32
K, N1, N2 = 64, 256, 64
TINY = 2.0**-24
W1_TINY = (np.arange(N1) >= 32) & (np.arange(N1) < 64) & (np.arange(N1) % 2 == 1)
W2_TINY = (np.arange(N2) >= 32) & (np.arange(N2) % 2 == 1)
R1 = np.where(W1_TINY, 1 / TINY, 1.0).astype(np.float32)
R2 = np.where(W2_TINY, 1 / TINY, 1.0).astype(np.float32)


@pytest.fixture(scope="module")
def mesh(devices):
    """The run's devices, or the most of them that are a power of two: the step's loss is the
    devices' mean, whose cotangent (the target over their number) the references need exact."""
    return Mesh(np.array(devices[: 1 << (len(devices).bit_length() - 1)]), ("fsdp",))


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(K, N1, use_bias=False, rngs=rngs)
        self.l2 = nnx.Linear(N1, N2, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.l1(x) * R1) * R2


def linear_loss(model, batch):
    x, t = batch
    return jnp.sum(model(x) * t)


def one_to_eight(rng, shape) -> np.ndarray:
    """Random fp32 values of magnitude in [1, 8), random signs."""
    return (rng.uniform(1, 8, shape) * rng.choice([-1.0, 1.0], shape)).astype(np.float32)


def mlp_data(devices: int, seed=0):
    """Weights, inputs and targets for ``devices`` devices' ``TOK`` tokens each: device
    ``3 devices / 8``'s tokens and token 7 of device ``5 devices / 8`` are the special ones
    (devices 3 and 5 of 8; 1 and 2 of 4; 0 and 1 of 2)."""
    rng = np.random.default_rng(seed)
    tiny_device, odd_device = 3 * devices // 8, 5 * devices // 8
    w1 = one_to_eight(rng, (N1, K)) * np.where(W1_TINY, TINY, 1.0)[:, None].astype(np.float32)
    w2 = one_to_eight(rng, (N2, N1)) * np.where(W2_TINY, TINY, 1.0)[:, None].astype(np.float32)
    special = np.zeros(devices * TOK, bool)
    special[tiny_device * TOK : (tiny_device + 1) * TOK] = True
    special[odd_device * TOK + 7] = True
    x = one_to_eight(rng, (devices * TOK, K)) * np.where(special, TINY, 1.0)[:, None].astype(np.float32)
    t = one_to_eight(rng, (devices * TOK, N2)) * np.where(special, 1 / TINY, 1.0)[:, None].astype(np.float32)
    # the outputs of W2's tiny rows: their targets take the signs of the recipe's outputs (token by
    # token), so that a forward flushing those rows moves the loss by their whole magnitudes
    # rather than by a sum of random signs, which may cancel
    h = exactly_fp32(rows(x) @ npo.mxfp8_weights(w1)[0].T, "h") * R1
    out = rows(h) @ npo.mxfp8_weights(w2)[0][W2_TINY].T
    t[:, W2_TINY] = np.abs(t[:, W2_TINY]) * np.where(out < 0, -1, 1)
    return w1, w2, x, t


def exactly_fp32(v, what):
    assert (np.asarray(v, np.float64) == np.asarray(v, np.float32)).all(), f"{what} is not exact in fp32"
    return np.asarray(v, np.float64)


def mlp_reference(w1, w2, x, t, *, fwd="row", dgrad="col", per_device=True, wgrad_blocks="tokens"):
    """The recipe on each device's tokens, summed over devices (the loss is a sum over the
    whole batch, as FSDP computes it): loss (value, scale) and the
    wgrads ``(exact, scale)`` as ``W [N, K]``. ``fwd``/``dgrad``: the planes the weights'
    GEMMs read; ``per_device``: token blocks per device; ``wgrad_blocks``: the wgrad's
    operands blocked along the tokens or (``"features"``) as in the forward and dgrad. The
    other choices are the wrong recipes the test must tell apart. The devices: ``len(x) / TOK``."""
    devices = len(x) // TOK
    w1_row, w1_col = npo.mxfp8_weights(w1)
    w2_row, w2_col = npo.mxfp8_weights(w2)
    w1_fwd = w1_row if fwd == "row" else w1_col
    w2_fwd = w2_row if fwd == "row" else w2_col
    w2_bwd = w2_col if dgrad == "col" else w2_row
    loss, loss_scale = 0.0, 0.0
    xs, hs, douts, dhs = [], [], [], []
    for d in range(devices):
        sl = slice(d * TOK, (d + 1) * TOK)
        h = exactly_fp32(rows(x[sl]) @ w1_fwd.T, "h") * R1
        out, out_s = product(rows(h), w2_fwd)
        loss += float((out * R2 * t[sl]).sum())
        loss_scale += float((out_s * R2 * np.abs(t[sl])).sum())
        dout = t[sl] * R2  # the loss sums over the whole batch
        dh = exactly_fp32(rows(dout) @ w2_bwd, "dh") * R1
        xs.append(x[sl]), hs.append(h), douts.append(dout), dhs.append(dh)

    def wgrad(dys, acts):
        if wgrad_blocks == "features":  # rowwise values, tokens padded alike
            parts = [
                product(np.pad(rows(dy), ((0, 8), (0, 0))).T, np.pad(rows(a), ((0, 8), (0, 0))).T)
                for dy, a in zip(dys, acts)
            ]
            return sum(p[0] for p in parts), sum(p[1] for p in parts)
        if per_device:  # each device's tokens padded to 32 on their own, the parts summed
            parts = [product(cols(dy).T, cols(a).T) for dy, a in zip(dys, acts)]
            return sum(p[0] for p in parts), sum(p[1] for p in parts)
        return product(cols(np.concatenate(dys)).T, cols(np.concatenate(acts)).T)

    return (loss, loss_scale), wgrad(dhs, xs), wgrad(douts, hs)


@pytest.fixture(scope="module")
def mlp_step(mesh):
    """Loss and kernel gradients of one step of the MLP, ``gemm="mxfp8"`` (both kernels
    MXFP8: the last would be a bf16 head by default)."""
    w1, w2, x, t = mlp_data(mesh.size)
    model = MLP(nnx.Rngs(0))
    model.l1.kernel.set_value(jnp.asarray(w1.T))
    model.l2.kernel.set_value(jnp.asarray(w2.T))
    fsdp = FSDP(
        model,
        mesh,
        loss_fn=linear_loss,
        example_batch=(x, t),
        gemm="mxfp8",
        precision_by_path={"kernel": "mxfp8"},
    )
    assert [(p.name, p.kind) for p in fsdp.units] == [("l1/kernel", "mxfp8"), ("l2/kernel", "mxfp8")]
    # whole 32-row blocks on every device: N2 = 64 rows padded to 32 per device (256 on 8 devices)
    assert [p.unit.out_padded for p in fsdp.units] == [mesh.size * rows_per_device(n, mesh.size) for n in (N1, N2)]
    loss, grads = fsdp.loss_and_grads(linear_loss)(fsdp.init(model, optax.sgd(1.0)), (x, t))
    got = {p.name: np.asarray(fsdp.to_logical(p, grads[p.name])) for p in fsdp.units}
    return (w1, w2, x, t), float(loss), got


def test_fsdp_mxfp8_step_is_the_recipe_on_each_devices_tokens(mlp_step):
    (w1, w2, x, t), loss, got = mlp_step
    devices = len(x) // TOK
    (ref_loss, loss_scale), (dw1, dw1_s), (dw2, dw2_s) = mlp_reference(w1, w2, x, t)
    # the loss: layer 2's forward adds N1 products, the loss 24 * N2 terms per device, then the devices'
    loss_terms = N1 + 1 + TOK * N2 + devices
    assert abs(loss - ref_loss) <= (gamma(loss_terms) + F64) * loss_scale, (loss, ref_loss)
    # the kernels' gradients ([in, out] = W^T): 32 padded tokens per device, the devices summed
    terms = 32 - 1 + devices - 1
    assert_within(got["l1/kernel"], dw1.T, dw1_s.T, terms, "l1/kernel gradient")
    assert_within(got["l2/kernel"], dw2.T, dw2_s.T, terms, "l2/kernel gradient")
    # no gradient part vanished: the tiny-weight and special-token parts are there
    assert (np.abs(dw1[W1_TINY]) > 0).all(axis=1).any() and (np.abs(dw2[W2_TINY]) > 0).any()

    # the bounds tell the recipe from its neighbours: a forward reading the columnwise planes,
    # a dgrad reading the rowwise ones, token blocks across devices
    fwd_col = mlp_reference(w1, w2, x, t, fwd="col")
    assert abs(loss - fwd_col[0][0]) > 2 * gamma(loss_terms) * loss_scale
    assert exceeds(got["l2/kernel"], fwd_col[2][0].T, dw2_s.T, terms)
    dgrad_row = mlp_reference(w1, w2, x, t, dgrad="row")
    assert exceeds(got["l1/kernel"], dgrad_row[1][0].T, dw1_s.T, terms)
    along_features = mlp_reference(w1, w2, x, t, wgrad_blocks="features")
    assert exceeds(got["l1/kernel"], along_features[1][0].T, dw1_s.T, terms)
    assert exceeds(got["l2/kernel"], along_features[2][0].T, dw2_s.T, terms)
    whole = mlp_reference(w1, w2, x, t, per_device=False)
    assert exceeds(got["l1/kernel"], whole[1][0].T, dw1_s.T, terms)
    assert exceeds(got["l2/kernel"], whole[2][0].T, dw2_s.T, terms)


# Kernels of several axes, read by jnp.einsum. A [D, H, Nh] (W_A: [(h n), D]) is read
# transposed, 'btd,dnh->btnh' on A.transpose(0, 2, 1): the dot keeps its axes as (n, h), not
# in W_A's order. B [Nh, H, D] (W_B: [D, (n h)]) contracts two axes in 'btnh,nhd->btd', which
# jnp.einsum lowers as a dot contracting them in the order (h, n), not W_B's. The canonical
# GEMM multiplies x [M, C] with C in W's order (the parameter's axis order, n-major for B)
# and blocks it there. Magnitudes make that visible: A's n >= 8 are tiny and B's huge, so
# B's K blocks in W's order (n < 8 | n >= 8, all h) are each of one magnitude; blocks in the
# dot's order (h < 2 | h >= 2, all n) would mix them (flushing the tiny activations and the
# ordinary weights). Values stay exact as in the MLP (the activation between the layers and
# the dgrad of B are exact fp32 sums).

D, H, NH, SEQ = 64, 4, 16, 24
N_TINY = np.arange(NH) >= 8


class EinsumNet(nnx.Module):
    def __init__(self, a, b):
        self.a = nnx.Param(jnp.asarray(a))
        self.b = nnx.Param(jnp.asarray(b))

    def __call__(self, x):
        h = jnp.einsum("btd,dnh->btnh", x, jnp.transpose(self.a[...], (0, 2, 1)))
        return jnp.einsum("btnh,nhd->btd", h, self.b[...])


def einsum_data(devices: int, seed=1):
    """Kernels A and B, and one sequence of inputs and targets per device."""
    rng = np.random.default_rng(seed)
    a = one_to_eight(rng, (D, H, NH)) * np.where(N_TINY, TINY, 1.0).astype(np.float32)
    b = one_to_eight(rng, (NH, H, D)) * np.where(N_TINY, 1 / TINY, 1.0)[:, None, None].astype(np.float32)
    x = one_to_eight(rng, (devices, SEQ, D))
    t = one_to_eight(rng, (devices, SEQ, D))
    return a, b, x, t


def einsum_reference(a, b, x, t, *, dot_order=False):
    """The recipe on W_A = A as [(h n), D] and W_B = B as [D, (n h)] (``dot_order``: B's
    contraction ordered and blocked as the dot's (h n) instead, the wrong recipe). One device per
    sequence of ``x``."""
    devices = len(x)
    swap = lambda v, first, second: v.reshape(-1, first, second).transpose(0, 2, 1).reshape(-1, first * second)
    to_k = (lambda v: v) if dot_order else (lambda v: swap(v, H, NH))  # W_A's rows (h n) -> B's K
    from_k = (lambda v: v) if dot_order else (lambda v: swap(v, NH, H))
    wa = a.transpose(1, 2, 0).reshape(H * NH, D)
    wb = (b.transpose(2, 1, 0) if dot_order else b.transpose(2, 0, 1)).reshape(D, H * NH)
    wa_row, _ = npo.mxfp8_weights(wa)
    wb_row, wb_col = npo.mxfp8_weights(wb)
    loss, loss_scale, xs, hs, dys, dhs = 0.0, 0.0, [], [], [], []
    for d in range(devices):
        h = to_k(exactly_fp32(rows(x[d]) @ wa_row.T, "h"))
        out, out_s = product(rows(h), wb_row)
        loss += float((out * t[d]).sum())
        loss_scale += float((out_s * np.abs(t[d])).sum())
        dy = t[d]  # the loss sums over the whole batch
        dh = from_k(exactly_fp32(rows(dy) @ wb_col, "dgrad of B"))  # in W_A's rows (h n)
        xs.append(x[d]), hs.append(h), dys.append(dy), dhs.append(dh)
    sum_parts = lambda parts: (sum(p[0] for p in parts), sum(p[1] for p in parts))
    dwa = sum_parts([product(cols(g).T, cols(v).T) for g, v in zip(dhs, xs)])  # [(h n), D]
    dwb = sum_parts([product(cols(g).T, cols(v).T) for g, v in zip(dys, hs)])  # [D, B's K]
    # as the kernels: A [D, H, Nh], B [Nh, H, D]
    to_a = lambda v: v.reshape(H, NH, D).transpose(2, 0, 1)
    to_b = lambda v: from_k(v).reshape(D, H, NH).transpose(2, 1, 0)
    return (loss, loss_scale), tuple(map(to_a, dwa)), tuple(map(to_b, dwb))


def test_fsdp_mxfp8_einsum_kernels_of_several_axes(mesh):
    a, b, x, t = einsum_data(mesh.size)
    model = EinsumNet(a, b)
    fsdp = FSDP(model, mesh, loss_fn=linear_loss, example_batch=(x, t), gemm="mxfp8", precision_by_path={".": "mxfp8"})
    units = {p.name: p.unit for p in fsdp.units}
    assert (units["a"].k_axes, units["a"].n_axes, units["b"].k_axes, units["b"].n_axes) == ((0,), (1, 2), (0, 1), (2,))
    loss, grads = fsdp.loss_and_grads(linear_loss)(fsdp.init(model, optax.sgd(1.0)), (x, t))
    got = {p.name: np.asarray(fsdp.to_logical(p, grads[p.name])) for p in fsdp.units}
    (ref_loss, loss_scale), (dwa, dwa_s), (dwb, dwb_s) = einsum_reference(a, b, x, t)
    loss_terms = H * NH + 1 + SEQ * D + mesh.size
    assert abs(float(loss) - ref_loss) <= (gamma(loss_terms) + F64) * loss_scale, (float(loss), ref_loss)
    terms = 32 - 1 + mesh.size - 1
    assert_within(got["a"], dwa, dwa_s, terms, "A's gradient")
    assert_within(got["b"], dwb, dwb_s, terms, "B's gradient")
    # B's contraction ordered and blocked as the dot's is another forward (the wgrads and
    # dgrads block along tokens and D, whatever the order of K)
    (wrong_loss, _), _, _ = einsum_reference(a, b, x, t, dot_order=True)
    assert abs(float(loss) - wrong_loss) > 2 * gamma(loss_terms) * loss_scale


# ------------------------------------------------------------------------------------------------
# 5. What the step saves for the backward
#
# In the jaxpr of the jitted step the forward, the loss, then the backward that value_and_grad
# traced after it: every value defined up to the loss and read after it is a residual (what the
# step keeps from its forward for its backward). A unit GEMM runs in a shard_map island, whose
# own residuals leave it split over the devices along their first axis. XLA may rematerialize
# or fuse further, never keep more than it is given.


def step_residuals(fsdp, loss_fn, state, batch) -> list[tuple[str, tuple, str]]:
    """``(dtype, shape per device, made by)`` of each residual of the step (a value split over
    the mesh along its first axis counted per device)."""
    closed = jax.make_jaxpr(lambda b: fsdp.loss_and_grads(loss_fn)(state, b))(batch)
    (call,) = [e for e in closed.jaxpr.eqns if e.primitive.name in ("jit", "pjit")]
    body = call.params["jaxpr"].jaxpr
    made = {v: i for i, e in enumerate(body.eqns) for v in e.outvars}
    cut = made[body.outvars[0]]  # the loss
    read_after = {v for e in body.eqns[cut + 1 :] for v in e.invars if not isinstance(v, jcore.Literal)}
    kept = [v for v in read_after if made.get(v, -1) <= cut and (v in made or v in body.invars)]
    by = lambda v: body.eqns[made[v]].primitive.name if v in made else "input"
    n = fsdp.mesh.size
    local = lambda shape: (shape[0] // n, *shape[1:]) if shape and shape[0] % n == 0 else shape
    return sorted((str(v.aval.dtype), local(tuple(v.aval.shape)), by(v)) for v in kept)


class Chain(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(96, 256, use_bias=False, rngs=rngs)
        self.l2 = nnx.Linear(256, 64, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.l1(x))


def test_the_step_saves_uint8_planes_for_the_wgrads(mesh):
    """x [24, 96] per device -> h [24, 256] -> out [24, 64]: with gemm="mxfp8" the backward
    reads x's and h's columnwise planes (uint8, 32 padded tokens) and the local columnwise
    planes of the weights, no fp32 activation (the loss's targets, a batch input, are its
    only float residual); with gemm="dequantized" it reads x and h themselves."""
    x = np.ones((mesh.size * TOK, 96), np.float32)
    t = np.ones((mesh.size * TOK, 64), np.float32)
    model = Chain(nnx.Rngs(0))
    found = {}
    for gemm in ("mxfp8", "dequantized"):
        fsdp = FSDP(model, mesh, loss_fn=linear_loss, example_batch=(x, t), gemm=gemm, precision_by_path={".": "mxfp8"})
        found[gemm] = step_residuals(fsdp, linear_loss, fsdp.init(model, optax.sgd(1.0)), (x, t))
    floats = lambda res: [r for r in res if r[0] != "uint8"]
    target = ("float32", (TOK, 64), "input")
    assert floats(found["mxfp8"]) == [target], found["mxfp8"]
    planes = {shape for dtype, shape, _ in found["mxfp8"] if dtype == "uint8"}
    assert {(1, 32, 96), (1, 1, 96), (1, 32, 256), (1, 1, 256)} <= planes  # x's and h's columnwise
    # each weight's local columnwise rows (W1 [256, 96], W2 [64, 256]; 32 each on 8 devices)
    r1, r2 = rows_per_device(256, mesh.size), rows_per_device(64, mesh.size)
    assert {(r1, 96), (r1 // 32, 96), (r2, 256), (r2 // 32, 256)} <= planes
    # the check sees activations where they are saved
    assert {("float32", (TOK, 96)), ("float32", (TOK, 256))} <= {r[:2] for r in floats(found["dequantized"])}
