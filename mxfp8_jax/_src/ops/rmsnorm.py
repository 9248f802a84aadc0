"""RMSNorm + MXFP8 quantize of local rows: the numerics, the pure-JAX reference, the local op.

Per row ``x`` (bf16, hidden size ``H``)::

    inv      = 1 / sqrt(sum(f32(x)^2) / H + eps)
    normed   = bf16_rne((f32(x) * inv) * (f32(gamma) + weight_offset))      [R, H] bf16
               (a NaN product becomes the canonical NaN 0x7FC00000 first: bf16 0x7FC0)
    quant    = E4M3 codes of normed, blocks of 32 along H                   [R, H] float8_e4m3fn
    scales   = E8M0 bytes                                                   [R, H/32] uint8

``quant``/``scales`` are byte-identical to ``mx.quantize(normed)``; ``quantize_from="fp32"``
quantizes the unrounded fp32 product instead (as TE's fused norm does). The sum of squares runs
in the order pinned in ``xla_ffi/include/mxfp8/numerics.h`` (32 partial sums over strides of 8,
then a halving tree), which ``reference`` reproduces, so every kernel gives the same bits. With
``columnwise=True`` the columnwise planes ``[R, H]`` and ``[R/32, H]`` follow. The gathered form
(``fused``) applies the same numerics to the rows of a group of devices.

Gradients: ``normed`` carries them to ``x`` and ``gamma``; the bf16 rounding of ``normed`` is
treated as the identity; ``quant`` and ``scales`` carry none.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from mxfp8_jax._src.core import vma
from mxfp8_jax._src.kernels import backend as backends
from mxfp8_jax._src.kernels import ffi_calls
from mxfp8_jax._src.numerics import format as fmt

QUANTIZE_FROM = ("normed", "fp32")
_TARGET = "mxfp8_rmsnorm_quantize"


@dataclasses.dataclass(frozen=True)
class NormConfig:
    """What the per-row math needs (static)."""

    eps: float
    weight_offset: float
    quantize_from_fp32: bool
    columnwise: bool
    rule: fmt.ScaleRule


def check_rows(x, argname: str = "x") -> tuple[int, int]:
    dt = jnp.dtype(getattr(x, "dtype", None))
    if dt != jnp.bfloat16:
        raise TypeError(
            f"{argname} has dtype {dt}; the fused RMSNorm + MXFP8 op takes bfloat16 input "
            f"(cast with {argname}.astype(jnp.bfloat16))"
        )
    if x.ndim != 2:
        raise ValueError(f"{argname} has shape {tuple(x.shape)}; it must be 2-D [rows, H]")
    rows, h = x.shape
    if h % fmt.BLOCK:
        raise ValueError(f"{argname}: H={h} (last axis) must be a multiple of 32 for MXFP8 blocks")
    return rows, h


def check_gamma(gamma, h: int, shapes: tuple[tuple[int, ...], ...]) -> None:
    dt = jnp.dtype(getattr(gamma, "dtype", None))
    if dt != jnp.bfloat16:
        raise TypeError(f"gamma has dtype {dt}; it must be bfloat16 like x (cast with gamma.astype(jnp.bfloat16))")
    if tuple(gamma.shape) not in shapes:
        raise ValueError(f"gamma has shape {tuple(gamma.shape)}; expected one of {list(shapes)} for H={h}")


def norm_config(eps, weight_offset, quantize_from, columnwise, scale_rule) -> NormConfig:
    if not isinstance(eps, numbers.Real) or not eps >= 0:
        raise ValueError(f"eps={eps!r} must be a non-negative real number")
    if not isinstance(weight_offset, numbers.Real) or not math.isfinite(weight_offset):
        raise ValueError(f"weight_offset={weight_offset!r} must be a finite real number")
    if quantize_from not in QUANTIZE_FROM:
        raise ValueError(f"quantize_from={quantize_from!r} is not one of {QUANTIZE_FROM}")
    return NormConfig(
        eps=float(np.float32(eps)),
        weight_offset=float(np.float32(weight_offset)),
        quantize_from_fp32=quantize_from == "fp32",
        columnwise=bool(columnwise),
        rule=fmt.ScaleRule.parse(scale_rule),
    )


def check_columnwise_rows(cfg: NormConfig, r: int) -> None:
    if cfg.columnwise and r % fmt.BLOCK:
        raise ValueError(
            f"columnwise=True needs R={r} gathered rows to be a multiple of 32 for MXFP8 "
            f"columnwise blocks; pass columnwise=False"
        )


def reference(x, gamma, cfg: NormConfig):
    """The canonical order in jnp (exact where XLA does not flush subnormals)."""
    r, h = x.shape
    f32 = jnp.float32
    xf = x.astype(f32)
    sq = jnp.pad(xf * xf, ((0, 0), (0, (-h) % 256)))
    # step (i, v) adds x[256 i + 8 j + v]^2 to partial j, in increasing i then v
    n_i = sq.shape[1] // 256
    steps = sq.reshape(r, n_i, 32, 8).transpose(1, 3, 0, 2).reshape(n_i * 8, r, 32)
    init = jnp.zeros_like(steps[0]) if steps.shape[0] else jnp.zeros((r, 32), f32)
    part, _ = jax.lax.scan(lambda p, s: (p + s, None), init, steps)
    for s in (16, 8, 4, 2, 1):
        part = part[:, :s] + part[:, s : 2 * s]
    # The barriers keep XLA from rewriting sumsq / H as sumsq * (1/H) and 1/sqrt(v) as rsqrt,
    # which round differently.
    h_f32 = jax.lax.optimization_barrier(jnp.full((r,), h, f32))
    root = jax.lax.optimization_barrier(jnp.sqrt(part[:, 0] / h_f32 + f32(cfg.eps)))
    inv = f32(1.0) / root
    g = gamma.astype(f32) + f32(cfg.weight_offset)
    y = fmt.canonical_nan((xf * inv[:, None]) * g)
    normed = fmt.f32_bits_to(jax.lax.bitcast_convert_type(y, jnp.uint32), jnp.bfloat16)
    src = y if cfg.quantize_from_fp32 else normed
    q, s = fmt.quantize_rowwise(src, cfg.rule)
    cq, cs = fmt.quantize_columnwise(src, cfg.rule) if cfg.columnwise else (None, None)
    return normed, q, s, cq, cs


def _kernel(x, gamma, cfg: NormConfig):
    normed, rq, rs, cq, cs = ffi_calls.rmsnorm_quantize(
        x,
        gamma,
        eps=cfg.eps,
        weight_offset=cfg.weight_offset,
        quantize_from_fp32=cfg.quantize_from_fp32,
        columnwise=cfg.columnwise,
        scale_rule=cfg.rule.code,
    )
    return normed, rq, rs, cq, cs


def norm_quant(x, gamma, cfg: NormConfig, backend: str):
    """``(normed, q, s, cq, cs)`` of rows ``x [R, H]`` by the kernel or the reference."""
    if x.shape[0] == 0:  # nothing for a kernel to do
        return reference(x, gamma, cfg)
    return backends.run(_TARGET, backend, lambda x, g: _kernel(x, g, cfg), lambda x, g: reference(x, g, cfg), x, gamma)


def vjp(x, gamma, d_normed, cfg: NormConfig):
    """Cotangents (fp32) of ``x [R, H]`` and ``gamma [H]`` for ``normed = (x * inv) * g``."""
    f32 = jnp.float32
    xf = x.astype(f32)
    g = gamma.astype(f32) + f32(cfg.weight_offset)
    inv = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + f32(cfg.eps))
    dy = d_normed.astype(f32)
    d_gamma = jnp.sum(dy * xf * inv, axis=0)
    dxhat = dy * g
    dx = inv * dxhat - xf * (inv * inv * inv) * jnp.mean(dxhat * xf, axis=-1, keepdims=True)
    return dx, d_gamma


def cotangent(ct, like):
    """A cotangent as fp32, with symbolic/float0 zeros made concrete."""
    if ct is None or jnp.dtype(ct.dtype) == jax.dtypes.float0:
        return jnp.zeros(like.shape, jnp.float32)
    return ct.astype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _local_fused(x, gamma, cfg: NormConfig, backend: str):
    return norm_quant(x, gamma, cfg, backend)


def _local_fused_fwd(x, gamma, cfg, backend):
    return norm_quant(x, gamma, cfg, backend), (x, gamma)


def _local_fused_bwd(cfg, backend, res, cts):
    x, gamma = res
    dx, d_gamma = vjp(x, gamma, cotangent(cts[0], x), cfg)
    dx, d_gamma = vma.cotangent_like(dx, x), vma.cotangent_like(d_gamma, gamma)
    return dx.astype(x.dtype), d_gamma.astype(gamma.dtype)


_local_fused.defvjp(_local_fused_fwd, _local_fused_bwd)


def rmsnorm_quant(
    x: jax.Array,
    gamma: jax.Array,
    *,
    eps: float = 1e-6,
    weight_offset: float = 0.0,
    quantize_from: str = "normed",
    columnwise: bool = False,
    scale_rule: str = "rceil",
    backend: str = "auto",
) -> tuple[jax.Array, ...]:
    """RMSNorm + MXFP8 quantize of local rows (the math is the module's). Differentiable in
    ``x`` and ``gamma``.

    Args:
      x: bf16 ``[R, H]``, ``H`` a multiple of 32.
      gamma: bf16 ``[H]``.
      eps: added to the mean square before the reciprocal square root.
      weight_offset: added to ``gamma`` (1.0 for Gemma-style zero-centred weights).
      quantize_from: ``"normed"`` quantizes the bf16 output, ``"fp32"`` the fp32 value before
        its rounding to bf16.
      columnwise: also make the columnwise planes (``R`` a multiple of 32).
      scale_rule: ``"rceil"`` or ``"floor"``.
      backend: ``"ffi"`` the compiled kernel, ``"jax"`` the pure-JAX reference of the same
        evaluation order, ``"auto"`` the kernel where it is installed for the lowering platform.

    Returns:
      ``(normed [R, H] bf16, quant [R, H] e4m3, scales [R, H/32] uint8)``, plus
      ``(columnwise_quant [R, H], columnwise_scales [R/32, H])`` when ``columnwise=True``.
    """
    r, h = check_rows(x)
    check_gamma(gamma, h, ((h,),))
    cfg = norm_config(eps, weight_offset, quantize_from, columnwise, scale_rule)
    check_columnwise_rows(cfg, r)
    backends.check(backend)
    normed, q, s, cq, cs = _local_fused(x, gamma, cfg, backend)
    return (normed, q, s, cq, cs) if cfg.columnwise else (normed, q, s)
