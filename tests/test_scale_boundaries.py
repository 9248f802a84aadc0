"""The E8M0 scale at every breakpoint of both rules, exhaustively within 8 fp32 ulps, down to the
subnormal maxima where ``amax / 448`` itself is an fp32 subnormal.

The expected bytes come from exact rational arithmetic (``fractions.Fraction``), written from the
rules of docs/design.md §2 in a second formulation that shares nothing with the bit manipulation
of the package or of tests/numpy_oracle.py:

- rceil: ``v = round_to_nearest_even_fp32(amax * fp32(1/448))`` (subnormal grid included), and the
  byte is the smallest ``b`` in ``[0, 254]`` with ``2^(b - 127) >= v`` (0 for ``v = 0``);
- floor: ``b = clamp(floor(log2(amax)) - 8 + 127, 0, 254)``, 0 for ``amax = 0``.

(The largest finite amax gives rceil byte 247 and floor byte 246; 254 needs an infinite amax.)

rceil's byte steps from ``b - 1`` to ``b`` where ``v`` passes ``2^(b - 128)``, i.e. near
``amax = 448 * 2^(b - 128)``; because ``fp32(1/448)`` is not exact, the step can sit a few ulps
away from that value (for b = 1 it is at amax bits 0x04600002, two ulps above 448 * 2^-127).
"""

import functools
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mxfp8_jax as mx

import numpy_oracle as oracle
from conftest import as_bytes

ULPS = 8  # fp32 ulps checked on each side of every breakpoint


def f32_value(bits: int) -> Fraction:
    """The exact value of the non-negative fp32 with these bits (Python floats hold fp32 exactly)."""
    return Fraction(float(np.array(bits, np.uint32).view(np.float32)))


def floor_log2(q: Fraction) -> int:
    """floor(log2(q)) of a positive rational, exactly."""
    e = q.numerator.bit_length() - q.denominator.bit_length()
    while Fraction(2) ** e > q:
        e -= 1
    while Fraction(2) ** (e + 1) <= q:
        e += 1
    return e


def round_fp32(q: Fraction) -> Fraction:
    """q >= 0 rounded to the nearest fp32 (ties to even), subnormals kept (no overflow here)."""
    if q == 0:
        return q
    quantum = Fraction(2) ** (max(floor_log2(q), -126) - 23)
    n, rem = divmod(q, quantum)
    if rem * 2 > quantum or (rem * 2 == quantum and n % 2):
        n += 1
    return n * quantum


INV448 = round_fp32(Fraction(1, 448))


def rceil_byte(amax: Fraction) -> int:
    v = round_fp32(amax * INV448)
    if v == 0:
        return 0
    b = max(floor_log2(v) + 127, 0)  # 2^(b - 127) <= v
    if Fraction(2) ** (b - 127) < v:
        b += 1
    return min(b, 254)


def floor_byte(amax: Fraction) -> int:
    return 0 if amax == 0 else min(max(floor_log2(amax) - 8 + 127, 0), 254)


def f32_bits(value: Fraction) -> int:
    return int(np.array(float(value), np.float32).view(np.uint32))


def amax_bits(rule: str) -> np.ndarray:
    """Every fp32 within ULPS of each breakpoint of ``rule``, plus the smallest maxima."""
    if rule == "rceil":
        centres = [f32_bits(448 * Fraction(2) ** (b - 128)) for b in range(1, 248)]
    else:
        centres = [f32_bits(Fraction(2) ** (b - 119)) for b in range(1, 247)]  # 2^(b - 127 + 8)
    centres += [0x00400000, 0x00800000]  # 2^-127 (the byte-0 scale itself) and 2^-126
    bits = {c + d for c in centres for d in range(-ULPS, ULPS + 1)}
    bits |= set(range(0, 2 * ULPS))  # 0 and the smallest subnormals
    out = np.array(sorted(b for b in bits if 0 <= b < 0x7F800000), np.uint32)
    return np.concatenate([out, np.full((-out.size) % 32, out[-1], np.uint32)])  # whole columnwise blocks


def blocks_with_maxima(bits: np.ndarray) -> np.ndarray:
    """[N, 32] fp32: row i has |max| = bits[i] (at a varying position and sign), the rest smaller."""
    amax = bits.view(np.float32)
    rng = np.random.default_rng(7)
    x = (rng.uniform(-1, 1, (amax.size, 32)) * amax[:, None]).astype(np.float32)
    rows = np.arange(amax.size)
    x[rows, rows % 32] = np.where(rows % 2, -amax, amax)
    return x


@functools.cache
def _quantize(rule, backend):
    return jax.jit(lambda a: mx.quantize(a, columnwise=False, scale_rule=rule, backend=backend))


@functools.cache
def _quantize_columnwise(rule, backend):
    return jax.jit(lambda a: mx.quantize(a, rowwise=False, scale_rule=rule, backend=backend))


BACKENDS = ["jax"] + (["ffi"] if "cpu" in mx.available_backends() else [])


def test_the_rational_oracle_on_hand_derived_values():
    """The second formulation itself, at values worked by hand."""
    assert INV448 == Fraction(0x924925, 2**32)  # fp32(1/448) = 0x3B124925: mantissa 0x124925, 2^-9
    # 448 * 2^-127 (bits 0x04600000): v rounds to 2^-127 exactly -> byte 0; one ulp up, still;
    # two ulps up v is the next subnormal above 2^-127 -> byte 1.
    assert [rceil_byte(f32_value(0x04600000 + d)) for d in range(3)] == [0, 0, 1]
    assert rceil_byte(Fraction(448)) == 127 and rceil_byte(f32_value(0x43E00001)) == 128
    assert rceil_byte(Fraction(0)) == 0 and rceil_byte(f32_value(0x7F7FFFFF)) == 247
    assert floor_byte(Fraction(256)) == 127 and floor_byte(f32_value(0x437FFFFF)) == 126
    assert floor_byte(f32_value(1)) == 0 and floor_byte(f32_value(0x7F7FFFFF)) == 246


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_scale_at_every_breakpoint(rule, backend):
    bits = amax_bits(rule)
    want = np.array([(rceil_byte if rule == "rceil" else floor_byte)(f32_value(int(b))) for b in bits], np.uint8)
    # the breakpoints are really there: every byte from 0 to the largest occurs, in order
    assert np.all(np.diff(want.astype(int)) >= 0)
    assert set(want) == set(range(int(want.max()) + 1)) and want.max() == (247 if rule == "rceil" else 246)
    x = blocks_with_maxima(bits)
    planes = oracle.quantize_blocks(x, rule)
    np.testing.assert_array_equal(planes[1], want)  # the numpy oracle agrees with the rationals

    got = _quantize(rule, backend)(jnp.asarray(x))
    scales = as_bytes(got.rowwise_scale)
    bad = np.flatnonzero(scales != want)
    assert bad.size == 0, (
        f"{backend} {rule}: {bad.size} scales differ; first at amax bits {bits[bad[0]]:#010x}: "
        f"got {scales[bad[0]]}, want {want[bad[0]]}"
    )
    np.testing.assert_array_equal(as_bytes(got.rowwise_data), planes[0].reshape(-1))
    # the same blocks as columns: the columnwise plane takes the same bytes
    col = _quantize_columnwise(rule, backend)(jnp.asarray(np.ascontiguousarray(x.T)))
    np.testing.assert_array_equal(as_bytes(col.columnwise_scale), want)
    np.testing.assert_array_equal(as_bytes(col.columnwise_data), np.ascontiguousarray(planes[0].T).reshape(-1))
