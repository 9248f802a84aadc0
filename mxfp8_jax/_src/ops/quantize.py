"""``quantize`` / ``dequantize``: argument checks, then the reference or the kernel
(``backend.run``; see ``backend`` for what ``"auto"``, ``"ffi"`` and ``"jax"`` mean).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from mxfp8_jax._src.core.tracing import is_traced
from mxfp8_jax._src.kernels import backend as backends
from mxfp8_jax._src.kernels import ffi_calls
from mxfp8_jax._src.numerics import format as fmt
from mxfp8_jax._src.numerics.tensor import (
    MXFP8Tensor,
    MXFP8Tensor2D,
    carries_tangent,
    not_differentiable,
    zero_tangent,
)

INPUT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def check_input(x, *, rowwise: bool, columnwise: bool, argname: str = "x") -> tuple[int, int]:
    """Validates a quantize input; returns its 2-D view ``(M, K)``."""
    dt = jnp.dtype(getattr(x, "dtype", None))
    if dt not in [jnp.dtype(d) for d in INPUT_DTYPES]:
        raise TypeError(f"{argname} has dtype {dt}; MXFP8 quantize takes bfloat16, float16 or float32 input")
    if x.ndim < 2:
        raise ValueError(
            f"{argname} has shape {tuple(x.shape)}; MXFP8 quantize needs at least 2-D input "
            f"(N-D input is quantized as its [prod(leading axes), K] view)"
        )
    if not (rowwise or columnwise):
        raise ValueError("at least one of rowwise=True or columnwise=True is required")
    m, k = math.prod(x.shape[:-1]), x.shape[-1]
    if k % fmt.BLOCK:
        raise ValueError(f"{argname}: K={k} (last axis) must be a multiple of 32 for MXFP8 blocks")
    if columnwise and m % fmt.BLOCK:
        raise ValueError(
            f"{argname}: M={m} (product of the leading axes) must be a multiple of 32 for "
            f"MXFP8 columnwise blocks; pass columnwise=False for a rowwise-only tensor"
        )
    return m, k


BLOCKS = ("1x32", "32x32")


def quantize(
    x: jax.Array,
    *,
    rowwise: bool = True,
    columnwise: bool = True,
    scale_rule: str = "rceil",
    backend: str = "auto",
    blocks: str = "1x32",
) -> MXFP8Tensor | MXFP8Tensor2D:
    """Quantizes ``x`` to MXFP8.

    Rowwise blocks run along the last axis, columnwise blocks along the rows of the 2-D view
    ``[M, K]`` with ``M = prod(shape[:-1])``.

    Args:
      x: bf16, fp16 or fp32 ``[..., K]``.
      rowwise: make the rowwise planes (needs ``K % 32 == 0``): data ``[M, K]``, scales
        ``[M, K/32]``.
      columnwise: make the columnwise planes (needs ``M % 32 == 0``): data ``[M, K]`` (not
        transposed), scales ``[M/32, K]``.
      scale_rule: ``"rceil"`` (TE, cuBLAS, MAX) or ``"floor"`` (OCP MX v1.0).
      backend: ``"auto"`` (the kernel where the lowering platform has one), ``"ffi"`` (the
        kernel or an error) or ``"jax"`` (the pure-JAX reference; the same bytes).
      blocks: ``"1x32"`` (the planes above) or ``"32x32"``: one plane with one scale per 32x32
        tile of ``[M, K]`` (both multiples of 32), which serves both directions
        (``MXFP8Tensor2D``; ``rowwise``/``columnwise`` do not apply). Its kernel
        (``mxfp8_quantize_tiles``) has CPU, CUDA and ROCm handlers, chosen by ``backend`` as
        for 1x32 blocks; under ``jit`` a sharded input stays sharded in whole 32x32 tiles.

    Returns:
      An ``MXFP8Tensor`` holding the requested planes (the others ``None``); its ``shape`` and
      ``dtype`` record ``x``'s. With ``blocks="32x32"``, an ``MXFP8Tensor2D``.

    Example::

        t = mx.quantize(x)                    # both planes, rceil
        y = mx.dequantize(t, dtype=jnp.float32)

    Not differentiable: ``jax.grad``/``jax.jvp`` through it raises a TypeError for every backend
    (the planes cannot carry a gradient; docs/design.md §2). Quantize
    ``jax.lax.stop_gradient(x)`` for a constant, or write a straight-through estimator as
    ``x + stop_gradient(dequantize(quantize(stop_gradient(x))) - x)``.
    """
    # checked as given: jnp.asarray would turn a float64 array into float32 silently
    x = x if hasattr(x, "dtype") else jnp.asarray(x)
    if blocks not in BLOCKS:
        raise ValueError(f"blocks={blocks!r} is not a known MXFP8 block shape; use one of {list(BLOCKS)}")
    if blocks == "32x32":
        return _quantize_tiles(x, rowwise, columnwise, scale_rule, backend)
    m, k = check_input(x, rowwise=rowwise, columnwise=columnwise)
    x = jnp.asarray(x)
    rule = fmt.ScaleRule.parse(scale_rule)
    backends.check(backend)
    # Eager calls (a notebook cell) run one executable compiled per configuration and shape
    # instead of dispatching the reference's few dozen operations one by one; traced calls are
    # inlined (see MXFP8Tensor.dequantize for why not as a nested jit).
    fn = _planes if is_traced(x) else _planes_jit
    rq, rs, cq, cs = fn(x.reshape(m, k), rowwise=rowwise, columnwise=columnwise, rule=rule, backend=backend)
    return MXFP8Tensor(
        rowwise_data=rq, rowwise_scale=rs, columnwise_data=cq, columnwise_scale=cs, shape=tuple(x.shape), dtype=x.dtype
    )


def _quantize_tiles(x, rowwise: bool, columnwise: bool, scale_rule: str, backend: str) -> MXFP8Tensor2D:
    """``quantize(x, blocks="32x32")``, checked: the reference or the kernel, as ``backend`` says."""
    if not (rowwise and columnwise):
        raise ValueError(
            "blocks='32x32' makes one plane that serves both directions: rowwise and columnwise do not apply "
            "(take one direction with MXFP8Tensor2D.view(rowwise=..., columnwise=...))"
        )
    m, k = check_input(x, rowwise=True, columnwise=False)
    if m % fmt.BLOCK:
        raise ValueError(f"x: M={m} (product of the leading axes) must be a multiple of 32 for 32x32 blocks")
    rule = fmt.ScaleRule.parse(scale_rule)
    backends.check(backend)
    fn = _tiles if is_traced(x) else _tiles_jit
    data, scale = fn(jnp.asarray(x).reshape(m, k), rule=rule, backend=backend)
    return MXFP8Tensor2D(data=data, scale=scale, shape=tuple(x.shape), dtype=x.dtype)


def _tiles(x2d, *, rule: fmt.ScaleRule, backend: str):
    return _tiles_no_grad(x2d, rule, backend)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _tiles_no_grad(x2d, rule: fmt.ScaleRule, backend: str):
    def reference(x2d):
        return fmt.quantize_tiles(x2d, rule)

    def kernel(x2d):
        return ffi_calls.quantize_tiles(x2d, scale_rule=rule.code)

    return backends.run("mxfp8_quantize_tiles", backend, kernel, reference, x2d)


@functools.partial(_tiles_no_grad.defjvp, symbolic_zeros=True)
def _tiles_jvp(rule, backend, primals, tangents):
    if carries_tangent(tangents[0]):
        raise not_differentiable("mx.quantize")
    out = _tiles_no_grad(*primals, rule, backend)
    return out, jax.tree.map(zero_tangent, out)


_tiles_jit = jax.jit(_tiles, static_argnames=("rule", "backend"))


def _planes(x2d, *, rowwise: bool, columnwise: bool, rule: fmt.ScaleRule, backend: str):
    return _planes_no_grad(x2d, rowwise, columnwise, rule, backend)


# One gradient behaviour for every backend: the reference's bit manipulation would give silent
# zeros and an FFI call cannot be differentiated at all, so differentiating either is an error.
@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3, 4))
def _planes_no_grad(x2d, rowwise: bool, columnwise: bool, rule: fmt.ScaleRule, backend: str):
    def reference(x2d):
        row = fmt.quantize_rowwise(x2d, rule) if rowwise else (None, None)
        col = fmt.quantize_columnwise(x2d, rule) if columnwise else (None, None)
        return row + col

    def kernel(x2d):
        (rq, rs), (cq, cs) = ffi_calls.quantize(x2d, scale_rule=rule.code, rowwise=rowwise, columnwise=columnwise)
        return rq, rs, cq, cs

    return backends.run("mxfp8_quantize", backend, kernel, reference, x2d)


@functools.partial(_planes_no_grad.defjvp, symbolic_zeros=True)
def _planes_jvp(rowwise, columnwise, rule, backend, primals, tangents):
    if carries_tangent(tangents[0]):
        raise not_differentiable("mx.quantize")
    out = _planes_no_grad(*primals, rowwise, columnwise, rule, backend)
    return out, jax.tree.map(zero_tangent, out)


_planes_jit = jax.jit(_planes, static_argnames=("rowwise", "columnwise", "rule", "backend"))


def dequantize(
    t: MXFP8Tensor | MXFP8Tensor2D, *, columnwise: bool = False, dtype: DTypeLike | None = None
) -> jax.Array:
    """``fp32(q) * 2^(byte - 127)`` of the rowwise (default) or columnwise plane, as ``dtype``.

    Exact in fp32 (subnormal results included); bf16 output is rounded to nearest even. Not
    differentiable in the planes (see ``quantize``). The same operation as
    ``MXFP8Tensor.dequantize``, with the same default.

    Args:
      t: an ``MXFP8Tensor`` satisfying ``MXFP8Tensor.validate`` (E4M3 data, uint8 scales of the
        planes' shapes), or an ``MXFP8Tensor2D`` (whose one plane both directions read).
      columnwise: dequantize the columnwise plane instead of the rowwise one (the same values
        for an ``MXFP8Tensor2D``).
      dtype: a floating-point output type; ``None`` (default) gives ``t.dtype``, the dtype of
        the array ``t`` was quantized from.

    Returns:
      A ``[*t.shape]`` array of ``dtype``.
    """
    if isinstance(t, MXFP8Tensor2D):
        return t.dequantize(dtype=dtype)
    if not isinstance(t, MXFP8Tensor):
        raise TypeError(f"t must be an MXFP8Tensor or MXFP8Tensor2D, got {type(t).__name__}")
    return t.dequantize(columnwise=columnwise, dtype=dtype)
