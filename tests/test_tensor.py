"""MXFP8Tensor helpers on their own (no Transformer Engine): padding and the cuBLAS swizzle
against hand-derived positions, dequantize's checks and defaults, and the vma helpers."""

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import mxfp8_jax as mx
from mxfp8_jax._src.core import vma

import numpy_oracle as npo

# ------------------------------------------------------------------------------------------------
# padding and swizzle


def numbered(shape):
    """A uint8 plane whose bytes say where they came from (mod 251, never 0)."""
    return (np.arange(np.prod(shape)).reshape(shape) % 251 + 1).astype(np.uint8)


def test_padding_puts_the_compact_plane_top_left_and_zeros_elsewhere():
    for pad, shape, want in (
        (mx.pad_rowwise_scale, (5, 3), (128, 4)),  # [ceil128(M), ceil4(K/32)]
        (mx.pad_rowwise_scale, (128, 8), (128, 8)),  # already aligned: unchanged
        (mx.pad_columnwise_scale, (3, 130), (4, 256)),  # [ceil4(M/32), ceil128(K)]
    ):
        s = numbered(shape)
        got = np.asarray(pad(jnp.asarray(s)))
        assert got.shape == want
        np.testing.assert_array_equal(got[: shape[0], : shape[1]], s)
        rest = got.copy()
        rest[: shape[0], : shape[1]] = 0
        assert not rest.any()


def tile_offset(r, c, cols):
    """Where element (r, c) of a padded [R, C] plane lands in cuBLAS's 128x4 scale layout: tiles
    of 128 rows x 4 columns in row-major tile order, 512 bytes each; inside a tile, row r goes to
    (r % 32) * 16 + (r // 32) * 4 and column c adds c."""
    tile = (r // 128) * (cols // 4) + c // 4
    r, c = r % 128, c % 4
    return tile * 512 + (r % 32) * 16 + (r // 32) * 4 + c


def test_swizzle_matches_the_128x4_tile_layout():
    for shape in ((128, 4), (256, 8), (384, 4)):
        s = numbered(shape)
        got = np.asarray(mx.swizzle_scale(jnp.asarray(s)))
        want = np.empty(s.size, np.uint8)
        for r in range(shape[0]):
            for c in range(shape[1]):
                want[tile_offset(r, c, shape[1])] = s[r, c]
        np.testing.assert_array_equal(got, want)


def test_columnwise_swizzle_takes_the_transposed_plane():
    s = numbered((4, 256))  # padded columnwise [ceil4(M/32), ceil128(K)]
    got = np.asarray(mx.swizzle_scale(jnp.asarray(s), columnwise=True))
    want = np.empty(s.size, np.uint8)
    for r in range(256):  # rows of the transpose [K, M/32]
        for c in range(4):
            want[tile_offset(r, c, 4)] = s[c, r]
    np.testing.assert_array_equal(got, want)


def test_padded_scales_and_padded_tensor():
    x = np.random.default_rng(0).standard_normal((64, 96)).astype(np.float32)
    t = mx.quantize(x)
    row, col = t.padded_scales()
    np.testing.assert_array_equal(np.asarray(row), np.asarray(mx.pad_rowwise_scale(t.rowwise_scale)))
    np.testing.assert_array_equal(np.asarray(col), np.asarray(mx.pad_columnwise_scale(t.columnwise_scale)))
    srow, scol = t.padded_scales(swizzle=True)
    np.testing.assert_array_equal(np.asarray(srow), np.asarray(mx.swizzle_scale(row)))
    np.testing.assert_array_equal(np.asarray(scol), np.asarray(mx.swizzle_scale(col, columnwise=True)))
    p = t.padded()
    assert isinstance(p, mx.PaddedMXFP8Tensor) and p.shape == (64, 96)
    chex.assert_trees_all_equal(
        (p.rowwise_data, p.rowwise_scale, p.columnwise_data, p.columnwise_scale),
        (t.rowwise_data, row, t.columnwise_data, col),
    )


def test_padded_scales_swizzled_from_hand_placed_bytes():
    """``padded_scales(swizzle=True)`` of a tensor whose compact scales are numbered bytes,
    against positions placed by hand (tile_offset): rowwise [M, K/32] and columnwise [M/32, K]
    both end in cuBLAS's 128x4 order; TE's padding bytes are 0."""
    m, k = 160, 96  # rowwise [160, 3] -> padded [256, 4]; columnwise [5, 96] -> padded [8, 128]
    row_s, col_s = numbered((m, k // 32)), numbered((m // 32, k))
    e4m3 = jnp.zeros((m, k), jnp.float8_e4m3fn)
    t = mx.MXFP8Tensor(e4m3, jnp.asarray(row_s), e4m3, jnp.asarray(col_s), shape=(m, k))
    srow, scol = (np.asarray(a) for a in t.padded_scales(swizzle=True))
    want_row = np.zeros(256 * 4, np.uint8)
    for r in range(m):
        for c in range(k // 32):
            want_row[tile_offset(r, c, 4)] = row_s[r, c]
    np.testing.assert_array_equal(srow, want_row)
    # columnwise: the padded [8, 128] plane is swizzled as its transpose [128, 8] (rows = K)
    want_col = np.zeros(128 * 8, np.uint8)
    for kk in range(k):
        for j in range(m // 32):
            want_col[tile_offset(kk, j, 8)] = col_s[j, kk]
    np.testing.assert_array_equal(scol, want_col)


def test_padding_and_swizzle_errors():
    with pytest.raises(ValueError, match="rows a multiple of 128 and columns a multiple of 4"):
        mx.swizzle_scale(jnp.zeros((64, 4), jnp.uint8))
    with pytest.raises(TypeError, match="must be uint8 E8M0 bytes"):
        mx.pad_rowwise_scale(jnp.zeros((4, 4), jnp.float32))
    with pytest.raises(ValueError, match="2-D scale plane"):
        mx.pad_columnwise_scale(jnp.zeros((4,), jnp.uint8))


# ------------------------------------------------------------------------------------------------
# dequantize


def test_dequantize_both_planes_against_the_oracle_and_its_default_dtype():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((64, 64)) * np.exp2(rng.integers(-20, 20, (64, 1)))).astype(np.float32)
    x[:, 1::2] *= 2.0**-17  # rowwise and columnwise blocks keep different values
    planes = npo.quantize(x)
    e4m3 = lambda q: jnp.asarray(q.view(ml_dtypes.float8_e4m3fn))
    t = mx.MXFP8Tensor(
        e4m3(planes["rowwise_data"]),
        jnp.asarray(planes["rowwise_scale"]),
        e4m3(planes["columnwise_data"]),
        jnp.asarray(planes["columnwise_scale"]),
        shape=(64, 64),
        dtype=jnp.float32,
    )
    row = npo.dequantize_rowwise(planes["rowwise_data"], planes["rowwise_scale"])
    col = npo.dequantize_columnwise(planes["columnwise_data"], planes["columnwise_scale"])
    assert not np.array_equal(row, col)
    got = t.dequantize()  # the nominal dtype
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), row.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(t.dequantize(columnwise=True)), col.astype(np.float32))
    # one default for the function and the method: the tensor's own dtype
    assert mx.dequantize(t).dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(mx.dequantize(t)), np.asarray(got))
    bf16 = dataclass_replace(t, dtype=jnp.bfloat16).dequantize()
    assert bf16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(bf16), row.astype(np.float32).astype(jnp.bfloat16))


def dataclass_replace(t, **kw):
    import dataclasses

    return dataclasses.replace(t, **kw)


def test_dequantize_validates_its_input():
    t = mx.quantize(np.ones((32, 64), np.float32))
    with pytest.raises(ValueError, match="rowwise_data must be float8_e4m3fn"):
        dataclass_replace(t, rowwise_data=jax.lax.bitcast_convert_type(t.rowwise_data, jnp.uint8)).dequantize()
    with pytest.raises(ValueError, match="rowwise_data must be float8_e4m3fn of shape"):
        mx.dequantize(dataclass_replace(t, rowwise_data=t.rowwise_data.astype(jnp.float8_e5m2)))
    with pytest.raises(ValueError, match=r"of shape \(64, 64\)"):
        mx.dequantize(dataclass_replace(t, shape=(64, 64)))
    with pytest.raises(TypeError, match="dtype=int32 must be a floating-point type"):
        mx.dequantize(t, dtype=jnp.int32)
    with pytest.raises(ValueError, match="holds no columnwise plane"):
        mx.quantize(np.ones((32, 64), np.float32), columnwise=False).dequantize(columnwise=True)
    with pytest.raises(TypeError, match="t must be an MXFP8Tensor"):
        mx.dequantize(np.ones((32, 32)))


def test_scale_e8m0_is_a_bitcast():
    x = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    t, want = mx.quantize(x), npo.quantize(x)
    assert not np.array_equal(want["rowwise_scale"].T, want["columnwise_scale"])  # [64, 1] vs [2, 32]
    for columnwise, plane in ((False, "rowwise_scale"), (True, "columnwise_scale")):
        v = t.scale_e8m0(columnwise=columnwise)
        assert v.dtype == jnp.float8_e8m0fnu and v.shape == want[plane].shape
        np.testing.assert_array_equal(np.asarray(v).view(np.uint8), want[plane])
        # the values E8M0 means: 2^(byte - 127)
        np.testing.assert_array_equal(
            np.asarray(v).astype(np.float64), np.ldexp(1.0, want[plane].astype(np.int64) - 127)
        )


# ------------------------------------------------------------------------------------------------
# varying manual axes


def test_vma_helpers_under_checked_and_unchecked_shard_map(devices):
    # (2, n/2): vma tracks axes by name, so with 2 devices the size-1 "b" is tracked all the same
    half = len(devices) // 2
    mesh = Mesh(np.array(devices[: 2 * half]).reshape(2, half), ("a", "b"))
    x = jnp.arange(2.0 * half)  # two elements per shard along "b"
    assert vma.varying_axes(x) == frozenset()  # outside shard_map nothing is tracked

    def body(shard, rep):
        seen = {
            "tracked": vma.tracked("b"),
            "shard": vma.varying_axes(shard),
            "rep": vma.varying_axes(rep),
            "union": vma.union(shard, rep),
            "vary": vma.varying_axes(vma.vary(rep, ("a",))),
        }
        # a cotangent that varies along b for an invariant primal is summed over b
        ct = vma.cotangent_like(shard, rep)
        seen["ct"] = vma.varying_axes(ct)
        found.append(seen)
        return ct

    for check in (True, False):
        found = []
        out = jax.shard_map(body, mesh=mesh, in_specs=(P("b"), P()), out_specs=P(), check_vma=check)(x, x[:2])
        (seen,) = found
        if check:
            assert seen == {
                "tracked": True,
                "shard": {"b"},
                "rep": frozenset(),
                "union": {"b"},
                "vary": {"a"},
                "ct": frozenset(),
            }
            # the shards of x along "b" summed: [0 + 2 + 4 + ..., 1 + 3 + 5 + ...]
            np.testing.assert_array_equal(np.asarray(out), [sum(range(0, 2 * half, 2)), sum(range(1, 2 * half, 2))])
        else:  # nothing is tracked, so nothing is cast or summed
            assert not seen["tracked"] and seen["shard"] == seen["union"] == seen["ct"] == frozenset()
