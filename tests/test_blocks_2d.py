"""32x32 blocks (``mx.quantize(x, blocks="32x32")``, ``MXFP8Tensor2D``): the reference and the CPU
kernel (``mxfp8_quantize_tiles``) against the independent numpy oracle byte for byte, every bf16
pattern and arbitrary fp32, fp16 and bf16, both scale rules, every instruction set; the kernel
under ``vmap`` and on a sharded input; the one plane's rowwise and columnwise views; clear
errors. (The GPU kernels' device code is compared with the CPU kernel in tests/test_hipcpu.py.)"""

import functools
import re

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import mxfp8_jax as mx
from mxfp8_jax._src.compiled import hlo

import numpy_oracle as oracle
from conftest import as_bytes

ALL_BF16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(ml_dtypes.bfloat16)
TARGET = "mxfp8_quantize_tiles"
HAS_KERNEL = "cpu" in mx.available_backends()
needs_kernel = pytest.mark.skipif(not HAS_KERNEL, reason="needs the compiled CPU extension")
# backend="jax" is the reference, "ffi" the CPU kernel
BACKENDS = ["jax", pytest.param("ffi", marks=needs_kernel)]
AVAILABLE = ("jax", "ffi") if HAS_KERNEL else ("jax",)


@functools.cache
def _tiler(rule, backend):
    return jax.jit(lambda a: mx.quantize(a, scale_rule=rule, blocks="32x32", backend=backend))


def check_tiles(x, rule="rceil", backends=AVAILABLE):
    """The 32x32 quantize of ``x`` by each backend against the oracle: the codes and the tile
    scales, byte for byte."""
    x = np.asarray(x)
    want_q, want_s = oracle.quantize_tiles(x, rule)
    want = want_q.reshape(-1)
    for backend in (backends,) if isinstance(backends, str) else backends:
        got = _tiler(rule, backend)(jnp.asarray(x))
        assert isinstance(got, mx.MXFP8Tensor2D)
        np.testing.assert_array_equal(np.asarray(got.scale), want_s, err_msg=f"backend={backend} scales")
        q = as_bytes(got.data)
        bad = np.flatnonzero(q != want)
        assert bad.size == 0, (
            f"backend={backend}: {bad.size} codes differ; first at {bad[0]}: got {q[bad[0]]:#04x}, "
            f"want {want[bad[0]]:#04x}"
        )
    return got


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_all_bf16_patterns(rule, backend):
    """Every bf16 pattern, in order (a tile holds 1024 consecutive patterns: 32 rows of 32) and
    shuffled, so that every pattern meets small and large tile maxima."""
    check_tiles(ALL_BF16.reshape(2048, 32), rule, backend)
    perm = np.random.default_rng(0).permutation(ALL_BF16)
    check_tiles(perm.reshape(256, 256), rule, backend)


@given(
    x=hnp.arrays(np.float32, (64, 96), elements=st.floats(width=32, allow_nan=True)),
    rule=st.sampled_from(["rceil", "floor"]),
)
def test_property_arbitrary_fp32(x, rule):
    check_tiles(x, rule)


@given(log_scale=st.integers(-140, 120), seed=st.integers(0, 2**31 - 1), rule=st.sampled_from(["rceil", "floor"]))
def test_property_random_scales_fp16_and_bf16(log_scale, seed, rule):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((64, 64)) * np.ldexp(1.0, log_scale)
    for dtype in (ml_dtypes.bfloat16, np.float16):
        with np.errstate(over="ignore"):
            check_tiles(x.astype(dtype), rule)


def _edge_tiles() -> np.ndarray:
    """fp32 tiles, side by side in [64, 32 * n]: maxima on the scale boundaries 448 * 2^k and one
    ulp either side (from subnormal maxima to 2^127), beside subnormal, zero, -0, Inf, NaN and
    -NaN elements, and tiles of zeros, of NaN only and of the largest float."""
    tiles = []
    one = np.float32(1)
    with np.errstate(over="ignore"):  # 448 * 2^127 * (1 + ulp) is Inf: a tile of its own
        for k in range(-150, 128, 7):
            for mult in (one, np.nextafter(one, np.float32(0)), np.nextafter(one, np.float32(2))):
                amax = np.float32(448) * mult * np.float32(2.0 ** max(k, -149))
                t = np.linspace(-1, 1, 32 * 32, dtype=np.float32).reshape(32, 32) * amax
                t[5, 17] = amax
                tiles.append(t)
    specials = np.linspace(-3, 3, 32 * 32, dtype=np.float32).reshape(32, 32)
    specials[1, 1], specials[2, 30], specials[30, 2] = np.float32(1e-45), -0.0, np.float32(-2e-39)
    for special in (np.inf, -np.inf, np.nan, -np.nan, 448, 464, -480):
        t = specials.copy()
        t[31, 31] = special
        tiles.append(t)
    tiles += [np.zeros((32, 32), np.float32), np.full((32, 32), -0.0, np.float32)]
    tiles += [np.full((32, 32), np.nan, np.float32), np.full((32, 32), np.finfo(np.float32).max)]
    tiles += [tiles[-1].copy()] * (-len(tiles) % 2)
    return np.concatenate([np.concatenate(tiles[0::2], axis=1), np.concatenate(tiles[1::2], axis=1)])


@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_scale_boundaries_and_specials(rule):
    """Tile maxima at the scale boundaries, and special elements, in fp32, bf16 and fp16."""
    x = _edge_tiles()
    for dtype in (np.float32, ml_dtypes.bfloat16, np.float16):
        with np.errstate(over="ignore"):
            check_tiles(x.astype(dtype), rule)


# ------------------------------------------------------------------------------------------------
# the CPU kernel: shapes, instruction sets, "auto", vmap, sharded inputs


@needs_kernel
@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((32, 32), np.float32),
        ((32, 160), ml_dtypes.bfloat16),
        ((160, 32), np.float16),
        ((96, 4128), ml_dtypes.bfloat16),
        ((2, 3, 32, 64), np.float32),
        ((64, 96), np.float16),
    ],
)
def test_kernel_on_shapes(shape, dtype):
    """One tile, one band of tiles, one column of tiles, a wide band (the kernel takes its tiles
    32 at a time: 129 of them, the last alone), an N-D input (its [M, K]
    view); eagerly and under jit, equal to the reference and the oracle."""
    rng = np.random.default_rng(sum(shape))
    with np.errstate(over="ignore"):  # fp16 overflows to Inf now and then: a special element
        x = (rng.standard_normal(shape) * np.exp2(rng.integers(-20, 20, shape))).astype(dtype)
    m, k = int(np.prod(shape[:-1])), shape[-1]
    want_q, want_s = oracle.quantize_tiles(x.reshape(m, k))
    for t in (mx.quantize(jnp.asarray(x), blocks="32x32", backend="ffi"), check_tiles(x.reshape(m, k))):
        assert t.data.shape == (m, k) and t.scale.shape == (m // 32, k // 32)
        np.testing.assert_array_equal(as_bytes(t.data), want_q.reshape(-1))
        np.testing.assert_array_equal(np.asarray(t.scale), want_s)


@needs_kernel
@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_every_cpu_isa_gives_the_oracle_bytes(rule):
    """The kernel's baseline, AVX2 and AVX-512 builds (those this CPU runs), on every bf16 pattern
    and on the boundary and special tiles in fp32."""
    x16, x32 = np.random.default_rng(3).permutation(ALL_BF16).reshape(128, 512), _edge_tiles()
    for isa in mx.cpu_isas():
        with mx.use_cpu_isa(isa):
            for x in (x16, x32):
                want_q, want_s = oracle.quantize_tiles(x, rule)
                t = _tiler(rule, "ffi")(jnp.asarray(x))
                np.testing.assert_array_equal(as_bytes(t.data), want_q.reshape(-1), err_msg=f"isa={isa}")
                np.testing.assert_array_equal(np.asarray(t.scale), want_s, err_msg=f"isa={isa}")


def _targets(text: str) -> list[str]:
    return re.findall(r'custom_call_target="(\w+)"', text)


@needs_kernel
def test_auto_runs_the_kernel_where_it_is_built():
    x = jnp.zeros((64, 64), jnp.float32)
    for backend, calls in (("auto", [TARGET]), ("ffi", [TARGET]), ("jax", [])):
        text = jax.jit(lambda a, b=backend: mx.quantize(a, blocks="32x32", backend=b)).lower(x).compile().as_text()
        assert _targets(text) == calls, backend


@needs_kernel
def test_vmap_is_one_call_over_the_batch():
    x = (np.random.default_rng(4).standard_normal((3, 64, 96)) * 8).astype(np.float32)
    fn = jax.vmap(lambda a: mx.quantize(a, blocks="32x32", backend="ffi"))
    t = jax.jit(fn)(jnp.asarray(x))
    assert t.data.shape == (3, 64, 96) and t.scale.shape == (3, 2, 3)
    for b in range(3):
        want_q, want_s = oracle.quantize_tiles(x[b])
        np.testing.assert_array_equal(as_bytes(t.data[b]), want_q.reshape(-1))
        np.testing.assert_array_equal(np.asarray(t.scale[b]), want_s)
    assert _targets(jax.jit(fn).lower(jnp.asarray(x)).compile().as_text()) == [TARGET]


def _local_shapes(text: str) -> list[tuple[int, ...]]:
    """The operand shape of each tile kernel call in compiled HLO: what one device runs on."""
    lines = [ln for ln in text.splitlines() if f'custom_call_target="{TARGET}"' in ln]
    return [
        tuple(int(d) for d in re.search(r"\w+\[([\d,]*)\]\{", ln.split("custom-call(")[1]).group(1).split(","))
        for ln in lines
    ]


# (mesh axes, input spec, input shape for n devices, each device's [M, K])
SHARDED = {
    "rows": (P("x"), lambda n: (64 * n, 96), (64, 96)),
    "columns": (P(None, "x"), lambda n: (64, 32 * n), (64, 32)),
    "n-d-leading-axis": (P("x"), lambda n: (n, 64, 64), (64, 64)),
    # 16 rows a device split tiles: the rows are gathered, the kernel runs on the whole input
    "split-tiles-gathered": (P("x"), lambda n: (16 * n, 64), None),
}


@needs_kernel
@pytest.mark.parametrize("case", SHARDED)
def test_sharded_input_stays_sharded_in_whole_tiles(case, devices):
    """Under jit a sharded input is quantized where it lies, rows or columns cut in whole 32x32
    tiles (no collective; the scales follow the data), with the unsharded call's bytes; a cut
    that splits tiles is gathered first."""
    spec, shape_for, local = SHARDED[case]
    n = len(devices)
    mesh = Mesh(np.array(devices), ("x",))
    shape = shape_for(n)
    if case == "split-tiles-gathered" and n % 2:
        pytest.skip("needs an even device count")
    x = (np.random.default_rng(5).standard_normal(shape) * 16).astype(ml_dtypes.bfloat16)
    xs = jax.device_put(jnp.asarray(x), NamedSharding(mesh, spec))
    fn = jax.jit(lambda a: mx.quantize(a, blocks="32x32", backend="ffi"))
    text = fn.lower(xs).compile().as_text()
    m, k = int(np.prod(shape[:-1])), shape[-1]
    if local is None:
        assert _local_shapes(text) == [(m, k)]
        assert hlo.counts_by_op(text).get("all-gather", 0) >= 1
    else:
        assert hlo.counts_by_op(text) == {}, "the kernel's input or planes were moved between devices"
        assert _local_shapes(text) == [local]
    t = fn(xs)
    want_q, want_s = oracle.quantize_tiles(x.reshape(m, k))
    np.testing.assert_array_equal(as_bytes(t.data), want_q.reshape(-1))
    np.testing.assert_array_equal(np.asarray(t.scale), want_s)
    if local is not None:
        view = NamedSharding(mesh, spec)  # the [M, K] view's cut (an N-D input's: on its rows)
        assert t.data.sharding.is_equivalent_to(view, 2), t.data.sharding
        assert t.scale.sharding.is_equivalent_to(view, 2), t.scale.sharding


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
        ((64, 64), {"backend": "cuda"}, "backend='cuda' is not one of"),
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_differentiating_the_2d_quantize_is_an_error(backend):
    def loss(a):
        return mx.quantize(a, blocks="32x32", backend=backend).dequantize(dtype=jnp.float32).sum()

    with pytest.raises(TypeError, match="not differentiable"):
        jax.grad(loss)(jnp.ones((32, 32)))


def test_the_quantize_bench_times_the_tiles_kernel(capsys):
    """``python -m mxfp8_jax.bench.quantize --planes tiles``: the 32x32 kernel, checked against
    the reference before it is timed, its bytes one code plane and one scale per tile."""
    from mxfp8_jax.bench import quantize as bench

    result = bench.run(64, 96, "bfloat16", iters=1, repeats=1, reference=False, blocks="32x32")
    assert result["blocks"] == "32x32"
    assert result["bytes_moved"] == 64 * 96 * 2 + 64 * 96 + (64 // 32) * (96 // 32)
    assert "one of 32x32 tiles" in capsys.readouterr().out
