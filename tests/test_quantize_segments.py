"""The packed-segment CPU kernel ``mxfp8_quantize_segments`` against an independent oracle.

Each piece of a segment must come out exactly as the numpy oracle (tests/numpy_oracle.py, written
from docs/design.md, no shared code) quantizes it on its own, at the piece's offset (data) and
offset/32 (both scale planes); bytes no piece covers must be 0, whatever the input holds there.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mxfp8_jax as mx
from mxfp8_jax._src.kernels import _ffi, ffi_calls

import numpy_oracle
from conftest import as_bytes

pytestmark = pytest.mark.skipif(
    not _ffi.has_target("mxfp8_quantize_segments", "cpu"),
    reason="the compiled CPU extension is not installed",
)

PLANES = ("rowwise_data", "rowwise_scale", "columnwise_data", "columnwise_scale")


SEGMENT = 16384  # elements; fixed, like the piece shapes below, so compiled programs are reused
MAX_PIECES = 4


@st.composite
def segments(draw):
    """Pieces ``(offset, rows, row_len)`` with gaps, in shuffled order, padded with unused rows."""
    pieces, at = [], 0
    for _ in range(draw(st.integers(1, MAX_PIECES))):
        k = draw(st.sampled_from([32, 96, 160]))
        rows = draw(st.sampled_from([32, 64]))
        off = at + 32 * draw(st.sampled_from([0, 0, 1, 7, 40]))  # pieces start on any 32
        if off + rows * k > SEGMENT:
            break
        pieces.append((off, rows, k))
        at = off + rows * k
    if not pieces:
        pieces.append((0, 32, 32))
    order = draw(st.permutations(range(len(pieces))))
    desc = [pieces[j] for j in order] + [(0, 0, 0)] * (MAX_PIECES - len(pieces))
    return pieces, np.array(desc, np.int32)


@functools.cache
def _kernel(rule, rowwise, columnwise):
    code = mx.ScaleRule.parse(rule).code
    return jax.jit(
        lambda x, d: ffi_calls.quantize_segments(x, d, scale_rule=code, rowwise=rowwise, columnwise=columnwise)
    )


def _run(x, desc, *, rule="rceil", rowwise=True, columnwise=True):
    (rq, rs), (cq, cs) = _kernel(rule, rowwise, columnwise)(x, jnp.asarray(desc))
    return dict(zip(PLANES, (rq, rs, cq, cs)))


def _check(x, pieces, out, *, rule="rceil"):
    n = x.shape[0]
    covered = np.zeros(n, bool)
    for off, rows, k in pieces:
        ref = numpy_oracle.quantize(np.asarray(x[off : off + rows * k]).reshape(rows, k), rule)
        for name in PLANES:
            plane = out[name]
            if plane is None:
                continue
            want = as_bytes(ref[name])
            start = off if name.endswith("data") else off // 32
            np.testing.assert_array_equal(as_bytes(plane)[start : start + want.size], want, err_msg=name)
        covered[off : off + rows * k] = True
    for name in PLANES:
        if out[name] is not None:
            mask = covered if name.endswith("data") else covered[::32]
            assert not as_bytes(out[name])[~mask].any(), f"{name}: uncovered bytes must be 0"


@settings(max_examples=25)
@given(
    seg=segments(),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16, jnp.float16]),
    rule=st.sampled_from(["rceil", "floor"]),
    planes=st.sampled_from([(True, True), (True, False), (False, True)]),
    seed=st.integers(0, 2**16),
)
def test_pieces_match_reference(seg, dtype, rule, planes, seed):
    pieces, desc = seg
    rng = np.random.default_rng(seed)
    # Magnitudes spread over many binades (per 32 elements) so scales differ across blocks.
    x = rng.standard_normal(SEGMENT) * np.exp2(rng.integers(-30, 20, SEGMENT // 32)).repeat(32)
    x = jnp.asarray(x.astype(np.float32)).astype(dtype)
    rowwise, columnwise = planes
    out = _run(x, desc, rule=rule, rowwise=rowwise, columnwise=columnwise)
    assert (out["rowwise_data"] is not None) == rowwise
    assert (out["columnwise_data"] is not None) == columnwise
    _check(x, pieces, out, rule=rule)


def test_special_values_and_garbage_in_gaps():
    # NaN, +-Inf, fp32 subnormals, zeros and 448 * 2^k boundaries inside pieces; NaN in the gaps.
    k, rows = 64, 64
    special = np.array([np.nan, np.inf, -np.inf, 1e-40, -1e-42, 0.0, -0.0, 448.0, 896.0, 224.0], np.float32)
    rng = np.random.default_rng(0)
    piece = rng.standard_normal(rows * k).astype(np.float32)
    piece[rng.integers(0, piece.size, 300)] = rng.choice(special, 300)
    piece[: 32 * k] = 0.0  # a band of all-zero blocks
    size = 4 * 32 * k
    x = np.full(size, np.nan, np.float32)
    x[32 * k : 32 * k + rows * k] = piece
    pieces = [(32 * k, rows, k)]
    out = _run(jnp.asarray(x), np.array(pieces, np.int32))
    _check(jnp.asarray(x), pieces, out)


def test_int64_descriptors():
    with jax.enable_x64(True):
        x = jnp.asarray(np.random.default_rng(1).standard_normal(4096), jnp.bfloat16)
        desc = np.array([[1024, 32, 32], [0, 32, 32]], np.int64)
        out = _run(x, desc)
        assert jnp.asarray(desc).dtype == jnp.int64
    _check(x, [(1024, 32, 32), (0, 32, 32)], out)


@pytest.mark.parametrize(
    "desc, message",
    [
        ([[0, 32, 48]], "row_len positive multiples of 32"),
        ([[0, 48, 32]], "rows and row_len positive multiples of 32"),
        ([[16, 32, 32]], "start at a multiple of 32"),
        ([[2048, 64, 32]], "inside the segment"),
        ([[0, 64, 32], [1024, 32, 32]], "overlap"),
    ],
)
def test_bad_descriptors_are_rejected(desc, message):
    x = jnp.zeros((3072,), jnp.float32)
    with pytest.raises(Exception, match=message):
        jax.block_until_ready(_run(x, np.array(desc, np.int32)))


def test_desc_shape_and_dtype_checked():
    x = jnp.zeros((1024,), jnp.float32)
    with pytest.raises(Exception, match="shape \\[P, 3\\]"):
        jax.block_until_ready(_run(x, np.zeros((2, 2), np.int32)))
    with pytest.raises(Exception, match="int64 or int32"):
        jax.block_until_ready(_run(x, np.zeros((1, 3), np.float32)))
