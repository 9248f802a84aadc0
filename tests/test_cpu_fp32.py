"""fp32 input on the CPU kernels' 16-bit paths, under every instruction set this CPU can run.

The kernels stage fp32 as "sticky bf16" (the top 16 bits, bit 0 set when any low bit is) and
quantize most blocks from that; blocks it cannot decide exactly go back to the fp32 input. The
inputs here are built to reach every branch of that split: all 2^16 top halves with low halves
that sit on, just off and far from rounding ties; specials, subnormals and tiny maxima (scale
bytes below 16, which rceil leaves to the fp32 path); columns of a 32-column chunk that need the
fp32 path, below, at and above the counts the fast paths patch up column by column; ragged
widths (tiles of 256 columns, groups of 8 blocks) and packed segments. Every plane is compared
byte for byte with the numpy oracle.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mxfp8_jax as mx
from mxfp8_jax._src.kernels import ffi_calls

import numpy_oracle as oracle
from conftest import as_bytes

pytestmark = pytest.mark.skipif("cpu" not in mx.available_backends(), reason="needs the compiled CPU extension")

ISAS = mx.cpu_isas() if "cpu" in mx.available_backends() else ()
PLANES = ("rowwise_data", "rowwise_scale", "columnwise_data", "columnwise_scale")
LOW_HALVES = (0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF)


@functools.cache
def _quantize(rule, rowwise, columnwise):
    return jax.jit(lambda x: mx.quantize(x, rowwise=rowwise, columnwise=columnwise, scale_rule=rule, backend="ffi"))


def _check(x, rule, rowwise=True, columnwise=True):
    want = oracle.quantize(x, rule)
    got = _quantize(rule, rowwise, columnwise)(jnp.asarray(x))
    for plane in PLANES:
        if (plane.startswith("row") and not rowwise) or (plane.startswith("col") and not columnwise):
            continue
        actual, expected = as_bytes(getattr(got, plane)), want[plane].reshape(-1)
        bad = np.flatnonzero(actual != expected)
        assert bad.size == 0, (
            f"isa={mx.cpu_isa()} {plane} ({rule}): {bad.size} bytes differ; first at {bad[0]}: "
            f"got {actual[bad[0]]:#04x}, want {expected[bad[0]]:#04x}"
        )


def _all_top_halves():
    """Every top half with each low half of LOW_HALVES: [6 * 2^16] fp32, top half fastest."""
    top = np.arange(1 << 16, dtype=np.uint32) << 16
    bits = np.concatenate([top | low for low in LOW_HALVES])
    return bits.view(np.float32)


def _mixed_columns(rng, bad_columns):
    """[64, 512] normal fp32 where `bad_columns` columns of the first 32-column chunk of each
    band hold one element 2^-20 below the column's others (an E4M3 subnormal: not for the
    16-bit cast)."""
    x = (rng.standard_normal((64, 512)) * 3).astype(np.float32)
    x[:, :32] = np.abs(x[:, :32]) + 1  # every element of the chunk a normal in [1, ...)
    for band in (0, 32):
        for c in rng.choice(32, bad_columns, replace=False):
            x[band + rng.integers(32), c] = np.float32(2.0**-20)
    return x


def _inputs():
    rng = np.random.default_rng(17)
    allbits = _all_top_halves()
    yield "all top halves x low halves", allbits.reshape(768, 512)
    yield "all top halves, transposed", np.ascontiguousarray(allbits.reshape(512, 768).T)
    # normal data with a per-row scale; K = 17 blocks (a ragged tile and group)
    x = rng.standard_normal((96, 544)) * np.exp2(rng.integers(-30, 30, size=(96, 1)))
    yield "normal, per-row scales", x.astype(np.float32)
    # the same with low halves forced onto ties and just off them
    b = x.astype(np.float32).view(np.uint32) & 0xFFFF0000
    b |= rng.choice(np.array(LOW_HALVES, np.uint32), size=b.shape)
    yield "normal, ties", b.view(np.float32)
    # specials, subnormals, zeros and 448 * 2^k boundaries sprinkled in normal data
    s = (rng.standard_normal((64, 800)) * 2).astype(np.float32)
    special = np.array([np.nan, np.inf, -np.inf, 1e-40, -1e-42, 0.0, -0.0, 448.0, 896.0, 224.0], np.float32)
    s.reshape(-1)[rng.integers(0, s.size, 200)] = rng.choice(special, 200)
    s[:, 64:128] = 0.0
    s[32:, 256:288] = -0.0
    yield "specials", s
    # elements spanning up to 24 binades below their block's maximum
    e = rng.integers(-24, 1, size=(64, 512)) + rng.integers(-100, 100, size=(64, 1))
    w = np.ldexp(rng.uniform(1, 2, size=(64, 512)), e) * rng.choice([-1, 1], size=(64, 512))
    yield "wide range", w.astype(np.float32)
    # tiny maxima: biased exponents below 16 (scale bytes rceil leaves to the fp32 path) and up
    t = np.ldexp(rng.uniform(1, 2, size=(64, 256)), rng.integers(-126, -100, size=(64, 256)))
    t[:, 128:] = np.ldexp(rng.uniform(1, 2, size=(64, 128)), rng.integers(-149, -120, size=(64, 128)))
    yield "tiny", t.astype(np.float32)
    for n in (1, 4, 5, 8, 9, 32):
        yield f"{n} columns of a chunk off the 16-bit cast", _mixed_columns(rng, n)


INPUTS = list(_inputs())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_fp32_gives_the_oracle_bytes(isa, rule):
    with mx.use_cpu_isa(isa):
        for _, x in INPUTS:
            _check(x, rule)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("planes", [(True, False), (False, True)])
def test_fp32_one_plane(isa, planes):
    x = INPUTS[0][1]
    with mx.use_cpu_isa(isa):
        for rule in ("rceil", "floor"):
            _check(x, rule, *planes)
        _check(INPUTS[2][1], "rceil", *planes)


@functools.cache
def _segments(rule):
    code = mx.ScaleRule.parse(rule).code
    return jax.jit(lambda x, d: ffi_calls.quantize_segments(x, d, scale_rule=code, rowwise=True, columnwise=True))


@pytest.mark.parametrize("isa", ISAS)
def test_fp32_segments_with_ragged_pieces(isa):
    # Pieces whose row lengths end inside a 256-column tile and inside a group of 8 blocks,
    # starting at odd multiples of 32, with a gap; the input mixes specials into normal data.
    rng = np.random.default_rng(5)
    pieces = [(32, 64, 288), (32 + 64 * 288 + 96, 32, 544), (32 + 64 * 288 + 96 + 32 * 544, 32, 800)]
    size = pieces[-1][0] + 32 * 800 + 64
    x = (rng.standard_normal(size) * np.exp2(rng.integers(-20, 20, size // 32)).repeat(32)).astype(np.float32)
    x[rng.integers(0, size, 64)] = rng.choice(np.array([np.nan, np.inf, 1e-41, 0.0], np.float32), 64)
    desc = np.array(pieces[::-1] + [(0, 0, 0)], np.int32)
    with mx.use_cpu_isa(isa):
        for rule in ("rceil", "floor"):
            (rq, rs), (cq, cs) = _segments(rule)(jnp.asarray(x), jnp.asarray(desc))
            out = dict(zip(PLANES, (rq, rs, cq, cs)))
            covered = np.zeros(size, bool)
            for off, rows, k in pieces:
                ref = oracle.quantize(x[off : off + rows * k].reshape(rows, k), rule)
                for name in PLANES:
                    want = ref[name].reshape(-1)
                    start = off if name.endswith("data") else off // 32
                    got = as_bytes(out[name])[start : start + want.size]
                    np.testing.assert_array_equal(got, want, err_msg=f"isa={isa} {rule} {name} piece at {off}")
                covered[off : off + rows * k] = True
            for name in PLANES:
                mask = covered if name.endswith("data") else covered[::32]
                assert not as_bytes(out[name])[~mask].any(), f"{name}: uncovered bytes must be 0"
