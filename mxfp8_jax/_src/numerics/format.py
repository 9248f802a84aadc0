"""MXFP8 numerics in pure JAX: the reference every kernel is tested against (docs/design.md §2).

Element format: OCP float8 E4M3 (``float8_e4m3fn``, max 448, no Inf, NaN 0x7F/0xFF).
Block: 32 consecutive elements; one E8M0 scale byte per block, value ``2^(byte - 127)``.

Why bits and integers: XLA:CPU executes with flush-to-zero and denormals-are-zero, and the scale
``2^-127`` (byte 0) is an fp32 subnormal, as are tiny inputs. Every step that could meet a
subnormal -- the block amax, the scale multiply, dequantization -- is therefore written on the
IEEE bit patterns with integer operations, and floating-point arithmetic is used only where the
operands and result are provably normal.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

BLOCK = 32
E4M3_MAX = 448.0
_F32_INV_E4M3_MAX = np.float32(1.0) / np.float32(E4M3_MAX)  # fp32(1/448), bits 0x3B124925


def _select(cond: jax.Array, a, b) -> jax.Array:
    """``jnp.where(cond, a, b)`` for integer operands of ``cond``'s shape (either may be a scalar),
    with no full-size constant: ``b ^ ((a ^ b) & mask)``, ``mask`` all ones where ``cond``.

    A scalar broadcast to the operands' shape (``jnp.where``'s, or ``lax.full_like``) is a value
    that depends on no input; under autodiff of a loop (a scanned FSDP layer dequantizing its
    weights inside a ``shard_map``) JAX's partial evaluation saves it as a residual and hoists it
    out of the loop: one buffer the size of the weight per scalar. Scalars given to a binary op
    as they are stay scalars in the program.
    """
    dtype = (b if jnp.ndim(b) else a).dtype
    a = a if jnp.ndim(a) else np.asarray(a, dtype)
    b = b if jnp.ndim(b) else np.asarray(b, dtype)
    mask = lax.sub(np.asarray(0, dtype), cond.astype(dtype))  # 0 - 1 = all ones, in any integer type
    return lax.bitwise_xor(b, lax.bitwise_and(lax.bitwise_xor(a, b), mask))


class ScaleRule(str, enum.Enum):
    """How a block's E8M0 scale is derived from its amax."""

    RCEIL = "rceil"  # round amax/448 up to a power of two (TE, cuBLAS, MAX, jax scaled_matmul)
    FLOOR = "floor"  # OCP MX v1.0: floor(log2(amax)) - 8; elements may saturate to +-448

    @classmethod
    def parse(cls, rule: str | ScaleRule, *, argname: str = "scale_rule") -> ScaleRule:
        """The ``ScaleRule`` that ``rule`` names.

        Args:
          rule: a ``ScaleRule`` or its value, ``"rceil"`` or ``"floor"`` (lower case).
          argname: the argument name an unknown rule's ValueError quotes.

        Returns:
          The ``ScaleRule`` member; any other value raises ValueError.
        """
        try:
            return cls(rule)
        except ValueError:
            raise ValueError(
                f"{argname}={rule!r} is not a known MXFP8 scale rule; use one of {[r.value for r in cls]}"
            ) from None

    @property
    def code(self) -> int:
        """The integer the FFI kernels take (0 rceil, 1 floor)."""
        return 0 if self is ScaleRule.RCEIL else 1


# ------------------------------------------------------------------------------------------------
# bits


def f32_bits(x: jax.Array) -> jax.Array:
    """fp32 bit patterns (uint32) of a bf16, fp16 or fp32 array, exactly (no flushing)."""
    dt = jnp.dtype(x.dtype)
    if dt == jnp.float32:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    if dt == jnp.bfloat16:
        return jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32) << 16
    if dt == jnp.float16:
        return _f16_bits_to_f32_bits(jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32))
    raise TypeError(f"expected bf16, fp16 or fp32, got {dt}")


def _f16_bits_to_f32_bits(h: jax.Array) -> jax.Array:
    sign = (h & 0x8000) << 16
    exp = (h >> 10) & 0x1F
    man = h & 0x3FF
    normal = sign | ((exp + 112) << 23) | (man << 13)
    special = sign | 0x7F800000 | (man << 13)
    # Subnormal half = man * 2^-24: float(man) is an exact normal fp32; shift its exponent.
    fm = jax.lax.bitcast_convert_type(man.astype(jnp.float32), jnp.uint32)
    sub = jnp.where(man == 0, sign, sign | (fm - (24 << 23)))
    return jnp.where(exp == 0x1F, special, jnp.where(exp == 0, sub, normal))


def abs_bits(bits: jax.Array) -> jax.Array:
    """|x| as bits, with NaN mapped to 0 so that it never wins a max (amax ignores NaN)."""
    a = bits & 0x7FFFFFFF
    return _select(a > 0x7F800000, 0, a)


# ------------------------------------------------------------------------------------------------
# scale rules: amax (fp32 bits, NaN-free, non-negative) -> E8M0 byte


def _first_amax_with_scale(byte_is_at_least) -> np.uint32:
    """Smallest non-negative fp32 (as bits) whose product with fp32(1/448) satisfies a predicate.

    Computed once with numpy on the host, where fp32 arithmetic is IEEE with subnormals.
    """
    lo, hi = 0, 0x7F800000
    while lo < hi:
        mid = (lo + hi) // 2
        v = (np.array(mid, np.uint32).view(np.float32) * _F32_INV_E4M3_MAX).view(np.uint32)
        if byte_is_at_least(int(v)):
            hi = mid
        else:
            lo = mid + 1
    return np.uint32(lo)


# Below this amax, v = amax * fp32(1/448) is an fp32 subnormal, which XLA:CPU would flush; there
# the rceil byte is 1 exactly when v > 2^-127 (subnormal mantissa > 0x400000), else 0.
_AMAX_V_NORMAL = _first_amax_with_scale(lambda v: v >= 0x00800000)
_AMAX_BYTE_1 = _first_amax_with_scale(lambda v: v > 0x00400000)


def e8m0_rceil(amax_bits: jax.Array) -> jax.Array:
    """rceil: v = fp32(amax * fp32(1/448)), rounded UP to a power of two on its fp32 bits.

    byte = exp(v) + (mantissa(v) != 0 and exp(v) != 0xFE and not (exp(v) == 0 and
    mantissa(v) <= 0x400000)); amax 0 -> 0, +Inf -> 0xFE.
    """
    amax = jax.lax.bitcast_convert_type(amax_bits, jnp.float32)
    v = jax.lax.bitcast_convert_type(amax * _F32_INV_E4M3_MAX, jnp.uint32)
    exp, man = v >> 23, v & 0x7FFFFF
    up = (man != 0) & (exp != 0xFE)
    byte = exp + up.astype(jnp.uint32)
    # v subnormal (flushed by XLA:CPU): exp(v) = 0, so the byte is 1 iff v > 2^-127.
    tiny = (amax_bits >= _AMAX_BYTE_1).astype(jnp.uint32)
    byte = _select(amax_bits < _AMAX_V_NORMAL, tiny, byte)
    byte = _select(amax_bits >= 0x7F800000, 0xFE, byte)
    return byte.astype(jnp.uint8)


def e8m0_floor(amax_bits: jax.Array) -> jax.Array:
    """floor (OCP MX v1.0): byte = clamp(floor(log2(amax)) - 8 + 127, 0, 254); amax 0 -> 0.

    floor(log2(amax)) + 127 is the exponent field of a normal amax; subnormal amax clamps to 0.
    """
    exp = (amax_bits >> 23).astype(jnp.int32)
    byte = jnp.clip(exp - 8, 0, 254)
    byte = _select(exp == 0xFF, 254, byte)  # +Inf: floor(log2) is +Inf, clamped
    return _select(exp == 0, 0, byte).astype(jnp.uint8)


def e8m0_scale(amax_bits: jax.Array, rule: ScaleRule) -> jax.Array:
    return e8m0_floor(amax_bits) if rule is ScaleRule.FLOOR else e8m0_rceil(amax_bits)


def e8m0_to_float32(byte: jax.Array) -> jax.Array:
    """2^(byte - 127) as fp32 (byte 0 is the subnormal 2^-127, 0xFF is NaN).

    Args:
      byte: E8M0 scale bytes (uint8), any shape.

    Returns:
      An fp32 array of ``byte``'s shape, built on the bits (byte 0 gives 2^-127 exactly, 0xFF
      the NaN 0x7FC00000).
    """
    b = byte.astype(jnp.uint32)
    bits = _select(b == 0, 0x00400000, b << 23)
    bits = _select(b == 0xFF, 0x7FC00000, bits)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def e8m0_view(byte: jax.Array) -> jax.Array:
    """The uint8 scales reinterpreted as ``float8_e8m0fnu`` (a free bitcast).

    Args:
      byte: E8M0 scale bytes (uint8), any shape.

    Returns:
      A ``float8_e8m0fnu`` array of ``byte``'s shape with the same bits.
    """
    return jax.lax.bitcast_convert_type(byte, jnp.float8_e8m0fnu)


# ------------------------------------------------------------------------------------------------
# cast and its inverse


def e4m3_scaled(bits: jax.Array, byte: jax.Array) -> jax.Array:
    """q = e4m3_rne_satfinite(x * 2^(127 - byte)), x given as fp32 bits; byte broadcasts.

    The power-of-two multiply is an exponent add on the bits (exact, no 2^-127 operand). Results
    below 2^-126 round to +-0 in E4M3 anyway; the final rounding is XLA's own f32 -> e4m3 convert
    after saturating to +-448 (E4M3FN has no Inf; its overflow would be NaN).
    """
    k = 127 - byte.astype(jnp.int32)
    sign = bits & np.uint32(0x80000000)
    a = bits & 0x7FFFFFFF
    exp = (a >> 23).astype(jnp.int32)
    man = a & 0x7FFFFF
    # A subnormal input m * 2^-149: float(m) is an exact normal fp32 with its own exponent.
    fm = jax.lax.bitcast_convert_type(man.astype(jnp.float32), jnp.uint32)
    ey = jnp.where(exp == 0, (fm >> 23).astype(jnp.int32) - 149, exp) + k
    my = jnp.where(exp == 0, fm & 0x7FFFFF, man)
    y_bits = _select(ey >= 1, (jnp.clip(ey, 1, 254).astype(jnp.uint32) << 23) | my, 0)
    y_bits = _select(a == 0, 0, y_bits)
    y_bits = jnp.where(exp == 0xFF, a, y_bits)  # Inf / NaN pass through
    y = jax.lax.bitcast_convert_type(sign | y_bits, jnp.float32)
    y = jnp.clip(y, -E4M3_MAX, E4M3_MAX)  # saturate finite and Inf; NaN stays NaN
    return y.astype(jnp.float8_e4m3fn)


def scaled_to_bits(q: jax.Array, byte: jax.Array) -> jax.Array:
    """fp32 bits of q * 2^(byte - 127), exactly (subnormal results included); byte broadcasts."""
    qb = jax.lax.bitcast_convert_type(q.astype(jnp.float32), jnp.uint32)
    sign = qb & np.uint32(0x80000000)
    a = qb & 0x7FFFFFFF
    exp = (a >> 23).astype(jnp.int32)
    sig = (a & 0x7FFFFF) | 0x800000
    e = exp + byte.astype(jnp.int32) - 127
    normal = (jnp.clip(e, 1, 254).astype(jnp.uint32) << 23) | (a & 0x7FFFFF)
    # q has 4 significant bits, so a subnormal result is exact: shift the significand.
    sub = sig >> jnp.clip(1 - e, 0, 31).astype(jnp.uint32)
    out = jnp.where(e >= 1, normal, sub)
    out = _select(e >= 255, 0x7F800000, out)
    out = _select(a == 0, 0, out)
    out = _select((a > 0x7F800000) | (byte == 0xFF), 0x7FC00000, out)
    return sign | out


CANONICAL_NAN_BITS = 0x7FC00000  # the one NaN of computed fp32 values (docs/design.md §2)


def canonical_nan(y: jax.Array) -> jax.Array:
    """fp32 ``y`` with every NaN replaced by the canonical NaN 0x7FC00000 (other bits kept).

    Hardware writes its own NaN for an invalid operation (x86 0xFFC00000, CUDA 0x7FFFFFFF, AMD
    0x7FC00000) or passes an input NaN through, so a computed value is made canonical before it
    is rounded or quantized; the select is on the bits, which no compiler may rewrite.
    """
    b = lax.bitcast_convert_type(y, jnp.uint32)
    nan = (b & 0x7FFFFFFF) > 0x7F800000
    return lax.bitcast_convert_type(_select(nan, np.uint32(CANONICAL_NAN_BITS), b), jnp.float32)


def f32_bits_to(bits: jax.Array, dtype) -> jax.Array:
    """fp32 bits -> dtype, rounding to nearest even in integers for bf16 (keeps subnormals)."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float32:
        return jax.lax.bitcast_convert_type(bits, jnp.float32)
    if dtype == jnp.bfloat16:
        nan = (bits & 0x7FFFFFFF) > 0x7F800000
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = jnp.where(nan, (bits >> 16) | 0x40, rounded)
        return jax.lax.bitcast_convert_type(rounded.astype(jnp.uint16), jnp.bfloat16)
    return jax.lax.bitcast_convert_type(bits, jnp.float32).astype(dtype)


# ------------------------------------------------------------------------------------------------
# blocks


def quantize_rowwise(x2d: jax.Array, rule: ScaleRule) -> tuple[jax.Array, jax.Array]:
    """[M, K] -> (data float8_e4m3fn [M, K], scale uint8 [M, K/32]), 32 along the last axis."""
    m, k = x2d.shape
    bits = f32_bits(x2d).reshape(m, k // BLOCK, BLOCK)
    scale = e8m0_scale(jnp.max(abs_bits(bits), axis=-1), rule)
    data = e4m3_scaled(bits, scale[..., None]).reshape(m, k)
    return data, scale


def quantize_columnwise(x2d: jax.Array, rule: ScaleRule) -> tuple[jax.Array, jax.Array]:
    """[M, K] -> (data float8_e4m3fn [M, K], scale uint8 [M/32, K]), 32 along the first axis."""
    m, k = x2d.shape
    bits = f32_bits(x2d).reshape(m // BLOCK, BLOCK, k)
    scale = e8m0_scale(jnp.max(abs_bits(bits), axis=1), rule)
    data = e4m3_scaled(bits, scale[:, None, :]).reshape(m, k)
    return data, scale


# ------------------------------------------------------------------------------------------------
# 2-D blocks: one scale per 32x32 tile


def quantize_tiles(x2d: jax.Array, rule: ScaleRule) -> tuple[jax.Array, jax.Array]:
    """[M, K] -> (data float8_e4m3fn [M, K], scale uint8 [M/32, K/32]): one scale per 32x32
    tile, the scale rule applied to the tile's amax, every element cast with its tile's scale
    (the 1x32 rules with the block grown to the tile)."""
    m, k = x2d.shape
    bits = f32_bits(x2d).reshape(m // BLOCK, BLOCK, k // BLOCK, BLOCK)
    scale = e8m0_scale(jnp.max(abs_bits(bits), axis=(1, 3)), rule)
    data = e4m3_scaled(bits, scale[:, None, :, None]).reshape(m, k)
    return data, scale


def tile_scales(scale: jax.Array, *, columnwise: bool) -> jax.Array:
    """A tile plane's scales ``[M/32, K/32]`` as a 1x32 plane's: each tile's byte for its 32
    rows (rowwise ``[M, K/32]``) or its 32 columns (columnwise ``[M/32, K]``)."""
    return jnp.repeat(scale, BLOCK, axis=1 if columnwise else 0)
