"""MXFP8 GEMMs: products of block-scaled E4M3 operands, and the three GEMMs of a training step.

An operand is E4M3 codes ``[B, M, C]`` with E8M0 scales ``[B, M, C/32]``, blocked along its
contraction ``C``, the last axis (``jax.nn.scaled_matmul``'s form). The product of ``a`` and
``w [B, N, C]`` is

    y[b, m, n] = sum_c  a[b, m, c] 2^(sa[b, m, c/32] - 127)  *  w[b, n, c] 2^(sw[b, n, c/32] - 127)

accumulated in fp32. Three paths compute it (``GEMM_PATHS``):

    native   ``jax.nn.scaled_matmul``: on CUDA one ``__op$block_scaled_dot`` custom call (cuDNN's
             MXFP8 GEMM on Blackwell, XLA's fp32 expansion before it), on ROCm the
             ``xla.scaled_dot`` composite; the operands reach it as E4M3 and E8M0, never
             dequantized first
    bf16     both operands dequantized exactly to bf16 (a 4-bit significand times a power of
             two is a bf16 value; rows shifted as for exact) and one bf16 ``dot_general`` with
             fp32 accumulation: the GPUs without block-scaled MMA (Hopper) multiply at their
             bf16 rate, the same numbers as exact
    exact    both operands dequantized exactly to fp32 (a product of two 4-bit significands is
             exact in fp32; each row shifted by a power of two so that no value of a row with
             normal values is an fp32 subnormal, which XLA:CPU's dot reads as zero) and one
             fp32 ``dot_general``: fp32 accumulation, as native

``"auto"`` takes the path of the platform the program is for: given GPU devices
(``resolve_path``, from an FSDP step's mesh), native where they multiply MXFP8 blocks (CUDA
10.0+, gfx950) and bf16 on other GPUs; otherwise native on every lowering platform in
``NATIVE_PLATFORMS`` and exact elsewhere (``lax.platform_dependent``). ``"native"`` where the
platform has none is an error, never a silent bf16 GEMM.

The training recipe (Transformer Engine's MXFP8BlockScaling; ``y = x W^T``, ``x [B, M, K]``,
``W [B, N, K]``), every operand blocked along its GEMM's own contraction:

    forward   y  = x W^T     x rowwise (blocks along K)       W rowwise planes  [N, K], [N, K/32]
    dgrad     dx = dy W      dy rowwise (blocks along N)      W columnwise planes as [K, N], [K, N/32]
    wgrad     dW = dy^T x    dy and x columnwise (blocks along tokens, zero-padded to 32)

Activations and gradients are quantized by the project's quantize (the kernel where built):
the same bytes as every other quantize of the package. Quantization is the identity for the
gradient (straight-through).

An activation that is already MXFP8 (the planes of RMSNorm + quantize, or of the fused
all-gather + RMSNorm + quantize) is handed to the GEMMs as it is by ``gemm_operand``: its value
is the dequantized rowwise planes (what any other consumer reads), and an FSDP step with
``gemm="mxfp8"`` gives the planes themselves to the unit GEMMs that read it, the columnwise
ones as the wgrad's x.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mxfp8_jax._src.core import platforms
from mxfp8_jax._src.numerics import format as fmt
from mxfp8_jax._src.numerics.format import BLOCK
from mxfp8_jax._src.ops.quantize import quantize

GEMM_PATHS = ("auto", "native", "bf16", "exact")
NATIVE_PLATFORMS = ("cuda", "rocm")
GEMMS = ("dequantized", "mxfp8")


def gemm_paths() -> dict[str, str]:
    """The path ``gemm_path="auto"`` takes on each platform.

    Returns:
      ``{"cpu": "exact", "cuda": "native", "rocm": "native"}``: native is the platform's
      block-scaled GEMM (``jax.nn.scaled_matmul``), exact the dequantized fp32 product.
    """
    return {p: ("native" if p in NATIVE_PLATFORMS else "exact") for p in ("cpu", *NATIVE_PLATFORMS)}


@dataclasses.dataclass(frozen=True)
class GemmMode:
    """How an MXFP8 unit's GEMMs run (static). ``path``: one of ``GEMM_PATHS``; ``scale_rule``: the
    rule activations and gradients are quantized with (the weights' own); ``platform``: the
    platform the step is built for, where known (its mesh's), which ``path="native"`` is checked
    against (None: this process's default device)."""

    path: str = "auto"
    scale_rule: fmt.ScaleRule = fmt.ScaleRule.RCEIL
    platform: str | None = None

    def __post_init__(self):
        if self.path not in GEMM_PATHS:
            raise ValueError(f"gemm_path={self.path!r} must be one of {GEMM_PATHS}")
        object.__setattr__(self, "scale_rule", fmt.ScaleRule.parse(self.scale_rule))


def resolve_path(path: str, platform: str | None, capability: str | None = None) -> str:
    """``path`` for a program on ``platform`` with devices of ``capability``
    (``core.platforms.capability``): ``"auto"`` becomes native where the GPU multiplies MXFP8
    blocks and bf16 on other GPUs; elsewhere (CPUs, GPUs of unknown capability) it stays
    ``"auto"``, chosen by the lowering platform (exact on CPUs)."""
    if path != "auto" or platform is None or not platforms.is_gpu(platform):
        return path
    native = platforms.has_block_scaled_mma(platform, capability)
    return "auto" if native is None else "native" if native else "bf16"


def check_mode(
    gemm: str, path: str, scale_rule, platform: str | None = None, capability: str | None = None
) -> GemmMode | None:
    """``FSDP(gemm=, gemm_path=)`` validated for a step on ``platform`` (the mesh's, its devices
    of ``capability``): a ``GemmMode`` for ``gemm="mxfp8"`` (``"auto"`` resolved where the
    devices say), else None."""
    if gemm not in GEMMS:
        raise ValueError(f"gemm={gemm!r} must be one of {GEMMS}")
    mode = GemmMode(path, scale_rule, platform)
    mode = dataclasses.replace(mode, path=resolve_path(path, platform, capability))
    if path == "native" and gemm == "mxfp8":
        require_native(platform or platforms.default())
    return mode if gemm == "mxfp8" else None


def require_native(platform: str) -> None:
    if platform not in NATIVE_PLATFORMS:
        raise ValueError(
            f"gemm_path='native': platform {platform!r} has no native block-scaled GEMM "
            f"(native: {NATIVE_PLATFORMS}); use gemm_path='exact' (dequantized exactly, fp32 "
            f"accumulation) or 'auto'"
        )


# ------------------------------------------------------------------------------------------------
# The block-scaled product


def scaled_matmul(a, a_scales, w, w_scales, *, path: str = "auto", platform: str | None = None) -> jax.Array:
    """``a [B, M, C] x w [B, N, C] -> [B, M, N]`` fp32, both blocked along ``C`` (codes E4M3 or
    their uint8 bytes, scales uint8 or ``float8_e8m0fnu`` ``[B, *, C/32]``), by ``path``.
    ``platform``: the program's, which ``path="native"`` needs a native GEMM on (None: this
    process's default device); ``"auto"`` is chosen by the lowering platform."""
    if path not in GEMM_PATHS:
        raise ValueError(f"path={path!r} must be one of {GEMM_PATHS}")
    a, w = _codes(a), _codes(w)
    a_scales, w_scales = _scale_bytes(a_scales), _scale_bytes(w_scales)
    _check_operands(a, a_scales, w, w_scales)
    if path == "exact":
        return _exact(a, a_scales, w, w_scales)
    if path == "bf16":
        return _exact(a, a_scales, w, w_scales, jnp.bfloat16)
    if path == "native":
        require_native(platform or platforms.default())
        return _native(a, a_scales, w, w_scales)
    branches = {p: (_native if p in NATIVE_PLATFORMS else _exact) for p in gemm_paths()}
    return lax.platform_dependent(a, a_scales, w, w_scales, default=_exact, **branches)


def _native(a, sa, w, sw):
    return jax.nn.scaled_matmul(a, w, fmt.e8m0_view(sa), fmt.e8m0_view(sw), preferred_element_type=jnp.float32)


def _exact(a, sa, w, sw, dtype=jnp.float32):
    """The dot of the exactly dequantized operands, each row shifted by a power of two first
    (its largest finite block scale to 2^0) and the result shifted back: the same fp32 numbers
    wherever nothing under- or overflows, and no operand value below 2^-126 (an fp32 subnormal,
    read as zero by XLA:CPU's dot) or above fp32's range where its row has normal values, so a
    product that fits in fp32 is kept as the native GEMM keeps it. ``dtype``: the operands'
    type in the dot, fp32 or bf16 (a shifted value, 4 significant bits, is exact in both), fp32
    accumulation either way."""
    ea, ew = _row_exponent(sa), _row_exponent(sw)  # [B, M, 1], [B, N, 1]
    fa, fw = _shifted(a, sa, ea).astype(dtype), _shifted(w, sw, ew).astype(dtype)
    dims = (((2,), (2,)), ((0,), (0,)))
    precision = lax.Precision.HIGHEST if dtype == jnp.float32 else None
    y = lax.dot_general(fa, fw, dims, precision=precision, preferred_element_type=jnp.float32)
    shift = ea + jnp.swapaxes(ew, 1, 2) - 254  # [B, M, N]: 2^(ea - 127) * 2^(ew - 127)
    first = jnp.clip(shift, -126, 127)
    return y * _pow2(first) * _pow2(jnp.clip(shift - first, -126, 127))


def _row_exponent(scales) -> jax.Array:
    """The largest finite (not 0xFF) scale byte of each row, int32 ``[..., 1]``."""
    s = scales.astype(jnp.int32)
    return jnp.max(jnp.where(s == 0xFF, 0, s), axis=-1, keepdims=True)


def _shifted(codes, scales, exponent) -> jax.Array:
    """The operand's fp32 values times 2^(127 - exponent) (NaN scales stay NaN)."""
    s = scales.astype(jnp.int32)
    byte = jnp.where(s == 0xFF, 0xFF, s - exponent + 127)
    return lax.bitcast_convert_type(fmt.scaled_to_bits(codes, jnp.repeat(byte, BLOCK, axis=-1)), jnp.float32)


def _pow2(e) -> jax.Array:
    """2^e as fp32 for integer ``e`` in [-126, 127], built from its bits."""
    return lax.bitcast_convert_type(((e + 127).astype(jnp.uint32) << 23), jnp.float32)


def dequantized(codes, scales, dtype=jnp.float32) -> jax.Array:
    """Codes ``[..., C]`` E4M3 with scales ``[..., C/32]`` -> exact fp32 values (or ``dtype``,
    rounded to nearest even, as ``mx.dequantize``)."""
    bits = fmt.scaled_to_bits(_codes(codes), jnp.repeat(_scale_bytes(scales), BLOCK, axis=-1))
    return fmt.f32_bits_to(bits, dtype)


def as_bytes(codes) -> jax.Array:
    """E4M3 codes as their uint8 bytes (bytes unchanged)."""
    return codes if codes.dtype == jnp.uint8 else lax.bitcast_convert_type(_codes(codes), jnp.uint8)


def _codes(x) -> jax.Array:
    if x.dtype == jnp.uint8:
        return lax.bitcast_convert_type(x, jnp.float8_e4m3fn)
    if x.dtype != jnp.float8_e4m3fn:
        raise TypeError(f"MXFP8 GEMM codes must be float8_e4m3fn (or their uint8 bytes), got {x.dtype}")
    return x


def _scale_bytes(s) -> jax.Array:
    if s.dtype == jnp.float8_e8m0fnu:
        return lax.bitcast_convert_type(s, jnp.uint8)
    if s.dtype != jnp.uint8:
        raise TypeError(f"MXFP8 GEMM scales must be uint8 E8M0 bytes (or float8_e8m0fnu), got {s.dtype}")
    return s


def _check_operands(a, sa, w, sw) -> None:
    if a.ndim != 3 or w.ndim != 3:
        raise ValueError(f"operands must be [B, M, C] and [B, N, C], got {a.shape} and {w.shape}")
    if a.shape[0] != w.shape[0] or a.shape[2] != w.shape[2]:
        raise ValueError(f"operands {a.shape} and {w.shape} differ in B or C (contraction last on both)")
    if a.shape[2] % BLOCK:
        raise ValueError(f"the contraction C={a.shape[2]} must be a multiple of {BLOCK} (MXFP8 blocks)")
    for x, s, name in ((a, sa, "a"), (w, sw, "w")):
        want = (*x.shape[:2], x.shape[2] // BLOCK)
        if tuple(s.shape) != want:
            raise ValueError(f"{name}_scales has shape {tuple(s.shape)}; {name} {tuple(x.shape)} needs {want}")


# ------------------------------------------------------------------------------------------------
# Activations and gradients quantized for the recipe


@dataclasses.dataclass(frozen=True)
class Quantized:
    """``x [B, M, C]`` quantized both ways, ``M`` zero-padded to ``Mp`` (a multiple of 32):
    rowwise codes ``[B, Mp, C]`` with scales ``[B, Mp, C/32]`` (blocks along C), columnwise
    codes ``[B, Mp, C]`` with scales ``[B, Mp/32, C]`` (blocks along M). Codes are uint8 bytes:
    XLA:CPU widens fp8 values carried through loops to f16, so saved planes stay bytes."""

    row: tuple | None
    col: tuple | None
    rows: int

    def rowwise(self) -> tuple[jax.Array, jax.Array]:
        """Operand ``[B, M, C]`` blocked along C (padding rows dropped)."""
        codes, scales = self.row
        return codes[:, : self.rows], scales[:, : self.rows]

    def columnwise_t(self) -> tuple[jax.Array, jax.Array]:
        """Operand ``[B, C, Mp]`` blocked along M (the wgrad's)."""
        codes, scales = self.col
        return jnp.swapaxes(codes, 1, 2), jnp.swapaxes(scales, 1, 2)


def quantize_tokens(x: jax.Array, rule: fmt.ScaleRule, *, rowwise: bool = True, columnwise: bool = True) -> Quantized:
    """``x [B, M, C]`` (bf16/fp16/fp32) -> its MXFP8 planes (``Quantized``), one quantize call."""
    b, m, c = x.shape
    mp = -(-m // BLOCK) * BLOCK
    if mp != m:
        x = jnp.pad(x, ((0, 0), (0, mp - m), (0, 0)))
    t = quantize(x.reshape(b * mp, c), rowwise=rowwise, columnwise=columnwise, scale_rule=rule.value)
    row = col = None
    if rowwise:
        row = (as_bytes(t.rowwise_data).reshape(b, mp, c), t.rowwise_scale.reshape(b, mp, c // BLOCK))
    if columnwise:
        col = (as_bytes(t.columnwise_data).reshape(b, mp, c), t.columnwise_scale.reshape(b, mp // BLOCK, c))
    return Quantized(row, col, m)


jax.tree_util.register_dataclass(Quantized, data_fields=["row", "col"], meta_fields=["rows"])


def weight_operand(codes, scales, *, columnwise: bool) -> tuple[jax.Array, jax.Array]:
    """A weight's planes ``[B, N, K]`` as a GEMM operand: the rowwise ones as they are
    (``[B, N, K]`` blocked along K), the columnwise ones transposed (``[B, K, N]``, scales
    ``[B, K, N/32]``, blocked along N): data movement only, no dequantize."""
    if columnwise:
        return jnp.swapaxes(codes, -1, -2), jnp.swapaxes(scales, -1, -2)
    return codes, scales


def forward(x: jax.Array, w_row, mode: GemmMode) -> tuple[jax.Array, Quantized]:
    """``y = x W^T`` (``x [B, M, K]``, ``w_row`` W's rowwise operand ``[B, N, K]``) in fp32,
    and x's columnwise planes for the wgrad."""
    q = quantize_tokens(x, mode.scale_rule)
    y = scaled_matmul(*q.rowwise(), *w_row, path=mode.path, platform=mode.platform)
    return y, dataclasses.replace(q, row=None)


def backward(dy: jax.Array, x_col: Quantized, w_col_t, mode: GemmMode, *, order=None) -> tuple[jax.Array, jax.Array]:
    """``(dx, dW)`` in fp32 from ``dy [B, M, N]``, x's saved columnwise planes and W's
    columnwise operand ``[B, K, N]`` (``weight_operand(columnwise=True)``). ``order=(p, b, s)``:
    x's columnwise planes hold the tokens in the order ``[p, b, s]`` of dy's ``[b, p * s]``
    (``gemm_operand``): dy's columnwise planes are made in that order, so the blocks pair up."""
    if order is None:
        q = quantize_tokens(dy, mode.scale_rule)
        col = q
    else:
        q = quantize_tokens(dy, mode.scale_rule, columnwise=False)
        p, b, s = order
        bt, m, n = dy.shape
        reordered = dy.reshape(b, p, s, n).transpose(1, 0, 2, 3).reshape(1, m, n)
        col = quantize_tokens(reordered, mode.scale_rule, rowwise=False)
    dx = scaled_matmul(*q.rowwise(), *w_col_t, path=mode.path, platform=mode.platform)
    dw = scaled_matmul(*col.columnwise_t(), *x_col.columnwise_t(), path=mode.path, platform=mode.platform)
    return dx, dw


# ------------------------------------------------------------------------------------------------
# Activations that are MXFP8 already

OPERAND = "mxfp8_gemm_operand"  # the name of the jitted call that marks one in a traced loss


@jax.custom_vjp
def straight_through(value: jax.Array, carrier: jax.Array) -> jax.Array:
    """``value`` forward; its cotangent goes to ``carrier`` (same shape): a dequantized MXFP8
    activation computed, the bf16 values it rounds differentiated."""
    return value


straight_through.defvjp(lambda value, carrier: (value, None), lambda _, ct: (None, ct.astype(jnp.bfloat16)))


def gemm_operand(normed, codes, scales, columnwise=None, *, order: tuple[int, int, int] | None = None) -> jax.Array:
    """The activation ``normed`` as MXFP8 GEMMs read it, given its MXFP8 planes.

    Inside an ``FSDP(gemm="mxfp8")`` step, a unit GEMM that reads the returned value itself
    takes the planes directly: the rowwise ones as its x (no quantize of its own, no
    dequantize), the columnwise ones as its wgrad's x. Anywhere else (other GEMMs, other ops,
    outside FSDP) the value is what ``mx.dequantize`` gives.

    Args:
      normed: ``[..., K]`` bf16, the values the planes quantize; the gradient goes to it
        (straight-through).
      codes: rowwise E4M3 codes ``[..., K]`` (or their uint8 bytes), in ``normed``'s layout.
      scales: rowwise E8M0 scales ``[..., K/32]`` uint8.
      columnwise: optional ``(codes [M, K], scales [M/32, K])`` over ``normed``'s ``M`` rows
        (with ``order``, also ``[p, b * s, K]`` and ``[p, b * s / 32, K]``: the same rows, the
        form in which a batch split over other mesh axes stays a split of axis 1).
      order: ``(p, b, s)`` when the columnwise rows are in the order ``[p, b, s]`` of rows that
        ``normed`` holds as ``[b, p * s]`` (what a sequence-parallel all-gather returns before
        the rows are put back into sequences); None: ``normed``'s own row order.

    Returns:
      The dequantized rowwise planes, bf16, shaped like ``normed``.
    """
    cq, cs = (None, None) if columnwise is None else columnwise
    if order is not None and columnwise is None:
        raise ValueError("order= describes the rows of the columnwise planes: pass columnwise=(codes, scales) too")
    shape = np.zeros((*order, 0), np.uint8) if order is not None else np.zeros((0,), np.uint8)
    return _operand(normed, codes, scales, cq, cs, shape)


def _operand_value(normed, codes, scales, col_codes, col_scales, order):
    value = dequantized(codes, scales, jnp.bfloat16)
    return straight_through(lax.stop_gradient(value), normed)


_operand_value.__name__ = OPERAND
_operand = jax.jit(_operand_value)


@dataclasses.dataclass(frozen=True)
class GivenOperand:
    """The planes of an activation marked by ``gemm_operand``, as a unit GEMM receives them:
    ``arrays = (normed, codes, scales, col_codes, col_scales)`` (the last two may be None) and
    the static row ``order`` of the columnwise planes (None: the value's)."""

    arrays: tuple
    order: tuple | None

    @classmethod
    def from_call(cls, ins) -> GivenOperand:
        """From the operands of a ``gemm_operand`` call (its None planes are no operands)."""
        normed, codes, scales, *col, order = ins
        if not col:  # no columnwise planes: the GEMM makes x's own, in the value's order
            return cls((normed, codes, scales, None, None), None)
        return cls((normed, codes, scales, *col), tuple(order.shape[:-1]) if order.ndim == 4 else None)
